#include "tierflow/optimizer/step_plan.hpp"

#include <cctype>
#include <iomanip>
#include <sstream>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/state_placement.hpp"
#include "tierflow/optimizer/state_tier.hpp"
#include "tierflow/tiering/tiers.hpp"

namespace tierflow::optimizer {

bool operator==(const PlanRoom& a, const PlanRoom& b) noexcept {
  return a.in_force == b.in_force && a.predicted_peak_bytes == b.predicted_peak_bytes;
}

PlanRoom plan_room(bool forced, bool has_plan, std::int64_t predicted_peak_bytes) noexcept {
  // Profiling: no plan in force; it is made from a timed step, which must not miss the share's states.
  if (!forced && !has_plan) return PlanRoom{false, 0};
  return PlanRoom{true, has_plan ? predicted_peak_bytes : 0};
}

StepWindow WindowWatch::seen(bool carries, std::uint64_t kernel_grad_bytes, std::uint64_t pinned_slabs,
                             double last_backward_ms) noexcept {
  StepWindow w;
  w.streamed = carries && kernel_grad_bytes > stepped_bytes_;
  w.backward_ms = last_backward_ms;
  w.pool_grew = pinned_slabs != slabs_;
  stepped_bytes_ = kernel_grad_bytes;
  slabs_ = pinned_slabs;
  return w;
}

bool share_due(GpuShareChoice& choice, const StepWindow& window, const PlanRoom& room) noexcept {
  // Not in force: the step is not counted, for the plan is made from a timed step that must see the share.
  if (!choice.pending() || !room.in_force) return false;
  return choice.choose_now(window.streamed, window.backward_ms, window.pool_grew);
}

std::int64_t share_took_bytes(const std::vector<ShareCandidate>& candidates, const std::vector<bool>& on_gpu) {
  TIERFLOW_EXPECTS(candidates.size() == on_gpu.size(), "share_took_bytes: one choice per candidate");
  bool any_16bit = false;
  std::size_t moved = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    any_16bit = any_16bit || candidates[i].is_16bit;
    if (candidates[i].streamed && on_gpu[i]) moved += candidates[i].numel;  // the others have no state to move
  }
  return static_cast<std::int64_t>(moved * gpu_share_bytes_per_element(any_16bit));
}

std::string shards_refusal(const Config& settings, std::size_t sharded, std::size_t params,
                           const std::vector<std::string>& plain, bool host_shards) {
  if (sharded == 0) return {};
  if (sharded != params) {
    std::string names;
    for (std::size_t i = 0; i < plain.size() && i < 3; ++i) names += (i ? ", '" : "'") + plain[i] + "'";
    return "tierflow's CPU optimizer: " + std::to_string(sharded) + " of its " + std::to_string(params) +
           " parameters are FSDP2's DTensor shards and " + std::to_string(plain.size()) + " are not (" + names +
           (plain.size() > 3 ? " and more" : "") + "): the model is only partly under fully_shard; accepted: "
           "fully_shard on the model too (its root), or TIERFLOW_OFFLOAD_OPTIMIZER=none";
  }
  const std::string why = tiering::fsdp_settings_refusal(settings, true, host_shards);  // ends with what FSDP2 accepts
  return why.empty() ? why : "tierflow's CPU optimizer over FSDP2's shards: " + why;
}

std::string gpu_share_format_note(std::size_t parameters, StateFormat format) {
  if (format == StateFormat::kFp32) return {};
  const std::string f = to_string(format);
  return "tierflow: the CPU optimizer's GPU share (" + std::to_string(parameters) + " parameters) keeps fp32 moments "
         "on the device, not TIERFLOW_OPTIMIZER_STATES=" + f + ": its CUDA AdamW is torch's fused AdamW bit for bit in "
         "fp32, and its room was planned at 8 bytes of moments an element";
}

namespace {

StateFormat keyword_state_format(const std::optional<std::string>& keyword, StateFormat setting) {
  if (!keyword) return setting;
  const auto first = keyword->find_first_not_of(" \t\n\r");
  std::string name;  // stripped, lower-cased
  if (first != std::string::npos) name = keyword->substr(first, keyword->find_last_not_of(" \t\n\r") + 1 - first);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const auto f = parse_state_format(name);
  if (!f) {
    throw config_error("tierflow CPUAdamW: optimizer_states='" + *keyword +
                       "' (TIERFLOW_OPTIMIZER_STATES); accepted: fp32, bf16, 8bit");
  }
  return *f;
}

std::string fraction_setting(const Config& settings, bool sharded) {
  if (sharded) return "0";  // none of FSDP2's shards: an explicit fraction is refused with them (fsdp_settings_refusal)
  if (settings.gpu_optimizer_fraction_auto) return "auto";
  std::ostringstream text;
  text << std::setprecision(17) << settings.gpu_optimizer_fraction;  // reads back to the same double
  return text.str();
}

}  // namespace

StepPlan::StepPlan(const Config& settings, const std::optional<std::string>& keyword_format, bool sharded)
    : format_(keyword_state_format(keyword_format, settings.optimizer_states)),
      nvme_(adamw_state_tier(settings.offload_optimizer) == Tier::kNvme),
      sharded_(sharded),
      overlap_setting_(settings.overlap_step),
      skip_nonfinite_(settings.skip_nonfinite),
      overlap_(settings.overlap_step && !nvme_),  // states on NVMe stream through pinned memory in step()
      gpu_share_(fraction_setting(settings, sharded)) {
  if (sharded_ && overlap_) {
    overlap_ = false;
    why_off_ = "FSDP2's shards step during backward under tierflow.wrap only, which finds the model's FSDP2 units: "
               "every shard steps in step()";
  }
  const auto refusal = offload_gradients_refusal(settings.offload_gradients, overlap_,
                                                 settings.overlap_step ? "on" : "off",
                                                 std::string(to_string(settings.offload_optimizer)));
  if (refusal) throw config_error(*refusal);
}

void StepPlan::check_amsgrad(bool amsgrad, std::size_t group) const {
  if (!amsgrad || format_ == StateFormat::kFp32) return;
  const std::string f = to_string(format_);
  throw config_error("tierflow CPUAdamW: param group " + std::to_string(group) +
                     " has amsgrad=True, and amsgrad keeps fp32 moments; TIERFLOW_OPTIMIZER_STATES=" + f +
                     " (keyword optimizer_states=" + f + ") is refused with it (accepted: fp32)");
}

void StepPlan::check_group_sharding(bool group_sharded) const {
  if (group_sharded == sharded_) return;
  throw config_error(std::string("CPUAdamW.add_param_group: the new group's parameters are ") +
                     (group_sharded ? "FSDP2's DTensor shards and the optimizer's are not"
                                    : "not DTensors and the optimizer steps FSDP2's shards") +
                     "; accepted: one optimizer for the FSDP2 model's shards, another for other parameters");
}

bool StepPlan::stop_steps_during_backward(const std::string& why) {
  if (!overlap_ || !why_off_.empty()) return false;
  why_off_ = why.empty() ? std::string("turned off") : why;
  return true;
}

bool StepPlan::stream_shards() noexcept {
  if (!sharded_ || !overlap_setting_ || nvme_) return false;
  overlap_ = true;
  why_off_.clear();
  return true;
}

ParamRoute StepPlan::route(const RouteFacts& p) const noexcept {
  if (!p.requires_grad || p.carried) return ParamRoute::kStepInStep;
  if (sharded_) return p.kernel_dtype ? ParamRoute::kFeed : ParamRoute::kStepInStep;  // the local shard steps
  if (p.on_device && p.contiguous && p.kernel_dtype && !p.in_gpu_share) return ParamRoute::kStream;
  return ParamRoute::kStepInStep;  // a CPU model beside a device runtime, strided, or the GPU share's
}

StepPath StepPlan::path(bool streaming, bool finite) const noexcept {
  if (skip_nonfinite_ && !finite) return StepPath::kSkipped;
  if (streaming) return StepPath::kStreamed;
  return nvme_ ? StepPath::kNvme : StepPath::kHost;
}

WeightTarget StepPlan::weight_target(bool has_home, bool in_host_memory, bool contiguous) noexcept {
  if (has_home) return WeightTarget::kHome;
  // In place or into the parameter alike: the kernel writes host memory that is the parameter's.
  const ParamLayout layout{in_host_memory, false, contiguous};
  return weight_update(layout) == WeightUpdate::kStaged || !contiguous ? WeightTarget::kStaging
                                                                       : WeightTarget::kParameter;
}

}  // namespace tierflow::optimizer
