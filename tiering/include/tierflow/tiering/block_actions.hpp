// What a C++ LibTorch trainer's block does with its activations between its
// forward and its backward: the per-block action table that
// bindings::BlockOffload carries out (Note [C++ block offload]).
//
// Note [C++ block actions]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// TIERFLOW_OFFLOAD_ACTIVATIONS gives every block its default action
// (block_action_from_config), and set / set_all override it per block, which
// is where a planner's per-block decision goes. From a plan of
// tiering::plan_activations (Note [Activation planner]; `python -m tierflow
// plan --json` prints the same plan for a shape or a recorded profile):
// keep -> kKeep, and swap, split or recompute -> kSwapHost / kSwapNvme by the
// plan's tier (block_action_from_plan). Those three free the block's device
// memory until its backward; C++ has one way to do that (the block's input to
// the tier, the rest recomputed), so a swap or split block recomputes more
// than its plan priced (the planner's prediction is then a lower bound on the
// step time) and never holds more. TIERFLOW_OFFLOAD_ACTIVATIONS=recompute and
// auto give every block kSwapHost, the memory floor: C++ cannot measure what
// a block saves (no saved-tensor hooks), which the planner needs, so a C++
// plan comes from a plan applied to the table. kSwapNvme needs the NVMe tier;
// the table refuses it otherwise, with a message naming the settings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// What happens to one block's activations between its forward and its backward.
enum class BlockAction : std::uint8_t {
  kKeep,       ///< autograd keeps them on the device (no tierflow involvement)
  kSwapHost,   ///< input to the pinned host pool, the rest recomputed
  kSwapNvme,   ///< input to the NVMe tier (host staging), the rest recomputed
  kRecompute,  ///< input kept on the device, the rest recomputed
};

/// "keep", "swap-host", "swap-nvme" or "recompute".
std::string_view to_string(BlockAction a) noexcept;

/// The action every block gets from TIERFLOW_OFFLOAD_ACTIVATIONS: none keeps,
/// host, recompute and auto swap the input to the host, nvme to NVMe
/// (Note [C++ block actions]).
BlockAction block_action_from_config(const Config& config) noexcept;

/// The action that carries out one block of an activation plan (Note [C++ block actions]).
BlockAction block_action_from_plan(const BlockPlan& plan) noexcept;

/// Every block's action: a default and per-block overrides (Note [C++ block actions]). Not thread-safe.
class BlockActionTable {
 public:
  /// `has_nvme_tier`: whether kSwapNvme can be carried out (an NVMe engine exists).
  BlockActionTable(BlockAction default_action, bool has_nvme_tier) noexcept;

  /// Sets the action of block `block` (0 is the first block of a forward); config_error for kSwapNvme
  /// without the NVMe tier (the table is then unchanged).
  void set(std::size_t block, BlockAction action);
  /// Sets the actions of blocks 0..n-1 (all checked first); later blocks get the default.
  void set_all(const std::vector<BlockAction>& actions);
  /// Sets every block's action from a plan (block_action_from_plan).
  void apply_plan(const Plan& plan);
  /// Sets the action of every block not set one by one.
  void set_default(BlockAction action);
  /// The action block `block` runs with.
  BlockAction action(std::size_t block) const noexcept;

 private:
  void check(BlockAction action) const;

  BlockAction default_action_;
  bool has_nvme_tier_;
  std::vector<std::optional<BlockAction>> actions_;
};

}  // namespace tierflow::tiering
