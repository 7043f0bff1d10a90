// See Note [Plan driver] in plan_driver.hpp; the phases and rules are Note [Auto plan phases], [Re-plan] and
// [Batch growth] in auto_plan.hpp.
#include "tierflow/tiering/plan_driver.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/tiering/plan_report.hpp"

namespace tierflow::tiering {
namespace {

std::uint64_t sum_of(const InputElements& inputs) {
  std::uint64_t n = 0;
  for (const auto& [place, elements] : inputs) n += elements;
  return n;
}

// Python's round(): half to even (the profile's scaled bytes were Python's).
std::uint64_t round_half_even(double v) { return static_cast<std::uint64_t>(std::nearbyint(v)); }

// A sorted list of places as Python's repr of it shows them (the log line was Python's).
std::string places_repr(const InputElements& inputs) {
  std::vector<std::string> names;
  for (const auto& [place, n] : inputs) names.push_back(place);
  std::sort(names.begin(), names.end());
  std::string out = "[";
  for (const auto& s : names) {
    if (out.size() > 1) out += ", ";
    const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    out += q;
    for (const char c : s) {
      if (c == '\\' || c == q) out += '\\';
      out += c;
    }
    out += q;
  }
  return out + "]";
}

const InputElements& at_or_empty(const std::map<int, InputElements>& by_forward, int forward) {
  static const InputElements kNone;
  const auto it = by_forward.find(forward);
  return it == by_forward.end() ? kNone : it->second;
}

}  // namespace

PlanDriverSettings PlanDriverSettings::of(const Config& config, std::size_t blocks) {
  PlanDriverSettings s;
  s.forced = config.offload_activations == OffloadTarget::kRecompute;
  s.blocks = blocks;
  s.replan = replans(config);
  s.calibrate_rest = config.replan;
  s.growth_refusal = batch_growth_refusal(config);
  s.prefetch_bytes = config.prefetch_bytes;
  s.optimizer_on_device = config.offload_optimizer == OffloadTarget::kNone;
  s.gradients_offloaded = config.offload_gradients;
  s.traffic = optimizer_traffic(config);
  return s;
}

PlanDriver::PlanDriver(PlanDriverSettings settings, std::optional<AutoProfile> loaded)
    : settings_(std::move(settings)),
      phases_(settings_.forced, settings_.blocks > 0, loaded.has_value() && !settings_.forced, settings_.replan),
      loaded_(settings_.forced ? std::nullopt : std::move(loaded)) {
  if (settings_.blocks == 0) {
    log(LogLevel::kWarn,
        std::string("tierflow: no repeated blocks found in the model (pass blocks=[...] to tierflow.wrap); "
                    "TIERFLOW_OFFLOAD_ACTIVATIONS=") +
            (settings_.forced ? "recompute swaps every saved tensor to the host instead"
                              : "auto swaps every saved tensor to the host in the first step, then keeps them all on "
                                "the device if what that step saved fits within TIERFLOW_GPU_MEMORY"));
  }
}

PhaseAction PlanDriver::before_forward(const InputElements& inputs, PlanFrontEnd& front) {
  const double now_seconds = front.now_seconds();
  const bool had_plan = plan_.has_value();
  const PhaseAction action = phases_.before_forward();
  if (!plan_ && phases_.forwards() <= kPlanForward) inputs_[phases_.forwards()] = inputs;
  act(action, now_seconds, front);  // a plan made here sets the reference
  const std::uint64_t elements = size(inputs);
  if (elements == 0 && !untracked_said_ && !settings_.forced) {
    untracked_said_ = true;
    log(LogLevel::kWarn,
        "tierflow: the model is called with no tensor among its arguments that tierflow can count (a batch in a "
        "dataclass?): a batch larger than the one the activation plan was made for is not seen, and the plan may "
        "then exceed TIERFLOW_GPU_MEMORY (Note [Batch growth]); pass the tensors as arguments, or keep one batch "
        "size");
  }
  if (!plan_) return action;
  // The measured step: from one forward to the next (a plan made here: from when it is in force).
  step_starts_.push_back(had_plan ? now_seconds : front.now_seconds());
  if (step_starts_.size() > kMeasuredSteps + 1)
    step_starts_.erase(step_starts_.begin(), step_starts_.end() - static_cast<std::ptrdiff_t>(kMeasuredSteps + 1));
  if (const std::uint64_t grown = grown_batch(planned_elements_, elements); grown && !settings_.forced)
    grow(grown, front);
  if (batch_varies(planned_elements_, elements)) {
    rest_pending_ = false;  // Note [Rest calibration]: the steps are not comparable
    if (phases_.may_replan())
      settle("the batches' sizes vary (Note [Batch growth]): a step's time is not comparable with the plan's "
             "prediction");
  }
  if (phases_.may_replan()) maybe_replan(front);
  maybe_calibrate_rest();
  return action;
}

void PlanDriver::forward_refused() noexcept { phases_.forward_refused(); }

void PlanDriver::act(PhaseAction action, double now_seconds, PlanFrontEnd& front) {
  switch (action) {
    case PhaseAction::kPlanWithoutBlocks: plan_without_blocks(0, front); break;
    case PhaseAction::kPlanFromProfile: plan_from_profile(front); break;
    case PhaseAction::kStartTiming:
      timed_start_ = now_seconds;
      front.start_timing();
      break;
    case PhaseAction::kMeasureAndPlan: measure_and_plan(now_seconds, front); break;
    case PhaseAction::kNone: break;
  }
}

std::uint64_t PlanDriver::size(const InputElements& inputs) {
  // This forward's size against the profiled forward's, their tensors matched by place (Note [Batch growth]).
  std::vector<std::uint64_t> profiled, common;
  std::map<std::string, std::uint64_t> ref(reference_.begin(), reference_.end());
  for (const auto& [place, n] : inputs) {
    if (const auto it = ref.find(place); it != ref.end()) {
      profiled.push_back(it->second);
      common.push_back(n);
    }
  }
  if (!ref.empty() && !inputs.empty() && (common.size() != ref.size() || common.size() != inputs.size()) &&
      !other_inputs_said_) {
    other_inputs_said_ = true;
    log(LogLevel::kWarn, "tierflow: the model is called with other tensors (" + places_repr(inputs) +
                             ") than in the forward its activation plan was profiled on (" + places_repr(reference_) +
                             "): a batch's size is measured on those both have, or on all of its elements when "
                             "none (Note [Batch growth])");
  }
  return batch_size(profiled, common, sum_of(reference_), sum_of(inputs));
}

void PlanDriver::measure_and_plan(double now_seconds, PlanFrontEnd& front) {
  const TimedStepMeasures m = front.measure_timed_step();
  const double step = timed_start_ ? now_seconds - *timed_start_ : 0.0;
  AutoProfile p;
  for (const auto& record : m.blocks) p.file.blocks.push_back(measured_block_profile(record, settings_.traffic));
  p.file.links = m.links;
  // Note [Batch growth]: the timed forward's size (its tables, times and peak), which later ones are measured
  // against.
  reference_ = at_or_empty(inputs_, kTimedForward);
  p.batch_tensor_elements = reference_;
  p.batch_elements = sum_of(reference_);
  // What the model-level hook packed in the timed step: the saved tensors outside the blocks.
  p.file.outside_saved_bytes = m.outside_saved_bytes;
  p.file.outside_largest_bytes = m.outside_largest_bytes;  // their host staging on the way to NVMe
  p.outside_measured = true;
  // Less their round trip (the plan adds it back where it swaps them) and the host's gaps (Note [Re-plan]).
  const double gaps = host_gaps_seconds(m.intervals);
  p.host_gaps_seconds = gaps;
  p.timed_step_seconds = step;
  p.rest_of_step_seconds = rest_of_step_seconds(
      step, m.blocks_forward_seconds + m.blocks_backward_seconds + m.blocks_replay_seconds,
      outside_swap_seconds(m.links, m.outside_saved_bytes), gaps, m.blocks_input_swap_seconds);
  if (m.peak_bytes) {
    p.measured_beside_bytes = m.beside_bytes;
    p.measured_peak_bytes = *m.peak_bytes;
    p.measured_reserved_peak_bytes = m.reserved_peak_bytes.value_or(0);
  }
  p.file.fixed_device_bytes = budgets(p, front).fixed_device_bytes;
  TimedStepSummary t;
  t.step_seconds = step;
  t.blocks_forward_seconds = m.blocks_forward_seconds;
  t.blocks_backward_seconds = m.blocks_backward_seconds;
  t.blocks_replay_seconds = m.blocks_replay_seconds;
  t.blocks_input_swap_seconds = m.blocks_input_swap_seconds;
  t.host_gaps_seconds = gaps;
  t.rest_of_step_seconds = *p.rest_of_step_seconds;
  t.outside_saved_bytes = m.outside_saved_bytes;
  t.measured_peak_bytes = p.measured_peak_bytes;
  t.fixed_device_bytes = p.file.fixed_device_bytes;
  t.links = p.file.links;
  t.blocks = p.file.blocks;
  timed_step_ = t;
  optimizer_ = m.optimizer;
  timed_optimizer_wait_ = std::max(m.optimizer_wait_seconds, 0.0);
  front.write_profile(p);
  std::uint64_t largest = 0;
  for (const auto& [forward, inputs] : inputs_) largest = std::max(largest, size(inputs));
  make_plan(p, largest, front);
}

void PlanDriver::plan_from_profile(PlanFrontEnd& front) {
  // A profile file from before Note [Batch growth]: taken to be for this (the first) forward's size.
  AutoProfile& profile = *loaded_;
  if (!profile.batch_tensor_elements) profile.batch_tensor_elements = at_or_empty(inputs_, phases_.forwards());
  reference_ = *profile.batch_tensor_elements;
  profile.batch_elements = sum_of(reference_);
  make_plan(profile, size(at_or_empty(inputs_, phases_.forwards())), front);
}

Budgets PlanDriver::budgets(const AutoProfile& profile, PlanFrontEnd& front) {
  SessionBudgetInputs in = front.budget_inputs();
  fsdp_gathered_ = tiering::fsdp_gathered_bytes(in.sharded_unit_bytes, in.sharded_root_bytes);
  in.prefetch_bytes = settings_.prefetch_bytes;
  in.optimizer_on_device = settings_.optimizer_on_device;
  in.gradients_offloaded = settings_.gradients_offloaded;
  in.measured_peak_bytes = profile.measured_peak_bytes.value_or(0);
  in.measured_reserved_peak_bytes = profile.measured_reserved_peak_bytes.value_or(0);
  in.outside_saved_bytes = profile.outside_measured ? profile.file.outside_saved_bytes : 0;
  in.outside_largest_bytes = profile.outside_measured ? profile.file.outside_largest_bytes : 0;
  in.batch_ratio = profile.batch_ratio > 0 ? profile.batch_ratio : 1.0;
  in.measured_beside_bytes = profile.measured_beside_bytes.value_or(0);
  return session_budgets(in, profile.file.blocks);
}

std::pair<AutoProfile, std::uint64_t> PlanDriver::for_batch(const AutoProfile& profile, std::uint64_t elements) const {
  const std::uint64_t base = profile.batch_elements;
  const std::uint64_t target = base ? std::max(base, elements) : 0;
  if (!base || target == base) return {profile, base};
  const double ratio = static_cast<double>(target) / static_cast<double>(base);
  AutoProfile out = profile;
  out.file.blocks = blocks_for_batch(profile.file.blocks, ratio);
  out.batch_ratio = ratio;
  // The tensors outside the blocks grow with the batch, each of them too (the logits: tokens x vocab).
  const auto outside = [&](std::uint64_t bytes) {
    return round_half_even(static_cast<double>(profile.outside_measured ? bytes : 0) * ratio);
  };
  out.file.outside_saved_bytes = outside(profile.file.outside_saved_bytes);
  out.file.outside_largest_bytes = outside(profile.file.outside_largest_bytes);
  out.outside_measured = true;
  return {std::move(out), target};
}

void PlanDriver::make_plan(const AutoProfile& base, std::uint64_t elements, PlanFrontEnd& front) {
  const auto [profile, target] = for_batch(base, elements);
  const bool scaled = base.batch_elements != 0 && target != base.batch_elements;
  const Budgets b = budgets(profile, front);
  std::vector<BlockProfile> blocks = profile.file.blocks;
  const Links& links = profile.file.links;
  Plan plan = plan_activations(blocks, links, b);
  std::vector<std::string> why = explain_plan(plan, blocks, links, b);
  // A split is exact only where the suffix matmul gives the full one's bits (Note [Activation plans]).
  if (const auto unsplittable = front.inexact_splits(plan.blocks); !unsplittable.empty()) {
    for (const std::size_t i : unsplittable) blocks.at(i).splittable = false;
    plan = plan_activations(blocks, links, b);
    why = explain_plan(plan, blocks, links, b);
    front.inexact_splits(plan.blocks);
  }
  plan_struct_ = plan;
  plan_blocks_ = blocks;
  DrivenPlan d;
  // Note [Overlap window]: no block's swap waits inside its compute, as far as the device budget allows.
  const PlanWindow window = plan_window(plan, b, settings_.prefetch_bytes);
  d.window_bytes = window.bytes;
  d.window_wanted_bytes = window.wanted_bytes;
  d.predicted_device_peak_bytes = window.peak_bytes;
  // The whole step predicted: the blocks' part priced by the plan, and the rest measured (Note [Re-plan]).
  d.predicted_blocks_seconds = plan.predicted_step_seconds;
  d.rest_of_step_seconds = profile.rest_of_step_seconds.value_or(0.0);
  d.predicted_step_seconds = d.predicted_blocks_seconds + d.rest_of_step_seconds;
  // Its terms (Note [Step prediction]). The rest the timed step measured holds the CPU optimizer's step past
  // backward: that term is the model's (its kernel at the rate the timed step measured, beside the plan's
  // backward) when the rate is known, else what step() waited for it in the timed step, within the rest; the
  // rest term is the remainder, so the terms add up to the whole step predicted above.
  StepPrediction step = predict_step(plan, blocks, links, b, optimizer_, 0.0);
  const bool modelled = optimizer_.on_cpu && optimizer_.params_per_second > 0;
  d.optimizer_model_seconds = modelled ? step.optimizer.exposed_seconds : timed_optimizer_wait_;
  step.optimizer.exposed_seconds = std::min(d.optimizer_model_seconds, d.rest_of_step_seconds);
  step.rest_seconds = d.rest_of_step_seconds - step.optimizer.exposed_seconds;
  step.total_seconds = step.blocks_seconds + step.optimizer.exposed_seconds + step.rest_seconds;
  d.step = step;
  // A profile written before the tensors outside the blocks were measured: they stay as they were planned then,
  // swapped by the model-level hooks unless every block is kept.
  d.outside_measured = profile.outside_measured;
  const bool all_kept = std::all_of(plan.blocks.begin(), plan.blocks.end(),
                                    [](const BlockPlan& bp) { return bp.mode == BlockMode::kKeep; });
  d.outside_kept = d.outside_measured ? plan.outside_kept : all_kept;
  d.keep_all = d.outside_kept && all_kept;
  d.summary = plan.summary();
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) d.lines.push_back(plan.block_line(i));
  d.why = std::move(why);
  d.plan = std::move(plan);
  d.released_cached_bytes = front.apply(d);
  d.batch_elements = target;
  d.profiled_batch_elements = base.batch_elements;
  put_in_force(std::move(d));
  // Note [Rest calibration]: the plan's own steps measure its rest, unless it is for another batch than the one
  // the steps run (a larger one than the profile's: its steps are compared with nothing measured).
  rest_pending_ = settings_.calibrate_rest && !settings_.forced && !scaled;
  profile_ = base;
  planned_elements_ = target;
  if (scaled && phases_.may_replan()) {
    // The calibration compares steps with the timed one: not with a plan for another size.
    settle("the plan is for a larger batch than the profile's (Note [Batch growth])");
  }
  // Note [Plan messages]: a plan in force is one line at info (a warning when it is over budget); its blocks
  // and reasons at debug.
  log(plan_->plan.fits ? LogLevel::kInfo : LogLevel::kWarn, "tierflow activation plan: " + plan_->summary);
  for (const auto& line : plan_->lines) log(LogLevel::kDebug, "tierflow   " + line);
  for (const auto& line : plan_->why) log(LogLevel::kDebug, "tierflow " + line);
}

void PlanDriver::put_in_force(DrivenPlan plan) {
  plan_ = std::move(plan);
  phases_.planned();
  revision_ += 1;
}

void PlanDriver::plan_without_blocks(std::uint64_t elements, PlanFrontEnd& front) {
  // Keep every saved tensor when the first step's fit beside what training holds, else go on swapping them all;
  // for a larger batch than the first, its saved bytes scaled alike (Note [Batch growth]).
  if (!plan_) {
    first_saved_bytes_ = front.first_step_saved_bytes();
    reference_ = at_or_empty(inputs_, kRecordForward);  // what the first step saved was its size's
    elements = size(at_or_empty(inputs_, phases_.forwards()));
  }
  const std::uint64_t first = sum_of(reference_);
  const std::uint64_t target = first ? std::max(first, elements) : 0;
  const std::uint64_t saved = round_half_even(
      static_cast<double>(first_saved_bytes_) * (first ? static_cast<double>(target) / static_cast<double>(first) : 1.0));
  const PlanWithoutBlocks decided = tiering::plan_without_blocks(saved, budgets(AutoProfile{}, front));
  planned_elements_ = target;
  DrivenPlan d;
  d.without_blocks = true;
  d.summary = decided.summary;
  d.keep_all = d.outside_kept = decided.keep_all;  // without blocks everything saved is outside them
  d.outside_bytes = saved;
  d.predicted_device_peak_bytes = decided.predicted_device_peak_bytes;
  d.window_bytes = settings_.prefetch_bytes;
  d.batch_elements = target;
  d.profiled_batch_elements = first;
  put_in_force(std::move(d));
  log(LogLevel::kInfo, "tierflow activation plan: " + decided.summary);
}

void PlanDriver::grow(std::uint64_t elements, PlanFrontEnd& front) {
  // A forward larger than the plan in force is for: plan again for its size, before it runs, from the profile
  // scaled to it; when nothing fits, the plan in force stays and says so (Note [Batch growth]).
  const double ratio = static_cast<double>(elements) / static_cast<double>(planned_elements_);
  if (!settings_.growth_refusal.empty()) {
    refuse_growth(elements, settings_.growth_refusal);
    return;
  }
  char shown[32];
  std::snprintf(shown, sizeof shown, "%.3g", ratio);
  log(LogLevel::kInfo, "tierflow: a batch of " + std::to_string(elements) + " input elements, x" + shown + " the " +
                           std::to_string(planned_elements_) +
                           " the activation plan in force was made for: planning again for it (Note [Batch growth])");
  try {
    if (!plan_->without_blocks && !plan_->plan.blocks.empty()) make_plan(*profile_, elements, front);
    else plan_without_blocks(elements, front);
  } catch (const out_of_memory& e) {
    refuse_growth(elements, std::string("no activation plan fits it: ") + e.what());
    return;
  } catch (const config_error& e) {
    refuse_growth(elements, std::string("no activation plan fits it: ") + e.what());
    return;
  }
  growth_.replans += 1;
  growth_.refused.reset();
  step_starts_.erase(step_starts_.begin(), step_starts_.end() - 1);
}

void PlanDriver::refuse_growth(std::uint64_t elements, const std::string& why) {
  // Said once per size (a larger one tries again) and in the report (Note [Batch growth]).
  growth_.refused = std::make_pair(elements, why);
  planned_elements_ = elements;
  rest_pending_ = false;  // Note [Rest calibration]: the steps run a batch the plan is not for
  if (phases_.may_replan()) settle("a batch larger than the plan's, which stays (Note [Batch growth])");
  log(LogLevel::kWarn, "tierflow: a batch of " + std::to_string(elements) + " input elements, larger than the " +
                           std::to_string(plan_->batch_elements) +
                           " the activation plan in force was made for, which stays and may exceed "
                           "TIERFLOW_GPU_MEMORY: " + why);
}

void PlanDriver::settle(const std::string& why) {
  if (!phases_.may_replan()) return;
  phases_.replan_settled();
  if (plan_) {
    plan_->settled = why;
    revision_ += 1;
  }
  log(LogLevel::kInfo, "tierflow activation plan: no re-plan from here: " + why);
}

void PlanDriver::maybe_replan(PlanFrontEnd& front) {
  // Note [Re-plan]: the first step under a plan is left out: it pins the host memory the plan's swaps need.
  const std::vector<double> judged(step_starts_.begin() + (step_starts_.empty() ? 0 : 1), step_starts_.end());
  const MeasuredBesidePredicted m =
      tiering::measured_beside_predicted(judged, std::nullopt, plan_->predicted_step_seconds, std::nullopt);
  if (!strays_from_prediction(m.step_seconds, m.steps, plan_->predicted_step_seconds)) return;
  phases_.replan_settled();
  const CalibratedFigures cal = calibrate_figures(plan_blocks_, profile_->file.links, budgets(*profile_, front),
                                                  plan_struct_, *m.step_seconds, plan_->rest_of_step_seconds);
  Replanned r;
  r.replanned = cal.calibrated;
  r.why = cal.why;
  r.measured_step_seconds = m.step_seconds;
  r.steps = m.steps;
  r.predicted_step_seconds = plan_->predicted_step_seconds;
  r.link_factor = cal.link_factor;
  r.compute_factor = cal.compute_factor;
  replanned_ = r;
  revision_ += 1;
  if (!cal.calibrated) {
    log(LogLevel::kInfo, "tierflow: no re-plan: " + cal.why);
    return;
  }
  AutoProfile profile = *profile_;
  profile.file.blocks = cal.blocks;
  profile.file.links = cal.links;
  profile.calibrated = ProfileCalibration{cal.link_factor, cal.compute_factor, cal.why};
  log(LogLevel::kInfo, "tierflow: re-planning once: " + cal.why);
  const auto failed = [&](const char* what) {  // the plan in force goes on: nothing was applied
    replanned_->replanned = false;
    replanned_->why = cal.why + "; the re-plan failed, the plan in force stays: " + what;
    log(LogLevel::kWarn, "tierflow: " + replanned_->why);
  };
  try {
    make_plan(profile, 0, front);
  } catch (const out_of_memory& e) {
    failed(e.what());
    return;
  } catch (const config_error& e) {
    failed(e.what());
    return;
  }
  front.write_profile(profile);  // the next run starts from the calibrated figures
  step_starts_.erase(step_starts_.begin(), step_starts_.end() - 1);  // the steps under the new plan from here
}

void PlanDriver::maybe_calibrate_rest() {
  // Note [Rest calibration]: once kRestCalibrationSteps steps ran under the plan after its first
  // kRestCalibrationSkip, the rest of the step is their median less the blocks' predicted part; the steps measured
  // beside the prediction start after.
  if (!rest_pending_ || !plan_ || plan_->without_blocks || !plan_->predicted_step_seconds) return;
  if (step_starts_.size() < kRestCalibrationSkip + kRestCalibrationSteps + 1) return;
  const std::vector<double> judged(step_starts_.begin() + kRestCalibrationSkip, step_starts_.end());
  const MeasuredBesidePredicted m = tiering::measured_beside_predicted(judged, std::nullopt, std::nullopt, std::nullopt);
  if (!m.step_seconds) return;
  rest_pending_ = false;
  DrivenPlan& d = *plan_;
  RestCalibration c;
  c.steps = m.steps;
  c.step_seconds = *m.step_seconds;
  c.timed_rest_seconds = d.rest_of_step_seconds;
  // Blocks priced longer than the whole step (their times measured in a timed step that ran slow): scaled to it,
  // with no rest left.
  if (d.predicted_blocks_seconds > c.step_seconds && d.predicted_blocks_seconds > 0)
    c.blocks_factor = c.step_seconds / d.predicted_blocks_seconds;
  d.rest_calibration = c;
  d.predicted_blocks_seconds *= c.blocks_factor;
  d.rest_of_step_seconds = std::max(0.0, c.step_seconds - d.predicted_blocks_seconds);
  d.predicted_step_seconds = d.predicted_blocks_seconds + d.rest_of_step_seconds;
  if (d.step) {
    StepPrediction& step = *d.step;
    for (double* term : {&step.compute_seconds, &step.activation_copy_seconds, &step.parameter_fetch_seconds,
                         &step.gradient_copy_seconds, &step.backward_seconds})
      *term *= c.blocks_factor;
    step.blocks_seconds = d.predicted_blocks_seconds;
    step.optimizer.exposed_seconds = std::min(d.optimizer_model_seconds, d.rest_of_step_seconds);
    step.rest_seconds = d.rest_of_step_seconds - step.optimizer.exposed_seconds;
    step.total_seconds = step.blocks_seconds + step.optimizer.exposed_seconds + step.rest_seconds;
  }
  revision_ += 1;
  step_starts_.erase(step_starts_.begin(), step_starts_.end() - 1);  // held out: the steps from here
  char line[160];
  std::snprintf(line, sizeof line,
                "tierflow activation plan: the rest of the step %.3g ms over %zu steps under the plan (the timed "
                "step's: %.3g ms); whole step predicted %.3g ms",
                d.rest_of_step_seconds * 1e3, c.steps, c.timed_rest_seconds * 1e3, *d.predicted_step_seconds * 1e3);
  log(LogLevel::kDebug, line);
}

std::uint64_t PlanDriver::kept_bytes() const noexcept {
  if (!profile_ || !plan_) return 0;
  std::uint64_t kept = 0;
  const auto& blocks = profile_->file.blocks;
  for (std::size_t i = 0; i < std::min(blocks.size(), plan_->plan.blocks.size()); ++i)
    if (plan_->plan.blocks[i].mode == BlockMode::kKeep) kept += blocks[i].saved_bytes();
  return kept;
}

MeasuredBesidePredicted PlanDriver::measured_beside_predicted(std::optional<std::uint64_t> peak_reserved_bytes) const {
  std::optional<double> step, peak;
  if (plan_) {
    step = plan_->predicted_step_seconds;
    peak = static_cast<double>(plan_->predicted_device_peak_bytes);
  }
  return tiering::measured_beside_predicted(step_starts_, peak_reserved_bytes, step, peak);
}

// ---- as JSON: the session's plan, the report's plan fields, the profile file (Note [Plan driver]) ----

namespace {

using Json = nlohmann::ordered_json;

template <typename T>
Json or_null(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

Json plan_object(const DrivenPlan& d) {
  Json out = Json::object();
  if (d.without_blocks) {  // without blocks everything saved is outside them
    out["summary"] = d.summary;
    out["blocks"] = Json::array();
    out["lines"] = Json::array();
    out["outside_kept"] = d.outside_kept;
    out["outside_tier"] = to_string(d.outside_kept ? Tier::kGpu : Tier::kHost);
    out["outside_bytes"] = d.outside_bytes;
  } else {
    const Plan& p = d.plan;
    Json blocks = Json::array();
    for (const BlockPlan& b : p.blocks) {
      blocks.push_back({{"mode", to_string(b.mode)}, {"alpha", b.alpha}, {"tier", to_string(b.tier)},
                        {"keep", b.keep}, {"swap", b.swap}, {"recompute", b.recompute}, {"swap_bytes", b.swap_bytes},
                        {"forward_seconds", b.forward_seconds}, {"backward_seconds", b.backward_seconds},
                        {"params", to_string(b.params)}});
    }
    out["blocks"] = std::move(blocks);
    out["lines"] = d.lines;
    out["summary"] = d.summary;
    out["keep_all_step_seconds"] = p.keep_all_step_seconds;
    out["host_bytes"] = p.host_bytes;
    out["nvme_bytes"] = p.nvme_bytes;
    out["fits"] = p.fits;
    out["rest_params"] = to_string(p.rest_params);
    out["outside_kept"] = p.outside_kept;  // the planner's: a profile without outside bytes swaps them anyway
    // Where the model-level hook sends them (Plan::outside_tier): gpu (kept), host or nvme (PackTarget::kOutsideNvme).
    out["outside_tier"] = to_string(p.outside_tier == Tier::kNvme && d.outside_measured ? Tier::kNvme
                                    : d.outside_kept                                 ? Tier::kGpu
                                                                                     : Tier::kHost);
    out["outside_bytes"] = p.outside_bytes;
    out["outside_swap_seconds"] = p.outside_swap_seconds;
    out["outside_staging_bytes"] = p.outside_staging_bytes;  // their host staging to NVMe, in host_bytes
    out["why"] = d.why;
    out["window_wanted_bytes"] = d.window_wanted_bytes;
    out["predicted_blocks_seconds"] = d.predicted_blocks_seconds;
    out["rest_of_step_seconds"] = d.rest_of_step_seconds;
    out["outside_measured"] = d.outside_measured;
    if (d.released_cached_bytes) out["released_cached_bytes"] = *d.released_cached_bytes;
  }
  out["predicted_device_peak_bytes"] = d.predicted_device_peak_bytes;
  out["predicted_step_seconds"] = or_null(d.predicted_step_seconds);
  if (d.step) {
    // Note [Step prediction]: each term's prediction; the front end puts its measurement beside ("measured_s").
    Json terms = Json::object();
    for (const auto& [name, seconds] : step_terms(*d.step)) terms[name] = {{"predicted_s", seconds}};
    out["terms"] = std::move(terms);
    out["optimizer_prediction"] = {{"kernel_seconds", d.step->optimizer.kernel_seconds},
                                   {"busy_seconds", d.step->optimizer.busy_seconds},
                                   {"backward_seconds", d.step->backward_seconds},
                                   {"exposed_seconds", d.step->optimizer.exposed_seconds}};
  }
  // Note [Rest calibration]: the plan's steps the rest came from (none yet: the timed step's).
  out["rest_calibration"] =
      d.rest_calibration ? Json{{"steps", d.rest_calibration->steps},
                                {"step_seconds", d.rest_calibration->step_seconds},
                                {"timed_rest_seconds", d.rest_calibration->timed_rest_seconds},
                                {"blocks_factor", d.rest_calibration->blocks_factor}}
                         : Json(nullptr);
  out["window_bytes"] = d.window_bytes;
  out["batch_elements"] = d.batch_elements;
  out["profiled_batch_elements"] = d.profiled_batch_elements;
  out["settled"] = or_null(d.settled);
  return out;
}

// The plan's figures a report shows, in this order.
constexpr const char* kReportPlanFields[] = {
    "summary",
    // What is saved outside the blocks: kept, or swapped by the model-level hooks (Note [Activation planner]);
    // their host staging on the way to NVMe; the window the plan runs with (Note [Overlap window]).
    "outside_kept", "outside_tier", "outside_bytes", "outside_swap_seconds", "outside_staging_bytes", "window_bytes",
    "window_wanted_bytes",
    "predicted_device_peak_bytes",
    // The whole step: the blocks' part the plan prices and the rest the timed step measured (Note [Re-plan]).
    "predicted_step_seconds", "predicted_blocks_seconds", "rest_of_step_seconds",
    // Note [Rest calibration]: the plan's own steps the rest came from (None: the timed step's rest).
    "rest_calibration",
    // CUDA: what the caching allocator gave back when the plan came in force (Note [Auto plan phases]).
    "released_cached_bytes",
    // Note [Batch growth]: the batch size (input elements) the plan is for, and the profile's.
    "batch_elements", "profiled_batch_elements",
    // Note [Re-plan]: why the steps' measurement may no longer re-plan (None: it still may, or it did).
    "settled",
    // Note [Step prediction]: the whole step term by term (the front end adds each term's measurement).
    "terms", "optimizer_prediction"};

Json links_object(const Links& links) {
  return Json::parse(profile_to_json({}, links, 0))["links"];
}

Json timed_step_object(const TimedStepSummary& t) {
  Json blocks = Json::array();
  for (const BlockProfile& b : t.blocks) {
    blocks.push_back({{"forward_seconds", b.forward_seconds}, {"backward_seconds", b.backward_seconds},
                      {"input_bytes", b.input_bytes}, {"whole_bytes", b.whole_bytes}, {"split_bytes", b.split_bytes},
                      {"cheap_bytes", b.cheap_bytes}, {"transient_bytes", b.transient_bytes},
                      {"split_recompute_seconds", b.split_recompute_seconds},
                      {"cheap_recompute_seconds", b.cheap_recompute_seconds}});
  }
  return {{"step_seconds", t.step_seconds}, {"blocks_forward_seconds", t.blocks_forward_seconds},
          {"blocks_backward_seconds", t.blocks_backward_seconds}, {"blocks_replay_seconds", t.blocks_replay_seconds},
          {"blocks_input_swap_seconds", t.blocks_input_swap_seconds}, {"host_gaps_seconds", t.host_gaps_seconds},
          {"rest_of_step_seconds", t.rest_of_step_seconds}, {"outside_saved_bytes", t.outside_saved_bytes},
          {"measured_peak_bytes", or_null(t.measured_peak_bytes)}, {"fixed_device_bytes", t.fixed_device_bytes},
          {"links", links_object(t.links)}, {"blocks", std::move(blocks)}};
}

}  // namespace

std::string plan_json(const DrivenPlan& plan) { return plan_object(plan).dump(); }

std::string PlanDriver::report_json(std::string_view plan_text) const {
  const Json plan = plan_ ? plan_object(*plan_) : Json::parse(plan_text);
  Json out = Json::object();
  for (const char* k : kReportPlanFields) out[k] = plan.contains(k) ? plan[k] : Json(nullptr);
  Json modes = Json::array(), alpha = Json::array(), params = Json::array();
  for (const auto& b : plan.value("blocks", Json::array())) {
    modes.push_back(b.value("mode", Json(nullptr)));
    alpha.push_back(b.value("alpha", Json(nullptr)));
    params.push_back(b.value("params", Json("gpu")));  // where each block's parameters live between uses
  }
  out["modes"] = std::move(modes);
  out["alpha"] = std::move(alpha);
  out["params"] = std::move(params);
  out["rest_params"] = plan.value("rest_params", Json("gpu"));
  Json replanned(nullptr);  // Note [Re-plan]: the one re-plan, or why there was none
  if (replanned_) {
    const Replanned& r = *replanned_;
    replanned = {{"replanned", r.replanned}, {"why", r.why}, {"measured_step_seconds", or_null(r.measured_step_seconds)},
                 {"steps", r.steps}, {"predicted_step_seconds", or_null(r.predicted_step_seconds)},
                 {"link_factor", r.link_factor}, {"compute_factor", r.compute_factor}};
  }
  out["replanned"] = std::move(replanned);
  out["timed_step"] = timed_step_ ? timed_step_object(*timed_step_) : Json(nullptr);  // none from a profile file
  out["why"] = plan.value("why", Json::array());
  out["fsdp_gathered_bytes"] = fsdp_gathered_;  // FSDP2's gathered copies, in the fixed bytes (0: none)
  Json refused(nullptr);  // Note [Batch growth]: re-plans for larger batches
  if (growth_.refused) refused = {{"batch_elements", growth_.refused->first}, {"why", growth_.refused->second}};
  out["batch_growth"] = {{"replans", growth_.replans}, {"refused", std::move(refused)}};
  out["kept_bytes"] = kept_bytes();  // they never pass through the offloader's counters
  return out.dump();
}

}  // namespace tierflow::tiering
