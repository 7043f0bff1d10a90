// What the runtime measured of each term of the step, beside the plan's prediction (Note [Step prediction]):
// the counters the front end reads (activation and parameter waits, step()'s wait for the CPU optimizer and its
// worker's wait for gradient copies, the kernel's time), per step since the plan came in force, and the blocks'
// compute as the timed step measured it; and the CPU optimizer as the timed step measured it. Torch-free: the
// front end (AutoPlanner in bindings/python/tierflow/activations/autoplan.py) reads the counters, this does the
// arithmetic and writes the report's parts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/state_format.hpp"
#include "tierflow/tiering/auto_plan.hpp"
#include "tierflow/tiering/step_prediction.hpp"

namespace tierflow::tiering {

/// What the runtime counts of the step's waits, cumulative (Note [Step prediction]).
struct WaitCounters {
  std::int64_t forwards = 0;                ///< forwards so far (one a step)
  std::int64_t optimizer_steps = 0;         ///< optimizer steps so far (several forwards each: accumulation)
  std::optional<double> param_wait_ms;      ///< the compute's waits for fetched parameters (none: no fetches)
  double activation_wait_ms = 0;            ///< the compute's waits for activations coming back and the window
  double step_wait_ms = 0;                  ///< step()'s wait for the CPU optimizer
  double grad_copy_wait_ms = 0;             ///< the optimizer's worker's wait for gradient copies after backward
  double kernel_ms = 0;                     ///< the CPU optimizer kernel's time
  double kernel_grad_bytes = 0;             ///< the gradient bytes it stepped
  bool streaming = false;                   ///< a gradient stream runs (the step engine steps during backward)
  std::optional<double> python_step_ms;     ///< a CPUAdamW's Python path inside step() (none: not one)
  double adam_elements = 0;                 ///< the parameters the runtime's CPU Adam kernels stepped
};

/// The blocks' compute as the timed step measured it, and what it is over (or why there is none).
struct MeasuredCompute {
  std::optional<double> seconds;
  std::string over;
};

/// The blocks' compute from a plan's report (`report_json`: its timed_step, modes, alpha, batch_elements and
/// profiled_batch_elements) with the replays the plan in force does: the timed step replayed every block
/// (`replays`: each block's measured replay seconds, none where none was); the plan replays a recompute block
/// whole, a split block its share ((split * (1 - alpha) + cheap) / forward of the measured replay), keep and swap
/// none. None without a timed step, after a batch-growth re-plan (the timed step ran another batch), and when the
/// plan replays a block the timed step did not.
MeasuredCompute measured_compute(const std::string& report_json, const std::vector<std::optional<double>>& replays);

/// Each term's measurement (report()["plan"]["terms"][name]["measured_s"]) from the counters `now` and when the
/// plan came in force (`then`; none: a plan given by hand, nothing counted since), as JSON: {"measured": {term:
/// seconds or null}, "over": {what each is over}} (Note [Step prediction]). `report_json` as measured_compute's,
/// with measured.step_seconds (the total). Per step: activation and parameter waits; per optimizer step: step()'s
/// wait split into the gradient copies' (the worker's wait, at most all of it) and the optimizer's (the rest, and
/// the Python path's steps inside step()).
std::string measured_terms_json(const std::string& report_json, const std::vector<std::optional<double>>& replays,
                                const WaitCounters& now, const std::optional<WaitCounters>& then);

/// The CPU optimizer as the timed step measured it (counters `before` and `after` it) for `parameters` of
/// `element_bytes` with moments in `states`: with a gradient stream, its kernel's rate (the gradient bytes it
/// stepped over its time), stepping during backward; without one, a CPUAdamW steps all in step() at the rate its
/// Python path stepped (adam_elements over python_step_ms); neither: not on the CPU.
OptimizerStepInputs timed_optimizer_inputs(const WaitCounters& before, const WaitCounters& after,
                                           std::uint64_t parameters, std::size_t element_bytes, StateFormat states);

/// step()'s wait for the CPU optimizer in the timed step, and the Python path's steps inside step(), seconds.
double timed_optimizer_wait_seconds(const WaitCounters& before, const WaitCounters& after) noexcept;

/// The report's measurement beside the plan's prediction (Note [Auto plan phases]) as JSON: {"measured":
/// {step_seconds, steps, device_peak_reserved_bytes, device_peak_allocated_bytes}, step_vs_predicted,
/// peak_vs_predicted (the reserved peak's), allocated_peak_vs_predicted (the plan budgets allocated memory: its
/// own ratio; null without an allocated peak or a predicted one)}. The peaks are CUDA's (none elsewhere).
std::string measured_beside_predicted_json(const MeasuredBesidePredicted& m, std::optional<std::uint64_t> reserved_peak,
                                           std::optional<std::uint64_t> allocated_peak,
                                           std::optional<double> predicted_peak);

}  // namespace tierflow::tiering
