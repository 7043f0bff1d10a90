// See Note [Optimizer states on NVMe] in nvme_adam.hpp.
#include "tierflow/optimizer/nvme_adam.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/clock.hpp"

namespace tierflow::optimizer {
namespace {

// A pinned buffer from the pool, returned on scope exit.
struct PoolBuffer {
  allocator::PinnedHostPool* pool = nullptr;
  void* p = nullptr;
  std::size_t bytes = 0;
  PoolBuffer(allocator::PinnedHostPool* pl, std::size_t n)
      : pool(pl), p(n ? pl->allocate(n) : nullptr), bytes(n) {}
  /// A stalled request may still read or write it (Note [Stall timeout]): never given back.
  void keep_for_good(const std::string& what) noexcept {
    if (!p) return;
    p = nullptr;
    note_kept_forever(bytes, what + " of " + format_bytes(bytes));
  }
  ~PoolBuffer() {
    if (p) pool->deallocate(p);
  }
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
  float* f() const { return static_cast<float*>(p); }
};

void write_param(void* out, ScalarType type, const float* master, std::size_t n) {
  switch (type) {
    case ScalarType::kFloat32: std::memcpy(out, master, n * 4); break;
    case ScalarType::kBFloat16:
      for (std::size_t i = 0; i < n; ++i) static_cast<std::uint16_t*>(out)[i] = float_to_bf16(master[i]);
      break;
    case ScalarType::kFloat16:
      for (std::size_t i = 0; i < n; ++i) static_cast<std::uint16_t*>(out)[i] = float_to_fp16(master[i]);
      break;
  }
}

// Byte offsets of the parts of an n-element state in its block (and in a buffer holding one): the fp32
// master at 0, then m and v in their format, then the fp32 vmax (amsgrad).
struct StateLayout {
  std::size_t m, v, vmax;
  StateLayout(std::size_t n, StateFormat f) : m(4 * n), v(4 * n + moment_bytes(f, n)), vmax(4 * n + 2 * moment_bytes(f, n)) {}
};

// A packed moment of format `f` (not kFp32) at `base`.
PackedMoment packed(StateFormat f, void* base, std::size_t n) {
  return f == StateFormat::k8bit ? packed_8bit(base, n) : PackedMoment{base, nullptr};
}

char* at_offset(void* base, std::size_t offset) { return static_cast<char*>(base) + offset; }

// Throws unless moments handed in or out in `given` suit an entry of `kept`: its own bytes, or fp32.
void check_moments_format(StateFormat given, StateFormat kept, const char* what) {
  TIERFLOW_EXPECTS(given == kept || given == StateFormat::kFp32,
                   std::string("NvmeAdamStore::") + what + ": moments in " + to_string(given) + " for a state kept in " +
                       to_string(kept) + " (accepted: fp32 or " + to_string(kept) + ")");
}

}  // namespace

NvmeAdamStore::NvmeAdamStore(std::shared_ptr<swap::NvmeEngine> nvme, std::shared_ptr<allocator::PinnedHostPool> pool,
                             int threads, CpuIsa isa)
    : nvme_(std::move(nvme)), pool_(std::move(pool)), adam_(threads, isa) {
  TIERFLOW_EXPECTS(nvme_ && pool_, "NvmeAdamStore: needs an NVMe engine and a pinned pool");
}

NvmeAdamStore::~NvmeAdamStore() {
  for (auto& [key, e] : entries_) nvme_->release(e.block);
}

const NvmeAdamStore::Entry& NvmeAdamStore::entry(std::uint64_t key) const {
  auto it = entries_.find(key);
  TIERFLOW_EXPECTS(it != entries_.end(), "NvmeAdamStore: unknown parameter key " + std::to_string(key));
  return it->second;
}

std::size_t NvmeAdamStore::numel(std::uint64_t key) const { return entry(key).numel; }

StateFormat NvmeAdamStore::format(std::uint64_t key) const { return entry(key).format; }

std::uint64_t NvmeAdamStore::add(std::size_t numel, bool amsgrad, const float* master, const void* m, const void* v,
                                 const float* vmax, StateFormat format, StateFormat moments_format) {
  TIERFLOW_EXPECTS(!amsgrad || format == StateFormat::kFp32,
                   std::string("NVMe optimizer: amsgrad keeps fp32 moments; optimizer_states=") + to_string(format) +
                       " (TIERFLOW_OPTIMIZER_STATES) is refused with it (accepted: fp32)");
  check_moments_format(moments_format, format, "add");
  // The first state goes straight into its block: there is no older one to keep.
  Entry e{nvme_->allocate(state_bytes(numel, amsgrad, format)), numel, amsgrad, format};
  try {
    fill_and_write(e, e.block, master, m, v, vmax, moments_format);
  } catch (const stall_error&) {
    throw;  // Note [Stall timeout]: the write may still land in the block: it is never released or reused
  } catch (...) {
    nvme_->release(e.block);
    throw;
  }
  const std::uint64_t key = next_key_++;
  entries_.emplace(key, e);
  return key;
}

void NvmeAdamStore::fill_and_write(const Entry& e, swap::NvmeBlock block, const float* master, const void* m,
                                   const void* v, const float* vmax, StateFormat moments_format) {
  const std::size_t n = e.numel;
  const StateLayout at(n, e.format);
  const std::size_t mbytes = moment_bytes(e.format, n);
  PoolBuffer buf(pool_.get(), state_bytes(e));
  std::memcpy(buf.p, master, n * 4);
  if (!m || !v) {  // a fresh state: zeros are zero moments in every format (8bit: codes 0, scales 0)
    TIERFLOW_EXPECTS(!m && !v, "NvmeAdamStore: both moments or neither");
    std::memset(at_offset(buf.p, at.m), 0, 2 * mbytes);
  } else if (moments_format == e.format) {
    std::memcpy(at_offset(buf.p, at.m), m, mbytes);
    std::memcpy(at_offset(buf.p, at.v), v, mbytes);
  } else {
    encode_moments(e.format, static_cast<const float*>(m), static_cast<const float*>(v), n,
                   packed(e.format, at_offset(buf.p, at.m), n), packed(e.format, at_offset(buf.p, at.v), n));
  }
  if (e.amsgrad) {
    if (vmax) std::memcpy(at_offset(buf.p, at.vmax), vmax, n * 4);
    else std::memset(at_offset(buf.p, at.vmax), 0, n * 4);
  }
  const swap::TransferHandle written = nvme_->write(block, buf.p, state_bytes(e));
  try {
    written.wait();
  } catch (const stall_error&) {
    buf.keep_for_good("an NVMe optimizer state's buffer under a stalled write");  // Note [Stall timeout]
    throw;
  }
}

void NvmeAdamStore::reserve(const std::vector<std::uint64_t>& state_sizes) {
  if (state_sizes.empty()) return;
  std::vector<std::uint64_t> blocks(state_sizes);
  const std::uint64_t largest = *std::max_element(state_sizes.begin(), state_sizes.end());
  // A step writes each new state out of place beside the old ones: room for
  // the one in flight and one more for the free list's cuts.
  blocks.push_back(largest);
  blocks.push_back(largest);
  std::uint64_t total = 0;
  for (auto b : state_sizes) total += b;
  try {
    nvme_->reserve(blocks);
  } catch (const io_error& err) {
    throw io_error(err.error_number(), "NVMe optimizer: the states of " + std::to_string(state_sizes.size()) +
                                           " parameter(s) need " + format_bytes(total) + " on NVMe, and " +
                                           format_bytes(2 * largest) + " more for a step; " + err.what());
  }
}

std::vector<swap::NvmeExtent> NvmeAdamStore::extents(std::uint64_t key) const {
  return nvme_->extents(entry(key).block);
}

void NvmeAdamStore::read(std::uint64_t key, float* master, void* m, void* v, float* vmax,
                         StateFormat moments_format) const {
  const Entry& e = entry(key);
  check_moments_format(moments_format, e.format, "read");
  PoolBuffer buf(pool_.get(), state_bytes(e));
  const swap::TransferHandle got = nvme_->read(e.block, buf.p, state_bytes(e));
  try {
    got.wait();
  } catch (const stall_error&) {
    buf.keep_for_good("an NVMe optimizer state's buffer under a stalled read");  // Note [Stall timeout]
    throw;
  }
  const std::size_t n = e.numel;
  const StateLayout at(n, e.format);
  std::memcpy(master, buf.p, n * 4);
  if (moments_format == e.format) {
    std::memcpy(m, at_offset(buf.p, at.m), moment_bytes(e.format, n));
    std::memcpy(v, at_offset(buf.p, at.v), moment_bytes(e.format, n));
  } else {
    decode_moments(e.format, packed(e.format, at_offset(buf.p, at.m), n), packed(e.format, at_offset(buf.p, at.v), n),
                   n, static_cast<float*>(m), static_cast<float*>(v));
  }
  if (vmax && e.amsgrad) std::memcpy(vmax, at_offset(buf.p, at.vmax), n * 4);
}

void NvmeAdamStore::write(std::uint64_t key, const float* master, const void* m, const void* v, const float* vmax,
                          StateFormat moments_format) {
  Entry& e = entries_.at(key);
  check_moments_format(moments_format, e.format, "write");
  TIERFLOW_EXPECTS(m && v, "NvmeAdamStore::write: both moments are needed");
  // Out of place: the old state stays valid until the new one is on disk.
  swap::NvmeBlock fresh = nvme_->allocate(state_bytes(e));
  try {
    fill_and_write(e, fresh, master, m, v, vmax, moments_format);
  } catch (const stall_error&) {
    throw;  // Note [Stall timeout]: `fresh` may still be written: never released; the old state stays
  } catch (...) {
    nvme_->release(fresh);
    throw;
  }
  nvme_->release(e.block);
  e.block = fresh;
}

void NvmeAdamStore::remove(std::uint64_t key) noexcept {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  nvme_->release(it->second.block);
  entries_.erase(it);
}

// step()'s double buffer: while item i steps in one buffer, item i+1's state
// is read into the other, whose previous write must have finished first.
struct NvmeAdamStore::Flight {
  Flight(NvmeAdamStore& store, const std::vector<Item>& items, std::size_t max_bytes)
      : s(store), items(items), bufs{PoolBuffer(s.pool_.get(), max_bytes), PoolBuffer(s.pool_.get(), max_bytes)} {}
  // Note [Stall timeout]: after a stall, a request may still read or write either buffer: both kept for good,
  // and no NVMe block of a request in flight is released (the entries keep their old, intact states).
  ~Flight() {
    if (!stall) return;
    bufs[0].keep_for_good("an NVMe optimizer step's buffer under a stalled request");
    bufs[1].keep_for_good("an NVMe optimizer step's buffer under a stalled request");
  }
  std::exception_ptr stall;  // the first stall_error of a wait (raised by step())
  NvmeAdamStore& s;
  const std::vector<Item>& items;
  StepResult result;
  PoolBuffer bufs[2];
  swap::TransferHandle reads[2], writes[2];
  std::string read_error[2];       // a read that could not even start
  swap::NvmeBlock fresh[2] = {0, 0};
  std::size_t writer[2] = {0, 0};  // item index whose write a buffer holds

  void fail(std::size_t i, const std::string& what) {
    result.failed.push_back(i);
    if (result.first_error.empty()) result.first_error = what;
  }
  void start_read(int b, std::size_t i) {
    read_error[b].clear();
    const Entry& e = s.entry(items[i].key);
    try {
      reads[b] = s.nvme_->read(e.block, bufs[b].p, s.state_bytes(e));
    } catch (const io_error& err) {
      reads[b] = swap::TransferHandle();
      read_error[b] = err.what();
    }
  }
  // Waits for buffer b's read; returns why its state was lost, or "".
  std::string wait_read(int b) {
    std::string lost = read_error[b];
    if (lost.empty()) {
      try {
        reads[b].wait();
      } catch (const stall_error&) {  // not lost: still in flight, its buffer not to be reused
        if (!stall) stall = std::current_exception();
        throw;
      } catch (const std::exception& err) {
        lost = err.what();
      }
    }
    reads[b] = swap::TransferHandle();
    return lost;
  }
  // Settles buffer b's write: on success the item's key moves to the new block.
  void settle(int b) {
    if (!writes[b].valid()) return;
    Entry& e = s.entries_.at(items[writer[b]].key);
    try {
      writes[b].wait();
      s.nvme_->release(e.block);
      e.block = fresh[b];
      s.stats_.bytes_written += s.state_bytes(e);
    } catch (const stall_error&) {
      // Not failed: still in flight. Its block is not released (nor reused), the old state stays the entry's.
      if (!stall) stall = std::current_exception();
      throw;
    } catch (const std::exception& err) {
      // Keep the previous state, and give the weight its previous value back.
      s.nvme_->release(fresh[b]);
      ++s.stats_.write_failures;
      fail(writer[b], err.what());
      restore_weight(items[writer[b]], e);
    }
    writes[b] = swap::TransferHandle();
  }
  void restore_weight(const Item& it, const Entry& e) {
    if (!it.param_out) return;
    try {
      PoolBuffer old(s.pool_.get(), s.state_bytes(e));
      const swap::TransferHandle got = s.nvme_->read(e.block, old.p, s.state_bytes(e));
      try {
        got.wait();
      } catch (const stall_error&) {
        old.keep_for_good("an NVMe optimizer state's buffer under a stalled read");
        if (!stall) stall = std::current_exception();
        throw;
      }
      write_param(it.param_out, it.param_type, old.f(), e.numel);  // the master leads every block
    } catch (const stall_error&) {
      throw;
    } catch (const std::exception& restore) {
      log(LogLevel::kError,
          std::string("NVMe optimizer: could not restore a weight after a failed write: ") + restore.what());
    }
  }
  // Lets every read land and every write settle (reads may be in flight after a break).
  // After a stall nothing more is waited for: what is in flight keeps its buffers and blocks (~Flight).
  void drain() {
    for (int b = 0; b < 2 && !stall; ++b) {
      try {
        reads[b].wait();
      } catch (const stall_error&) {
        stall = std::current_exception();
      } catch (...) {
      }
    }
    for (int b = 0; b < 2 && !stall; ++b) {
      try {
        settle(b);
      } catch (const stall_error&) {  // (kept by settle)
      }
    }
  }
};

// Item i, whose state is in buffer i % 2: stepped and written behind. False
// when no NVMe space is left for it (it and the rest are failed).
bool NvmeAdamStore::step_item(Flight& f, const AdamOptions& options, std::int64_t step, std::size_t i) {
  const int cur = static_cast<int>(i % 2), nxt = 1 - cur;
  const Entry& e = entry(f.items[i].key);
  const std::uint64_t t0 = now_ns();
  const std::string lost = f.wait_read(cur);
  stats_.read_wait_ns += now_ns() - t0;
  if (i + 1 < f.items.size()) {
    f.settle(nxt);  // the other buffer's write must finish before it is reused
    f.start_read(nxt, i + 1);
  }
  if (!lost.empty()) {
    // Its state cannot be read back (corrupt, or a read error): this item is
    // not stepped, nothing of it changes, and the others go on.
    f.result.lost.push_back(i);
    f.fail(i, lost);
    return true;
  }
  stats_.bytes_read += state_bytes(e);
  // Space for the new state first: without it this item (and the rest) is
  // not stepped at all, so nothing changes for them.
  try {
    f.fresh[cur] = nvme_->allocate(state_bytes(e));
  } catch (const std::exception& full) {  // out_of_memory, or io_error of a grow
    for (std::size_t j = i; j < f.items.size(); ++j) f.fail(j, full.what());
    return false;
  }
  AdamTensor t;
  t.numel = e.numel;
  void* base = f.bufs[cur].p;
  const StateLayout at(e.numel, e.format);
  t.master = static_cast<float*>(base);
  t.state_format = e.format;
  if (e.format == StateFormat::kFp32) {
    t.exp_avg = reinterpret_cast<float*>(at_offset(base, at.m));
    t.exp_avg_sq = reinterpret_cast<float*>(at_offset(base, at.v));
  } else {  // stepped in place in the buffer: the block goes back to NVMe in its format
    t.m = packed(e.format, at_offset(base, at.m), e.numel);
    t.v = packed(e.format, at_offset(base, at.v), e.numel);
  }
  t.max_exp_avg_sq = e.amsgrad ? reinterpret_cast<float*>(at_offset(base, at.vmax)) : nullptr;
  t.grad = f.items[i].grad;
  t.grad_type = f.items[i].grad_type;
  t.param_out = f.items[i].param_out;
  t.param_type = f.items[i].param_type;
  AdamOptions o = options;
  o.amsgrad = e.amsgrad && options.amsgrad;
  adam_.step(o, step, {t});
  f.writer[cur] = i;
  f.writes[cur] = nvme_->write(f.fresh[cur], f.bufs[cur].p, state_bytes(e));
  return true;
}

NvmeAdamStore::StepResult NvmeAdamStore::step(const AdamOptions& options, std::int64_t step,
                                              const std::vector<Item>& items) {
  if (items.empty()) return {};
  std::size_t max_bytes = 0;
  for (const auto& it : items) max_bytes = std::max(max_bytes, state_bytes(entry(it.key)));
  Flight f(*this, items, max_bytes);
  f.start_read(0, 0);
  try {
    for (std::size_t i = 0; i < items.size(); ++i)
      if (!step_item(f, options, step, i)) break;
  } catch (...) {
    f.drain();  // something unexpected: finish what is in flight before the buffers go
    throw;
  }
  f.drain();
  if (f.stall) std::rethrow_exception(f.stall);  // Note [Stall timeout]
  ++stats_.steps;
  std::sort(f.result.failed.begin(), f.result.failed.end());
  return std::move(f.result);
}

}  // namespace tierflow::optimizer
