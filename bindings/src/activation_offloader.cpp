// See Note [Saved-tensor offload] in activation_offloader.hpp.
#include "tierflow/bindings/activation_offloader.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "tierflow/core/error.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/log.hpp"

namespace tierflow::bindings {

using tiering::BlockId;
using tiering::Residence;

ActivationOffloader::ActivationOffloader(ActivationOffloaderOptions options,
                                         std::shared_ptr<allocator::PinnedHostPool> pool,
                                         std::shared_ptr<swap::CopyEngine> engine,
                                         std::shared_ptr<swap::NvmeEngine> nvme)
    : options_(options),
      engine_(std::move(engine)),
      saved_(options.schedule, options.min_offload_bytes),
      pipeline_(pipeline_options(), std::move(pool), engine_, std::move(nvme)) {}

ActivationOffloader::~ActivationOffloader() = default;

swap::StagedPipelineOptions ActivationOffloader::pipeline_options() {
  swap::StagedPipelineOptions o;
  o.max_to_host_bytes = options_.schedule.prefetch_bytes;  // the prefetch window bounds both directions
  o.allocate_device = [this](std::size_t bytes, int index) {
    // On the current stream of the block's device (Note [Saved-tensor offload]).
    at::Tensor dst = at::empty({static_cast<std::int64_t>(bytes)},
                               at::TensorOptions().dtype(at::kByte).device(device_of(index)));
    auto storage = std::make_shared<c10::Storage>(dst.storage());
    return swap::DeviceBuffer{dst.data_ptr(), std::move(storage)};
  };
  o.compute_stream = [this](int index) { return current_stream(device_of(index)); };
  o.on_state = [this](std::uint64_t id, swap::StagedState to) { follow_pipeline(id, to); };
  return o;
}

namespace {
// The device storage a pipeline's device buffer holds (allocated by pack() or allocate_device).
const c10::Storage& storage_of(const swap::DeviceBuffer& buffer) {
  return *static_cast<const c10::Storage*>(buffer.owner.get());
}
}  // namespace

void ActivationOffloader::follow_pipeline(std::uint64_t id, swap::StagedState to) {
  auto& reg = saved_.schedule().registry();
  const auto block = static_cast<BlockId>(id);
  const Residence r = tiering::residence_of(to);
  if (reg.residence(block) != r) reg.transition(block, r);
}

at::Device ActivationOffloader::device_of(int index) const {
  if (engine_->device() != allocator::DeviceKind::kCuda) return at::Device(at::kCPU);
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
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
    auto found = parameter_index_.find(key);
    if (found != parameter_index_.end()) {
      // Our weak reference keeps the address from being reused; should a storage there be new all the same,
      // it is this parameter's now.
      if (parameters_[found->second].expired()) parameters_[found->second] = p.storage().getWeakStorageImpl();
      continue;
    }
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
  pipeline_.poll();
  saved_.schedule().begin_forward();
  by_storage_.clear();
  if (blocks_.size() > saved_.schedule().registry().size()) blocks_.resize(saved_.schedule().registry().size());
}

std::shared_ptr<SavedHandle> ActivationOffloader::pack(const at::Tensor& t, PackTarget target) {
  auto handle = std::make_shared<SavedHandle>();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  tiering::SavedTensorFacts facts;  // Note [Saved-tensor decisions]
  facts.defined = t.defined();
  if (facts.defined) pipeline_.poll();
  facts.managed = facts.defined && managed(t);
  const void* key = nullptr;
  std::shared_ptr<SavedBlock> existing;
  if (facts.managed) {
    key = t.storage().unsafeGetStorageImpl();
    auto param = parameter_index_.find(key);
    facts.parameter = (param != parameter_index_.end() && !parameters_[param->second].expired()) ||
                      (t.is_leaf() && t.requires_grad());
    auto found = by_storage_.find(key);
    if (found != by_storage_.end()) existing = found->second.lock();
    facts.saved_already = existing && existing->version == t._version() && existing->device == t.device();
    facts.bytes = t.storage().nbytes();
    facts.in_no_offload_region = no_offload_depth() > 0;
  }
  const tiering::PackChoice c = saved_.pack(facts, target, has_nvme());
  if (c.verdict == tiering::PackVerdict::kPassThrough) {
    handle->passthrough = t;
    return handle;
  }
  handle->sizes = t.sizes().vec();
  handle->strides = t.strides().vec();
  handle->storage_offset = t.storage_offset();
  handle->dtype = t.scalar_type();
  if (c.verdict == tiering::PackVerdict::kSameBlock) {
    handle->block = std::move(existing);
    return handle;
  }
  const c10::Storage& storage = t.storage();
  auto block = std::make_shared<SavedBlock>(storage.getWeakStorageImpl());
  block->id = c.id;
  block->owner = shared_from_this();  // from here on its destructor releases it, whatever throws below
  block->nbytes = facts.bytes;
  block->device = t.device();
  block->version = t._version();
  block->kept = storage;
  if (blocks_.size() <= c.id) blocks_.resize(c.id + 1);
  blocks_[c.id] = block;
  if (c.offload) {
    // The copy reads the storage without materializing it (data(), not
    // mutable_data(): a copy-on-write storage stays shared).
    swap::DeviceBuffer src{const_cast<void*>(storage.data()), std::make_shared<c10::Storage>(storage)};
    block->staged = true;  // so that its release reaches the pipeline, whatever throws below
    block->kept = c10::Storage();
    if (pipeline_.offload(c.id, std::move(src), facts.bytes, t.device().index(), c.to,
                          current_stream(t.device()))) {
      saved_.offloaded(facts.bytes);
    } else {
      block->staged = false;
      block->kept = storage;
      if (saved_.host_full(c.id)) {
        log(LogLevel::kWarn, "pinned host pool full (TIERFLOW_HOST_MEMORY): saved activations "
                             "that do not fit stay on the device");
      }
    }
  }
  by_storage_[key] = block;
  handle->block = std::move(block);
  return handle;
}

void ActivationOffloader::prefetch_locked(BlockId id) {
  if (id >= blocks_.size()) return;
  auto b = blocks_[id].lock();
  if (!b || b->released || !b->staged) return;
  // The pipeline moves the registry on (follow_pipeline): kept by forwarding,
  // or on its way back; without staging now the block is left as it was and
  // its unpack fetches it.
  if (pipeline_.fetch(id) == swap::FetchResult::kStarted) saved_.prefetched();
}

void ActivationOffloader::begin_backward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  pipeline_.poll();
  for (BlockId id : saved_.schedule().begin_backward()) prefetch_locked(id);
}

at::Tensor ActivationOffloader::unpack(const std::shared_ptr<SavedHandle>& handle) {
  TIERFLOW_EXPECTS(handle != nullptr, "unpack: null handle");
  if (!handle->block) return handle->passthrough;
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  pipeline_.poll();
  SavedBlock& b = *handle->block;
  TIERFLOW_EXPECTS(!b.released, "unpack: saved tensor block " + std::to_string(b.id) +
                                    " was already released");
  auto& reg = saved_.schedule().registry();
  const bool ready = reg.residence(b.id) == Residence::kInFlightToDevice && pipeline_.copy_to_device_ready(b.id);
  switch (saved_.read(b.id, ready, pipeline_.offloaded(b.id))) {  // Note [Saved-tensor decisions]
    case tiering::ReadServe::kForward:  // its copy to the host is still running: keep the device copy
      pipeline_.fetch(b.id);
      break;
    case tiering::ReadServe::kFetchNow:  // nobody prefetched it: fetch now and wait
      prefetch_locked(b.id);
      break;
    case tiering::ReadServe::kAsIs:
      break;
  }
  if (tiering::off_device(reg.residence(b.id))) pipeline_.fetch_or_throw(b.id);
  if (reg.residence(b.id) == Residence::kInFlightToDevice) {
    const std::uint64_t t0 = now_ns();
    pipeline_.complete_fetch(b.id);  // the current stream waits for the copy; raises a failed read
    saved_.stalled_for(now_ns() - t0);
  }
  for (BlockId next : saved_.schedule().on_unpack(b.id)) prefetch_locked(next);

  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(handle->dtype).device(b.device));
  out.set_(b.staged ? storage_of(pipeline_.device_copy(b.id)) : b.kept, handle->storage_offset, handle->sizes,
           handle->strides);
  return out;
}

void ActivationOffloader::release(SavedBlock& b) noexcept {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (b.released) return;
  b.released = true;
  b.kept = c10::Storage();
  if (b.staged && pipeline_.contains(b.id)) {
    pipeline_.release(b.id);  // waits for its transfers; follow_pipeline releases it in the registry
    return;
  }
  try {
    saved_.schedule().registry().transition(b.id, Residence::kReleased);
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("saved tensor release: ") + e.what());
  }
}

void ActivationOffloader::synchronize() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  pipeline_.synchronize();
}

void ActivationOffloader::set_window_bytes(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  saved_.schedule().set_prefetch_bytes(bytes);
  pipeline_.set_max_to_host_bytes(bytes);
}

ActivationOffloaderStats ActivationOffloader::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return saved_.stats(pipeline_.stats());
}

void ActivationOffloader::reset_peaks() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  saved_.schedule().registry().reset_peaks();
}

}  // namespace tierflow::bindings
