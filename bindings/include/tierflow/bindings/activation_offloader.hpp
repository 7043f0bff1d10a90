// Saved-activation offload for PyTorch autograd: the pack/unpack hooks.
//
// Note [Saved-tensor offload]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autograd calls pack() for every tensor it saves in forward and unpack()
// when backward needs it. pack() leaves parameters alone (they live on the
// device anyway), keeps unmanaged tensors (sparse, conjugate views, tensors
// of another device) as they are, and registers every other storage once per
// forward: a storage saved twice at the same version is one block (dedup).
// The ActivationSchedule decides per block: keep it, or copy the whole
// storage to a pinned host block through the copy engine (the D2H stream).
// The device storage is dropped as soon as that copy completes, observed on
// the next hook call. Backward start (a gradient hook on the model's output)
// and every unpack top up the prefetch window in the recorded order; unpack
// rebuilds the exact tensor view (sizes, strides, offset, dtype) over the
// restored storage, so results are bit-identical to not offloading. A read
// while the host copy is still in flight is served from the device copy
// (forwarding). A full host pool means the block stays on the device and a
// fallback is counted; training never fails for lack of offload space.
// The movement itself (host staging, the bound on copies to the host in
// flight, by the prefetch window; NVMe write-behind and read-ahead,
// forwarding, bounded staging, failures) is Note [Staged pipeline]
// (swap/staged_pipeline.hpp): each offloaded storage is a block of a
// swap::StagedPipeline, and the offloader follows the block's states in the
// schedule's registry. With the NVMe target the last blocks of the graph stay
// on the device (keep_tail_bytes).
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

namespace tierflow::bindings {

/// Settings of an ActivationOffloader.
struct ActivationOffloaderOptions {
  tiering::ActivationScheduleOptions schedule;  ///< policy and prefetch window
  std::uint64_t min_offload_bytes = 64 << 10;   ///< smaller storages stay on the device
};

/// Counters of the offloader since creation.
struct ActivationOffloaderStats {
  std::uint64_t packs = 0;              ///< tensors autograd saved
  std::uint64_t skipped_parameters = 0; ///< parameters and leaves requiring grad, not copied
  std::uint64_t skipped_unmanaged = 0;  ///< other devices, sparse, conjugate views
  std::uint64_t dedup_hits = 0;         ///< saves of a storage already saved
  std::uint64_t kept_small = 0;         ///< blocks kept: below the size threshold
  std::uint64_t kept_region = 0;        ///< blocks kept: inside tierflow.no_offload()
  std::uint64_t host_fallbacks = 0;     ///< blocks kept: host pool budget full
  std::uint64_t offloaded_blocks = 0;   ///< blocks copied to the host
  std::uint64_t offloaded_bytes = 0;    ///< bytes copied to the host
  std::uint64_t offload_waits = 0;      ///< forward waited for a copy to the host (window full)
  std::uint64_t offload_wait_ns = 0;    ///< time spent in those waits
  std::uint64_t prefetched_blocks = 0;  ///< host->device copies started ahead of need
  std::uint64_t unpacks = 0;            ///< tensors backward read
  std::uint64_t prefetch_hits = 0;      ///< reads of offloaded blocks already back on the device
  std::uint64_t forwarded = 0;          ///< reads served from a device copy not yet dropped
  std::uint64_t stalls = 0;             ///< reads that had to wait for their copy
  std::uint64_t stall_ns = 0;           ///< time spent in those waits
  std::uint64_t unprefetched = 0;       ///< reads of blocks nobody had prefetched
  std::uint64_t nvme_writes = 0;        ///< blocks written to NVMe (write-behind from staging)
  std::uint64_t nvme_write_bytes = 0;   ///< bytes written to NVMe
  std::uint64_t nvme_reads = 0;         ///< blocks read back from NVMe
  std::uint64_t nvme_forwarded = 0;     ///< prefetches served from staging while the write was pending
  std::uint64_t nvme_write_failures = 0;///< failed NVMe writes: the block stayed in host memory
  std::uint64_t nvme_full = 0;          ///< blocks kept in host memory: NVMe tier full
  std::uint64_t staging_waits = 0;      ///< times a transfer waited for staging memory (back-pressure)
  StatValues device_bytes;              ///< bytes of saved activations held on the device
  StatValues host_bytes;                ///< bytes of saved activations held on the host
  StatValues nvme_bytes;                ///< bytes of saved activations held on NVMe only (Note [Block residences])
};

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

/// Where pack() sends one tensor: kPolicy follows TIERFLOW_OFFLOAD_ACTIVATIONS;
/// the others carry a block plan's decision (Note [Activation plans]).
enum class PackTarget : std::uint8_t { kPolicy, kKeep, kHost, kNvme };

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
  /// Counters snapshot.
  ActivationOffloaderStats stats() const;
  /// Resets the peaks of the byte statistics.
  void reset_peaks();

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
  tiering::ActivationSchedule schedule_;
  std::vector<std::weak_ptr<SavedBlock>> blocks_;      // by BlockId
  std::unordered_map<const void*, std::weak_ptr<SavedBlock>> by_storage_;  // this forward
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> parameters_;
  std::unordered_map<const void*, std::size_t> parameter_index_;
  ActivationOffloaderStats stats_;
  swap::StagedPipeline pipeline_;  // offloaded blocks by BlockId; last, as its states update schedule_
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
