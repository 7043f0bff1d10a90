// See Note [Replay side effects] in replay_rule.hpp.
#include "tierflow/tiering/replay_rule.hpp"

namespace tierflow::tiering {

namespace {
std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}
}  // namespace

std::string replay_refusal(const BlockSideEffects& effects) {
  std::string why;
  if (!effects.foreign_hooks.empty())
    why = "it carries a forward hook that is not tierflow's or torch's own (" + joined(effects.foreign_hooks) +
          "), which a replay in backward would call again";
  if (!effects.unrestorable_state.empty())
    why += (why.empty() ? "" : "; ") + std::string("its forward wrote ") + joined(effects.unrestorable_state) +
           " in place, which the forward it was recorded from did not, so no value from before it was kept";
  return why;
}

BlockMode replay_mode(BlockMode planned, bool replayable) noexcept {
  if (replayable || planned == BlockMode::kKeep || planned == BlockMode::kSwap) return planned;
  return BlockMode::kSwap;
}

}  // namespace tierflow::tiering
