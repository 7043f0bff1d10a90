// See Note [Staged pipeline] in staged_pipeline.hpp.
#include "tierflow/swap/staged_pipeline.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/keep_forever.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/stall.hpp"

namespace tierflow::swap {

/// One block and the transfers that move it.
struct StagedPipeline::Block {
  std::uint64_t id = 0;
  std::size_t bytes = 0;
  int device = 0;
  StagedState state = StagedState::kToHost;
  bool to_nvme = false;          // goes on to the NVMe tier after the copy to the host
  bool offloaded = true;         // false once its copy to the host failed
  bool to_host_settled = false;  // its copy to the host was observed complete (or it was released)
  DeviceBuffer device_copy;      // held while the block has a device copy
  void* staging = nullptr;       // pinned pool block while it has a host copy
  NvmeBlock nvme_block = 0;      // its space on NVMe, once a write started
  TransferHandle d2h;
  TransferHandle h2d;
  TransferHandle write;
  TransferHandle read;
  std::exception_ptr read_error;  // a failed NVMe read, raised by complete_fetch()
};

const char* to_string(StagedState s) noexcept {
  switch (s) {
    case StagedState::kOnDevice: return "on device";
    case StagedState::kToHost: return "in flight to host";
    case StagedState::kOnHost: return "on host";
    case StagedState::kOnNvme: return "on NVMe";
    case StagedState::kToDevice: return "in flight to device";
    case StagedState::kReleased: return "released";
  }
  return "?";
}

namespace {
// The oldest block of `list` not released, or null.
template <class Ptr>
Ptr oldest_live(const std::vector<Ptr>& list) {
  for (const auto& b : list)
    if (b->state != StagedState::kReleased) return b;
  return nullptr;
}

// Waits for a transfer whose failure poll() settles (or complete_fetch() raises). A stall is raised
// (Note [Stall timeout]): taken for a failure, the caller would report a lack of staging memory.
void wait_quietly(const TransferHandle& handle) {
  try {
    handle.wait();
  } catch (const stall_error&) {
    throw;
  } catch (const std::exception&) {
  }
}
}  // namespace

StagedPipeline::StagedPipeline(StagedPipelineOptions options, std::shared_ptr<allocator::PinnedHostPool> pool,
                               std::shared_ptr<CopyEngine> engine, std::shared_ptr<NvmeEngine> nvme)
    : options_(std::move(options)), pool_(std::move(pool)), engine_(std::move(engine)), nvme_(std::move(nvme)) {
  TIERFLOW_EXPECTS(pool_ && engine_, "StagedPipeline: a pinned host pool and a copy engine are required");
  TIERFLOW_EXPECTS(options_.allocate_device && options_.compute_stream,
                   "StagedPipeline: allocate_device and compute_stream are required");
}

StagedPipeline::~StagedPipeline() {
  std::vector<std::uint64_t> ids;
  ids.reserve(blocks_.size());
  for (const auto& entry : blocks_) ids.push_back(entry.first);
  for (std::uint64_t id : ids) release(id);
  // Note [Stall timeout]: a stalled block's memory may still be read or written by its work: wait for it
  // within the limit (counted from the work's start: what stalled already is given up at once), and past it
  // keep the block's memory for good (staging, device copy, NVMe space) instead of hanging the exit.
  std::uint64_t kept_bytes = 0;
  std::vector<std::shared_ptr<void>> kept;  // its staging, device copy and NVMe space stay
  for (const BlockPtr& b : stalled_) {
    bool hung = false;
    for (const TransferHandle* h : {&b->d2h, &b->h2d, &b->write, &b->read}) {
      try {
        h->wait();
      } catch (const stall_error&) {
        hung = true;
        break;
      } catch (const std::exception&) {  // a failure: the work has ended
      }
    }
    if (!hung) {
      free_block(*b);
      continue;
    }
    kept_bytes += b->bytes;
    kept.push_back(b);
  }
  if (kept.empty()) return;
  const std::string what = std::to_string(kept.size()) + " staged block(s) of " + format_bytes(kept_bytes) +
                           " whose copy or NVMe request stalled, at the pipeline's teardown";
  keep_forever(std::move(kept), kept_bytes, what);
}

StagedPipeline::Block& StagedPipeline::at(std::uint64_t id) const {
  auto it = blocks_.find(id);
  TIERFLOW_EXPECTS(it != blocks_.end(), "StagedPipeline: no block " + std::to_string(id));
  return *it->second;
}

void StagedPipeline::set_state(Block& b, StagedState to) {
  b.state = to;
  if (options_.on_state) options_.on_state(b.id, to);
}

StagedState StagedPipeline::state(std::uint64_t id) const {
  auto it = blocks_.find(id);
  return it == blocks_.end() ? StagedState::kReleased : it->second->state;
}

const DeviceBuffer& StagedPipeline::device_copy(std::uint64_t id) const { return at(id).device_copy; }

bool StagedPipeline::copy_to_device_ready(std::uint64_t id) const { return at(id).h2d.ready(); }

bool StagedPipeline::offloaded(std::uint64_t id) const {
  auto it = blocks_.find(id);
  return it != blocks_.end() && it->second->offloaded;
}

std::size_t StagedPipeline::transfers_left() const noexcept {
  // A copy to the host still has its NVMe write ahead of it: it counts twice,
  // so every completion lowers the sum.
  return 2 * to_host_.size() + writes_.size() + reads_.size() + to_device_.size();
}

bool StagedPipeline::wait_for_a_transfer() {
  const std::size_t before = transfers_left();
  if (before == 0) return false;
  // Transfers that free staging first: a write, or a read and its copy to the
  // device. Copies to the host come last: they free staging only by way of
  // their writes, and waiting on them syncs with the compute that feeds them.
  // A failed transfer is settled by poll() (a failed copy or write keeps the
  // data where it was; a failed read is raised by the block's complete_fetch).
  if (auto b = oldest_live(writes_)) {
    wait_quietly(b->write);
  } else if (auto b = oldest_live(to_device_)) {
    if (b->read.valid() && !b->h2d.valid()) {
      wait_quietly(b->read);
      poll();  // starts its copy to the device
    }
    if (b->h2d.valid()) wait_quietly(b->h2d);
  } else if (auto b = oldest_live(to_host_)) {
    wait_quietly(b->d2h);
  }
  poll();
  return transfers_left() < before;
}

void* StagedPipeline::staging(std::size_t bytes) {
  // Back-pressure: staging comes free as transfers complete; wait for them
  // one at a time until the block fits or nothing is left in flight.
  if (bytes > pool_->budget_bytes()) return nullptr;  // no wait would make it fit
  for (;;) {
    if (void* p = pool_->try_allocate(bytes)) return p;
    ++stats_.staging_waits;
    if (!wait_for_a_transfer()) return nullptr;
  }
}

bool StagedPipeline::offload(std::uint64_t id, DeviceBuffer src, std::size_t bytes, int device,
                             StagedTarget target, StreamRef after) {
  raise_stall();
  TIERFLOW_EXPECTS(blocks_.count(id) == 0, "StagedPipeline::offload: block " + std::to_string(id) + " is held");
  TIERFLOW_EXPECTS(target == StagedTarget::kHost || nvme_, "StagedPipeline::offload: no NVMe tier is attached");
  const bool to_nvme = target == StagedTarget::kNvme;
  void* host = to_nvme ? staging(bytes) : pool_->try_allocate(bytes);
  if (!host) return false;
  auto b = std::make_shared<Block>();
  b->id = id;
  b->bytes = bytes;
  b->device = device;
  b->to_nvme = to_nvme;
  b->staging = host;
  try {
    b->d2h = engine_->copy(Direction::kDeviceToHost, host, src.data, bytes, {}, after);
  } catch (...) {
    pool_->deallocate(host);
    throw;
  }
  b->device_copy = std::move(src);
  blocks_.emplace(id, b);
  to_host_.push_back(b);
  to_host_bytes_ += bytes;
  throttle(bytes);
  return true;
}

void StagedPipeline::throttle(std::size_t just_added) {
  // Copies to the host that have not finished still hold device memory: bound
  // them, waiting on the oldest (back-pressure).
  const std::uint64_t window = std::max<std::uint64_t>(options_.max_to_host_bytes, just_added);
  while (to_host_bytes_ > window && !to_host_.empty()) {
    const BlockPtr oldest = to_host_.front();
    if (oldest->state != StagedState::kReleased && !oldest->d2h.ready()) {
      const std::uint64_t t0 = now_ns();
      oldest->d2h.wait();
      stats_.offload_waits += 1;
      stats_.offload_wait_ns += now_ns() - t0;
    }
    const std::size_t before = to_host_.size();
    poll();
    if (to_host_.size() == before) break;  // nothing settled: do not spin
  }
}

void StagedPipeline::start_nvme_write(Block& b) {
  try {
    b.nvme_block = nvme_->allocate(b.bytes);
  } catch (const out_of_memory& e) {
    if (stats_.nvme_full++ == 0) log(LogLevel::kWarn, std::string(e.what()) + "; blocks stay in host memory");
    return;
  }
  b.write = nvme_->write(b.nvme_block, b.staging, b.bytes);
}

void StagedPipeline::poll() {
  poll_stalled();
  poll_to_host();
  poll_writes();
  poll_reads();
  poll_to_device();
}

void StagedPipeline::poll_to_host() {
  std::vector<BlockPtr> still;
  for (auto& b : to_host_) {
    if (b->state == StagedState::kReleased) continue;  // release() settled its bytes
    if (!b->d2h.ready()) {
      still.push_back(b);
      continue;
    }
    if (b->to_host_settled) continue;
    to_host_bytes_ -= b->bytes;
    b->to_host_settled = true;
    try {
      b->d2h.wait();
    } catch (const std::exception& e) {
      // The copy to the host failed: the device copy is still there, keep it.
      log(LogLevel::kWarn, std::string("a block stays on the device, its copy to the host failed: ") + e.what());
      pool_->deallocate(b->staging);
      b->staging = nullptr;
      b->offloaded = false;
      if (b->state == StagedState::kToHost) set_state(*b, StagedState::kOnDevice);
      continue;
    }
    if (b->state == StagedState::kToHost) {
      b->device_copy = DeviceBuffer{};  // the device copy is no longer needed
      set_state(*b, StagedState::kOnHost);
      if (b->to_nvme) {
        start_nvme_write(*b);
        if (b->write.valid()) writes_.push_back(b);
      }
    } else if (b->state == StagedState::kOnDevice && b->staging) {
      pool_->deallocate(b->staging);  // forwarded: the host copy is not needed
      b->staging = nullptr;
    }
  }
  to_host_.swap(still);
}

void StagedPipeline::poll_writes() {
  std::vector<BlockPtr> still;
  for (auto& b : writes_) {
    if (b->state == StagedState::kReleased) continue;
    if (!b->write.ready()) {
      still.push_back(b);
      continue;
    }
    try {
      b->write.wait();
      ++stats_.nvme_writes;
      stats_.nvme_write_bytes += b->bytes;
      // The staging block goes back to the pool unless a fetch is reading it.
      if (b->state != StagedState::kToDevice && b->staging) {
        pool_->deallocate(b->staging);
        b->staging = nullptr;
        if (b->state == StagedState::kOnHost) set_state(*b, StagedState::kOnNvme);
      }
    } catch (const std::exception& e) {
      // The data is still in host memory: keep it there, never lose it.
      if (stats_.nvme_write_failures++ == 0)
        log(LogLevel::kWarn, std::string(e.what()) + "; the block stays in host memory");
      nvme_->release(b->nvme_block);
      b->nvme_block = 0;
    }
  }
  writes_.swap(still);
}

void StagedPipeline::poll_reads() {
  std::vector<BlockPtr> still;
  for (auto& b : reads_) {
    if (b->state == StagedState::kReleased) continue;
    if (!b->read.ready()) {
      still.push_back(b);
      continue;
    }
    try {
      b->read.wait();
    } catch (...) {
      // The data is gone: the error belongs to whoever completes this fetch
      // (a block that is never read again never sees it).
      b->read_error = std::current_exception();
      continue;
    }
    ++stats_.nvme_reads;
    b->h2d = engine_->copy(Direction::kHostToDevice, b->device_copy.data, b->staging, b->bytes, {},
                           options_.compute_stream(b->device));
  }
  reads_.swap(still);
}

void StagedPipeline::poll_to_device() {
  // A block on its way to the device no longer needs its staging once the copy is done.
  std::vector<BlockPtr> still;
  for (auto& b : to_device_) {
    if (b->state == StagedState::kReleased || !b->staging) continue;
    if (b->read_error) {  // nothing will copy it: the staging is free now
      pool_->deallocate(b->staging);
      b->staging = nullptr;
      continue;
    }
    if (!b->h2d.valid() || !b->h2d.ready()) {
      still.push_back(b);
      continue;
    }
    const bool write_pending = b->write.valid() && !b->write.ready();
    if (write_pending) {
      still.push_back(b);
      continue;
    }
    try {
      b->h2d.wait();
    } catch (const std::exception&) {
      continue;  // complete_fetch raises it
    }
    pool_->deallocate(b->staging);
    b->staging = nullptr;
  }
  to_device_.swap(still);
}

FetchResult StagedPipeline::fetch(std::uint64_t id) {
  raise_stall();
  auto it = blocks_.find(id);
  if (it == blocks_.end()) return FetchResult::kNothing;
  const BlockPtr b = it->second;
  switch (b->state) {
    case StagedState::kToHost:
      // The device copy still exists: keep it instead of a round trip.
      set_state(*b, StagedState::kOnDevice);
      return FetchResult::kForwarded;
    case StagedState::kOnHost:
    case StagedState::kOnNvme: {
      const bool from_nvme = b->staging == nullptr;  // else its staging still holds it (forwarding)
      // Device memory, then staging, then the transfer: if any of them cannot
      // be had, the block is left as it was.
      DeviceBuffer dst = options_.allocate_device(b->bytes, b->device);
      if (from_nvme) {
        void* staged = staging(b->bytes);
        if (!staged) return FetchResult::kNoStaging;  // complete it later, with fetch_or_throw
        try {
          b->read = nvme_->read(b->nvme_block, staged, b->bytes);
        } catch (...) {
          pool_->deallocate(staged);
          throw;
        }
        b->staging = staged;
        reads_.push_back(b);
      } else {
        if (b->write.valid()) ++stats_.nvme_forwarded;
        b->h2d = engine_->copy(Direction::kHostToDevice, dst.data, b->staging, b->bytes, {b->d2h},
                               options_.compute_stream(b->device));
      }
      b->device_copy = std::move(dst);
      if (nvme_) to_device_.push_back(b);
      set_state(*b, StagedState::kToDevice);
      return FetchResult::kStarted;
    }
    default:
      return FetchResult::kNothing;
  }
}

void StagedPipeline::fetch_or_throw(std::uint64_t id) {
  const StagedState s = state(id);
  if (s != StagedState::kOnHost && s != StagedState::kOnNvme) return;
  // Not fetched although nothing of ours may be in flight: try once more, as
  // the pool is shared (with the optimizer), which may have freed memory since.
  fetch(id);
  if (state(id) == StagedState::kToDevice) return;
  const auto st = pool_->stats();
  throw out_of_memory("no pinned staging memory to bring back a block of " + format_bytes(at(id).bytes) +
                      " with every transfer settled: " + format_bytes(st.in_use.current) + " in use and " +
                      format_bytes(st.reserved.current) + " reserved of TIERFLOW_HOST_MEMORY=" +
                      format_bytes(pool_->budget_bytes()) + "; raise TIERFLOW_HOST_MEMORY");
}

void StagedPipeline::complete_fetch(std::uint64_t id) {
  raise_stall();
  Block& b = at(id);
  TIERFLOW_EXPECTS(b.state == StagedState::kToDevice, "StagedPipeline::complete_fetch: block " + std::to_string(id) +
                                                          " is " + to_string(b.state) + ", not in flight to device");
  if (b.read.valid() && !b.h2d.valid()) {
    b.read.wait();  // raises a failed or corrupt read
    poll();         // starts its copy to the device
    if (b.read_error) std::rethrow_exception(b.read_error);
  }
  // Rule 2 of Note [Copy ordering]: the compute stream that reads the block
  // waits for its copy (on CUDA the host does not block). A failed copy is
  // raised here, as the data is not there.
  if (b.h2d.ready()) b.h2d.wait();
  engine_->make_stream_wait(options_.compute_stream(b.device), b.h2d);
  set_state(b, StagedState::kOnDevice);
  const bool write_pending = b.write.valid() && !b.write.ready();
  if (b.staging && !write_pending) {
    pool_->deallocate(b.staging, b.h2d.state());  // rule 3: reused once the copy has read it
    b.staging = nullptr;
  }
}

void StagedPipeline::release(std::uint64_t id) noexcept {
  auto it = blocks_.find(id);
  if (it == blocks_.end()) return;
  const BlockPtr b = it->second;
  if (!b->to_host_settled) to_host_bytes_ -= b->bytes;
  b->to_host_settled = true;
  blocks_.erase(it);
  if (!stall_.empty()) {  // after a stall, a block whose work is not done waits no more: parked at once
    bool done = false;
    try {
      done = b->d2h.ready() && b->h2d.ready() && b->write.ready() && b->read.ready();
    } catch (const std::exception&) {
    }
    if (!done) {
      try {
        stalled_.push_back(b);
        set_state(*b, StagedState::kReleased);
      } catch (const std::exception&) {
      }
      return;
    }
  }
  try {
    // A copy may still read or write the staging: let it finish first.
    b->d2h.wait();
    b->h2d.wait();
  } catch (const stall_error& e) {
    return park_stalled(b, "a copy", e);
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("copy failed while releasing a block: ") + e.what());
  }
  try {
    b->write.wait();
  } catch (const stall_error& e) {
    return park_stalled(b, "an NVMe write", e);
  } catch (const std::exception&) {
    // a failed write was already reported; its space is released below
  }
  try {
    b->read.wait();
  } catch (const stall_error& e) {
    return park_stalled(b, "an NVMe read", e);
  } catch (const std::exception&) {
    // the read's error reached (or will not matter to) its complete_fetch
  }
  free_block(*b);
}

void StagedPipeline::free_block(Block& b) noexcept {
  if (b.nvme_block) {
    nvme_->release(b.nvme_block);
    b.nvme_block = 0;
  }
  if (b.staging) {
    pool_->deallocate(b.staging);
    b.staging = nullptr;
  }
  b.device_copy = DeviceBuffer{};
  if (b.state == StagedState::kReleased) return;  // parked by park_stalled, which said so then
  try {
    set_state(b, StagedState::kReleased);
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("staged block release: ") + e.what());
  }
}

// Note [Stall timeout]: a block released while its copy or request stalls keeps its memory (staging, device
// copy, NVMe space) until that ends, since the work may still read or write it; it is freed by a later poll,
// or by the destructor, which waits within the limit and then keeps it for good. release() cannot raise: the stall is kept and raised by the next offload,
// fetch or complete_fetch, and from then on a release parks a block whose work is not done without waiting.
void StagedPipeline::park_stalled(const BlockPtr& b, const char* what, const std::exception& e) noexcept {
  log(LogLevel::kError, std::string("a released block keeps its memory while ") + what + " of it is stalled: " +
                            e.what());
  try {
    if (stall_.empty()) stall_ = e.what();  // raised by the next offload or fetch: release cannot raise
    stalled_.push_back(b);
    set_state(*b, StagedState::kReleased);
  } catch (const std::exception&) {  // no room to remember it: its memory stays for good (safe, not freed)
  }
}

void StagedPipeline::raise_stall() const {
  raise_if_stalled();  // the oldest work in flight past its limit, named as it is now (Note [Stall timeout])
  if (!stall_.empty()) throw stall_error(stall_);
}

void StagedPipeline::poll_stalled() noexcept {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < stalled_.size(); ++i) {
    Block& b = *stalled_[i];
    bool done = false;
    try {
      done = b.d2h.ready() && b.h2d.ready() && b.write.ready() && b.read.ready();
    } catch (const std::exception&) {  // a failed query: keep it for the destructor's wait
    }
    if (done) free_block(b);
    else stalled_[kept++] = stalled_[i];
  }
  stalled_.resize(kept);
}

void StagedPipeline::synchronize() {
  engine_->synchronize();
  poll();
}

void StagedPipeline::set_max_to_host_bytes(std::uint64_t bytes) {
  TIERFLOW_EXPECTS(bytes > 0, "StagedPipeline: max_to_host_bytes must be > 0");
  options_.max_to_host_bytes = bytes;
}

}  // namespace tierflow::swap
