// See Note [Replay side effects] in replay_rule.hpp.
#include "tierflow/tiering/replay_rule.hpp"

#include "tierflow/core/error.hpp"

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

BlockWrites::Before BlockWrites::before(std::size_t block, std::size_t tracked) const {
  Before b;
  b.known.assign(tracked, false);
  const auto it = blocks_.find(block);
  if (it != blocks_.end() && it->second.written.size() == tracked) {
    b.compared = it->second.compared;
    b.known = it->second.written;
  }
  b.keep.resize(tracked);
  for (std::size_t i = 0; i < tracked; ++i) b.keep[i] = !b.compared || b.known[i];  // the first call: all
  return b;
}

BlockWrites::After BlockWrites::after(std::size_t block, std::size_t state_count, const Before& before,
                                      const std::vector<bool>& wrote) {
  const std::size_t n = wrote.size();
  TIERFLOW_EXPECTS(before.keep.size() == n && before.known.size() == n,
                   "BlockWrites::after: " + std::to_string(n) + " tensors written, " +
                       std::to_string(before.keep.size()) + " tracked before the call");
  After a;
  a.restore.assign(n, false);
  std::vector<std::string> unrestorable;
  for (std::size_t i = 0; i < n; ++i) {
    if (wrote[i] && !before.keep[i])
      unrestorable.push_back(i < state_count ? "state tensor " + std::to_string(i)
                                             : "parameter " + std::to_string(i - state_count));
    a.restore[i] = before.keep[i] && (wrote[i] || before.known[i]);
  }
  Block& w = blocks_[block];
  if (w.written.size() != n) w.written.assign(n, false);
  w.compared = true;
  for (std::size_t i = 0; i < n; ++i) w.written[i] = w.written[i] || wrote[i];
  if (!unrestorable.empty() && w.refused.empty()) {
    w.refused = replay_refusal({{}, unrestorable});
    a.refused_now = w.refused;
  }
  return a;
}

std::string BlockWrites::refusal(std::size_t block) const {
  const auto it = blocks_.find(block);
  return it == blocks_.end() ? std::string() : it->second.refused;
}

}  // namespace tierflow::tiering
