// Internals of the activation planner shared by planner.cpp (the model),
// plan_search.cpp (the search) and plan_activations.cpp (the plan within a budget); see Note [Activation planner].
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering::detail {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

/// Whether the budgets and links give an NVMe tier (swap_tiers' row kNvme is present).
bool nvme_available(const Links& links, const Budgets& budgets);
/// What the saved tensors outside the blocks add to the device peak, kept or swapped (Note [Activation planner]).
std::uint64_t outside_device_bytes(std::uint64_t outside, std::uint64_t largest_transient, bool kept);

/// The prefetch window's device bytes in a plan's peak (Note [Activation planner]): the window, or every byte the
/// blocks swap when that is less (no more can be in flight ahead of a backward); 0 when nothing swaps.
inline std::uint64_t window_bytes(std::uint64_t prefetch_bytes, std::uint64_t swapped_bytes) noexcept {
  return prefetch_bytes < swapped_bytes ? prefetch_bytes : swapped_bytes;
}

/// A block's predicted forward and backward seconds.
struct Times {
  double forward = 0, backward = 0;
  double total() const { return forward + backward; }
};

/// t(alpha) = at0 + slope * alpha (slope infinite: at0 at alpha = 0, infinite beyond).
struct Line {
  double at0 = 0, slope = 0;
};
/// The terms of each phase of a block in one mode and tier, as lines in alpha; a phase takes the largest.
struct Phases {
  std::vector<Line> forward, backward;
};
/// Note [Activation planner]'s terms of a block swapping to row `tier` of `tiers` (alpha matters for kSplit
/// only): the swap at that row's path bandwidths (Note [Tier descriptors]), the rest on `links`' PCIe.
Phases block_phases(const BlockProfile& p, const Links& links, const TierTable& tiers, BlockMode mode,
                    SwapTier tier);
/// The alphas in [0, 1] where a split block's time can bend: 0, 1 and where two terms of a phase cross.
std::vector<double> split_breakpoints(const BlockProfile& p, const Links& links, const TierTable& tiers,
                                      SwapTier tier);

/// The per-block pipeline of Note [Activation planner]. Swapped bytes are taken continuous in alpha
/// (swap_bytes rounds them to a byte), so the time is exactly piecewise linear in alpha.
Times block_times(const BlockProfile& p, const Links& links, const TierTable& tiers, BlockMode mode, double alpha,
                  SwapTier tier);
/// Bytes a block sends to its tier per step.
std::uint64_t swap_bytes_of(const BlockProfile& p, BlockMode mode, double alpha);
/// MEMO's link rule: the largest alpha whose swap-out to `tier` fits in the block's forward (1: nothing to split).
double link_alpha(const BlockProfile& p, const TierTable& tiers, SwapTier tier);
/// Whether two profiles are equal in every field (their blocks group in the search).
bool same_profile(const BlockProfile& a, const BlockProfile& b);

/// What the search found.
struct SearchOutcome {
  bool found = false;                 ///< some plan fits
  bool complete = true;               ///< the search ended within its node limit: the plan is optimal
  std::vector<BlockPlan> assignment;  ///< modes, tiers and alphas of the best plan
};

/// The branch and bound of Note [Activation planner], for budgets that cannot keep every block.
SearchOutcome search_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets);

}  // namespace tierflow::tiering::detail
