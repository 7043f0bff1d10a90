// See Note [Auto plan phases] in auto_plan.hpp.
#include "tierflow/tiering/auto_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <utility>

namespace tierflow::tiering {

PhaseAction AutoPlanPhases::before_forward() noexcept {
  forwards_ += 1;
  if (forced_ || planned_) return PhaseAction::kNone;
  if (!blocks_) return forwards_ == kTimedForward ? PhaseAction::kPlanWithoutBlocks : PhaseAction::kNone;
  if (loaded_) return PhaseAction::kPlanFromProfile;
  if (forwards_ == kTimedForward) return PhaseAction::kStartTiming;
  if (forwards_ == kPlanForward) return PhaseAction::kMeasureAndPlan;
  return PhaseAction::kNone;
}

OptimizerTraffic optimizer_traffic(const Config& c) noexcept {
  OptimizerTraffic t;
  t.grads_down_in_backward = c.offload_optimizer == OffloadTarget::kHost && c.overlap_step;
  // Parameters on the host between uses get their weights there; their fetches are the plan's (Budgets::params).
  t.weights_up_in_forward = t.grads_down_in_backward && c.weights_return_in_forward &&
                            c.offload_params == OffloadTarget::kNone;
  return t;
}

BlockProfile measured_block_profile(const BlockRecord& r, OptimizerTraffic traffic) noexcept {
  BlockProfile p;
  p.parameter_bytes = r.parameter_bytes;
  p.upload_bytes = traffic.weights_up_in_forward ? r.parameter_bytes : 0;
  p.download_bytes = traffic.grads_down_in_backward ? r.parameter_bytes : 0;
  const double fwd = r.forward_seconds;
  const double total = r.total_flops > 0 ? r.total_flops : 1.0;
  const double split_s = fwd * r.split_flops / total;
  const double attention_s = fwd * r.attention_flops / total;
  p.forward_seconds = fwd;
  p.backward_seconds = r.backward_seconds > 0 ? r.backward_seconds : kBackwardPerForward * fwd;
  p.input_bytes = r.input_bytes;
  p.whole_bytes = r.attention_bytes;
  p.split_bytes = r.split_bytes;
  p.split_recompute_seconds = split_s;
  p.cheap_bytes = r.cheap_bytes;
  p.cheap_recompute_seconds = std::max(fwd - split_s - attention_s, 0.0);
  p.splittable = r.has_split_ops;
  p.replayable = r.replayable;
  p.transient_bytes = kTransientPerInput * r.input_bytes;
  return p;
}

PlanWithoutBlocks plan_without_blocks(std::uint64_t saved_bytes, const Budgets& budgets) {
  auto mib = [](std::uint64_t n) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(n) / (1 << 20));
    return std::string(buf);
  };
  PlanWithoutBlocks p;
  const std::uint64_t peak = budgets.fixed_device_bytes + saved_bytes;
  p.keep_all = peak <= budgets.device_bytes;
  p.predicted_device_peak_bytes = p.keep_all ? peak : budgets.fixed_device_bytes;
  p.summary = "no blocks; the " + mib(saved_bytes) + " a step saves " + (p.keep_all ? "fit" : "do not fit") +
              " (device peak " + mib(peak) + " of " + mib(budgets.device_bytes) + "): " +
              (p.keep_all ? "keep everything" : "swap every saved tensor to the host");
  return p;
}

std::uint64_t fsdp_gathered_bytes(const std::vector<std::uint64_t>& unit_bytes, std::uint64_t root_bytes) noexcept {
  const std::size_t n = unit_bytes.size();
  auto at = [&](std::size_t i) { return i < n ? unit_bytes[i] : std::uint64_t{0}; };
  std::uint64_t most = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t forward = at(i) + at(i + 1);
    const std::uint64_t backward = (i > 0 ? at(i - 1) : 0) + 2 * at(i) + at(i + 1);
    most = std::max({most, forward, backward});
  }
  return root_bytes + most;
}

Budgets session_budgets(const SessionBudgetInputs& in, const std::vector<BlockProfile>& blocks) noexcept {
  std::uint64_t saved = 0, largest = 0;
  for (const auto& b : blocks) {
    saved += b.saved_bytes();
    largest = std::max(largest, b.saved_bytes() + b.transient_bytes);
  }
  const std::uint64_t window = std::min(in.prefetch_bytes, saved);
  const bool fetched = in.params != ParamPolicy::kResident;
  // Parameters and their gradients; fetched parameters are the plan's to count (Budgets::params). Gradients
  // freed once on the host hold the device only until their copy lands: one block's at a time, counted as
  // the largest block's parameters.
  std::uint64_t grads_in_flight = 0;
  for (const auto& b : blocks) grads_in_flight = std::max(grads_in_flight, b.parameter_bytes);
  std::uint64_t fixed = (fetched ? 0 : in.parameter_bytes) +
                        (in.gradients_offloaded ? std::min(grads_in_flight, in.parameter_bytes) : in.parameter_bytes);
  // torch's Adam and AdamW make m and v with zeros_like: in the parameters' dtype (bf16 parameters, bf16 states).
  // An optimizer that keeps more (fp32 masters) shows in the measured peak, on CUDA, below.
  if (in.optimizer_on_device) fixed += 2 * in.parameter_bytes;
  fixed += fsdp_gathered_bytes(in.sharded_unit_bytes, in.sharded_root_bytes);
  // The measured peak held the fetched parameters of its time too: those are the plan's.
  // The allocated peak, not the reserved one: the budget bounds allocated memory (Note [Auto plan phases]).
  const std::uint64_t peak = in.measured_peak_bytes;
  const std::uint64_t measured = fetched ? peak - std::min(peak, in.measured_parameter_peak_bytes) : peak;
  // Note [Batch growth]: the peak was measured at the profile's size, where the blocks were 1/ratio of these;
  // what it held beyond them, beyond the fixed bytes and beyond what was there before the first forward (the
  // logits, the loss's arrays) grows with the batch. At ratio 1: max(fixed, measured - largest - window).
  const double ratio = in.batch_ratio > 0 ? in.batch_ratio : 1.0;
  const auto at_profile = [ratio](std::uint64_t bytes) {
    return static_cast<std::uint64_t>(std::llround(static_cast<double>(bytes) / ratio));
  };
  const std::uint64_t profiled = at_profile(largest) + std::min(in.prefetch_bytes, at_profile(saved));
  if (measured > profiled) {
    const std::uint64_t states = in.optimizer_on_device ? 2 * in.parameter_bytes : 0;
    const std::uint64_t steady = fixed + (in.measured_beside_bytes > states ? in.measured_beside_bytes - states : 0);
    const std::uint64_t rest = measured - profiled;
    const std::uint64_t grows = rest > steady ? rest - steady : 0;
    fixed = std::max(fixed, rest - grows) + static_cast<std::uint64_t>(std::llround(static_cast<double>(grows) * ratio));
  }
  Budgets b;
  b.params = in.params;
  b.param_tier = in.param_tier;
  b.rest_parameter_bytes = fetched ? in.rest_parameter_bytes : 0;
  b.device_bytes = in.device_budget_bytes;
  b.fixed_device_bytes = fixed;
  b.host_bytes = in.host_budget_bytes > in.host_in_use_bytes ? in.host_budget_bytes - in.host_in_use_bytes : 0;
  b.nvme_bytes = in.nvme_available_bytes;
  b.prefetch_bytes = window;
  b.outside_saved_bytes = in.outside_saved_bytes;
  b.outside_largest_bytes = in.outside_largest_bytes;
  return b;
}

std::vector<BlockProfile> blocks_for_batch(const std::vector<BlockProfile>& blocks, double ratio) {
  const auto bytes = [ratio](std::uint64_t b) {
    return static_cast<std::uint64_t>(std::llround(static_cast<double>(b) * ratio));
  };
  std::vector<BlockProfile> out = blocks;
  for (auto& b : out) {
    b.input_bytes = bytes(b.input_bytes);
    b.whole_bytes = bytes(b.whole_bytes);
    b.split_bytes = bytes(b.split_bytes);
    b.cheap_bytes = bytes(b.cheap_bytes);
    b.transient_bytes = bytes(b.transient_bytes);
    b.forward_seconds *= ratio;
    b.backward_seconds *= ratio;
    b.split_recompute_seconds *= ratio;
    b.cheap_recompute_seconds *= ratio;
  }
  return out;
}

std::uint64_t batch_size(const std::vector<std::uint64_t>& profiled, const std::vector<std::uint64_t>& inputs,
                         std::uint64_t profiled_elements, std::uint64_t elements) noexcept {
  if (profiled.size() != inputs.size() || profiled_elements == 0) return elements;
  // The input that grew most; when none grew, the one that shrank most (a shorter batch beside a fixed image).
  double most = 0, least = 0;
  bool any = false;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (profiled[i] == 0) continue;
    const double r = static_cast<double>(inputs[i]) / static_cast<double>(profiled[i]);
    most = any ? std::max(most, r) : r;
    least = any ? std::min(least, r) : r;
    any = true;
  }
  if (!any) return elements;
  const double ratio = most > 1 ? most : least;
  return static_cast<std::uint64_t>(std::llround(ratio * static_cast<double>(profiled_elements)));
}

std::uint64_t grown_batch(std::uint64_t planned_elements, std::uint64_t elements) noexcept {
  return planned_elements > 0 && elements > planned_elements ? elements : 0;
}

bool batch_varies(std::uint64_t planned_elements, std::uint64_t elements) noexcept {
  if (planned_elements == 0 || elements == 0) return false;
  const double p = static_cast<double>(planned_elements), e = static_cast<double>(elements);
  return std::abs(e - p) > kBatchVaries * p;
}

std::uint64_t link_probe_bytes(std::uint64_t host_budget_bytes, std::uint64_t host_in_use_bytes,
                               std::uint64_t most) noexcept {
  const std::uint64_t room = host_budget_bytes > host_in_use_bytes ? host_budget_bytes - host_in_use_bytes : 0;
  return std::max(std::min(most, room / 16) / kProbeGranule * kProbeGranule, kProbeGranule);
}

std::uint64_t nvme_probe_bytes(std::uint64_t available_bytes) noexcept {
  return std::min(kNvmeProbeBytes, available_bytes) / kProbeGranule * kProbeGranule;
}

std::uint64_t next_nvme_probe_bytes(std::uint64_t bytes) noexcept { return bytes / 2 / kProbeGranule * kProbeGranule; }

double median_seconds(std::vector<double> seconds) noexcept {
  if (seconds.empty()) return 0;
  std::sort(seconds.begin(), seconds.end());
  const auto n = seconds.size();
  return n % 2 ? seconds[n / 2] : (seconds[n / 2 - 1] + seconds[n / 2]) / 2;
}

MeasuredBesidePredicted measured_beside_predicted(const std::vector<double>& forward_starts,
                                                  std::optional<std::uint64_t> peak_reserved_bytes,
                                                  std::optional<double> predicted_step_seconds,
                                                  std::optional<double> predicted_peak_bytes) {
  MeasuredBesidePredicted out;
  std::vector<double> gaps;
  for (std::size_t i = 1; i < forward_starts.size(); ++i) gaps.push_back(forward_starts[i] - forward_starts[i - 1]);
  out.steps = gaps.size();
  if (!gaps.empty()) out.step_seconds = median_seconds(std::move(gaps));
  if (out.step_seconds && predicted_step_seconds && *predicted_step_seconds != 0) {
    out.step_vs_predicted = *out.step_seconds / *predicted_step_seconds;
  }
  if (peak_reserved_bytes && predicted_peak_bytes && *predicted_peak_bytes != 0) {
    out.peak_vs_predicted = static_cast<double>(*peak_reserved_bytes) / *predicted_peak_bytes;
  }
  return out;
}

PlanWindow plan_window(const Plan& plan, const Budgets& budgets, std::uint64_t configured_bytes) noexcept {
  PlanWindow w;
  w.bytes = std::max(budgets.prefetch_bytes, configured_bytes);
  w.peak_bytes = plan.predicted_device_peak_bytes;
  // A block's copies to the host start as its forward saves; the block before's may still be in flight.
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const std::uint64_t before = i > 0 ? plan.blocks[i - 1].swap_bytes : 0;
    w.wanted_bytes = std::max(w.wanted_bytes, before + plan.blocks[i].swap_bytes);
  }
  if (w.wanted_bytes <= w.bytes) return w;  // nothing swaps (no window in the peak), or it already fits the window
  // The plan's peak counted budgets.prefetch_bytes; what the window adds beyond it takes the room left.
  const std::uint64_t room = plan.device_budget_bytes > w.peak_bytes ? plan.device_budget_bytes - w.peak_bytes : 0;
  const std::uint64_t grown = std::min(w.wanted_bytes, budgets.prefetch_bytes + room);
  if (grown <= w.bytes) return w;
  w.peak_bytes += grown - budgets.prefetch_bytes;
  w.bytes = grown;
  return w;
}

bool replans(const Config& config) noexcept {
  return config.replan && config.offload_params != OffloadTarget::kAuto;
}

std::string batch_growth_refusal(const Config& config) {
  if (config.offload_params != OffloadTarget::kAuto) return {};
  return "TIERFLOW_OFFLOAD_PARAMS=auto made the blocks its first plan kept on the device resident for good, "
         "which a plan for a larger batch could not undo; make the first batches the longest (or pad to one "
         "length), or set TIERFLOW_OFFLOAD_PARAMS=host (every block fetched) or none";
}

double rest_of_step_seconds(double step_seconds, double blocks_seconds, double outside_seconds,
                            double host_gaps_seconds, double input_swap_seconds) noexcept {
  return std::max(step_seconds - blocks_seconds - outside_seconds - host_gaps_seconds - input_swap_seconds, 0.0);
}

double host_gaps_seconds(std::vector<TimedInterval> intervals) {
  std::stable_sort(intervals.begin(), intervals.end(),
                   [](const TimedInterval& a, const TimedInterval& b) { return a.start < b.start; });
  double gaps = 0;
  for (std::size_t i = 1; i < intervals.size(); ++i) {
    const TimedInterval& prev = intervals[i - 1];
    const TimedInterval& next = intervals[i];
    const bool neighbours = prev.backward == next.backward &&
                            (prev.backward ? next.block + 1 == prev.block : next.block == prev.block + 1);
    if (neighbours) gaps += std::max(next.start - prev.end - next.wait_before, 0.0);
  }
  return gaps;
}

bool strays_from_prediction(std::optional<double> measured_step_seconds, std::size_t steps,
                            std::optional<double> predicted_step_seconds) noexcept {
  if (steps < kReplanAfterSteps || !measured_step_seconds || !predicted_step_seconds || *predicted_step_seconds <= 0)
    return false;
  const double ratio = *measured_step_seconds / *predicted_step_seconds;
  return ratio > 1 + kReplanMargin || ratio < 1 / (1 + kReplanMargin);
}

namespace {

Links scaled(Links l, double f) {
  for (double* v : {&l.d2h, &l.h2d, &l.duplex, &l.nvme_write, &l.nvme_read}) *v *= f;
  return l;
}

std::vector<BlockProfile> scaled(std::vector<BlockProfile> blocks, double f) {
  for (auto& b : blocks) {
    for (double* v : {&b.forward_seconds, &b.backward_seconds, &b.split_recompute_seconds, &b.cheap_recompute_seconds})
      *v *= f;
  }
  return blocks;
}

// The factor in [1/range, range] where `predicted` (monotone in it) meets `target`, by bisection on its
// logarithm; clamped at the end nearer the target when none does.
double solve(const std::function<double(double)>& predicted, double target, bool increasing) {
  double lo = -std::log(kCalibrationRange), hi = std::log(kCalibrationRange);
  for (int i = 0; i < 100; ++i) {
    const double mid = (lo + hi) / 2;
    const bool above = predicted(std::exp(mid)) > target;
    (above == increasing ? hi : lo) = mid;
  }
  return std::exp((lo + hi) / 2);
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g s", s);
  return buf;
}

}  // namespace

CalibratedFigures calibrate_figures(const std::vector<BlockProfile>& blocks, const Links& links,
                                    const Budgets& budgets, const Plan& plan, double measured_step_seconds,
                                    double rest_seconds) {
  CalibratedFigures out;
  out.blocks = blocks;
  out.links = links;
  const double target = measured_step_seconds - rest_seconds;
  const std::string seen = "measured step " + seconds(measured_step_seconds) + ", predicted " +
                           seconds(plan.predicted_step_seconds + rest_seconds) + " (blocks " +
                           seconds(plan.predicted_step_seconds) + " + the rest of the step " + seconds(rest_seconds) +
                           ")";
  const bool keeps_all = std::all_of(plan.blocks.begin(), plan.blocks.end(), [](const BlockPlan& b) {
    return b.mode == BlockMode::kKeep && b.params == Tier::kGpu;
  }) && plan.rest_params == Tier::kGpu && (plan.outside_kept || plan.outside_bytes == 0);
  if (keeps_all) {
    out.why = seen + ": the plan keeps every block, its parameters and what is saved outside the blocks, the "
                     "fastest plan whatever the times";
    return out;
  }
  if (target <= 0) {
    out.why = seen + ": the rest of the step alone is longer than the measured step; nothing to calibrate";
    return out;
  }
  auto step_with = [&](const std::vector<BlockProfile>& b, const Links& l) {
    return evaluate_plan(b, l, budgets, plan.blocks, plan.rest_params, plan.outside_tier).predicted_step_seconds;
  };
  auto with_links = [&](double f) { return step_with(blocks, scaled(links, f)); };
  const double slowest = with_links(1 / kCalibrationRange), fastest = with_links(kCalibrationRange);
  char buf[64];
  if (slowest > fastest && target >= fastest && target <= slowest) {
    out.link_factor = solve(with_links, target, /*increasing=*/false);
    out.links = scaled(links, out.link_factor);
    std::snprintf(buf, sizeof buf, "%.3g", out.link_factor);
    out.why = seen + ": every link speed x" + buf + " explains it";
  } else {
    auto with_compute = [&](double f) { return step_with(scaled(blocks, f), links); };
    const double f = solve(with_compute, target, /*increasing=*/true);
    std::snprintf(buf, sizeof buf, "%.3g", f);
    const std::string lead = seen + ": " + (slowest > fastest ? "no link speed explains it; " :
                                                                "the plan's transfers are hidden; ");
    if (std::abs(with_compute(f) - target) > 1e-3 * target) {  // clamped at the range's end: nothing explains it
      out.why = lead + "nor does a compute factor within the calibration's range (x" + buf + " at its end)";
      return out;
    }
    out.compute_factor = f;
    out.blocks = scaled(blocks, f);
    out.why = lead + "every block's compute x" + buf;
  }
  out.calibrated = true;
  return out;
}

}  // namespace tierflow::tiering
