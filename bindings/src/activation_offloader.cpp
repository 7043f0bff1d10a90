// See Note [Saved-tensor offload] in activation_offloader.hpp.
#include "tierflow/bindings/activation_offloader.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <chrono>

#include "tierflow/core/error.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::bindings {

using tiering::BlockId;
using tiering::Residence;

ActivationOffloader::ActivationOffloader(ActivationOffloaderOptions options,
                                         std::shared_ptr<allocator::PinnedHostPool> pool,
                                         std::shared_ptr<swap::CopyEngine> engine,
                                         std::shared_ptr<swap::NvmeEngine> nvme)
    : options_(options),
      pool_(std::move(pool)),
      engine_(std::move(engine)),
      nvme_(std::move(nvme)),
      schedule_(options.schedule) {}

ActivationOffloader::~ActivationOffloader() = default;

namespace {
// The oldest block of `list` still alive, or null.
std::shared_ptr<SavedBlock> oldest_live(const std::vector<std::weak_ptr<SavedBlock>>& list) {
  for (const auto& w : list) {
    auto b = w.lock();
    if (b && !b->released) return b;
  }
  return nullptr;
}
}  // namespace

std::size_t ActivationOffloader::transfers_left_locked() const noexcept {
  // A copy to the host still has its NVMe write ahead of it: it counts twice,
  // so every completion lowers the sum.
  return 2 * pending_d2h_.size() + pending_nvme_writes_.size() + pending_nvme_reads_.size() + pending_h2d_.size();
}

bool ActivationOffloader::wait_for_a_transfer_locked() {
  const std::size_t before = transfers_left_locked();
  if (before == 0) return false;
  // Transfers that free staging first: a write, or a read and its copy to the
  // device. Copies to the host come last: they free staging only by way of
  // their writes, and waiting on them syncs with the compute that feeds them.
  // A failed transfer is settled by poll_locked (a failed copy or write keeps
  // the data where it was; a failed read is raised by the block's unpack).
  const auto wait_quietly = [](const auto& handle) {
    try {
      handle.wait();
    } catch (const std::exception&) {
    }
  };
  if (auto b = oldest_live(pending_nvme_writes_)) {
    wait_quietly(b->nvme_write);
  } else if (auto b = oldest_live(pending_h2d_)) {
    if (b->nvme_read.valid() && !b->h2d.valid()) {
      wait_quietly(b->nvme_read);
      poll_locked();  // starts its copy to the device
    }
    if (b->h2d.valid()) wait_quietly(b->h2d);
  } else if (auto b = oldest_live(pending_d2h_)) {
    wait_quietly(b->d2h);
  }
  poll_locked();
  return transfers_left_locked() < before;
}

void* ActivationOffloader::staging_locked(std::size_t bytes) {
  // Back-pressure: staging comes free as transfers complete; wait for them
  // one at a time until the block fits or nothing is left in flight.
  if (bytes > pool_->budget_bytes()) return nullptr;  // no wait would make it fit
  for (;;) {
    if (void* p = pool_->try_allocate(bytes)) return p;
    ++stats_.staging_waits;
    if (!wait_for_a_transfer_locked()) return nullptr;
  }
}

void ActivationOffloader::start_nvme_write_locked(SavedBlock& b) {
  try {
    b.nvme_block = nvme_->allocate(b.nbytes);
  } catch (const out_of_memory& e) {
    if (stats_.nvme_full++ == 0) log(LogLevel::kWarn, std::string(e.what()) + "; saved activations stay in host memory");
    return;
  }
  b.nvme_write = nvme_->write(b.nvme_block, b.host, b.nbytes);
}

swap::StreamRef ActivationOffloader::current_stream(const at::Device& device) const {
  return compute_stream_of(*engine_, device);
}

swap::StreamRef compute_stream_of(const swap::CopyEngine& engine, const at::Device& device) {
  if (engine.device() != allocator::DeviceKind::kCuda) return engine.compute_stream(nullptr);
  TIERFLOW_EXPECTS(device.is_cuda(), "compute_stream_of: a " + device.str() + " tensor has no CUDA stream");
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  return engine.compute_stream(impl->getStream(device).native_handle());
}

bool on_engine_device(const swap::CopyEngine& engine, const at::Tensor& t) {
  return engine.device() == allocator::DeviceKind::kCuda ? t.is_cuda() : t.is_cpu();
}

bool ActivationOffloader::managed(const at::Tensor& t) const {
  if (t.layout() != at::kStrided || t.is_conj() || t.is_neg() || !t.has_storage()) return false;
  if (!on_engine_device(*engine_, t)) return false;
  return t.storage().nbytes() > 0;
}

void ActivationOffloader::register_parameters(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  for (const auto& p : params) {
    if (!p.defined() || !p.has_storage()) continue;
    const void* key = p.storage().unsafeGetStorageImpl();
    if (parameter_index_.count(key)) continue;
    parameter_index_.emplace(key, parameters_.size());
    parameters_.push_back(p.storage().getWeakStorageImpl());
  }
}

namespace {
thread_local int t_no_offload_depth = 0;
}  // namespace

void push_no_offload() { ++t_no_offload_depth; }

void pop_no_offload() {
  TIERFLOW_EXPECTS(t_no_offload_depth > 0, "tierflow.no_offload(): leaving a region that was never entered");
  --t_no_offload_depth;
}

int no_offload_depth() noexcept { return t_no_offload_depth; }

void ActivationOffloader::begin_forward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  poll_locked();
  schedule_.begin_forward();
  by_storage_.clear();
  if (blocks_.size() > schedule_.registry().size()) blocks_.resize(schedule_.registry().size());
}

std::shared_ptr<SavedHandle> ActivationOffloader::pack(const at::Tensor& t, PackTarget target) {
  auto handle = std::make_shared<SavedHandle>();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  ++stats_.packs;
  if (!t.defined()) {
    handle->passthrough = t;
    return handle;
  }
  poll_locked();
  if (!managed(t)) {
    ++stats_.skipped_unmanaged;
    handle->passthrough = t;
    return handle;
  }
  const c10::Storage& storage = t.storage();
  const void* key = storage.unsafeGetStorageImpl();
  auto param = parameter_index_.find(key);
  const bool is_registered_param =
      param != parameter_index_.end() && !parameters_[param->second].expired();
  if (is_registered_param || (t.is_leaf() && t.requires_grad())) {
    ++stats_.skipped_parameters;
    handle->passthrough = t;
    return handle;
  }
  handle->sizes = t.sizes().vec();
  handle->strides = t.strides().vec();
  handle->storage_offset = t.storage_offset();
  handle->dtype = t.scalar_type();

  const std::int64_t version = t._version();
  auto found = by_storage_.find(key);
  if (found != by_storage_.end()) {
    auto existing = found->second.lock();
    if (existing && existing->version == version && existing->device == t.device()) {
      ++stats_.dedup_hits;
      handle->block = std::move(existing);
      return handle;
    }
  }

  const std::size_t nbytes = storage.nbytes();
  const bool small = nbytes < options_.min_offload_bytes;
  const bool region = no_offload_depth() > 0;
  const tiering::PackDirective directive = target == PackTarget::kPolicy ? tiering::PackDirective::kPolicy
                                           : target == PackTarget::kKeep ? tiering::PackDirective::kKeep
                                                                         : tiering::PackDirective::kOffload;
  const bool to_nvme = nvme_ != nullptr &&
                       (target == PackTarget::kNvme ||
                        (target == PackTarget::kPolicy && options_.schedule.target == OffloadTarget::kNvme));
  tiering::PackDecision d = schedule_.on_pack(nbytes, !small && !region, directive);
  auto block = std::make_shared<SavedBlock>(storage.getWeakStorageImpl());
  block->id = d.id;
  block->owner = shared_from_this();  // from here on its destructor releases it, whatever throws below
  block->nbytes = nbytes;
  block->device = t.device();
  block->version = version;
  block->device_storage = storage;
  if (blocks_.size() <= d.id) blocks_.resize(d.id + 1);
  blocks_[d.id] = block;
  if (!d.offload) {
    if (small) ++stats_.kept_small;
    else if (region) ++stats_.kept_region;
  } else if (void* host = to_nvme ? staging_locked(nbytes) : pool_->try_allocate(nbytes)) {
    block->host = host;
    block->offloaded = true;
    block->to_nvme = to_nvme;
    block->d2h = engine_->copy(swap::Direction::kDeviceToHost, host, storage.data(), nbytes, {},
                               current_stream(t.device()));
    pending_d2h_.push_back(block);
    ++stats_.offloaded_blocks;
    stats_.offloaded_bytes += nbytes;
    d2h_inflight_bytes_ += nbytes;
    throttle_locked(nbytes);
  } else {
    if (stats_.host_fallbacks++ == 0) {
      log(LogLevel::kWarn, "pinned host pool full (TIERFLOW_HOST_MEMORY): saved activations "
                           "that do not fit stay on the device");
    }
    schedule_.registry().transition(d.id, Residence::kResident);
  }
  by_storage_[key] = block;
  handle->block = std::move(block);
  return handle;
}

void ActivationOffloader::poll_locked() {
  std::vector<std::weak_ptr<SavedBlock>> still;
  for (auto& w : pending_d2h_) {
    auto b = w.lock();
    if (!b || b->released) continue;  // release() settled its bytes
    if (!b->d2h.ready()) {
      still.push_back(w);
      continue;
    }
    if (b->d2h_settled) continue;
    d2h_inflight_bytes_ -= b->nbytes;
    b->d2h_settled = true;
    auto& reg = schedule_.registry();
    try {
      b->d2h.wait();
    } catch (const std::exception& e) {
      // The copy to the host failed: the device copy is still there, keep it.
      log(LogLevel::kWarn, std::string("saved tensor stays on the device, its copy to the host failed: ") + e.what());
      if (reg.residence(b->id) == Residence::kInFlightToHost) reg.transition(b->id, Residence::kResident);
      pool_->deallocate(b->host);
      b->host = nullptr;
      b->offloaded = false;
      continue;
    }
    if (reg.residence(b->id) == Residence::kInFlightToHost) {
      reg.transition(b->id, Residence::kOnHost);
      b->device_storage = c10::Storage();  // the device copy is no longer needed
      if (b->to_nvme) {
        start_nvme_write_locked(*b);
        if (b->nvme_write.valid()) pending_nvme_writes_.push_back(b);
      }
    } else if (reg.residence(b->id) == Residence::kResident && b->host) {
      pool_->deallocate(b->host);  // forwarded: the host copy is not needed
      b->host = nullptr;
    }
  }
  pending_d2h_.swap(still);

  std::vector<std::weak_ptr<SavedBlock>> writes;
  for (auto& w : pending_nvme_writes_) {
    auto b = w.lock();
    if (!b || b->released) continue;
    if (!b->nvme_write.ready()) {
      writes.push_back(w);
      continue;
    }
    try {
      b->nvme_write.wait();
      b->on_nvme = true;
      ++stats_.nvme_writes;
      stats_.nvme_write_bytes += b->nbytes;
      // The staging block goes back to the pool unless a prefetch is reading it.
      if (schedule_.registry().residence(b->id) != Residence::kInFlightToDevice && b->host) {
        pool_->deallocate(b->host);
        b->host = nullptr;
      }
    } catch (const std::exception& e) {
      // The data is still in host memory: keep it there, never lose it.
      if (stats_.nvme_write_failures++ == 0)
        log(LogLevel::kWarn, std::string(e.what()) + "; the block stays in host memory");
      nvme_->release(b->nvme_block);
      b->nvme_block = 0;
    }
  }
  pending_nvme_writes_.swap(writes);

  std::vector<std::weak_ptr<SavedBlock>> reads;
  for (auto& w : pending_nvme_reads_) {
    auto b = w.lock();
    if (!b || b->released) continue;
    if (!b->nvme_read.ready()) {
      reads.push_back(w);
      continue;
    }
    try {
      b->nvme_read.wait();
    } catch (...) {
      // The data is gone: the error belongs to whoever unpacks this block
      // (a graph that is never unpacked again never sees it).
      b->read_error = std::current_exception();
      continue;
    }
    ++stats_.nvme_reads;
    b->h2d = engine_->copy(swap::Direction::kHostToDevice, b->device_storage.mutable_data(), b->host, b->nbytes,
                           {}, current_stream(b->device));
  }
  pending_nvme_reads_.swap(reads);

  // A block on its way to the device no longer needs its staging once the copy is done.
  std::vector<std::weak_ptr<SavedBlock>> h2ds;
  for (auto& w : pending_h2d_) {
    auto b = w.lock();
    if (!b || b->released || !b->host) continue;
    if (b->read_error) {  // nothing will copy it: the staging is free now
      pool_->deallocate(b->host);
      b->host = nullptr;
      continue;
    }
    if (!b->h2d.valid() || !b->h2d.ready()) {
      h2ds.push_back(w);
      continue;
    }
    const bool write_pending = b->nvme_write.valid() && !b->nvme_write.ready();
    if (write_pending) {
      h2ds.push_back(w);
      continue;
    }
    try {
      b->h2d.wait();
    } catch (const std::exception&) {
      continue;  // its unpack raises it
    }
    pool_->deallocate(b->host);
    b->host = nullptr;
  }
  pending_h2d_.swap(h2ds);
}

void ActivationOffloader::throttle_locked(std::size_t just_added) {
  // Copies to the host that have not finished still hold device memory: bound
  // them by the same window as prefetch, waiting on the oldest (back-pressure).
  const std::uint64_t window = std::max<std::uint64_t>(options_.schedule.prefetch_bytes, just_added);
  while (d2h_inflight_bytes_ > window && !pending_d2h_.empty()) {
    auto oldest = pending_d2h_.front().lock();
    if (oldest && !oldest->released && !oldest->d2h.ready()) {
      const std::uint64_t t0 = now_ns();
      oldest->d2h.wait();
      stats_.offload_waits += 1;
      stats_.offload_wait_ns += now_ns() - t0;
    }
    const std::size_t before = pending_d2h_.size();
    poll_locked();
    if (pending_d2h_.size() == before) break;  // nothing settled: do not spin
  }
}

void ActivationOffloader::prefetch_locked(BlockId id) {
  if (id >= blocks_.size()) return;
  auto b = blocks_[id].lock();
  if (!b || b->released) return;
  auto& reg = schedule_.registry();
  switch (reg.residence(id)) {
    case Residence::kInFlightToHost:
      // The device copy still exists: keep it instead of a round trip.
      reg.transition(id, Residence::kResident);
      break;
    case Residence::kOnHost: {
      const bool from_nvme = b->host == nullptr;  // else its staging still holds it (forwarding)
      // Device memory, then staging, then the transfer: if any of them cannot
      // be had, the block is left as it was.
      at::Tensor dst = at::empty({static_cast<std::int64_t>(b->nbytes)},
                                 at::TensorOptions().dtype(at::kByte).device(b->device));
      if (from_nvme) {
        void* staging = staging_locked(b->nbytes);
        if (!staging) return;  // no staging now: unpack fetches it
        try {
          b->nvme_read = nvme_->read(b->nvme_block, staging, b->nbytes);
        } catch (...) {
          pool_->deallocate(staging);
          throw;
        }
        b->host = staging;
        pending_nvme_reads_.push_back(b);
      } else {
        if (b->nvme_write.valid() && !b->on_nvme) ++stats_.nvme_forwarded;
        b->h2d = engine_->copy(swap::Direction::kHostToDevice, dst.data_ptr(), b->host, b->nbytes, {b->d2h},
                               current_stream(b->device));
      }
      b->device_storage = dst.storage();
      if (nvme_) pending_h2d_.push_back(b);
      reg.transition(id, Residence::kInFlightToDevice);
      ++stats_.prefetched_blocks;
      break;
    }
    default:
      break;
  }
}

void ActivationOffloader::begin_backward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  poll_locked();
  for (BlockId id : schedule_.begin_backward()) prefetch_locked(id);
}

at::Tensor ActivationOffloader::unpack(const std::shared_ptr<SavedHandle>& handle) {
  TIERFLOW_EXPECTS(handle != nullptr, "unpack: null handle");
  if (!handle->block) return handle->passthrough;
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  ++stats_.unpacks;
  poll_locked();
  SavedBlock& b = *handle->block;
  TIERFLOW_EXPECTS(!b.released, "unpack: saved tensor block " + std::to_string(b.id) +
                                    " was already released");
  auto& reg = schedule_.registry();
  const bool first_read = !schedule_.consumed(b.id);
  switch (reg.residence(b.id)) {
    case Residence::kInFlightToHost:  // its copy to the host is still running
      reg.transition(b.id, Residence::kResident);
      ++stats_.forwarded;
      break;
    case Residence::kOnHost:  // nobody prefetched it: fetch now and wait
      ++stats_.unprefetched;
      prefetch_locked(b.id);
      ++stats_.stalls;
      break;
    case Residence::kInFlightToDevice:
      if (b.h2d.ready()) ++stats_.prefetch_hits;
      else ++stats_.stalls;
      break;
    case Residence::kResident:
      if (b.offloaded && first_read) ++stats_.prefetch_hits;  // forwarded by a prefetch
      break;
    case Residence::kReleased:
      break;
  }
  if (reg.residence(b.id) == Residence::kOnHost) {
    // Not fetched although nothing of ours is in flight: try once more, as the
    // pool is shared with the optimizer, which may have freed memory since.
    prefetch_locked(b.id);
    if (reg.residence(b.id) != Residence::kInFlightToDevice) {
      const auto st = pool_->stats();
      throw out_of_memory("unpack: no pinned staging memory for a saved activation of " + format_bytes(b.nbytes) +
                          " with every transfer settled: " + format_bytes(st.in_use.current) + " in use and " +
                          format_bytes(st.reserved.current) + " reserved of TIERFLOW_HOST_MEMORY=" +
                          format_bytes(pool_->budget_bytes()) + "; raise TIERFLOW_HOST_MEMORY");
    }
  }
  if (reg.residence(b.id) == Residence::kInFlightToDevice) {
    const std::uint64_t t0 = now_ns();
    if (b.nvme_read.valid() && !b.h2d.valid()) {
      b.nvme_read.wait();  // raises a failed or corrupt read
      poll_locked();       // starts its copy to the device
      if (b.read_error) std::rethrow_exception(b.read_error);
    }
    // Rule 2 of Note [Copy ordering]: the compute stream that reads the block
    // waits for its copy (on CUDA the host does not block). A failed copy is
    // raised here, as the data is not there.
    if (b.h2d.ready()) b.h2d.wait();
    engine_->make_stream_wait(current_stream(b.device), b.h2d);
    stats_.stall_ns += now_ns() - t0;
    reg.transition(b.id, Residence::kResident);
    const bool write_pending = b.nvme_write.valid() && !b.nvme_write.ready();
    if (b.host && !write_pending) {
      pool_->deallocate(b.host, b.h2d.state());  // rule 3: reused once the copy has read it
      b.host = nullptr;
    }
  }
  for (BlockId next : schedule_.on_unpack(b.id)) prefetch_locked(next);

  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(handle->dtype).device(b.device));
  out.set_(b.device_storage, handle->storage_offset, handle->sizes, handle->strides);
  return out;
}

void ActivationOffloader::release(SavedBlock& b) noexcept {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (b.released) return;
  if (b.offloaded && !b.d2h_settled) d2h_inflight_bytes_ -= b.nbytes;
  b.d2h_settled = true;
  try {
    // A copy may still read or write the host block: let it finish first.
    b.d2h.wait();
    b.h2d.wait();
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("copy failed while releasing a saved tensor: ") + e.what());
  }
  try {
    b.nvme_write.wait();
  } catch (const std::exception&) {
    // a failed write was already reported; its space is released below
  }
  try {
    b.nvme_read.wait();
  } catch (const std::exception&) {
    // the read's error reached (or will not matter to) its unpack
  }
  if (b.nvme_block) {
    nvme_->release(b.nvme_block);
    b.nvme_block = 0;
  }
  if (b.host) {
    pool_->deallocate(b.host);
    b.host = nullptr;
  }
  b.device_storage = c10::Storage();
  b.released = true;
  try {
    schedule_.registry().transition(b.id, Residence::kReleased);
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("saved tensor release: ") + e.what());
  }
}

void ActivationOffloader::synchronize() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  engine_->synchronize();
  poll_locked();
}

ActivationOffloaderStats ActivationOffloader::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  ActivationOffloaderStats s = stats_;
  s.device_bytes = schedule_.registry().device_bytes().values();
  s.host_bytes = schedule_.registry().host_bytes().values();
  return s;
}

void ActivationOffloader::reset_peaks() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  schedule_.registry().reset_peaks();
}

}  // namespace tierflow::bindings
