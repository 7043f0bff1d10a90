// What happens to each tensor autograd saves: the decisions behind the pack
// and unpack hooks of bindings' ActivationOffloader, torch-free.
//
// Note [Saved-tensor decisions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The hooks find torch facts (SavedTensorFacts); SavedTensors decides from
// them and counts what it decided. pack() gives one of three verdicts:
//  - pass through (autograd keeps the tensor as it is, no block): an
//    undefined tensor; one the offloader does not manage (not strided, a
//    conjugate or negative view, no storage or an empty one, a tensor of
//    another device than the engine's); a parameter (a registered parameter's
//    storage, or a leaf that requires grad: it lives on the device anyway);
//  - the same block: its storage was saved earlier in this forward at the
//    same version on the same device (a storage saved twice is one block);
//  - a new block, which the ActivationSchedule keeps or offloads: kept when
//    smaller than TIERFLOW_MIN_OFFLOAD_BYTES or saved inside
//    tierflow.no_offload(); else as its PackTarget says (kPolicy: the
//    schedule's TIERFLOW_OFFLOAD_ACTIVATIONS target; kKeep and kHost/kNvme: a
//    block plan's decision, Note [Activation plans]), to NVMe when the target
//    is NVMe and an NVMe tier is attached, else to the host.
// An offloaded block the pinned pool cannot take stays on the device
// (resident again in the registry) and counts as a host fallback; the first
// one is worth a warning, never an error.
//
// unpack() serves a read by the block's residence (Note [Block residences]):
// on its way to the host, the device copy is still there (forwarded); on the
// host or NVMe, nobody prefetched it (fetched now: a stall); on its way back,
// a hit when the copy is done, else a stall; resident, a hit when a prefetch
// brought it back before this first read. The movement itself is Note
// [Staged pipeline] (swap/staged_pipeline.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/core/stats.hpp"
#include "tierflow/swap/staged_pipeline.hpp"
#include "tierflow/tiering/activation_schedule.hpp"

namespace tierflow::tiering {

/// Where pack() sends one tensor: kPolicy follows TIERFLOW_OFFLOAD_ACTIVATIONS;
/// kKeep, kHost and kNvme carry a block plan's decision (Note [Activation plans]);
/// kOutsideNvme is kPolicy's decision (and its policy_bytes) sent to NVMe: the
/// model-level hook when the plan puts what is saved outside the blocks on NVMe.
enum class PackTarget : std::uint8_t { kPolicy, kKeep, kHost, kNvme, kOutsideNvme };

/// "policy", "keep", "host", "nvme" or "outside_nvme"; anything else is a ConfigError naming them.
PackTarget parse_pack_target(const std::string& text);

/// What the pack hook found out about one saved tensor (Note [Saved-tensor decisions]).
struct SavedTensorFacts {
  bool defined = true;                ///< false: an undefined tensor
  bool managed = true;                ///< strided, plain, on the engine's device, with a storage of > 0 bytes
  bool parameter = false;             ///< a registered parameter's storage, or a leaf that requires grad
  bool saved_already = false;         ///< its storage was saved in this forward at this version and device
  std::uint64_t bytes = 0;            ///< its storage's bytes
  bool in_no_offload_region = false;  ///< saved inside tierflow.no_offload()
};

/// pack()'s verdict for one saved tensor.
enum class PackVerdict : std::uint8_t {
  kPassThrough,  ///< autograd keeps the tensor itself
  kSameBlock,    ///< the block its storage already is
  kNewBlock,     ///< a new block: `id`, kept or offloaded to `to`
};

/// What pack() decided.
struct PackChoice {
  PackVerdict verdict = PackVerdict::kPassThrough;
  BlockId id = 0;                                  ///< kNewBlock: its id in this forward
  bool offload = false;                            ///< kNewBlock: copied off the device
  swap::StagedTarget to = swap::StagedTarget::kHost;  ///< ... to this tier
};

/// How a read is served, before the block is fetched (Note [Saved-tensor decisions]).
enum class ReadServe : std::uint8_t {
  kForward,   ///< its copy to the host is running: fetch (the device copy is kept)
  kFetchNow,  ///< nobody prefetched it: fetch now, and wait
  kAsIs,      ///< on its way back, resident or released: nothing to start
};

/// Counters of the saved tensors since creation.
struct SavedTensorStats {
  std::uint64_t packs = 0;              ///< tensors autograd saved
  std::uint64_t skipped_parameters = 0; ///< parameters and leaves requiring grad, not copied
  std::uint64_t skipped_unmanaged = 0;  ///< other devices, sparse, conjugate views
  std::uint64_t dedup_hits = 0;         ///< saves of a storage already saved
  std::uint64_t kept_small = 0;         ///< blocks kept: below the size threshold
  std::uint64_t kept_region = 0;        ///< blocks kept: inside tierflow.no_offload()
  std::uint64_t host_fallbacks = 0;     ///< blocks kept: host pool budget full
  std::uint64_t offloaded_blocks = 0;   ///< blocks copied to the host
  std::uint64_t offloaded_bytes = 0;    ///< bytes copied to the host
  /// Bytes of new saved tensors the policy's packs (PackTarget::kPolicy: the model-level hook) received, large
  /// enough to offload and outside a no-offload region, offloaded or not: under `auto`, what is saved outside the
  /// blocks (Note [Auto plan phases]).
  std::uint64_t policy_bytes = 0;
  /// The largest single tensor among them (its storage's bytes) since the start: under `auto`, the host staging
  /// of what is saved outside the blocks on its way to NVMe (Budgets::outside_largest_bytes).
  std::uint64_t policy_largest_bytes = 0;
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

/// The exported fields of SavedTensorStats (Note [Stat fields]), in three
/// groups as the stats dicts show them: the saved tensors ("activations"),
/// their NVMe traffic ("activations"/"nvme") and the prefetch ("prefetch").
const std::vector<StatField<SavedTensorStats>>& saved_tensor_stat_fields();
const std::vector<StatField<SavedTensorStats>>& saved_tensor_nvme_stat_fields();
const std::vector<StatField<SavedTensorStats>>& saved_tensor_prefetch_stat_fields();

/// The decisions of Note [Saved-tensor decisions] over one ActivationSchedule,
/// and their counters. Not thread-safe: its owner serializes calls.
class SavedTensors {
 public:
  SavedTensors(ActivationScheduleOptions options, std::uint64_t min_offload_bytes);

  /// The verdict for one saved tensor; a new block is registered in the schedule.
  PackChoice pack(const SavedTensorFacts& facts, PackTarget target, bool has_nvme);
  /// The new block of `bytes` went to the staged pipeline.
  void offloaded(std::uint64_t bytes);
  /// The pinned pool could not take block `id`: it stays on the device.
  /// True for the first such block (the one worth a warning).
  bool host_full(BlockId id);
  /// A prefetch of a block was started.
  void prefetched() noexcept { ++stats_.prefetched_blocks; }

  /// Backward reads block `id`; `copy_ready`: its copy to the device is done
  /// (asked only while it is on its way back); `was_offloaded`: the pipeline
  /// copied it off the device. Counts the read.
  ReadServe read(BlockId id, bool copy_ready, bool was_offloaded);
  /// A read waited `ns` for its copy to the device.
  void stalled_for(std::uint64_t ns) noexcept { stats_.stall_ns += ns; }

  /// The counters, with the pipeline's and the registry's bytes per tier.
  SavedTensorStats stats(const swap::StagedPipelineStats& pipeline) const;

  ActivationSchedule& schedule() noexcept { return schedule_; }
  const ActivationSchedule& schedule() const noexcept { return schedule_; }

 private:
  ActivationSchedule schedule_;
  std::uint64_t min_offload_bytes_;
  SavedTensorStats stats_;
};

}  // namespace tierflow::tiering
