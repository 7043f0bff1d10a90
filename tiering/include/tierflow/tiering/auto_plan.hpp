// TIERFLOW_OFFLOAD_ACTIVATIONS=auto inside the user's first steps: when it
// records, times and plans, what a measured block costs, and the budgets the
// planner gets. Torch-free; bindings/python/tierflow adapts the model to it.
//
// Note [Auto plan phases]
// ~~~~~~~~~~~~~~~~~~~~~~~
// `auto` has no step of its own: it profiles inside the user's first steps.
//   forward 1 (kRecordForward)  every block records its ops and swaps every saved
//              tensor to the host (the first step fits wherever anything fits);
//   forward 2 (kTimedForward)   the runners time each block's forward; the
//              device's peak counter is reset;
//   forward 3 (kPlanForward)    before it: the links and the NVMe tier are
//              probed through the engines (Note [NVMe probe]), the profile is
//              written to TIERFLOW_PROFILE if set, and the planner decides
//              (Note [Activation planner]).
// On CUDA, once a plan is in force (and after a re-plan) the caching
// allocator's unused blocks go back to the device (torch.cuda.empty_cache):
// the profiling steps' own allocation pattern (every tensor swapped in
// forward 1) would otherwise stay reserved beside the plan's, in every step's
// reserved peak (x1.25 of the allocated one on an H100, gpt1b).
// A profile read from TIERFLOW_PROFILE plans before the first forward (and is
// tried again before each forward until a plan is in force). A model without
// repeated blocks decides before forward 2 between keeping every saved tensor
// (what forward 1 swapped fits beside the rest of training) and swapping them
// all. TIERFLOW_OFFLOAD_ACTIVATIONS=recompute is forced: no phases.
// tiering::PlanDriver (plan_driver.hpp, Note [Plan driver]) runs these phases
// and every rule of this Note, [Re-plan] and [Batch growth]; a front end (the
// Python AutoPlanner, a C++ trainer's) measures and applies.
//
// A measured block (measured_block_profile): its saved bytes per class come
// from the recorded table; its forward time is the median of the timed
// forwards, shared out among the classes in proportion to their flops; its
// backward is the median of the timed backwards, from the gradient of its
// output to the gradient of its input, its replay taken out (a block whose
// input needs no gradient has no end to time: kBackwardPerForward times its
// forward stands in); its working set is kTransientPerInput times its input
// (an estimate, see issue "cost model"); its split is possible when the table
// found a split op. With the
// CPU optimizer streaming (TIERFLOW_OFFLOAD_OPTIMIZER=host, TIERFLOW_OVERLAP_STEP
// on) the block's gradients cross the link during its backward
// (download_bytes = its parameters' bytes) and, with
// TIERFLOW_WEIGHTS_RETURN=forward, its weights come back during its forward
// (upload_bytes): optimizer_traffic says which from the configuration, and the
// planner prices both (Note [Activation planner]). Optimizer states on NVMe
// step after backward: no traffic inside a block.
//
// The budgets (session_budgets): the device's is TIERFLOW_GPU_MEMORY; what the
// rest of training holds there (fixed) is the parameters and their gradients,
// plus Adam's two moments in the parameters' dtype (torch's AdamW) when the
// optimizer stays on the device, or, once the timed step measured a device
// peak over its forward and backward (on CUDA: up to the optimizer's step,
// whose own transient memory never meets the saved activations), that peak
// less the largest block's working set and the prefetch window if that is
// more (workspace included). The peak is the allocated one: the budget bounds
// allocated memory, as torch.cuda.max_memory_allocated counts it. The caching
// allocator's reserved peak also counts blocks that earlier steps (or earlier
// work in the process) cached and left free for the taking, and the allocator
// releases those and retries before an allocation fails: on an H100 the timed
// step's reserved peak stood 4.7 GB above its allocated one, and counting it
// found no plan at checkpointing's allocated peak, where checkpointing itself
// ran. The reserved peak is measured and reported beside (Note [Re-plan]'s
// report), not budgeted. The host's is
// TIERFLOW_HOST_MEMORY less what is in use (optimizer states, saved tensors);
// NVMe's what the engine can still place (NvmeEngine::available_bytes); the
// prefetch window TIERFLOW_PREFETCH_BYTES, never more than the blocks save.
// Under FSDP2 (fully_shard), the parameters, gradients and optimizer states
// counted are each rank's shards, and FSDP2's gathered copies are added
// (fsdp_gathered_bytes): the root unit's unsharded parameters for the whole
// step (FSDP2 keeps the root gathered from its forward through backward), and
// at the most of the other units, in forward order: in forward a unit's
// parameters beside the next one's prefetched all-gather; in backward a unit's
// parameters and its unsharded gradients, the previous unit's prefetched
// all-gather and the reduce-scatter input of the unit after it still in
// flight (FSDP2 keeps one). A model, not a measurement: on CUDA the measured
// peak, which holds them as they are, takes over where it is more.
// The saved tensors outside the blocks are what the model-level hook packed in
// the timed step (SavedTensors' policy_bytes: the blocks' runners shield
// theirs), large enough to offload; the plan keeps or swaps them (Note
// [Activation planner], Outside the blocks). On CUDA the measured peak had them
// swapped, so it never counts them twice.
//
// Once a plan is in force, the report sets its predictions beside what the
// steps since measured (measured_beside_predicted, issue 17): the median wall
// time between consecutive forwards (the last kMeasuredSteps of them) and, on
// CUDA, the caching allocator's reserved peak; and their ratios to the
// predictions. The step predicted is a whole one: the plan prices the blocks'
// forward and backward, and the rest of the step (the layers outside the
// blocks, the loss, the optimizer's step, the user's loop) is what the timed
// step measured beside its blocks (rest_of_step_seconds, Note [Re-plan]).
//
// Note [Re-plan]
// ~~~~~~~~~~~~~~
// The timed step's wall time, from its forward to the next, less its blocks'
// timed forwards, backwards and replays and the model's round trip of what
// the model-level hooks swapped outside the blocks in it (the plan adds that
// back where it swaps them) and the host's gaps between neighbouring blocks
// (host_gaps_seconds) is the rest of the step; the plan's whole step is its
// blocks' predicted time plus that rest. The gaps: between the end of a
// block's timed forward and the start of the next block's (or of its backward
// and the previous block's) the host runs the timing's own work (the runners'
// hooks, the profiling step's swaps), which the device hides behind queued
// work once the timing is gone (on an H100 the timed step's rest was twice
// the steady step's rest without them); what the device synchronize before
// the next block waited for is device work queued there (a module between
// the blocks, FSDP2's all-gather or reduce-scatter) and stays in the rest.
// Except the timed step's own copies: it swaps each block's inputs to the
// host before the block's forward (every block is recomputed in it), timed
// apart (synchronized before and after) and taken out of the rest, as the
// plan prices an input's swap where it swaps or recomputes the block (on an
// H100, gpt1b: 24 inputs of 32 MiB, about 15 ms a step that the steady step
// of a plan keeping everything does not make).
// Once
// kReplanAfterSteps steps ran under a plan, not counting its first (which pins
// the host memory the plan's swaps need), the median of their wall times is
// set beside it; a ratio beyond 1 + kReplanMargin either way re-plans, once per
// session (TIERFLOW_REPLAN=off: never), from figures calibrated so that the
// model predicts what was measured for the plan in force (calibrate_figures):
//   - when the plan moves bytes over the link (swaps, the optimizer's traffic,
//     fetched parameters) and a factor of every link speed within
//     [1/kCalibrationRange, kCalibrationRange] explains the blocks' measured
//     part (measured step less the rest), that factor (solved by bisection:
//     the predicted step never grows with the links' speed);
//   - else a factor of every block's compute times (forward, backward and
//     recompute), in the same range; when none in it explains the
//     measurement either, no re-plan.
// Links first: the device's compute was measured in the timed step, the links
// were probed idle; what a plan adds to the step that the timed step did not
// have is its traffic. The calibrated model reproduces the plan in force's
// measured step (the tests check it) and the planner's search runs on it
// unchanged; TIERFLOW_PROFILE, when set, is rewritten with the calibrated
// figures (and the factors, under "calibrated"), so the next run starts there. With TIERFLOW_OFFLOAD_PARAMS=auto it never re-plans (replans):
// the units its plan keeps on the device stay resident for good, and a second
// plan could not undo that. A rest longer than the whole measured step leaves nothing to
// calibrate, and a plan that keeps every block and parameter is the fastest
// whatever the times: no re-plan, said once in the log, as any decision not to.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

inline constexpr int kRecordForward = 1;
inline constexpr int kTimedForward = 2;
inline constexpr int kPlanForward = 3;
inline constexpr double kBackwardPerForward = 2.0;
inline constexpr std::uint64_t kTransientPerInput = 2;
/// The link probe's buffer: at most this, and a sixteenth of the host room left.
inline constexpr std::uint64_t kLinkProbeBytes = 32ull << 20;
/// The NVMe probe's block, written and read back once (Note [NVMe probe]).
inline constexpr std::uint64_t kNvmeProbeBytes = 64ull << 20;
inline constexpr std::uint64_t kProbeGranule = 4096;

/// What to do before a forward of the model.
enum class PhaseAction {
  kNone,               ///< go on (recording, or a plan is in force)
  kPlanWithoutBlocks,  ///< no blocks: keep every saved tensor or swap them all (plan_without_blocks)
  kPlanFromProfile,    ///< plan from the profile read from TIERFLOW_PROFILE
  kStartTiming,        ///< the runners time this forward
  kMeasureAndPlan,     ///< stop timing, probe the links and NVMe, write the profile, plan
};

/// The phases of Note [Auto plan phases] for one session.
class AutoPlanPhases {
 public:
  /// `forced`: TIERFLOW_OFFLOAD_ACTIVATIONS=recompute; `blocks`: repeated blocks
  /// found; `loaded_profile`: a profile was read from TIERFLOW_PROFILE.
  /// `replan`: TIERFLOW_REPLAN (Note [Re-plan]).
  AutoPlanPhases(bool forced, bool blocks, bool loaded_profile, bool replan = true) noexcept
      : forced_(forced), blocks_(blocks), loaded_(loaded_profile), replan_(replan) {}
  /// Counts a forward and says what to do before it.
  PhaseAction before_forward() noexcept;
  /// The forward just counted was refused before it ran (it raised): not one of the phases' forwards.
  void forward_refused() noexcept {
    if (forwards_ > 0) forwards_ -= 1;
  }
  /// A plan is in force from now on.
  void planned() noexcept { planned_ = true; }
  bool has_plan() const noexcept { return planned_; }
  int forwards() const noexcept { return forwards_; }
  /// Whether the steps' measurement may still re-plan: a plan from blocks in force, TIERFLOW_REPLAN on, and the
  /// one re-plan neither made nor ruled out (Note [Re-plan]).
  bool may_replan() const noexcept { return planned_ && blocks_ && !forced_ && replan_ && !replan_settled_; }
  /// The re-plan was made, or ruled out: no other this session.
  void replan_settled() noexcept { replan_settled_ = true; }

 private:
  bool forced_, blocks_, loaded_, replan_;
  bool replan_settled_ = false;
  bool planned_ = false;
  int forwards_ = 0;
};

/// What one recorded block saves and computes, per class (the runner's table).
struct BlockRecord {
  std::uint64_t input_bytes = 0, attention_bytes = 0, split_bytes = 0, cheap_bytes = 0;
  double split_flops = 0, attention_flops = 0, total_flops = 0;
  bool has_split_ops = false;
  bool replayable = true;  ///< its forward may run again in backward (Note [Replay side effects])
  double forward_seconds = 0;  ///< median of the timed forwards (0: none timed)
  double backward_seconds = 0;  ///< median of the timed backwards, replays excluded (0: none timed)
  std::uint64_t parameter_bytes = 0;  ///< the block's own parameters, as stored
};

/// What the CPU optimizer moves over the link while a block runs.
struct OptimizerTraffic {
  bool weights_up_in_forward = false;   ///< its weights come back during its forward
  bool grads_down_in_backward = false;  ///< its gradients stream to the host during its backward
};

/// The optimizer's traffic inside the blocks for `config` (Note [Auto plan phases]).
OptimizerTraffic optimizer_traffic(const Config& config) noexcept;

/// The BlockProfile of a measured block (Note [Auto plan phases]).
BlockProfile measured_block_profile(const BlockRecord& record, OptimizerTraffic traffic = {}) noexcept;

/// What session_budgets is computed from.
struct SessionBudgetInputs {
  std::uint64_t device_budget_bytes = 0;  ///< TIERFLOW_GPU_MEMORY on this device
  std::uint64_t host_budget_bytes = 0;    ///< TIERFLOW_HOST_MEMORY
  std::uint64_t host_in_use_bytes = 0;    ///< the pinned pool's bytes in use
  std::uint64_t nvme_available_bytes = 0; ///< NvmeEngine::available_bytes (0: no NVMe tier)
  std::uint64_t prefetch_bytes = 0;       ///< TIERFLOW_PREFETCH_BYTES
  std::uint64_t parameter_bytes = 0;      ///< the model's parameters, as stored
  bool optimizer_on_device = false;       ///< TIERFLOW_OFFLOAD_OPTIMIZER=none
  bool gradients_offloaded = false;       ///< TIERFLOW_OFFLOAD_GRADIENTS=on: freed on the device once on the host
  std::uint64_t measured_peak_bytes = 0;  ///< the timed forward's device peak (0: not measured)
  /// The caching allocator's reserved peak over the same span (0: not measured): reported, not budgeted (Note [Auto
  /// plan phases]: cached blocks are free for the taking).
  std::uint64_t measured_reserved_peak_bytes = 0;
  /// TIERFLOW_OFFLOAD_PARAMS: kFetchAll (host) fetches every unit; the plan then counts the parameters
  /// (Budgets::params) and fixed_device_bytes keeps only their gradients.
  ParamPolicy params = ParamPolicy::kResident;
  Tier param_tier = Tier::kHost;                ///< where fetched parameters live between uses
  std::uint64_t rest_parameter_bytes = 0;       ///< parameters outside the blocks (with params other than kResident)
  std::uint64_t measured_parameter_peak_bytes = 0;  ///< fetched parameters' device peak in the timed step
  /// What the model-level hook packed in the timed step, large enough to offload (SavedTensors' policy_bytes):
  /// the saved tensors outside the blocks (Budgets::outside_saved_bytes).
  std::uint64_t outside_saved_bytes = 0;
  /// The largest single one of them (SavedTensorStats::policy_largest_bytes; 0: not measured): their host staging
  /// on the way to NVMe (Budgets::outside_largest_bytes).
  std::uint64_t outside_largest_bytes = 0;
  /// FSDP2 (fully_shard): each unit's unsharded parameter bytes other than the root's, in forward order, and the
  /// root unit's (fsdp_gathered_bytes; empty and 0 without FSDP2). parameter_bytes is then this rank's shards.
  std::vector<std::uint64_t> sharded_unit_bytes;
  std::uint64_t sharded_root_bytes = 0;
  /// Note [Batch growth]: the blocks given are scaled by this ratio from the size the profile measured; the
  /// measured peak's part beyond the blocks, the parameters, gradients and optimizer states grows with it.
  double batch_ratio = 1.0;
  /// The device's allocated bytes before the first forward beside the model's parameters and gradients (0: not
  /// measured): a frozen model, another's tensors; they do not grow with the batch (Note [Batch growth]). Up to
  /// the optimizer's states (optimizer_on_device) they are taken for a resumed optimizer's, counted already.
  std::uint64_t measured_beside_bytes = 0;
};

/// FSDP2's gathered copies on the device at their most (Note [Auto plan phases]): the root unit's unsharded
/// parameters plus, over the other units in forward order (u), the larger of u[i] + u[i+1] (forward, the next
/// all-gather prefetched) and u[i-1] + 2 u[i] + u[i+1] (backward: the previous unit prefetched, this unit's
/// parameters and unsharded gradients, the reduce-scatter input of the unit after it). 0 without FSDP2.
std::uint64_t fsdp_gathered_bytes(const std::vector<std::uint64_t>& unit_bytes, std::uint64_t root_bytes) noexcept;

/// The plan of a model without repeated blocks (Note [Auto plan phases]).
struct PlanWithoutBlocks {
  bool keep_all = false;                      ///< what a step saves fits beside the rest of training
  std::uint64_t predicted_device_peak_bytes = 0;
  std::string summary;                        ///< the logged line
};
/// Keep every saved tensor when the `saved_bytes` a step saved (all swapped in the first step) fit within the
/// device budget beside fixed_device_bytes; else go on swapping them all.
PlanWithoutBlocks plan_without_blocks(std::uint64_t saved_bytes, const Budgets& budgets);

/// The planner's budgets for `blocks` (Note [Auto plan phases]).
Budgets session_budgets(const SessionBudgetInputs& in, const std::vector<BlockProfile>& blocks) noexcept;

// Note [Batch growth]
// ~~~~~~~~~~~~~~~~~~~
// A plan is made for the batch its profile measured, and a later batch can be
// larger: with dynamic padding (transformers' data collators, the default)
// every batch is as long as its longest sequence, and a plan that kept
// everything for a short first batch would hold a long one's activations on
// the device past TIERFLOW_GPU_MEMORY. A forward's size is measured on the
// tensors the model is called with (input ids, masks, labels grow with the
// batch's tokens), against the profiled forward's (batch_size): the largest
// ratio of a tensor's elements to the same tensor's there (the smallest when
// none grew), times that forward's elements, so an input of fixed size (an
// image beside the text) does not dilute the tokens' growth (a mask of the
// sequence's square overstates it: more is moved than needed, the budget
// holds). Tensors are matched by their place among the arguments (keyword
// names, nesting); a forward called with other ones than the profiled forward
// is measured on those both have, said once, or on its own elements when they
// have none. 0 (no tensor among them: a dataclass batch) is not tracked, said
// once.
// - The profile is the timed forward's (forward 2): its times, its measured
//   peak and its saved bytes (a block records a table for each input shape it
//   meets, so forward 2's own), and it records that forward's tensors
//   (batch_tensor_elements, by place; batch_elements their sum; a profile file
//   without them is taken to be for the first forward's).
// - A plan is for the largest size seen: made before forward 3, for the
//   largest of the three; under a plan, a forward larger than the plan's size
//   re-plans for it before it runs (grown_batch), from the profile with every
//   block's saved bytes, working set and times scaled by the ratio
//   (blocks_for_batch), the saved tensors outside the blocks and the measured
//   peak's part beyond the blocks too (SessionBudgetInputs::batch_ratio); the
//   parameters, their gradients and the optimizer's states do not grow. A
//   plan for a larger batch holds for every smaller one (it moves more than
//   they need), so the re-plans are as many as the records the sizes set.
// - Linear in the size: the saved tensors grow with the tokens, attention
//   through SDPA's kernels included; an eager attention's scores grow with
//   their square and are underestimated (on CUDA the measured peak in the
//   report shows it).
// - No plan fits the larger batch: the plan in force stays, said (warn) and in
//   report()["plan"]["batch_growth"]. So it does under
//   TIERFLOW_OFFLOAD_PARAMS=auto (batch_growth_refusal): the units its first
//   plan kept on the device stay there for good, which a plan for more
//   activations could not undo.
// - The calibration re-plan (Note [Re-plan]) compares steps of one size: once
//   a forward's size differs from the plan's by more than kBatchVaries, it is
//   settled (batch_varies).
// - A model without repeated blocks (plan_without_blocks) decides again for the
//   larger batch from its first step's saved bytes scaled alike.
// - A block keeps the tables of the kTablesKeptPerBlock input shapes it met
//   last (a table is its forward's ops and saved tensors, for one shape): with
//   a length per batch, one per shape would grow through the run. A shape met
//   again after its table went is recorded again (that forward recomputes
//   where its plan splits: with more lengths than that in turn, a split block
//   mostly recomputes). A plan that changes a block's action or split keeps
//   only the table its probe checked.
inline constexpr double kBatchVaries = 0.1;
inline constexpr int kTablesKeptPerBlock = 8;

/// `blocks` for a batch `ratio` times as large: their saved bytes, working sets and times scaled (Note [Batch
/// growth]); their parameters and the optimizer's traffic unchanged.
std::vector<BlockProfile> blocks_for_batch(const std::vector<BlockProfile>& blocks, double ratio);
/// A forward's size (Note [Batch growth]): `inputs` and `profiled` are the elements of the tensors this forward
/// and the profiled one were both called with (matched by their place among the arguments), `profiled_elements`
/// all of the profiled forward's and `elements` all of this one's. No tensor in common (or no profiled forward
/// yet): `elements`.
std::uint64_t batch_size(const std::vector<std::uint64_t>& profiled, const std::vector<std::uint64_t>& inputs,
                         std::uint64_t profiled_elements, std::uint64_t elements) noexcept;
/// 0 when a plan made for `planned_elements` holds for a forward of `elements`; else the size to re-plan for.
std::uint64_t grown_batch(std::uint64_t planned_elements, std::uint64_t elements) noexcept;
/// Whether a forward of `elements` is not comparable with steps of `planned_elements` (Note [Batch growth]).
bool batch_varies(std::uint64_t planned_elements, std::uint64_t elements) noexcept;

/// The link probe's buffer size: at most `most` and a sixteenth of the host
/// room left (its two pinned buffers take at most an eighth), in granules, at
/// least one.
std::uint64_t link_probe_bytes(std::uint64_t host_budget_bytes, std::uint64_t host_in_use_bytes,
                               std::uint64_t most = kLinkProbeBytes) noexcept;

/// The NVMe probe's first block size: kNvmeProbeBytes or what the tier can
/// place, in granules (0: no room). Halve it (next_nvme_probe_bytes) when the
/// free space is in pieces.
std::uint64_t nvme_probe_bytes(std::uint64_t available_bytes) noexcept;

/// The median of `seconds` as Python's statistics.median (the mean of the middle two of an even count);
/// 0 for none. A block's measured forward is the median of its timed forwards.
double median_seconds(std::vector<double> seconds) noexcept;

/// Step gaps the measured step is the median of (Note [Auto plan phases]).
inline constexpr std::size_t kMeasuredSteps = 32;

/// The plan's predictions beside what the steps since measured (Note [Auto plan phases]).
struct MeasuredBesidePredicted {
  std::optional<double> step_seconds;          ///< median gap between forwards; none before two forwards
  std::size_t steps = 0;                       ///< gaps it is the median of
  std::optional<double> step_vs_predicted;     ///< none without a measured step or a predicted one
  std::optional<double> peak_vs_predicted;     ///< none without a measured peak or a predicted one
};

/// Ratios of the measured step and peak to the predicted ones; `forward_starts` are the last forwards' start
/// times (seconds), the others are absent (or 0 when predicted) where unknown.
MeasuredBesidePredicted measured_beside_predicted(const std::vector<double>& forward_starts,
                                                  std::optional<std::uint64_t> peak_reserved_bytes,
                                                  std::optional<double> predicted_step_seconds,
                                                  std::optional<double> predicted_peak_bytes);
std::uint64_t next_nvme_probe_bytes(std::uint64_t bytes) noexcept;

// Note [Overlap window]
// ~~~~~~~~~~~~~~~~~~~~~
// The planner prices a block's swap-out as overlapping its own forward and its
// swap-in as overlapping its own backward. The swap engine bounds the bytes in
// flight each way by one window (TIERFLOW_PREFETCH_BYTES: prefetch ahead, and
// copies to the host before offload() waits, Note [Staged pipeline]); a block
// that swaps more than the window makes the host wait on the device inside
// the block's compute, every window's worth, which the model does not price.
// A window of one block is not enough either: a block's copies are queued
// as its forward saves, so the last of them finish after its compute, and
// the next block's first save would wait for them while the device has only
// that block's first kernels queued; each block's last copies then run
// beside no compute (measured on an H100: a 1.34B GPT's forward twice as
// long with 22 blocks swapping about one window each). So under a plan the
// window is the largest swap of two neighbouring blocks (plan_window), never
// below the configured one and only as far as the device budget leaves room
// beside the plan's peak (which counts the window once when anything swaps);
// the plan's peak is then the one with that window. A plan that swaps nothing
// keeps the configured window, and no plan shrinks it.

/// The window a plan runs with and the plan's device peak with it (Note [Overlap window]).
struct PlanWindow {
  std::uint64_t bytes = 0;        ///< the prefetch window / bound on copies to the host
  std::uint64_t peak_bytes = 0;   ///< the plan's predicted device peak with that window
  std::uint64_t wanted_bytes = 0; ///< the largest swap of two neighbouring blocks (what no wait inside a block needs)
};
/// Note [Overlap window]: `plan` as plan_activations made it within `budgets` (budgets.prefetch_bytes: the
/// window in its peak); never below `configured_bytes` (TIERFLOW_PREFETCH_BYTES, which the budgets cap at what
/// the blocks save).
PlanWindow plan_window(const Plan& plan, const Budgets& budgets, std::uint64_t configured_bytes = 0) noexcept;

/// Whether a session under `config` may re-plan (Note [Re-plan]): TIERFLOW_REPLAN on, and parameters not
/// planned per unit (TIERFLOW_OFFLOAD_PARAMS=auto makes the units its plan keeps resident for good, which a
/// second plan could not undo).
bool replans(const Config& config) noexcept;
/// Why a session under `config` cannot plan again for a larger batch (Note [Batch growth]), empty when it can:
/// TIERFLOW_OFFLOAD_PARAMS=auto, whose first plan made its units resident for good.
std::string batch_growth_refusal(const Config& config);

/// Note [Re-plan]: steps under a plan before its measurement is judged; how far it may stray; the calibration's
/// range either way.
inline constexpr std::size_t kReplanAfterSteps = 3;
inline constexpr double kReplanMargin = 0.25;
inline constexpr double kCalibrationRange = 64;

/// The timed step's wall time less its blocks' timed forwards, backwards and replays (`blocks_seconds`), the
/// model's round trip of what the model-level hooks swapped outside the blocks (`outside_seconds`: the plan adds
/// it back where it swaps them), the host's gaps between neighbouring blocks, and the swaps of the blocks' inputs
/// the timed step made before each block's forward (`input_swap_seconds`: the plan prices them where it swaps or
/// recomputes a block); never below 0 (Note [Re-plan]).
double rest_of_step_seconds(double step_seconds, double blocks_seconds, double outside_seconds = 0,
                            double host_gaps_seconds = 0, double input_swap_seconds = 0) noexcept;

/// One timed interval of the timed step: a block's forward or its backward (Note [Re-plan]).
struct TimedInterval {
  bool backward = false;
  std::size_t block = 0;
  double start = 0, end = 0;  ///< seconds on one clock
  /// How long the device synchronize just before `start` waited: device work queued since the last interval
  /// (a module between the blocks, FSDP2's all-gather), which is real work and stays in the rest of the step.
  double wait_before = 0;
};

/// The host's own time between neighbouring blocks in the timed step (Note [Re-plan]): in start order, the time
/// from one interval's end to the next one's start, less the next one's wait_before, where both are forwards of
/// blocks i and i + 1, or backwards of blocks i and i - 1; never negative.
double host_gaps_seconds(std::vector<TimedInterval> intervals);

/// Whether the measured step (median of `steps` step gaps) strays from the predicted whole step beyond the
/// margin; false before kReplanAfterSteps gaps or without either figure.
bool strays_from_prediction(std::optional<double> measured_step_seconds, std::size_t steps,
                            std::optional<double> predicted_step_seconds) noexcept;

/// Figures scaled so that the model predicts the measured step for the plan in force (Note [Re-plan]).
struct CalibratedFigures {
  bool calibrated = false;     ///< false: nothing explains the measurement (why says what); do not re-plan
  double link_factor = 1;      ///< every link speed times this
  double compute_factor = 1;   ///< every block's compute times times this
  std::vector<BlockProfile> blocks;  ///< the blocks with compute_factor applied
  Links links;                       ///< the links with link_factor applied
  std::string why;                   ///< one line for the log: the measurement, the prediction, the factor
};

/// Note [Re-plan]: calibrates `blocks` and `links` on the plan in force (`plan`, made from them within
/// `budgets`), its measured whole step and the measured rest of the step.
CalibratedFigures calibrate_figures(const std::vector<BlockProfile>& blocks, const Links& links,
                                    const Budgets& budgets, const Plan& plan, double measured_step_seconds,
                                    double rest_seconds);

}  // namespace tierflow::tiering
