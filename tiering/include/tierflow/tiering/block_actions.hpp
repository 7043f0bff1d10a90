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
// step time) and never holds more. TIERFLOW_OFFLOAD_ACTIVATIONS=recompute
// gives every block kSwapHost, the memory floor. auto gives them kSwapHost for
// the two profiling forwards only: BlockOffload then measures what each block
// saves in its rerun (a kept forward, through the device memory meter, with no
// saved-tensor hooks), and tiering::PlanDriver plans before the third forward
// (Note [C++ auto activations] in bindings/.../block_offload.hpp); actions
// set by hand make the driver stand aside. kSwapNvme needs the NVMe tier;
// the table refuses it otherwise, with a message naming the settings.
//
// Each call of a block (BlockCalls::call) runs with its table action, except
// that a call with nothing for autograd to differentiate (grad mode off, or
// neither the input nor a parameter requiring grad) simply runs, as kKeep. A
// call whose block index is not greater than the previous call's starts a
// new forward pass (block 0 again, or a shorter model); the first swapped
// block that backward reaches in a step starts every tier's prefetch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/param_schedule.hpp"
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
/// host, recompute and auto (until auto's plan is in force) swap the input to the host, nvme to NVMe
/// (Note [C++ block actions]).
BlockAction block_action_from_config(const Config& config) noexcept;

/// The action that carries out one block of an activation plan (Note [C++ block actions]).
BlockAction block_action_from_plan(const BlockPlan& plan) noexcept;

/// The action one call of block `block` carries out, from the table's (`planned`): a block whose rerun was
/// refused (`rerun_refused`, Note [Replay side effects]) is kept, unless its parameters are fetched from the host
/// (`params_fetched`, Note [C++ parameter residency]: autograd would hold them until backward); an automatic plan
/// (`automatic`, Note [C++ auto activations]) recomputes a kept block whose parameters are fetched, keeping its
/// input; a trainer's kKeep for such a block is config_error naming the block and the actions accepted.
BlockAction block_call_action(std::size_t block, BlockAction planned, bool rerun_refused, bool params_fetched,
                              bool automatic);

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

/// The parameter schedule's units of a C++ trainer's blocks (Note [C++ parameter residency] in
/// bindings/include/tierflow/bindings/block_offload.hpp): block b's parameters (`params[b]`) live on `tier`
/// between uses, a kept block's (its action in `actions`) on the device, where autograd holds them; a last,
/// empty unit stands for the trainer's own parameters, where it put them. The options prefetch one block ahead
/// (the largest that leaves the device). config_error for a tier other than the host.
std::pair<std::vector<ParamUnit>, ParamScheduleOptions> block_param_units(
    const BlockActionTable& actions, const std::vector<std::vector<ParamRef>>& params, Tier tier);
/// config_error, naming `tier`, for a tier a C++ trainer's parameters cannot live on (all but the host): the
/// first thing offload_parameters checks.
void check_param_tier(Tier tier);

/// Counters of a C++ trainer's block calls since creation.
struct BlockCallStats {
  std::uint64_t forwards = 0;         ///< forward passes (block 0 seen again)
  std::uint64_t kept = 0;             ///< block calls with kKeep (or autograd off)
  std::uint64_t swapped_host = 0;     ///< block calls whose input went to the host tier
  std::uint64_t swapped_nvme = 0;     ///< block calls whose input went to the NVMe tier
  std::uint64_t recomputed = 0;       ///< block calls with kRecompute
  std::uint64_t reruns = 0;           ///< block forwards rerun in backward
  std::uint64_t rerun_ns = 0;         ///< time spent in those reruns
};

/// What one block call does (Note [C++ block actions]).
struct BlockCall {
  bool new_forward = false;              ///< a forward pass starts with this call
  BlockAction action = BlockAction::kKeep;  ///< what to carry out (kKeep: just run the block)
};

/// The block calls of one model: forward passes, the action each call
/// carries out, the first backward of a step, and their counters
/// (Note [C++ block actions]). Not thread-safe.
class BlockCalls {
 public:
  /// Block `block`, whose table action is `action`, is called; `needs_graph`:
  /// autograd has something to differentiate in it.
  BlockCall call(std::size_t block, BlockAction action, bool needs_graph);
  /// Backward reached a swapped block: true for the first in this step (start the prefetch).
  bool reached_backward() noexcept;
  /// A block was rerun in backward, taking `ns`.
  void rerun(std::uint64_t ns) noexcept;
  const BlockCallStats& stats() const noexcept { return stats_; }

 private:
  bool started_ = false;           // a block ran since creation
  std::size_t last_block_ = 0;     // index of the previous call
  bool backward_started_ = false;  // this step's backward reached a swapped block
  BlockCallStats stats_;
};

}  // namespace tierflow::tiering
