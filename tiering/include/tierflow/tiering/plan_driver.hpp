// The `auto` activation planner's sequencing in one torch-free class: measured
// events in, a typed plan out (Note [Plan driver]).
//
// Note [Plan driver]
// ~~~~~~~~~~~~~~~~~~
// PlanDriver runs every phase and rule of Note [Auto plan phases], [Re-plan]
// and [Batch growth]: when to record, time and plan; the profile the timed
// step makes; the plan (and the plan again once a split probed inexact); the
// window; the whole step predicted; the one calibration re-plan (and its
// failure, which keeps the plan in force); planning again for a larger batch,
// or refusing to; settling; the plan of a model without repeated blocks; the
// reference sizes by input place; the measured step beside the predicted one;
// and the log lines saying so. It decides; a front end measures and applies:
//
//   the driver (tiering/)                 the front end (PlanFrontEnd)
//   -------------------------------       -----------------------------------
//   counts forwards, picks the phase      starts the timing (runners, peaks)
//   builds the profile from the timed     measures it: block records, links,
//     step's measures, asks to write it     NVMe, outside bytes, intervals, peaks;
//   plans, re-plans, grows, settles         writes the profile file
//   asks which split blocks are exact     probes the splits on the device
//   the window, hooks needed or not       applies the plan: runners' modes,
//     (keep_all, outside_kept)              the window, parameter residency,
//                                            the caching allocator's release
//   the budgets from measured inputs      the inputs: runtime, FSDP2, parameters
//
// Python's AutoPlanner (bindings/python/tierflow/activations/autoplan.py) is
// one front end; the C++ BlockOffload of a LibTorch trainer can be another.
// The driver never holds its front end: each event that may plan takes it.
//
// Note [Plan messages]
// ~~~~~~~~~~~~~~~~~~~~
// Planning is routine, so its lines are quiet (TIERFLOW_LOG_LEVEL): a plan
// put in force is one line at info (its blocks' lines and reasons at debug);
// the calibration re-plan and planning again for a larger batch are info too.
// A warning means something is wrong or a budget may not hold: no repeated
// blocks, a batch the driver cannot measure or measures on other tensors, a
// re-plan that failed, a larger batch no plan fits (the plan in force stays
// and may exceed TIERFLOW_GPU_MEMORY). report()["plan"] has every figure.
//
// Note [Rest calibration]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The plan's whole step is its blocks' part (the planner's model, from the
// timed step's block times and the probed links) plus the rest of the step
// (Note [Re-plan]). The timed step is one step, and not a typical one: the
// runners' timing hooks and synchronizes, every block recomputed, its inputs
// swapped, the CPU AdamW cutting its buckets the first time; on the emulated
// tiny preset its rest came out about twice a steady step's (cpu-adam: 4.3 ms
// against 2.2 ms), so the prediction ran 1.4x over every later step. So the
// rest is measured again on the plan's own steps: once kRestCalibrationSteps
// (8) steps ran under it after its first kRestCalibrationSkip (3: the first
// pins the host memory its swaps need; on the adversarial device the next few
// still ran up to 2x the later ones: the CPU AdamW's buckets, the copy pool
// warming), the rest becomes their median wall time less the blocks' priced part
// (never below 0; blocks priced above that median, a timed step that ran
// slow, are scaled down to it: blocks_factor), the terms follow (the CPU
// optimizer's exposed step still at most the rest), and the steps measured
// beside the prediction (report()["plan"]["measured"]) start after those:
// the prediction is compared only with steps it was not made from. For the
// plan in force the whole step predicted is then the calibration steps'
// median: what is tested against held-out steps is that it stays the step
// (and the terms' split of it); the model's own content is in what it prices
// for another plan (a re-plan, a larger batch, the CLI). It runs whether or
// not the steps re-plan (a plan that keeps everything, TIERFLOW_OFFLOAD_
// PARAMS=auto: they never do) and for every plan put in force after (a
// re-plan's, from its own steps); not with TIERFLOW_REPLAN=off (the
// prediction stays the timed step's, as the user froze it), nor on steps of
// another batch than the plan's (Note [Batch growth]: sizes that vary, a plan
// scaled for a larger batch, a refused one). report()["plan"]["rest_
// calibration"] has the steps, their median, the timed step's rest it
// replaced and blocks_factor (None until then). Measured on the emulated
// device (benchmarks/plan_prediction_check.py, results in benchmarks/results/
// plan_prediction_tiny_*.json): see Note [Step prediction].
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/auto_plan.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/profile_file.hpp"
#include "tierflow/tiering/step_prediction.hpp"

namespace tierflow::tiering {

/// A forward's input tensors' elements by their place among the arguments (Note [Batch growth]), in call order.
using InputElements = std::vector<std::pair<std::string, std::uint64_t>>;

/// The calibration a re-plan made its profile with (Note [Re-plan]); written under "calibrated".
struct ProfileCalibration {
  double link_factor = 1, compute_factor = 1;
  std::string why;
};

/// A profile as `auto` measures, writes and reads it (Note [Profile file]): the file's blocks, links and fixed
/// bytes, and the timed step's figures beside them (absent: a file written before they were measured).
struct AutoProfile {
  /// blocks, links, fixed_device_bytes; outside_saved_bytes and outside_largest_bytes when outside_measured
  ProfileFile file;
  bool outside_measured = false; ///< the file has outside_saved_bytes
  std::optional<InputElements> batch_tensor_elements;  ///< the timed forward's tensors by place
  std::uint64_t batch_elements = 0;      ///< their sum (0: not known)
  std::optional<double> host_gaps_seconds, timed_step_seconds, rest_of_step_seconds;
  std::optional<std::uint64_t> measured_beside_bytes, measured_peak_bytes, measured_reserved_peak_bytes;
  std::optional<ProfileCalibration> calibrated;
  double batch_ratio = 1;  ///< scaled for a larger batch than batch_elements (for_batch); never written
};

/// What the timed step measured, as the front end hands it over (Note [Auto plan phases], [Re-plan]).
struct TimedStepMeasures {
  std::vector<BlockRecord> blocks;  ///< each block's recorded table and timings, in forward order
  Links links;                      ///< measured (NVMe probed when there is a tier)
  std::uint64_t outside_saved_bytes = 0;  ///< what the model-level hook packed in the timed step
  /// The largest single tensor of those (SavedTensorStats::policy_largest_bytes; 0: not measured): their host
  /// staging on the way to NVMe (Budgets::outside_largest_bytes, Note [Activation planner], Outside the blocks).
  std::uint64_t outside_largest_bytes = 0;
  std::vector<TimedInterval> intervals;   ///< the blocks' timed forwards and backwards
  double blocks_forward_seconds = 0, blocks_backward_seconds = 0, blocks_replay_seconds = 0;
  double blocks_input_swap_seconds = 0;   ///< the blocks' inputs swapped before their forwards
  std::optional<std::uint64_t> peak_bytes, reserved_peak_bytes;  ///< CUDA: forward and backward's device peaks
  std::uint64_t beside_bytes = 0;  ///< CUDA: the device's bytes beside the model's before the first forward
  /// step()'s wait for the CPU optimizer after the timed step's backward (its part of the rest; Note [Step
  /// prediction]); 0 without one.
  double optimizer_wait_seconds = 0;
  /// The CPU optimizer as measured (its parameters, its kernel's rate: 0 unknown); on_cpu false without one.
  OptimizerStepInputs optimizer;
};

/// The timed step's figures as the report shows them (report()["plan"]["timed_step"]).
struct TimedStepSummary {
  double step_seconds = 0, blocks_forward_seconds = 0, blocks_backward_seconds = 0, blocks_replay_seconds = 0;
  double blocks_input_swap_seconds = 0, host_gaps_seconds = 0, rest_of_step_seconds = 0;
  std::uint64_t outside_saved_bytes = 0, fixed_device_bytes = 0;
  std::optional<std::uint64_t> measured_peak_bytes;
  Links links;                      ///< as measured (a re-plan's calibration leaves them)
  std::vector<BlockProfile> blocks; ///< as measured
};

/// Steps a plan runs first that its whole-step prediction leaves out (its first pins host memory; the next still
/// warm up), then the steps it takes the rest of the step from (Note [Rest calibration]).
inline constexpr std::size_t kRestCalibrationSkip = 3;
inline constexpr std::size_t kRestCalibrationSteps = 8;

/// Note [Rest calibration]: the rest of the step as the plan's own steps measured it.
struct RestCalibration {
  std::size_t steps = 0;                ///< the plan's steps (after its first) it is the median of
  double step_seconds = 0;              ///< their median wall time
  double timed_rest_seconds = 0;        ///< the rest the timed step measured, which it replaced
  double blocks_factor = 1;             ///< < 1: the blocks' priced time was more than step_seconds, scaled to it
};

/// The plan in force, typed, with what the front end needs to apply it.
struct DrivenPlan {
  bool without_blocks = false;  ///< plan_without_blocks's: no blocks, keep or swap all (Plan left empty)
  Plan plan;                    ///< per block mode, alpha, tier, params; rest_params; outside_*; predictions
  std::string summary;
  std::vector<std::string> lines, why;  ///< one per block; what each rejected action would have cost
  bool keep_all = false;        ///< every block and what is outside them kept: no saved-tensor hooks at all
  bool outside_kept = false;    ///< what is saved outside the blocks kept: no model-level hooks
  bool outside_measured = true; ///< the profile measured the outside tensors
  std::uint64_t outside_bytes = 0;  ///< without blocks: what a step saves
  std::uint64_t window_bytes = 0, window_wanted_bytes = 0;  ///< Note [Overlap window]
  std::uint64_t predicted_device_peak_bytes = 0;
  std::optional<double> predicted_step_seconds;  ///< the whole step (none without blocks)
  std::optional<StepPrediction> step;            ///< its terms (Note [Step prediction]; none without blocks)
  double predicted_blocks_seconds = 0, rest_of_step_seconds = 0;
  /// The CPU optimizer's exposed step as the model gives it, before the rest bounds it (Note [Step prediction]).
  double optimizer_model_seconds = 0;
  std::optional<RestCalibration> rest_calibration;  ///< Note [Rest calibration]: none until the plan's steps ran
  std::optional<std::uint64_t> released_cached_bytes;  ///< CUDA: what the front end's apply gave back
  std::uint64_t batch_elements = 0, profiled_batch_elements = 0;
  std::optional<std::string> settled;  ///< why the steps may no longer re-plan (Note [Steady step])
};

/// Note [Re-plan]: the one re-plan, or why there was none.
struct Replanned {
  bool replanned = false;
  std::string why;
  std::optional<double> measured_step_seconds;
  std::size_t steps = 0;
  std::optional<double> predicted_step_seconds;
  double link_factor = 1, compute_factor = 1;
};

/// Note [Batch growth]: re-plans for larger batches, and the last refusal.
struct BatchGrowth {
  int replans = 0;
  std::optional<std::pair<std::uint64_t, std::string>> refused;  ///< batch_elements, why
};

/// What only the front end can do (Note [Plan driver]). The driver calls these inside the event it was handed to.
class PlanFrontEnd {
 public:
  virtual ~PlanFrontEnd() = default;
  /// The budgets' inputs measured now; the settings' (prefetch, optimizer, gradients) and the profile's own
  /// fields (peaks, outside bytes, batch ratio) are the driver's.
  virtual SessionBudgetInputs budget_inputs() = 0;
  /// Of `blocks` (a plan's), the indices of split blocks where no split op is exact on the device; each split
  /// block's exact rows are set as a side effect (a block without a table yet probes when it has one).
  virtual std::vector<std::size_t> inexact_splits(const std::vector<BlockPlan>& blocks) = 0;
  /// Puts `plan` in force (runners' modes and hooks, the window, parameter residency); returns the cached bytes
  /// given back to the device (CUDA; none elsewhere).
  virtual std::optional<std::uint64_t> apply(const DrivenPlan& plan) = 0;
  /// The timed forward begins: time the blocks (and on CUDA reset the peaks).
  virtual void start_timing() = 0;
  /// The timed step ended: stop timing and hand over what it measured (links and NVMe probed here).
  virtual TimedStepMeasures measure_timed_step() = 0;
  /// The bytes the first step swapped (a model without blocks swaps every saved tensor in it).
  virtual std::uint64_t first_step_saved_bytes() = 0;
  /// `profile` made or calibrated: write it to TIERFLOW_PROFILE when set.
  virtual void write_profile(const AutoProfile& profile) = 0;
  /// The time now, in seconds on one clock: a forward's start, a plan's end.
  virtual double now_seconds() = 0;
};

/// The settings a driver runs under, from the configuration.
struct PlanDriverSettings {
  bool forced = false;                  ///< TIERFLOW_OFFLOAD_ACTIVATIONS=recompute
  std::size_t blocks = 0;               ///< repeated blocks found
  bool replan = true;                   ///< replans(config)
  bool calibrate_rest = true;           ///< TIERFLOW_REPLAN (Note [Rest calibration]; OFFLOAD_PARAMS=auto too)
  std::string growth_refusal;           ///< batch_growth_refusal(config)
  std::uint64_t prefetch_bytes = 0;     ///< TIERFLOW_PREFETCH_BYTES
  bool optimizer_on_device = false;     ///< TIERFLOW_OFFLOAD_OPTIMIZER=none
  bool gradients_offloaded = false;     ///< TIERFLOW_OFFLOAD_GRADIENTS=on
  OptimizerTraffic traffic;             ///< optimizer_traffic(config)
  /// `config`'s, for a model of `blocks` repeated blocks.
  static PlanDriverSettings of(const Config& config, std::size_t blocks);
};

/// TIERFLOW_OFFLOAD_ACTIVATIONS=auto and =recompute for one session (Note [Plan driver]).
class PlanDriver {
 public:
  /// `loaded`: the profile read from TIERFLOW_PROFILE (never with `forced`). Says (warn) when there are no blocks.
  explicit PlanDriver(PlanDriverSettings settings, std::optional<AutoProfile> loaded = std::nullopt);

  /// Before every forward of the model with grad, with its input tensors' elements. Records, times, plans, grows,
  /// settles or re-plans as the phases say; returns the phase's action.
  PhaseAction before_forward(const InputElements& inputs, PlanFrontEnd& front);
  /// The forward just counted was refused before it ran (it raised): not one of the profiling forwards.
  void forward_refused() noexcept;
  /// The plan in force stays from here: device memory was taken after its measurements (`why`, logged once).
  void settle(const std::string& why);

  /// The planner's budgets for `profile` with the front end's inputs measured now.
  Budgets budgets(const AutoProfile& profile, PlanFrontEnd& front);
  /// `profile` scaled to a batch of `elements` and the size it is for (Note [Batch growth]).
  std::pair<AutoProfile, std::uint64_t> for_batch(const AutoProfile& profile, std::uint64_t elements) const;

  const AutoPlanPhases& phases() const noexcept { return phases_; }
  const std::optional<DrivenPlan>& plan() const noexcept { return plan_; }
  /// Counts every change of plan() (a new plan, a settled one): the front end's copy is stale when it moved.
  std::uint64_t revision() const noexcept { return revision_; }
  /// The profile the plan in force was made from (before scaling for a batch).
  const std::optional<AutoProfile>& profile() const noexcept { return profile_; }
  const std::optional<AutoProfile>& loaded_profile() const noexcept { return loaded_; }
  const std::optional<Replanned>& replanned() const noexcept { return replanned_; }
  const std::optional<TimedStepSummary>& timed_step() const noexcept { return timed_step_; }
  const BatchGrowth& batch_growth() const noexcept { return growth_; }
  std::uint64_t fsdp_gathered_bytes() const noexcept { return fsdp_gathered_; }
  std::uint64_t planned_elements() const noexcept { return planned_elements_; }
  /// Saved bytes of the blocks the plan in force keeps (0 without a profile).
  std::uint64_t kept_bytes() const noexcept;
  /// The plan in force's figures report()["plan"] shows (a JSON object): the plan's (the driver's, else
  /// `plan_text`, one given by hand as plan_json writes it), the re-plan, the timed step, batch growth.
  std::string report_json(std::string_view plan_text = "{}") const;
  /// The plan's predictions beside the steps since it came in force; `peak_reserved_bytes` the front end's.
  MeasuredBesidePredicted measured_beside_predicted(std::optional<std::uint64_t> peak_reserved_bytes) const;

 private:
  void act(PhaseAction action, double now_seconds, PlanFrontEnd& front);
  void measure_and_plan(double now_seconds, PlanFrontEnd& front);
  void plan_from_profile(PlanFrontEnd& front);
  void make_plan(const AutoProfile& base, std::uint64_t elements, PlanFrontEnd& front);
  void plan_without_blocks(std::uint64_t elements, PlanFrontEnd& front);
  void grow(std::uint64_t elements, PlanFrontEnd& front);
  void refuse_growth(std::uint64_t elements, const std::string& why);
  void maybe_replan(PlanFrontEnd& front);
  void maybe_calibrate_rest();
  void put_in_force(DrivenPlan plan);
  std::uint64_t size(const InputElements& inputs);

  PlanDriverSettings settings_;
  AutoPlanPhases phases_;
  std::optional<AutoProfile> loaded_;
  std::map<int, InputElements> inputs_;  ///< the profiling forwards' inputs, by forward
  InputElements reference_;              ///< the profiled forward's, which a forward's size is measured against
  bool untracked_said_ = false, other_inputs_said_ = false;
  std::uint64_t planned_elements_ = 0;
  std::uint64_t first_saved_bytes_ = 0;
  std::uint64_t fsdp_gathered_ = 0;
  BatchGrowth growth_;
  std::vector<double> step_starts_;
  std::optional<double> timed_start_;
  std::optional<Replanned> replanned_;
  std::optional<TimedStepSummary> timed_step_;
  std::optional<DrivenPlan> plan_;
  std::uint64_t revision_ = 0;
  bool rest_pending_ = false;  ///< the plan in force's rest is still the timed step's (Note [Rest calibration])
  Plan plan_struct_;                       ///< the plan in force as the planner made it (what a re-plan calibrates)
  std::vector<BlockProfile> plan_blocks_;  ///< the profile's blocks as planned (inexact splits marked so)
  std::optional<AutoProfile> profile_;
  OptimizerStepInputs optimizer_;        ///< the CPU optimizer the timed step measured
  double timed_optimizer_wait_ = 0;      ///< step()'s wait for it in the timed step
};

/// `plan` as the session and the report read it (a JSON object): the planner's fields, the window, the whole step
/// predicted, the batch sizes and why it settled.
std::string plan_json(const DrivenPlan& plan);
/// `profile` as its file holds it (Note [Profile file]), with the timed step's figures beside.
std::string auto_profile_json(const AutoProfile& profile);
/// A profile from its file's text or auto_profile_json's (checked as profile_from_json checks a file): a block
/// without backward_seconds gets the planner's estimate from its forward, links without duplex both directions'
/// sum, a file without outside_saved_bytes leaves the tensors outside the blocks unmeasured.
AutoProfile auto_profile_from_json(std::string_view text);

}  // namespace tierflow::tiering
