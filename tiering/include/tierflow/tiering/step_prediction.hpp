// The whole training step predicted, term by term, torch-free: the blocks'
// compute, what their copies leave exposed (activations, parameters,
// gradients), and the CPU optimizer's step as far as it sticks out past
// backward (Note [Step prediction]).
//
// Note [Step prediction]
// ~~~~~~~~~~~~~~~~~~~~~~
// The planner predicts the blocks' forward and backward (Note [Activation
// planner]); a step also holds the CPU optimizer. predict_step takes a plan
// apart into terms that add up to the whole step:
//   compute             the blocks' forward, backward and replays (recompute)
//                       alone: the model with every link infinitely fast
//   activation copies   what the swaps leave exposed: the model with the
//                       activations' copies only (no parameter fetched, no
//                       optimizer traffic), less compute; with the round trip
//                       of what is saved outside the blocks
//   parameter fetches   what fetched parameters (TIERFLOW_OFFLOAD_PARAMS) and
//                       the optimizer's weights coming back add on top: the
//                       model with them, less the one before; the rest unit's
//                       fetches included
//   gradient copies     what the gradients going device->host add on top (and
//                       the link slowed beside the CPU kernel): the plan's
//                       figure less the one before
//   CPU optimizer       exposed = busy - backward when the optimizer steps
//                       during backward (the step engine steps each bucket as
//                       its gradients land; Note [Gradient streaming]), never
//                       below 0: a CPU step shorter than backward is hidden;
//                       without steps during backward (TIERFLOW_OFFLOAD_
//                       OPTIMIZER=nvme steps in step(): Note [Optimizer states
//                       on NVMe]) all of busy. busy = max(kernel, NVMe) with
//                       kernel = parameters / rate and NVMe = the states read
//                       at nvme_read plus written at nvme_write (double
//                       buffered: the reads and writes overlap the kernel,
//                       not each other); backward = the plan's blocks'
//                       backward phases
//   rest of the step    what no model here predicts (auto: measured at the
//                       timed step, Note [Auto plan phases]); 0 in the CLI
// Each of the first four is the difference of two evaluations of the same
// model (evaluate_plan), so they add up to the plan's figure exactly and no
// formula of the planner is written twice; the order is fixed (activations,
// then parameters, then gradients), so a phase bound by the link is charged to
// what came first.
//
// The CPU AdamW's rate (parameters a second) is given (--cpu-adam-rate, for
// states in fp32) or measured here with tierflow's own kernel in the chosen
// format (optimizer::measure_cpu_adam_rate, installed by the bindings through
// set_cpu_adam_rate_source). The kernel is bound by memory on a many-core
// host, so a rate known in one format is scaled to another by the bytes a
// parameter the step moves (cpu_adam_step_bytes_per_param: master read and
// written, m and v in the format read and written, the gradient in and the
// weight out; gpu_offload_predict.py's memory floor).
//
// In `auto` (PlanDriver, Note [Plan driver]) the rest is what the timed step
// measured beside its blocks (Note [Re-plan]); it holds the CPU optimizer's
// step past backward, so that term comes out of the rest: the model's excess
// at the rate the timed step's kernel ran (its gradient bytes over its time)
// when known, else step()'s wait for the worker in the timed step, never more
// than the rest. The terms then add up to predicted_step_seconds.
// report()["plan"]["terms"] puts each beside its measurement: per forward
// since the plan came in force (the forward it came in before included), the
// compute's waits for activations (prefetch stalls, the copy window) and for
// fetched parameters; per optimizer step, step()'s waits for the CPU
// optimizer, split in two: the worker's wait for gradient copies after the
// backward ended (StepEngineStats::grad_copy_wait_ns, Note [Stream timeline];
// at most step()'s wait) is the gradient copies' term, the rest the
// optimizer's; the blocks' compute as the timed step measured it; the
// measured step; None where nothing counts a term apart (the rest). benchmarks/plan_prediction_check.py gives predicted / measured per
// mode over several runs. The rest (and with it the whole step) comes from the
// plan's own steps once they ran, compared with the steps after (Note [Rest
// calibration]); tiny preset, 5 fresh runs a mode, 20 held-out steps each,
// min / median / max of predicted / measured on 2 cores shared with other
// builds (load 2.4-3.3; benchmarks/results/plan_prediction_tiny_*.json):
//   polite       keep 0.98/1.05/1.50  tight 0.92/0.95/1.01  cpu-adam 0.63/
//                1.00/1.37  tight-cpu 0.98/1.05/1.42  params 0.80/0.95/1.18
//   adversarial  keep 0.95/1.16/1.41  tight 0.74/0.97/1.17  cpu-adam 1.05/
//                1.13/1.24  tight-cpu 0.98/1.01/1.11  params 0.92/0.97/1.00
// Every median within 25%; the runs beyond it are single runs whose held-out
// steps met a neighbour's build (from the timed step alone it was 0.38-2.60,
// cpu-adam a steady 1.4x).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/core/state_format.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// Bytes a parameter one CPU AdamW step moves with moments in `states` and parameters (gradients, weights) of
/// `dtype_bytes`: master (4) and both moments read and written, the gradient read and the weight written.
double cpu_adam_step_bytes_per_param(StateFormat states, int dtype_bytes) noexcept;

/// A CPU AdamW rate known in one format, as another would step (Note [Step prediction]: scaled by the bytes).
double cpu_adam_rate_in(double params_per_second, StateFormat known_in, StateFormat wanted, int dtype_bytes) noexcept;

/// The CPU optimizer as the step prediction sees it.
struct OptimizerStepInputs {
  bool on_cpu = false;                    ///< TIERFLOW_OFFLOAD_OPTIMIZER host or nvme: the CPU AdamW steps
  std::uint64_t parameters = 0;           ///< parameters it steps
  double params_per_second = 0;           ///< its kernel's rate in `states` (0: unknown, not predicted)
  StateFormat states = StateFormat::kFp32;
  bool steps_during_backward = true;      ///< the step engine steps buckets as their gradients land
  std::uint64_t nvme_state_bytes = 0;     ///< states on NVMe, read and written each step (0: on the host)
  double nvme_read = 0, nvme_write = 0;   ///< bytes a second (0: unknown, the NVMe part not predicted)
};

/// The CPU optimizer's part of the step (Note [Step prediction]).
struct OptimizerStepTimes {
  double kernel_seconds = 0;      ///< parameters / rate
  double nvme_read_seconds = 0;   ///< the states read from NVMe
  double nvme_write_seconds = 0;  ///< ... and written back
  double busy_seconds = 0;        ///< max(kernel, NVMe read + write)
  double exposed_seconds = 0;     ///< what sticks out past backward (all of busy without steps during backward)
};

/// The optimizer's times beside a backward of `backward_seconds`. A rate of 0 is unknown: that part is 0 (not
/// predicted); config_error for a negative or non-finite rate.
OptimizerStepTimes optimizer_step_times(const OptimizerStepInputs& optimizer, double backward_seconds);

/// The whole step, term by term (Note [Step prediction]); the terms add up to total_seconds.
struct StepPrediction {
  double compute_seconds = 0;            ///< the blocks' forward, backward and replays alone
  double activation_copy_seconds = 0;    ///< exposed by the activations' swaps (and the outside round trip)
  double parameter_fetch_seconds = 0;    ///< exposed by fetched parameters and weights coming back
  double gradient_copy_seconds = 0;      ///< exposed by gradients going device->host
  double blocks_seconds = 0;             ///< the four above: the plan's figure
  double backward_seconds = 0;           ///< the blocks' backward phases (what the CPU step overlaps)
  OptimizerStepTimes optimizer;          ///< optimizer.exposed_seconds is the term
  double rest_seconds = 0;               ///< what no model here predicts (auto: measured)
  double total_seconds = 0;              ///< blocks + optimizer exposed + rest
};

/// The step of `plan` (made by plan_activations or evaluate_plan from `blocks`, `links` and `budgets`) with
/// `optimizer` and `rest_seconds` measured outside the model.
StepPrediction predict_step(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                            const Budgets& budgets, const OptimizerStepInputs& optimizer, double rest_seconds = 0);

/// The terms by name, in a fixed order: compute, activation_copies, parameter_fetches, gradient_copies,
/// optimizer (exposed), rest, total.
std::vector<std::pair<std::string, double>> step_terms(const StepPrediction& p);

/// One line per term, as the plan command prints them.
std::vector<std::string> step_prediction_lines(const StepPrediction& p, const OptimizerStepInputs& optimizer);

/// A function that measures the CPU AdamW's parameters a second with moments in `states` on this machine.
using CpuAdamRateSource = double (*)(StateFormat states);
/// Installs the measurement (the bindings install optimizer::measure_cpu_adam_rate); nullptr removes it.
void set_cpu_adam_rate_source(CpuAdamRateSource source) noexcept;
/// The rate for `states`: `given` (0: unknown) scaled from fp32 by cpu_adam_rate_in, else the installed source's
/// measurement (memoized per format), else 0.
double cpu_adam_rate(double given, StateFormat states, int dtype_bytes);

}  // namespace tierflow::tiering
