// The torch-free parts of streaming gradients to the CPU optimizer during
// backward (Note [Gradient streaming] in bindings/include/tierflow/bindings/
// grad_stream.hpp): which gradients share a bucket and when `auto` sizes the
// buckets, the partial norms of the buckets that have landed, and which
// parameters step on the GPU (the share set, or chosen from measured speeds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/optimizer/scalar_type.hpp"

namespace tierflow::optimizer {

/// One bucket: the tensors (indices into the plan's input) whose gradients
/// travel device -> host together and step together, and their bytes.
struct GradBucket {
  std::vector<std::size_t> tensors;  ///< in arrival order
  std::size_t bytes = 0;             ///< sum of their gradient bytes
};

/// Cuts tensors, taken in `order` (the order backward completes their
/// gradients), into consecutive buckets of at most `bucket_bytes`; a tensor
/// larger than that gets a bucket of its own. `bytes[i]` is tensor i's
/// gradient size. Throws logic_error when `order` is not a permutation of
/// the indices of `bytes` or `bucket_bytes` is 0.
std::vector<GradBucket> plan_grad_buckets(const std::vector<std::size_t>& bytes,
                                          const std::vector<std::size_t>& order, std::size_t bucket_bytes);

/// TIERFLOW_GRAD_BUCKET_BYTES=auto: about 16 buckets over `total_grad_bytes`,
/// clamped to [4 MiB, 64 MiB]. Below 4 MiB a copy's fixed cost (~10 us per
/// cudaMemcpyAsync and event) exceeds 5% of its time on a 55 GB/s link; above
/// 64 MiB the last bucket, which steps after backward has ended, costs more
/// than ~2.5% of a 1e9-parameter step.
std::size_t auto_grad_bucket_bytes(std::size_t total_grad_bytes) noexcept;

/// What TIERFLOW_GRAD_BUCKET_BYTES=auto is chosen from once a step has been
/// measured (GradStream::size_buckets).
struct BucketSizing {
  double backward_seconds = 0;           ///< measured, first gradient to the end of backward
  double link_bytes_per_second = 0;      ///< measured device -> host copy rate
  double cpu_grad_bytes_per_second = 0;  ///< measured CPU AdamW rate, in gradient bytes
  std::size_t total_grad_bytes = 0;      ///< one step's gradients
};

/// TIERFLOW_GRAD_BUCKET_BYTES=auto from measured speeds. The work left when
/// backward ends is the last bucket: its copy and its CPU step, bytes/link +
/// bytes/cpu. The bucket is the largest that keeps that tail within 2% of the
/// measured backward, clamped to [4 MiB, min(256 MiB, a quarter of the
/// gradients)] (at least 4 buckets to overlap; below 4 MiB the oneTBB step's
/// fixed cost of waking its threads, ~10 us, passes 2.5% of a bucket's step at
/// 5e9 parameters/s). Falls back to auto_grad_bucket_bytes when a speed is
/// missing.
std::size_t measured_grad_bucket_bytes(const BucketSizing& in) noexcept;

/// Bytes of the device -> host copy that measures the link for
/// measured_grad_bucket_bytes: a bucket-sized copy, total_grad_bytes / 16
/// within [1 MiB, 16 MiB] (it takes that much device memory).
std::size_t grad_link_probe_bytes(std::size_t total_grad_bytes) noexcept;

/// Note [Steady step]
/// ~~~~~~~~~~~~~~~~~~
/// The first steps of a streamed run are not the run's: the first creates the
/// optimizer states, and the next ones allocate the pinned out-of-place
/// outputs (Note [Step during backward]; a new pinned slab is a
/// cudaHostAlloc) and warm up the device, so their backward and CPU rate can
/// be far from an ordinary step's (the 1.34B preset on an H100: backward 33 s,
/// 2.1 s, 2.8 s, then 0.095 s). What is decided from those measurements (the
/// bucket size, the GPU share of the optimizer) waits for a steady step: a
/// step() whose gradients streamed and stepped, not the first such, whose
/// window grew no pinned slab, and whose backward is within
/// kSteadyBackwardSpread of the streamed step's before it; or the
/// kSteadyStepLimit-th such step, whatever it measured (a run that never
/// settles still decides). Each decision watches the steps it is called for.
inline constexpr int kSteadyStepLimit = 6;
inline constexpr double kSteadyBackwardSpread = 0.25;

/// Counts the streamed steps one decision sees (Note [Steady step]).
class SteadyStepWatch {
 public:
  /// After a step() whose gradients streamed and stepped: its backward
  /// (first gradient to its end) and whether its window grew the pinned pool.
  /// True when the decision may be made from it.
  bool steady(double backward_ms, bool pool_grew) noexcept;
  int streamed_steps() const noexcept { return streamed_steps_; }

 private:
  int streamed_steps_ = 0;
  double previous_backward_ms_ = 0;
};

/// When TIERFLOW_GRAD_BUCKET_BYTES=auto measures the bucket size: at the first
/// steady step (Note [Steady step]), once.
class BucketSizingSchedule {
 public:
  /// `auto_size`: TIERFLOW_GRAD_BUCKET_BYTES=auto (otherwise never due).
  explicit BucketSizingSchedule(bool auto_size) noexcept : pending_(auto_size) {}
  /// True until the buckets have been sized.
  bool pending() const noexcept { return pending_; }
  /// After a step(): `carries_parameters`: the stream carries any;
  /// `streamed`: its gradients streamed and the CPU AdamW stepped them; the
  /// last backward's time; `pool_grew`: the step's window allocated pinned
  /// slabs. True when the buckets are sized now (with a copy of
  /// grad_link_probe_bytes); false after.
  bool due(bool carries_parameters, bool streamed, double last_backward_ms, bool pool_grew) noexcept;

 private:
  bool pending_;
  SteadyStepWatch watch_;
};

/// Sum of squares of `numel` values of type `type`, in double: a bucket's
/// share of the squared global 2-norm. Non-finite values propagate (inf or NaN).
double sum_of_squares(const void* data, ScalarType type, std::size_t numel) noexcept;

/// Running squared norm over the buckets that have landed. Squares only grow,
/// so once the running norm exceeds max_grad_norm the clip is known to bind
/// before backward ends (Note [Gradient streaming]: speculation stops there).
class PartialNorms {
 public:
  /// Adds a landed bucket's sum of squares.
  void add(double sum_sq) noexcept {
    sum_sq_ += sum_sq;
    ++buckets_;
  }
  /// Forgets every bucket (a new backward).
  void reset() noexcept {
    sum_sq_ = 0.0;
    buckets_ = 0;
  }
  /// The norm of what has landed so far (a lower bound of the global norm).
  double norm() const noexcept;
  /// True when the clip to `max_norm` must bind whatever is still to come, or a
  /// gradient is already non-finite. The margin of 1e-3 relative keeps the
  /// different summation order of torch's norm from ever making it wrong.
  bool clip_must_bind(double max_norm) const noexcept;
  /// Buckets added since the last reset.
  std::size_t buckets() const noexcept { return buckets_; }

 private:
  double sum_sq_ = 0.0;
  std::size_t buckets_ = 0;
};

/// What the GPU/CPU split is chosen from (Deep Optimizer States, with the
/// share measured instead of set by hand).
struct SplitInputs {
  double cpu_elements_per_second = 0;  ///< measured CPU AdamW rate
  double gpu_elements_per_second = 0;  ///< GPU AdamW rate (0: assume the GPU step is free)
  double backward_seconds = 0;         ///< measured time from the first gradient to the end of backward
  std::size_t elements = 0;            ///< parameters that could step on either side
  std::size_t gpu_bytes_per_element = 0;  ///< device bytes a GPU-stepped element needs (master, m, v)
  std::size_t gpu_free_bytes = 0;      ///< device budget left for optimizer state
};

/// TIERFLOW_GPU_OPTIMIZER_FRACTION=auto: the smallest share f of the elements
/// that steps on the GPU such that the CPU's part, (1-f)*elements at the
/// measured rate, ends with backward; capped by what fits in the device
/// budget. 0 when the CPU already keeps up; in [0, 1].
double choose_gpu_fraction(const SplitInputs& in) noexcept;

/// Device bytes the GPU share's states may take: within TIERFLOW_GPU_MEMORY
/// (`budget_bytes`), what the peak so far left of it, or what the activation
/// plan in force predicts for its peak when that is higher (`planned_peak_bytes`,
/// 0 without a plan; chosen at a steady step, Note [Steady step]: under the
/// planner once its plan is in force, after which the plan does not change,
/// since its measured figures do not hold the share's states), and at most half
/// of what the device has free.
std::int64_t gpu_share_room(std::int64_t free_bytes, std::int64_t budget_bytes,
                            std::int64_t first_step_peak_bytes, std::int64_t planned_peak_bytes = 0) noexcept;

/// Device bytes per element of a GPU-stepped parameter: m and v in fp32, plus
/// an fp32 master when any of them is 16-bit.
std::size_t gpu_share_bytes_per_element(bool any_16bit) noexcept;

/// Deep Optimizer States: which of the device parameters (`numels`, in group
/// order) step on the GPU, interleaved so that about `fraction` of the
/// elements do: a parameter goes to the GPU while the share so far, counting
/// half of it, stays within `fraction` of the elements seen.
std::vector<bool> assign_gpu_share(const std::vector<std::size_t>& numels, double fraction);

/// A device parameter the GPU share may take, in group order.
struct ShareCandidate {
  std::size_t numel = 0;
  bool streamed = false;  ///< its gradient streams: only these are measured, and only these move at auto
  bool is_16bit = false;  ///< bf16 or fp16 (its GPU step needs an fp32 master)
};

/// What TIERFLOW_GPU_OPTIMIZER_FRACTION=auto chooses from, at a steady step (Note [Steady step]).
struct ShareMeasurements {
  double cpu_elements = 0;   ///< elements the CPU AdamW has stepped (the runtime's optimizer stats)
  double cpu_step_ms = 0;    ///< the time it took
  double backward_ms = 0;    ///< the last backward, first gradient to its end
  std::int64_t free_bytes = 0;             ///< device memory free now
  std::int64_t budget_bytes = 0;           ///< TIERFLOW_GPU_MEMORY in bytes
  std::int64_t first_step_peak_bytes = 0;  ///< the device's peak so far
  std::int64_t planned_peak_bytes = 0;     ///< the activation plan in force's predicted peak (0: none)
};

/// TIERFLOW_GPU_OPTIMIZER_FRACTION: which device parameters step on the GPU
/// (Deep Optimizer States). A number is the share of the elements, assigned at
/// the first step; `auto` chooses once, at the first steady step (Note [Steady step]), the
/// share with which the CPU's step ends with backward, within the device
/// memory left (choose_gpu_fraction, gpu_share_room).
class GpuShareChoice {
 public:
  /// `setting`: "auto" or a number from 0 to 1 (as the configuration table accepts it).
  explicit GpuShareChoice(const std::string& setting);
  /// True while `auto` has not chosen yet.
  bool pending() const noexcept { return pending_; }
  /// The share of the elements in force (0 while `auto` has not chosen).
  double fraction() const noexcept { return fraction_; }
  /// Which parameters (`numels`, in group order) step on the GPU at fraction().
  std::vector<bool> assign(const std::vector<std::size_t>& numels) const { return assign_gpu_share(numels, fraction_); }
  /// After each step(): `streamed`: its gradients streamed and stepped (the
  /// stream's backward and kernel were measured); its backward's time;
  /// `pool_grew`: its window allocated pinned slabs. True once, for `auto` at
  /// the first steady step (Note [Steady step]): choose now.
  bool choose_now(bool streamed, double backward_ms, bool pool_grew) noexcept;
  /// `auto`'s choice over every device parameter: none when no streamed
  /// candidate, CPU step or backward was measured; otherwise the fraction from
  /// the measured CPU rate, the backward and the room, then assign() over all.
  std::vector<bool> choose(const std::vector<ShareCandidate>& candidates, const ShareMeasurements& measured);

 private:
  bool pending_ = false;
  double fraction_ = 0.0;
  SteadyStepWatch watch_;
};

}  // namespace tierflow::optimizer
