// See Note [NVMe optimizer faults] in state_tier.hpp.
#include "tierflow/optimizer/state_tier.hpp"

#include <algorithm>

#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::optimizer {

namespace {

// The pool's blocks are whole pages (Note [Pinned host pool]).
std::uint64_t pool_rounded(std::uint64_t bytes) noexcept {
  constexpr std::uint64_t kPage = allocator::PinnedHostPool::kBlockAlignment;
  return (bytes + kPage - 1) / kPage * kPage;
}

}  // namespace

std::uint64_t state_bytes(const ParamStateShape& state) noexcept {
  return 4ULL * state.numel * (state.amsgrad ? 2 : 1) + 2ULL * moment_bytes(state.format, state.numel);
}

StatePoolNeed state_pool_need(const std::vector<ParamStateShape>& states, bool nvme) {
  TIERFLOW_EXPECTS(!states.empty(), "state_pool_need: no states");
  StatePoolNeed out;
  // A step's gradients on the host and new weights in staging: one block each per moving parameter.
  std::uint64_t moved = 0;
  std::size_t moving = 0;
  for (const auto& s : states) {
    if (s.moved_element_bytes == 0) continue;
    moved += 2 * pool_rounded(static_cast<std::uint64_t>(s.numel) * s.moved_element_bytes);
    ++moving;
  }
  const std::string step_part =
      moving == 0 ? "" : " and one step's gradients and new weights of " + std::to_string(moving) +
                             " parameters in pinned staging (" + format_bytes(moved) + ")";
  if (nvme) {
    std::uint64_t largest = 0;
    for (const auto& s : states) largest = std::max(largest, state_bytes(s));
    out.bytes = 2 * pool_rounded(largest) + moved;
    out.what = "two buffers of the largest parameter's state (" + format_bytes(largest) +
               ") that the states stream through from NVMe" + step_part;
    return out;
  }
  std::uint64_t elements = 0;
  bool amsgrad = false;
  for (const auto& s : states) {
    out.bytes += pool_rounded(state_bytes(s));
    elements += s.numel;
    amsgrad = amsgrad || s.amsgrad;
  }
  out.bytes += moved;
  out.what = "the states of " + std::to_string(states.size()) + " parameters (" + std::to_string(elements) +
             " elements, fp32 master, exp_avg, exp_avg_sq" + (amsgrad ? ", max_exp_avg_sq" : "") +
             (states.front().format == StateFormat::kFp32
                  ? ""
                  : std::string(" with ") + to_string(states.front().format) + " moments") +
             ")" + step_part;
  return out;
}

void check_state_pool(const std::vector<ParamStateShape>& states, bool nvme, std::uint64_t pool_budget_bytes,
                      const std::string& host_memory_setting) {
  if (states.empty()) return;
  const StatePoolNeed need = state_pool_need(states, nvme);
  if (need.bytes <= pool_budget_bytes) return;
  throw out_of_memory("tierflow: the optimizer needs " + format_bytes(need.bytes) +
                      " of pinned host memory for " + need.what + ", more than the pinned pool's budget of " +
                      format_bytes(pool_budget_bytes) + " (TIERFLOW_HOST_MEMORY=" + host_memory_setting +
                      "); raise TIERFLOW_HOST_MEMORY" +
                      (states.front().format == StateFormat::k8bit
                           ? ""
                           : ", keep the moments in 8 bits (TIERFLOW_OPTIMIZER_STATES=8bit, 6 bytes a parameter "
                             "with the master)") +
                      (nvme ? "" : " or put the states on NVMe (TIERFLOW_OFFLOAD_OPTIMIZER=nvme)"));
}

std::string describe_parameter(const std::optional<std::string>& name,
                               const std::optional<std::pair<std::size_t, std::size_t>>& group_and_index,
                               const std::vector<std::int64_t>& shape) {
  std::string label = "None";
  if (name) {
    label = *name;
  } else if (group_and_index) {
    label = "param group " + std::to_string(group_and_index->first) + " index " +
            std::to_string(group_and_index->second);
  }
  std::string dims;
  for (std::size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  return "'" + label + "' [" + dims + "]";
}

std::string nvme_step_error(const std::vector<StepProblem>& problems) {
  TIERFLOW_EXPECTS(!problems.empty(), "nvme_step_error: no problems");
  constexpr std::size_t kNamedUnwritten = 8;
  std::vector<const StepProblem*> lost, kept;
  for (const auto& p : problems) (p.lost ? lost : kept).push_back(&p);
  std::vector<std::string> parts;
  if (!lost.empty()) {
    std::string names;
    for (std::size_t i = 0; i < lost.size(); ++i) names += (i ? ", " : "") + lost[i]->parameter;
    parts.push_back("the state of " + std::to_string(lost.size()) + " parameter(s) could not be read back and is "
                    "lost: " + names + "; opt.state_dict() still saves every intact state (the lost ones marked '" +
                    kLostStateKey + "'): restore these from your last good checkpoint "
                    "(tierflow.CPUAdamW.fill_lost_states)");
  }
  if (!kept.empty()) {
    std::string names;
    for (std::size_t i = 0; i < kept.size() && i < kNamedUnwritten; ++i)
      names += (i ? ", " : "") + kept[i]->parameter;
    parts.push_back("the new state of " + std::to_string(kept.size()) + " parameter(s) could not be written: " +
                    names + (kept.size() > kNamedUnwritten ? " ..." : "") +
                    "; their previous state and weights are kept, and a retry of step() steps only them");
  }
  const std::string& first = lost.empty() ? problems.front().reason : lost.front()->reason;
  std::string text = "NVMe optimizer step: ";
  for (std::size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
  return text + ". The other parameters stepped. First error: " + first;
}

std::string lost_states_refusal(const std::vector<std::string>& parameters) {
  TIERFLOW_EXPECTS(!parameters.empty(), "lost_states_refusal: no parameters");
  std::string names;
  for (std::size_t i = 0; i < parameters.size(); ++i) names += (i ? ", " : "") + parameters[i];
  return "tierflow CPUAdamW.load_state_dict: the state of " + std::to_string(parameters.size()) +
         " parameter(s) was lost when this state dict was saved (" + names + "; '" + kLostStateKey +
         "' marks them); take their states from an earlier checkpoint with "
         "tierflow.CPUAdamW.fill_lost_states(state_dict, earlier) and load that";
}

std::string unfilled_lost_states(const std::vector<std::string>& keys) {
  TIERFLOW_EXPECTS(!keys.empty(), "unfilled_lost_states: no keys");
  std::string list;
  for (std::size_t i = 0; i < keys.size(); ++i) list += (i ? ", " : "") + keys[i];
  return "tierflow CPUAdamW.fill_lost_states: the earlier state dict has no intact state for parameter(s) [" +
         list + "]";
}

std::optional<std::string> offload_gradients_refusal(bool offload_gradients, bool steps_during_backward,
                                                     const std::string& overlap_step,
                                                     const std::string& offload_optimizer) {
  if (!offload_gradients || steps_during_backward) return std::nullopt;
  return "TIERFLOW_OFFLOAD_GRADIENTS=on frees gradients as they stream to the CPU step during backward, which "
         "needs TIERFLOW_OVERLAP_STEP=on (it is " + overlap_step + ") and optimizer states on the host, "
         "TIERFLOW_OFFLOAD_OPTIMIZER=host (it is " + offload_optimizer + "); accepted: those two settings, or "
         "TIERFLOW_OFFLOAD_GRADIENTS=off";
}

std::string grad_scaler_refusal() {
  return "tierflow CPUAdamW: torch.amp.GradScaler cannot see gradients that TIERFLOW_OFFLOAD_GRADIENTS=on has freed "
         "on the device; accepted: bf16 without a scaler (with TIERFLOW_SKIP_NONFINITE=on for inf/NaN steps), or "
         "TIERFLOW_OFFLOAD_GRADIENTS=off with the scaler";
}

}  // namespace tierflow::optimizer
