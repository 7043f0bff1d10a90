// See Note [C++ block actions] in block_actions.hpp.
#include "tierflow/tiering/block_actions.hpp"

#include <algorithm>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

std::string_view to_string(BlockAction a) noexcept {
  switch (a) {
    case BlockAction::kKeep: return "keep";
    case BlockAction::kSwapHost: return "swap-host";
    case BlockAction::kSwapNvme: return "swap-nvme";
    case BlockAction::kRecompute: return "recompute";
  }
  return "?";
}

BlockAction block_action_from_config(const Config& config) noexcept {
  switch (config.offload_activations) {
    case OffloadTarget::kNone: return BlockAction::kKeep;
    case OffloadTarget::kNvme: return BlockAction::kSwapNvme;
    case OffloadTarget::kHost:
    case OffloadTarget::kRecompute:  // every block recomputed from its swapped input: the floor
    case OffloadTarget::kAuto: return BlockAction::kSwapHost;
  }
  return BlockAction::kSwapHost;
}

BlockAction block_action_from_plan(const BlockPlan& plan) noexcept {
  if (plan.mode == BlockMode::kKeep) return BlockAction::kKeep;
  // swap, split and recompute all free the block's device memory until its backward; C++ has one way to
  // do that (Note [C++ block actions]): the input to the plan's tier, the rest recomputed.
  return plan.tier == SwapTier::kNvme ? BlockAction::kSwapNvme : BlockAction::kSwapHost;
}

BlockAction block_call_action(std::size_t block, BlockAction planned, bool rerun_refused, bool params_fetched,
                              bool automatic) {
  if (rerun_refused && !params_fetched) return BlockAction::kKeep;
  if (planned != BlockAction::kKeep || !params_fetched) return planned;
  if (automatic) return BlockAction::kRecompute;
  throw config_error("BlockOffload: block " + std::to_string(block) + " is kKeep, but its parameters are "
                     "fetched from the host (offload_parameters): autograd would hold them until backward; "
                     "accepted for such a block: kSwapHost, kSwapNvme or kRecompute");
}

void check_param_tier(Tier tier) {
  if (tier != Tier::kHost)
    throw config_error(std::string("BlockOffload::offload_parameters: tier '") + std::string(to_string(tier)) +
                       "'; accepted: host (the NVMe tier for parameters is not available from C++ yet)");
}

std::pair<std::vector<ParamUnit>, ParamScheduleOptions> block_param_units(
    const BlockActionTable& actions, const std::vector<std::vector<ParamRef>>& params, Tier tier) {
  check_param_tier(tier);
  std::vector<ParamUnit> units;
  ParamScheduleOptions o;
  for (std::size_t b = 0; b < params.size(); ++b) {
    ParamUnit u;
    u.residence = actions.action(b) == BlockAction::kKeep ? Tier::kGpu : tier;
    u.params = params[b];
    std::uint64_t bytes = 0;
    for (const ParamRef& p : params[b]) bytes += p.bytes;
    if (u.residence != Tier::kGpu) o.prefetch_bytes = std::max(o.prefetch_bytes, bytes);  // one block ahead
    units.push_back(std::move(u));
  }
  units.push_back(ParamUnit{});  // the rest unit: the trainer's own, where it put them
  return {std::move(units), o};
}

BlockActionTable::BlockActionTable(BlockAction default_action, bool has_nvme_tier) noexcept
    : default_action_(default_action), has_nvme_tier_(has_nvme_tier) {}

void BlockActionTable::check(BlockAction action) const {
  if (action == BlockAction::kSwapNvme && !has_nvme_tier_)
    throw config_error("BlockOffload: action swap-nvme needs the NVMe tier: set TIERFLOW_NVME_PATHS and "
                       "TIERFLOW_OFFLOAD_ACTIVATIONS=nvme (or TIERFLOW_OFFLOAD_OPTIMIZER=nvme)");
}

void BlockActionTable::set(std::size_t block, BlockAction action) {
  check(action);
  if (actions_.size() <= block) actions_.resize(block + 1);
  actions_[block] = action;
}

void BlockActionTable::set_all(const std::vector<BlockAction>& actions) {
  for (auto a : actions) check(a);
  actions_.assign(actions.begin(), actions.end());
}

void BlockActionTable::apply_plan(const Plan& plan) {
  std::vector<BlockAction> actions;
  actions.reserve(plan.blocks.size());
  for (const auto& b : plan.blocks) actions.push_back(block_action_from_plan(b));
  set_all(actions);
}

void BlockActionTable::set_default(BlockAction action) {
  check(action);
  default_action_ = action;
}

BlockAction BlockActionTable::action(std::size_t block) const noexcept {
  if (block < actions_.size() && actions_[block]) return *actions_[block];
  return default_action_;
}

BlockCall BlockCalls::call(std::size_t block, BlockAction action, bool needs_graph) {
  BlockCall c;
  c.new_forward = !started_ || block <= last_block_;
  if (c.new_forward) {
    stats_.forwards += 1;
    backward_started_ = false;
  }
  started_ = true;
  last_block_ = block;
  c.action = needs_graph ? action : BlockAction::kKeep;
  switch (c.action) {
    case BlockAction::kKeep:
      stats_.kept += 1;
      break;
    case BlockAction::kSwapHost:
      stats_.swapped_host += 1;
      break;
    case BlockAction::kSwapNvme:
      stats_.swapped_nvme += 1;
      break;
    case BlockAction::kRecompute:
      stats_.recomputed += 1;
      break;
  }
  return c;
}

bool BlockCalls::reached_backward() noexcept {
  if (backward_started_) return false;
  backward_started_ = true;
  return true;
}

void BlockCalls::rerun(std::uint64_t ns) noexcept {
  stats_.reruns += 1;
  stats_.rerun_ns += ns;
}

}  // namespace tierflow::tiering
