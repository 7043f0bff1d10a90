// The fixture shared by the ParamMover tests (test_param_mover.cpp; test_param_mover_unwritten.cpp: a failed
// write's values kept in the staging): a host of byte buffers stands for ParamResidency's tensors, a real
// NvmeEngine (with NvmeFaults) for the NVMe tier.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "nvme_test_dir.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/tiering/param_mover.hpp"

namespace tierflow::param_mover_test {

using namespace tierflow;
using namespace tierflow::tiering;
using tierflow::allocator::AlignedBuffer;

inline constexpr std::uint64_t kBytes = 4096;  // every parameter's

// A transfer that is complete; its wait runs `on_wait` (which may throw, as a failed or stalled copy's).
struct FakeTransfer final : swap::detail::TransferState {
  std::function<void()> on_wait;
  bool ready() const override { return true; }
  void wait() const override {
    if (on_wait) on_wait();
  }
  std::size_t bytes() const noexcept override { return kBytes; }
};

inline swap::TransferHandle handle(std::function<void()> on_wait = {}) {
  auto s = std::make_shared<FakeTransfer>();
  s->on_wait = std::move(on_wait);
  return swap::TransferHandle(s);
}

// Each parameter's device memory (absent: dropped), host copy and staging as byte buffers; what a read of a
// dropped one raises; what each parameter points at; the calls in order.
struct FakeHost final : ParamMoverHost {
  std::map<ParamId, std::vector<unsigned char>> device;
  std::map<ParamId, std::string> why;
  std::map<ParamId, AlignedBuffer> host, staging;
  std::map<ParamId, ParamView> view;
  std::vector<std::string> calls;
  std::set<ParamId> fail_fetch;    // fetch throws out_of_memory
  std::set<ParamId> stall_fetch;   // the fetch's wait throws stall_error
  std::set<ParamId> kept;          // keep_stalled
  std::set<ParamId> stall_download;  // download throws stall_error (a device-to-host copy past its limit)
  std::function<void(ParamId)> on_stage;  // runs at each stage, first (may throw: a staging out of memory)
  // Where a staging starts in its buffer: 8 makes it unaligned, and the engine then copies a read into it as the
  // read completes (from its bounce buffer), so a read that lands after its staging went shows in `let_go`.
  std::size_t stage_offset = 0;
  std::map<ParamId, int> stages;  // stagings made, by parameter (each read from NVMe goes into a new one)
  std::vector<AlignedBuffer> let_go;  // each staging unstaged, poisoned (kPoison) and kept: a later write shows
  static constexpr unsigned char kPoison = 0xEE;

  void note(const std::string& what, ParamId id) { calls.push_back(what + " " + std::to_string(id)); }
  void drop(ParamId id, const std::string& w) override {
    note("drop", id);
    device.erase(id);
    why[id] = w;
  }
  bool has_memory(ParamId id) override { return device.count(id) > 0; }
  swap::TransferHandle fetch(ParamId id, const swap::TransferHandle& read) override {
    note("fetch", id);
    if (fail_fetch.count(id)) throw out_of_memory("no device memory for parameter " + std::to_string(id));
    read.wait();
    const auto* from = reinterpret_cast<const unsigned char*>(read.valid() ? staging.at(id).data() : host.at(id).data());
    device[id].assign(from, from + kBytes);
    if (stall_fetch.count(id)) return handle([] { throw stall_error("stalled fetch"); });
    return handle();
  }
  void await_on_device(ParamId id, const swap::TransferHandle& f) override {
    note("await", id);
    f.wait();
  }
  void* stage(ParamId id) override {
    if (on_stage) on_stage(id);
    ++stages[id];
    staging[id] = AlignedBuffer(kBytes + stage_offset);
    return staged(id);
  }
  void unstage(ParamId id) noexcept override {
    const auto it = staging.find(id);
    if (it == staging.end()) return;
    std::memset(it->second.data(), kPoison, it->second.capacity());
    let_go.push_back(std::move(it->second));
    staging.erase(it);
  }
  void keep_stalled(ParamId id, const std::string&, const std::string&) noexcept override { kept.insert(id); }
  void make_host_copy(ParamId id) override { host[id] = AlignedBuffer(kBytes); }
  swap::TransferHandle copy_to_host_copy(ParamId id) override {
    std::memcpy(host.at(id).data(), device.at(id).data(), kBytes);
    return handle();
  }
  void* host_copy(ParamId id) override { return host.count(id) ? host.at(id).data() : nullptr; }
  void free_host_copy(ParamId id) override { host.erase(id); }
  void upload(ParamId id, ParamView from) override {
    note("upload", id);
    const auto* src = from == ParamView::kStaging ? staged(id) : reinterpret_cast<unsigned char*>(host.at(id).data());
    device[id].assign(src, src + kBytes);
  }
  void download(ParamId id) override {
    if (stall_download.count(id)) throw stall_error("stalled download");
    std::memcpy(staged(id), device.at(id).data(), kBytes);
  }
  void point(ParamId id, ParamView v) override { view[id] = v; }
  /// Whether `id` points at its device storage (as it does until first pointed elsewhere).
  bool at_device(ParamId id) const { return !view.count(id) || view.at(id) == ParamView::kDevice; }

  unsigned char first_device_byte(ParamId id) const { return device.at(id).at(0); }
  unsigned char* staged(ParamId id) { return reinterpret_cast<unsigned char*>(staging.at(id).data()) + stage_offset; }
  /// Whether every staging let go still holds only kPoison (nothing wrote into it once it went).
  bool let_go_untouched() const {
    for (const AlignedBuffer& b : let_go) {
      const auto* p = reinterpret_cast<const unsigned char*>(b.data());
      if (std::any_of(p, p + b.capacity(), [](unsigned char c) { return c != kPoison; })) return false;
    }
    return true;
  }
  unsigned char first_byte(const std::map<ParamId, AlignedBuffer>& m, ParamId id) const {
    return reinterpret_cast<const unsigned char*>(m.at(id).data())[0];
  }
};

// An NVMe engine of blocks of a parameter's bytes, `bytes` of room in `dir`, requests failed by `faults`.
inline std::shared_ptr<swap::NvmeEngine> nvme_engine(const testing_nvme::NvmeTestDir& dir, std::uint64_t bytes,
                                              swap::NvmeFaults* faults = nullptr) {
  swap::NvmeEngineOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = bytes;
  o.block_bytes = kBytes;
  o.faults = faults;
  return std::make_shared<swap::NvmeEngine>(o);
}

// The io_error `call` raises; none (and a test failure saying `expected`) when it raises none.
template <class Call>
std::optional<io_error> io_error_of(Call&& call, const char* expected) {
  try {
    call();
  } catch (const io_error& e) {
    return e;
  }
  ADD_FAILURE() << expected;
  return std::nullopt;
}

// A FakeHost::on_stage that runs `then` at the `n`th stage from now (1: the next).
inline std::function<void(ParamId)> at_stage(int n, std::function<void()> then) {
  return [n, then](ParamId) mutable {
    if (--n == 0) then();
  };
}

// A stall limit of `seconds` within its scope (Note [Stall timeout]), the one before restored after.
struct StallLimit {
  explicit StallLimit(double seconds) : before(stall_timeout()) { set_stall_timeout(seconds); }
  ~StallLimit() { set_stall_timeout(before); }
  double before;
};
inline constexpr double kStallLimit = 0.15;   // seconds a wait in the tests below may last
inline constexpr int kStuckUs = 600'000;      // how long a stuck disk holds a request there

inline std::vector<unsigned char> nvme_value(ParamMover& mover, ParamId id) {
  std::vector<unsigned char> value(kBytes);
  mover.read_nvme(id, value.data());
  return value;
}

inline ParamSpec spec(ParamId id, const std::string& name) {
  static std::map<ParamId, int> storages;  // any distinct address per parameter
  return ParamSpec{id, kBytes, name, &storages[id], ""};
}

// Blocks 0 and 1 (parameters 1, 2), the rest unit 2 (parameter 3): each parameter's device bytes hold its id.
struct Fixture {
  FakeHost host;
  std::unique_ptr<ParamMover> mover;
  explicit Fixture(Tier tier = Tier::kHost, std::uint64_t budget = 1ULL << 30, std::shared_ptr<swap::NvmeEngine> nvme = {},
                   Tier rest = Tier::kHost) {
    for (ParamId id : {1, 2, 3}) host.device[id].assign(kBytes, static_cast<unsigned char>(id));
    mover = std::make_unique<ParamMover>(
        std::vector<std::vector<ParamSpec>>{{spec(1, "blocks.0.w")}, {spec(2, "blocks.1.w")}, {spec(3, "head.w")}},
        std::vector<Tier>{tier, tier, rest}, 2, std::vector<std::string>{"block 0", "block 1", "'head'"}, budget,
        std::move(nvme), host, this);
  }
};

}  // namespace tierflow::param_mover_test
