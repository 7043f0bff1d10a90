// Saved-activation offload for PyTorch autograd: the pack/unpack hooks.
//
// Note [Saved-tensor offload]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autograd calls pack() for every tensor it saves in forward and unpack()
// when backward needs it. What each saved tensor gets (passed through, the
// block its storage already is, or a new block kept or offloaded) and how a
// read is served are decided in tiering::SavedTensors (Note [Saved-tensor
// decisions]); the hooks find the torch facts those decisions need and carry
// them out. An offloaded block is a block of a swap::StagedPipeline (Note
// [Staged pipeline]: host staging, the bound on copies to the host in flight,
// NVMe write-behind and read-ahead, forwarding, failures), whose states the
// offloader follows in the schedule's registry; backward start and every
// unpack top up the prefetch window in the recorded order (Note
// [Recorded-order prefetch]). unpack rebuilds the exact tensor view (sizes,
// strides, offset, dtype) over the restored storage, so results are
// bit-identical to not offloading.
//
// Stream ordering (the rules of Note [Copy ordering], applied here): the copy
// to the host names the stream current at pack() (the one whose kernel wrote
// the tensor), and the pipeline keeps the storage referenced until that copy
// completes. A prefetch allocates its destination on the current stream and
// names that stream, so the copy also waits for kernels that still use memory
// the caching allocator just handed out. unpack() makes the current stream
// wait for the block's copy to the device before autograd reads it. On CUDA
// none of this blocks the host. On the emulated device its adversarial mode
// checks every one of these rules.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/staged_pipeline.hpp"
#include "tierflow/tiering/activation_schedule.hpp"
#include "tierflow/tiering/saved_tensors.hpp"

namespace tierflow::bindings {

/// Settings of an ActivationOffloader.
struct ActivationOffloaderOptions {
  tiering::ActivationScheduleOptions schedule;  ///< policy and prefetch window
  std::uint64_t min_offload_bytes = 64 << 10;   ///< smaller storages stay on the device
};

/// Counters of the offloader since creation (Note [Saved-tensor decisions]).
using ActivationOffloaderStats = tiering::SavedTensorStats;

class ActivationOffloader;
struct SavedBlock;

/// The compute stream that tensors of `device` are produced and used on, as
/// `engine` names it (Note [Copy ordering]): torch's current CUDA stream
/// (the default stream included, whose handle is nullptr), or the emulated
/// compute.
swap::StreamRef compute_stream_of(const swap::CopyEngine& engine, const at::Device& device);

/// True for a tensor of `engine`'s device: a CUDA tensor on CUDA, a CPU
/// tensor (the emulated device's memory) on the emulated device.
bool on_engine_device(const swap::CopyEngine& engine, const at::Tensor& t);

/// Enters a region (on this thread) whose saved tensors stay on the device.
void push_no_offload();
/// Leaves the innermost such region; throws logic_error when none is open.
void pop_no_offload();
/// Depth of no-offload regions open on this thread.
int no_offload_depth() noexcept;

/// What autograd holds for one saved tensor; returned by pack().
struct SavedHandle {
  at::Tensor passthrough;               ///< set when the tensor is not managed
  std::shared_ptr<SavedBlock> block;    ///< set when it is
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  std::int64_t storage_offset = 0;
  at::ScalarType dtype = at::kFloat;
};

using tiering::PackTarget;

/// The pack/unpack hooks and their state. Thread-safe.
class ActivationOffloader : public std::enable_shared_from_this<ActivationOffloader> {
 public:
  /// `pool` and `engine` must outlive the offloader and every handle it returns.
  ActivationOffloader(ActivationOffloaderOptions options,
                      std::shared_ptr<allocator::PinnedHostPool> pool,
                      std::shared_ptr<swap::CopyEngine> engine,
                      std::shared_ptr<swap::NvmeEngine> nvme = nullptr);
  ~ActivationOffloader();

  /// Autograd's pack hook. kNvme falls back to the host when there is no NVMe tier.
  std::shared_ptr<SavedHandle> pack(const at::Tensor& tensor, PackTarget target = PackTarget::kPolicy);
  /// Whether an NVMe tier is attached.
  bool has_nvme() const noexcept { return pipeline_.has_nvme(); }
  /// Autograd's unpack hook.
  at::Tensor unpack(const std::shared_ptr<SavedHandle>& handle);
  /// A forward pass of the wrapped model starts.
  void begin_forward();
  /// Backward reached the model's output: start prefetching.
  void begin_backward();
  /// Storages of these tensors are never copied (the model's parameters).
  void register_parameters(const std::vector<at::Tensor>& params);
  /// Waits for every copy in flight and settles block states.
  void synchronize();
  /// The prefetch window and the bound on copies to the host, both `bytes` from now on (a plan's; Note [Overlap
  /// window] in tiering/auto_plan.hpp).
  void set_window_bytes(std::uint64_t bytes);
  /// Counters snapshot.
  ActivationOffloaderStats stats() const;
  /// Resets the peaks of the byte statistics.
  void reset_peaks();
  /// The saved activations' bytes per tier since the previous call, what they hold now included (Note [Window
  /// peak] in core/stats.hpp; one reader: the step recorder, Note [Step stats]).
  tiering::BlockRegistry::WindowPeaks take_window_peaks() noexcept {
    return saved_.schedule().registry().take_window_peaks();  // atomics: no lock (the mark reads it mid-wait)
  }

  /// Removes the NVMe swap files' names (process exit); see NvmeEngine::unlink_files.
  void unlink_nvme_files() noexcept {
    if (pipeline_.has_nvme()) pipeline_.nvme()->unlink_files();
  }
  /// Called by ~SavedBlock: frees the block's memory and marks it released.
  void release(SavedBlock& block) noexcept;

 private:
  bool managed(const at::Tensor& t) const;
  void prefetch_locked(tiering::BlockId id);
  void follow_pipeline(std::uint64_t id, swap::StagedState to);
  swap::StagedPipelineOptions pipeline_options();
  at::Device device_of(int index) const;
  swap::StreamRef current_stream(const at::Device& device) const;

  ActivationOffloaderOptions options_;
  std::shared_ptr<swap::CopyEngine> engine_;
  mutable std::recursive_mutex mutex_;
  tiering::SavedTensors saved_;  // the decisions and counters (Note [Saved-tensor decisions])
  std::vector<std::weak_ptr<SavedBlock>> blocks_;      // by BlockId
  std::unordered_map<const void*, std::weak_ptr<SavedBlock>> by_storage_;  // this forward
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> parameters_;
  std::unordered_map<const void*, std::size_t> parameter_index_;
  swap::StagedPipeline pipeline_;  // offloaded blocks by BlockId; last, as its states update saved_
};

/// One storage's bytes as tierflow manages them.
struct SavedBlock {
  std::shared_ptr<ActivationOffloader> owner;
  tiering::BlockId id = 0;
  std::size_t nbytes = 0;
  at::Device device{at::kCPU};
  c10::weak_intrusive_ptr<c10::StorageImpl> source;  // identity for dedup; keeps the address unique
  std::int64_t version = 0;
  c10::Storage kept;             // the device storage of a block the pipeline does not hold
  bool staged = false;           // handed to the staged pipeline (Note [Staged pipeline])
  bool released = false;

  SavedBlock(const c10::weak_intrusive_ptr<c10::StorageImpl>& src) : source(src) {}
  ~SavedBlock() {
    if (owner) owner->release(*this);
  }
};

}  // namespace tierflow::bindings
