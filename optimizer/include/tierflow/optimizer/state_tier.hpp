// The CPU AdamW's states as they sit on a tier (TIERFLOW_OFFLOAD_OPTIMIZER:
// the pinned host pool or NVMe): the space they need, checked when the
// optimizer is made, and the error a step that fails part way raises. The
// Python CPUAdamW (bindings/python/tierflow/optim/nvme_states.py) keeps only
// what touches tensors and asks these functions for every decision.
//
// Note [NVMe optimizer faults]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With states on NVMe (TIERFLOW_OFFLOAD_OPTIMIZER=nvme) a step can fail for
// some parameters and not others: a failed write or a full disk keeps that
// parameter's previous state and weight (Note [Optimizer states on NVMe]); a
// state that cannot be read back (a checksum mismatch: the data on disk is
// corrupt) is lost. step() steps every other parameter, counts a step only for
// those that stepped, and raises an error that names the ones that did not
// (nvme_step_error). Each parameter that stepped remembers the gradient it
// stepped with (the same tensor at the same version) and its step count after
// it; a step() that finds both unchanged skips it. So a retry after the fault
// is gone (space freed) steps every parameter exactly once, and the weights
// are those of a run that never failed. A new backward, zero_grad() or a
// loaded state with another step count makes the next step() a new step for
// everyone.
//
// Space and memory are checked when the optimizer is made (at wrap): the host
// pool must hold what the states need (TIERFLOW_HOST_MEMORY; check_state_pool),
// and with states on NVMe the swap files are grown for every state and a
// step's new state (Note [NVMe space] in swap/include/tierflow/swap/nvme_engine.hpp),
// so too little of either is an error there, naming the need, the budget or
// free space and the variable, not in the middle of the first step.
//
// A lost state is marked in state_dict(): its entry is ``{"step": <last good
// step>, kLostStateKey: "<what happened>"}`` with no moments, so a checkpoint
// still saves every intact state. load_state_dict() refuses a state dict with
// such an entry, naming the parameters;
// ``CPUAdamW.fill_lost_states(state_dict, earlier)`` takes their entries from an
// earlier checkpoint (a lost parameter did not step after its last good state,
// so its weight still matches it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// The key that marks a state lost to NVMe corruption in state_dict() (Note [NVMe optimizer faults]).
inline constexpr const char* kLostStateKey = "tierflow_state_lost";

/// What one parameter's optimizer state is made of.
struct ParamStateShape {
  std::size_t numel = 0;  ///< elements of the parameter
  bool amsgrad = false;   ///< its group keeps max_exp_avg_sq too
  /// Bytes per element of its gradient's host copy and of its new weight's pinned staging, which a step
  /// holds beside the states (the parameter's element size for one on the runtime's device; 0 for a CPU
  /// parameter, stepped from p.grad into p in place).
  std::size_t moved_element_bytes = 0;
  /// How its moments are kept (TIERFLOW_OPTIMIZER_STATES; Note [Optimizer state formats]).
  StateFormat format = StateFormat::kFp32;
};

/// Bytes of one parameter's state: the fp32 master, exp_avg and exp_avg_sq in
/// its format (moment_bytes each) and, with amsgrad, an fp32 max_exp_avg_sq.
std::uint64_t state_bytes(const ParamStateShape& state) noexcept;

/// The pinned host memory the states need and what for, in the words of the error.
struct StatePoolNeed {
  std::uint64_t bytes = 0;  ///< whole pool blocks (pages)
  std::string what;         ///< "the states of N parameters (...)" or "two buffers of ..."
};

/// What the pinned pool must hold for one step of `states` (not empty): every
/// state on the host tier, or on the NVMe tier the two buffers the states
/// stream through (two of the largest state: Note [Optimizer states on NVMe]);
/// and, for parameters that move (moved_element_bytes), the step's gradients
/// on the host and new weights in staging, all held at once (Note [Atomic
/// step] in bindings/python/tierflow/optim/adamw.py: everything a step
/// allocates is allocated before anything is written). A budget below this
/// cannot complete a single step: wrap refuses it.
StatePoolNeed state_pool_need(const std::vector<ParamStateShape>& states, bool nvme);

/// Throws out_of_memory naming the need, the pool's budget and
/// TIERFLOW_HOST_MEMORY (`host_memory_setting`, as given) when the pool of
/// `pool_budget_bytes` cannot hold state_pool_need(states, nvme). Nothing to
/// check for no states.
void check_state_pool(const std::vector<ParamStateShape>& states, bool nvme, std::uint64_t pool_budget_bytes,
                      const std::string& host_memory_setting);

/// A parameter as a user knows it, for error messages: its name in the model,
/// else its place ("param group 0 index 3"), else "None"; and its shape:
/// "'layer.weight' [64, 32]".
std::string describe_parameter(const std::optional<std::string>& name,
                               const std::optional<std::pair<std::size_t, std::size_t>>& group_and_index,
                               const std::vector<std::int64_t>& shape);

/// One parameter a step could not step (Note [NVMe optimizer faults]).
struct StepProblem {
  std::string parameter;  ///< describe_parameter's text
  bool lost = false;      ///< its state could not be read back
  std::string reason;     ///< the error that stopped it
};

/// The text of the one io_error for the parameters a step could not step
/// (not empty): the lost ones, all named; the unwritten ones, the first 8
/// named; and the first error, a lost one's when there is one.
std::string nvme_step_error(const std::vector<StepProblem>& problems);

/// The text of load_state_dict's refusal of a state dict whose states of
/// `parameters` (described, not empty) are marked lost, pointing at fill_lost_states.
std::string lost_states_refusal(const std::vector<std::string>& parameters);

/// The text of fill_lost_states' refusal when the earlier state dict has no
/// intact state for the parameters of these keys (as Python prints them, not empty).
std::string unfilled_lost_states(const std::vector<std::string>& keys);

/// TIERFLOW_OFFLOAD_GRADIENTS=on frees gradients as they stream to the CPU step
/// during backward, so it needs those steps: the refusal when
/// `steps_during_backward` is false, naming the two settings' values
/// (`overlap_step`, `offload_optimizer`) and what is accepted; nullopt otherwise.
std::optional<std::string> offload_gradients_refusal(bool offload_gradients, bool steps_during_backward,
                                                     const std::string& overlap_step,
                                                     const std::string& offload_optimizer);

/// The text of step()'s refusal of torch.amp.GradScaler with
/// TIERFLOW_OFFLOAD_GRADIENTS=on: the scaler cannot see the freed gradients.
std::string grad_scaler_refusal();

}  // namespace tierflow::optimizer
