// The CPU AdamW's plan: where its states live and in what format, which
// parameters stream, which path each step() takes and where it writes a new
// weight, and when the steady-step decisions are made, from typed settings and
// plain facts. The Python CPUAdamW (bindings/python/tierflow/optim/) gathers
// the facts off its tensors and applies what this returns.
//
// Note [Step plan]
// ~~~~~~~~~~~~~~~~
// One StepPlan per optimizer, made from the settings (core::Config), the
// moments' format a keyword may name, and whether the parameters are FSDP2's
// shards:
// - the states' tier (Note [CPU AdamW state placement]) and format (Note
//   [Optimizer state formats]); amsgrad keeps fp32 moments, so a group with it
//   is refused beside packed ones;
// - steps during backward (Note [Step during backward]): planned with
//   TIERFLOW_OVERLAP_STEP=on and states on the host; FSDP2's shards only once
//   wrap found their units (stream_shards); turned off for the rest of the run
//   with a reason (DDP's all-reduce: Note [Distributed training]); the stream
//   steps at a backward only while they are on and the masters are fresh.
//   TIERFLOW_OFFLOAD_GRADIENTS=on without them is refused;
// - the GPU share's setting (none for FSDP2's shards);
// - each parameter's route when the stream starts (route), each step()'s path
//   (path) and where a step writes a parameter's new weight (weight_target);
// - Note [Steady step]'s gates: the GPU share (auto) chooses at a steady step
//   with the activation plan in force, a value (PlanRoom), never a reference
//   into the planner; WindowWatch says what each step()'s window showed.
//
// Note [Atomic step]
// ~~~~~~~~~~~~~~~~~~
// A step is all or nothing: an error raised from step() leaves every weight and
// optimizer state (exp_avg, exp_avg_sq, master, step) as it was, so a retry is
// one step; or the step completes. With states on the host, step() first does
// everything that can fail, for every group: the states a first step makes, the
// gradients' copies to the host (waited), the new weights' staging; a failure
// there drops the states it made and raises. Only then the kernels run, the step
// counts advance and the weights go back. Nothing that can fail runs after: the
// link probe that sizes the gradient buckets (optim/streaming.py) fits the
// pinned pool's room and a probe that still fails leaves the buckets' size as
// it was.
// wrap refuses a TIERFLOW_HOST_MEMORY that cannot hold one step (states,
// gradients' host copies, staging: optimizer/state_tier.hpp). States on NVMe
// keep Note [NVMe optimizer faults] (the parameters that stepped stay stepped; a
// retry steps only the others, exactly once). Steps taken during backward
// (Note [Gradient streaming]) join the same order: the stream's prepare_finish
// (its verdicts, its redone steps' staging, the released gradients it leaves to
// Python back in p.grad) and the Python path's preparation both run before the
// stream's commit_finish, which cannot fail.
//
// In Python (bindings/python/tierflow/optim/step_paths.py) the order is
// _prepare_groups, then the stream's commit_finish, then _apply_group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// Which way one step() goes (StepPlan::path).
enum class StepPath {
  kSkipped,   ///< TIERFLOW_SKIP_NONFINITE=on and a gradient is not finite: nothing steps
  kStreamed,  ///< the stream commits or redoes its early steps; step() steps only what it left
  kHost,      ///< every parameter in step(), states in the pinned host pool
  kNvme,      ///< every parameter in step(), states streamed from NVMe (Note [NVMe optimizer faults])
};

/// How a parameter joins the gradient stream when it starts (StepPlan::route).
enum class ParamRoute {
  kStepInStep,  ///< not carried: it steps in step()
  kStream,      ///< its gradient streams from a backward hook
  kFeed,        ///< FSDP2: its reduce-scattered gradient is fed to its local shard
};

/// A parameter as route sees it.
struct RouteFacts {
  bool requires_grad = false;
  bool carried = false;        ///< the stream carries it already
  bool on_device = false;      ///< on the runtime's device
  bool contiguous = false;
  bool kernel_dtype = false;   ///< float32, bfloat16 or float16
  bool in_gpu_share = false;   ///< it steps on the GPU
};

/// Where a step writes a parameter's new weight (Note [CPU AdamW state placement]).
enum class WeightTarget {
  kHome,       ///< its host copy (it lives on the host between uses): the next forward fetches it
  kParameter,  ///< the parameter itself (host memory, contiguous): the kernel writes it
  kStaging,    ///< a pinned staging buffer, copied into the parameter after the kernel
};

/// The activation plan as the GPU share sees it, read when the choice is asked.
struct PlanRoom {
  bool in_force = true;                   ///< false while the planner profiles: no plan yet
  std::int64_t predicted_peak_bytes = 0;  ///< the plan's predicted device peak (0: none)
};
bool operator==(const PlanRoom& a, const PlanRoom& b) noexcept;

/// The room of a planner's plan: `forced` (a fixed plan), `has_plan` (one made), its predicted peak.
PlanRoom plan_room(bool forced, bool has_plan, std::int64_t predicted_peak_bytes) noexcept;

/// What one step()'s window showed (Note [Steady step]).
struct StepWindow {
  bool streamed = false;    ///< its gradients streamed and the CPU AdamW stepped them
  double backward_ms = 0;   ///< its backward, first gradient to its end
  bool pool_grew = false;   ///< it allocated pinned slabs
};

/// Turns the stream's running counters into one StepWindow per step().
class WindowWatch {
 public:
  /// `pinned_slabs`: the pool's slab allocations when the stream started.
  explicit WindowWatch(std::uint64_t pinned_slabs) noexcept : slabs_(pinned_slabs) {}
  /// At the end of a step(): whether the stream `carries` any parameter, the
  /// gradient bytes its CPU AdamW has stepped so far, the pool's slab
  /// allocations so far, and the last backward's time.
  StepWindow seen(bool carries, std::uint64_t kernel_grad_bytes, std::uint64_t pinned_slabs,
                  double last_backward_ms) noexcept;

 private:
  std::uint64_t stepped_bytes_ = 0;
  std::uint64_t slabs_;
};

/// TIERFLOW_GPU_OPTIMIZER_FRACTION=auto chooses now: still pending, the plan in
/// force, and `window` a steady step of its watch (which counts only then).
bool share_due(GpuShareChoice& choice, const StepWindow& window, const PlanRoom& room) noexcept;

/// Device bytes the streamed candidates chosen (`on_gpu`) take once moved:
/// their elements at gpu_share_bytes_per_element of every candidate's dtypes.
std::int64_t share_took_bytes(const std::vector<ShareCandidate>& candidates, const std::vector<bool>& on_gpu);

/// The refusal of a CPU AdamW over FSDP2's DTensor shards, or "": `sharded` of its `params` are shards and the
/// rest (`plain`: their names) are not (their gradients are not reduced across ranks, and one norm cannot be taken
/// over both), or the settings the shards do not take (`host_shards`: a shard in host memory beside a CUDA
/// runtime, FSDP2's CPUOffloadPolicy).
std::string shards_refusal(const Config& settings, std::size_t sharded, std::size_t params,
                           const std::vector<std::string>& plain, bool host_shards);

/// The GPU share's one info line when its `parameters` keep fp32 moments while the host's are in `format`
/// (Note [Optimizer state formats]); "" for fp32.
std::string gpu_share_format_note(std::size_t parameters, StateFormat format);

/// See Note [Step plan].
class StepPlan {
 public:
  /// `keyword_format`: CPUAdamW's optimizer_states keyword as given (nullopt:
  /// TIERFLOW_OPTIMIZER_STATES); `sharded`: FSDP2's shards. Throws
  /// config_error for an unknown format and for TIERFLOW_OFFLOAD_GRADIENTS=on
  /// without steps during backward.
  StepPlan(const Config& settings, const std::optional<std::string>& keyword_format, bool sharded);

  StateFormat format() const noexcept { return format_; }
  bool states_on_nvme() const noexcept { return nvme_; }
  /// "nvme" or "host".
  const char* tier_name() const noexcept { return nvme_ ? "nvme" : "host"; }
  bool sharded() const noexcept { return sharded_; }
  /// Throws config_error for a param group added whose parameters are FSDP2's shards (`group_sharded`) where
  /// the optimizer's are not, or the other way round.
  void check_group_sharding(bool group_sharded) const;
  /// Throws config_error naming the setting when param group `group` has amsgrad with packed moments.
  void check_amsgrad(bool amsgrad, std::size_t group) const;

  /// A gradient stream is planned (its steps may still be off: steps_during_backward).
  bool overlap() const noexcept { return overlap_; }
  /// Why steps during backward are off for the run ("" when they are not).
  const std::string& steps_after_backward() const noexcept { return why_off_; }
  /// Parameters step during backward now: planned, not turned off, and (`master_stale`) fresh masters.
  bool steps_during_backward(bool master_stale = false) const noexcept {
    return overlap_ && why_off_.empty() && !master_stale;
  }
  /// Turns them off for the rest of the run (`why`); false when there were none to turn off.
  bool stop_steps_during_backward(const std::string& why);
  /// FSDP2 under wrap, its units found: the shards step during backward from now on when the settings
  /// allow it. True when they do.
  bool stream_shards() noexcept;

  /// TIERFLOW_GPU_OPTIMIZER_FRACTION as GpuShareChoice reads it: "0" for FSDP2's shards.
  const std::string& gpu_share_setting() const noexcept { return gpu_share_; }

  /// How a parameter joins the stream when it starts.
  ParamRoute route(const RouteFacts& p) const noexcept;
  /// The path of a step() with a stream running (`streaming`) whose gradients are `finite`.
  StepPath path(bool streaming, bool finite) const noexcept;
  /// Where a step writes a parameter's new weight: `has_home` (a host copy it lives in), or the
  /// parameter's own memory (`in_host_memory`, not the device's) and layout.
  static WeightTarget weight_target(bool has_home, bool in_host_memory, bool contiguous) noexcept;

 private:
  StateFormat format_ = StateFormat::kFp32;
  bool nvme_ = false;
  bool sharded_ = false;
  bool overlap_setting_ = false;  // TIERFLOW_OVERLAP_STEP
  bool skip_nonfinite_ = false;
  bool overlap_ = false;
  std::string why_off_;
  std::string gpu_share_;
};

}  // namespace tierflow::optimizer
