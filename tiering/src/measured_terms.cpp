// See tiering/measured_terms.hpp and Note [Step prediction] in tiering/step_prediction.hpp.
#include "tierflow/tiering/measured_terms.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

namespace {

using Json = nlohmann::ordered_json;

Json parsed(const std::string& text) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    throw config_error(std::string("measured terms: the report is not JSON: ") + e.what());
  }
}

// `j[key]` as a number; `missing` where it is absent, null or not a number (Python's `.get(key) or missing`).
double number(const Json& j, const char* key, double missing = 0.0) {
  if (!j.is_object()) return missing;
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : missing;
}

// `j[key]` as an array (empty where absent or null).
const Json& array(const Json& j, const char* key) {
  static const Json empty = Json::array();
  if (!j.is_object()) return empty;
  const auto it = j.find(key);
  return it != j.end() && it->is_array() ? *it : empty;
}

Json or_null(const std::optional<double>& v) { return v ? Json(*v) : Json(nullptr); }

MeasuredCompute compute_of(const Json& report, const std::vector<std::optional<double>>& replays) {
  const auto timed_at = report.find("timed_step");
  if (timed_at == report.end() || !timed_at->is_object() || timed_at->empty()) return {std::nullopt, "none: no timed step"};
  const Json& timed = *timed_at;
  const auto batch = report.find("batch_elements"), profiled = report.find("profiled_batch_elements");
  if (batch != report.end() && profiled != report.end() && !batch->is_null() && !profiled->is_null() &&
      *batch != *profiled)
    return {std::nullopt, "none: the timed step ran a batch of " + profiled->dump() + " elements, the plan in force "
                          "is for " + batch->dump() + " (Note [Batch growth])"};
  const Json& modes = array(report, "modes");
  const Json& alphas = array(report, "alpha");
  const Json& blocks = array(timed, "blocks");
  double total = 0;
  for (std::size_t i = 0; i < modes.size(); ++i) {
    const std::string mode = modes[i].is_string() ? modes[i].get<std::string>() : std::string();
    if (mode != "recompute" && mode != "split") continue;
    std::optional<double> replay = i < replays.size() ? replays[i] : std::nullopt;
    if (!replay)
      return {std::nullopt, "none: the timed step did not replay block " + std::to_string(i) + ", which the plan replays"};
    if (mode == "split") {
      const Json b = i < blocks.size() ? blocks[i] : Json::object();
      const double forward = number(b, "forward_seconds");
      const double alpha = i < alphas.size() && alphas[i].is_number() ? alphas[i].get<double>() : 0.0;
      const double share = number(b, "split_recompute_seconds") * (1 - alpha) + number(b, "cheap_recompute_seconds");
      *replay *= forward > 0 ? std::min(1.0, share / forward) : 1.0;
    }
    total += *replay;
  }
  const double compute = number(timed, "blocks_forward_seconds") + number(timed, "blocks_backward_seconds");
  return {compute + total, "the timed step's blocks' forward and backward, and the replays the plan in force does "
                           "(a recompute block's measured replay, a split block's share of it; keep and swap none)"};
}

}  // namespace

MeasuredCompute measured_compute(const std::string& report_json, const std::vector<std::optional<double>>& replays) {
  const Json report = parsed(report_json);
  return report.is_object() ? compute_of(report, replays) : MeasuredCompute{std::nullopt, "none: no timed step"};
}

std::string measured_terms_json(const std::string& report_json, const std::vector<std::optional<double>>& replays,
                                const WaitCounters& now, const std::optional<WaitCounters>& then) {
  const Json report = parsed(report_json);
  // Without counters from when the plan came in force, nothing was counted since: no step, no optimizer step.
  const WaitCounters& since = then ? *then : now;
  const std::int64_t steps = now.forwards - since.forwards;
  const std::int64_t opt_steps = now.optimizer_steps - since.optimizer_steps;  // once an optimizer step
  auto per_step = [&](double now_ms, double then_ms) -> std::optional<double> {
    if (steps <= 0) return std::nullopt;
    return (now_ms - then_ms) / 1e3 / static_cast<double>(steps);
  };
  std::optional<double> optimizer, gradients;
  if (then && now.streaming && opt_steps > 0) {
    const double per = static_cast<double>(opt_steps);
    const double step_wait = std::max(0.0, now.step_wait_ms - since.step_wait_ms) / 1e3 / per;
    const double copy_wait = std::max(0.0, now.grad_copy_wait_ms - since.grad_copy_wait_ms) / 1e3 / per;
    gradients = std::min(copy_wait, step_wait);  // a wait before step() began is not the step's
    optimizer = step_wait - *gradients;
  }
  // The Python path's CPU optimizer time inside step() (what the stream left: every parameter with gradient
  // accumulation; all of it without a stream), per optimizer step.
  if (then && now.python_step_ms && since.python_step_ms && opt_steps > 0) {
    const double python = std::max(0.0, *now.python_step_ms - *since.python_step_ms) / 1e3 / static_cast<double>(opt_steps);
    optimizer = optimizer.value_or(0.0) + python;
  }
  std::optional<double> fetches;
  if (then && now.param_wait_ms && since.param_wait_ms) fetches = per_step(*now.param_wait_ms, *since.param_wait_ms);
  const MeasuredCompute compute = report.is_object() ? compute_of(report, replays)
                                                     : MeasuredCompute{std::nullopt, "none: no timed step"};
  const Json measured_at = report.is_object() && report.contains("measured") ? report["measured"] : Json();
  const Json total = measured_at.is_object() && measured_at.contains("step_seconds") ? measured_at["step_seconds"]
                                                                                     : Json(nullptr);
  Json out;
  out["measured"] = {{"compute", or_null(compute.seconds)},
                     {"activation_copies", or_null(per_step(now.activation_wait_ms, since.activation_wait_ms))},
                     {"parameter_fetches", or_null(fetches)},
                     {"gradient_copies", or_null(gradients)},
                     {"optimizer", or_null(optimizer)},
                     {"rest", nullptr},
                     {"total", total}};
  out["over"] = {{"steps", steps},
                 {"optimizer_steps", opt_steps},
                 {"compute", compute.over},
                 {"activation_copies", "the compute's waits for activations coming back and for the copy window, "
                                       "per step"},
                 {"parameter_fetches", "the compute's waits for fetched parameters"},
                 {"gradient_copies", "the CPU optimizer's wait for gradient copies after backward ended, per "
                                     "optimizer step (at most step()'s wait)"},
                 {"optimizer", "step()'s wait for the CPU optimizer less the gradient copies' part, and its Python "
                               "path's steps inside step(), per optimizer step"},
                 {"total", "the median gap between forwards since the plan's own steps (held out)"}};
  return out.dump();
}

OptimizerStepInputs timed_optimizer_inputs(const WaitCounters& before, const WaitCounters& after,
                                           std::uint64_t parameters, std::size_t element_bytes, StateFormat states) {
  OptimizerStepInputs o;
  auto rate = [](double stepped, double seconds) { return seconds > 0 && stepped > 0 ? stepped / seconds : 0.0; };
  if (!after.streaming) {
    if (!after.python_step_ms) return o;  // not a CPUAdamW: nothing on the CPU
    const double seconds = (*after.python_step_ms - before.python_step_ms.value_or(0.0)) / 1e3;
    o.params_per_second = rate(after.adam_elements - before.adam_elements, seconds);
    o.steps_during_backward = false;  // it steps all in step()
  } else {
    const double seconds = (after.kernel_ms - before.kernel_ms) / 1e3;
    const double element = static_cast<double>(element_bytes > 0 ? element_bytes : 4);
    o.params_per_second = rate((after.kernel_grad_bytes - before.kernel_grad_bytes) / element, seconds);
  }
  o.on_cpu = true;
  o.parameters = parameters;
  o.states = states;
  return o;
}

double timed_optimizer_wait_seconds(const WaitCounters& before, const WaitCounters& after) noexcept {
  double seconds = std::max(0.0, after.step_wait_ms - before.step_wait_ms) / 1e3;
  if (after.python_step_ms)  // and the Python path's steps inside step()
    seconds += std::max(0.0, *after.python_step_ms - before.python_step_ms.value_or(0.0)) / 1e3;
  return seconds;
}

std::string measured_beside_predicted_json(const MeasuredBesidePredicted& m, std::optional<std::uint64_t> reserved_peak,
                                           std::optional<std::uint64_t> allocated_peak,
                                           std::optional<double> predicted_peak) {
  auto bytes = [](const std::optional<std::uint64_t>& v) { return v ? Json(*v) : Json(nullptr); };
  Json out;
  out["measured"] = {{"step_seconds", or_null(m.step_seconds)}, {"steps", m.steps},
                     {"device_peak_reserved_bytes", bytes(reserved_peak)},
                     {"device_peak_allocated_bytes", bytes(allocated_peak)}};
  out["step_vs_predicted"] = or_null(m.step_vs_predicted);
  out["peak_vs_predicted"] = or_null(m.peak_vs_predicted);
  out["allocated_peak_vs_predicted"] =
      allocated_peak && predicted_peak && *predicted_peak > 0
          ? Json(static_cast<double>(*allocated_peak) / *predicted_peak)
          : Json(nullptr);
  return out.dump();
}

}  // namespace tierflow::tiering
