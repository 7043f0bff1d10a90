// The gradient stream's rules on single tensors, stated on plain facts: which
// parameters and gradients it carries, and which steps share one CPU Adam
// kernel call. GradStream (Note [Gradient streaming] in bindings/) gathers the
// facts from torch's tensors and applies these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/scalar_type.hpp"
#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// A parameter as the stream sees it when it is registered.
struct ParamFacts {
  bool requires_grad = false;
  bool leaf = false;
  bool contiguous = false;
  bool on_device = false;          ///< on the runtime's device
  std::optional<ScalarType> type;  ///< nullopt: a dtype the kernels do not take
};

/// Why the parameter's gradients cannot stream (it then steps in step()), or
/// nullptr when they can: a leaf that requires grad, contiguous, float32,
/// bfloat16 or float16, on the runtime's device.
const char* param_not_streamable(const ParamFacts& p) noexcept;

/// A gradient as backward delivers it, beside its parameter. A fact after one
/// that fails is not read (an undefined or sparse tensor cannot say it).
struct GradFacts {
  bool defined = false;
  bool sparse = false;
  bool contiguous = false;
  std::size_t numel = 0;
  std::size_t param_numel = 0;     ///< its parameter's numel
  std::optional<ScalarType> type;  ///< nullopt: a dtype the kernels do not take
  bool on_device = false;          ///< on the runtime's device
};

/// Why this gradient cannot stream (step() then takes it from p.grad, and names
/// what it refuses there), or nullptr when it can: defined, dense, contiguous,
/// of its parameter's numel, float32, bfloat16 or float16, on the runtime's device.
const char* grad_not_streamable(const GradFacts& g) noexcept;

/// One array of a slot's optimizer state as the front end holds it (a tensor of the Python state).
struct StateArrayFacts {
  bool defined = false;
  bool host = false;        ///< in host memory
  bool contiguous = false;
  std::optional<StateFormat> format;  ///< the moment format its dtype holds (float32: fp32); nullopt: none
  std::size_t bytes = 0;
};

/// The format of moments `exp_avg` and `exp_avg_sq` of `numel` elements when both are contiguous host arrays of
/// one format and moment_bytes each (Note [Optimizer state formats]); nullopt otherwise.
std::optional<StateFormat> moments_format(std::size_t numel, const StateArrayFacts& exp_avg,
                                          const StateArrayFacts& exp_avg_sq);

/// The state the stream steps slot `slot` (of `numel` elements) with, or it throws logic_error naming what is
/// wrong: a contiguous fp32 host master of the parameter's size; both moments contiguous on the host, of one
/// format (TIERFLOW_OPTIMIZER_STATES) and moment_bytes each; max_exp_avg_sq undefined or like the master; the
/// step counter (`step_counter_ok`) a one-element host tensor. Returns the moments' format.
StateFormat check_stream_state(std::size_t slot, std::size_t numel, const StateArrayFacts& master,
                               const StateArrayFacts& exp_avg, const StateArrayFacts& exp_avg_sq,
                               const StateArrayFacts& max_exp_avg_sq, bool step_counter_ok);

/// One parameter's step, as far as sharing a kernel call goes.
struct KernelStep {
  std::int64_t step = 0;  ///< the step number it takes
  AdamOptions options;    ///< its hyperparameters; grad_scale compares as bits (a NaN coefficient groups with itself)
  int group = -1;         ///< its param group, when calls are per group (-1 otherwise)
  bool skip = false;      ///< it steps in no call (held: no memory for its out-of-place step)
};

/// One kernel call per distinct (step number, group, hyperparameters), usually
/// one per bucket: the members (indices into `steps`, in input order) of each
/// call, calls in order of first appearance; skipped steps are in none.
std::vector<std::vector<std::size_t>> group_kernel_calls(const std::vector<KernelStep>& steps);

}  // namespace tierflow::optimizer
