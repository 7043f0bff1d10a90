// The activation planner's model: a block's phases and times, evaluate_plan, evaluate_alternative and
// forced_plan. plan_activations is in plan_activations.cpp, the search in plan_search.cpp, the plan's text in
// plan_text.cpp. See Note [Activation planner].
#include "tierflow/tiering/planner.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/replay_rule.hpp"
#include "tierflow/tiering/detail/plan_params.hpp"
#include "tierflow/tiering/detail/plan_search.hpp"

namespace tierflow::tiering {
namespace {

std::uint64_t split_rows_bytes(const BlockProfile& p, double alpha) {
  return static_cast<std::uint64_t>(std::llround(alpha * static_cast<double>(p.split_bytes)));
}

}  // namespace

double outside_swap_seconds(const Links& links, std::uint64_t bytes) {
  if (bytes == 0) return 0;
  const double b = static_cast<double>(bytes);
  return (links.d2h > 0 ? b / links.d2h : detail::kInf) + (links.h2d > 0 ? b / links.h2d : detail::kInf);
}

std::uint64_t outside_staging_bytes(const Budgets& budgets) noexcept {
  return std::min(budgets.outside_largest_bytes, budgets.outside_saved_bytes);
}

double outside_tier_seconds(const Links& links, std::uint64_t bytes, Tier tier) {
  if (bytes == 0 || tier == Tier::kGpu) return 0;
  if (tier == Tier::kHost) return outside_swap_seconds(links, bytes);
  const double b = static_cast<double>(bytes);
  const double write = std::min(links.d2h, links.nvme_write), read = std::min(links.h2d, links.nvme_read);
  return (write > 0 ? b / write : detail::kInf) + (read > 0 ? b / read : detail::kInf);
}

namespace detail {

std::uint64_t outside_device_bytes(std::uint64_t outside, std::uint64_t largest_transient, bool kept) {
  return kept ? outside : outside - std::min(outside, largest_transient);
}

bool nvme_available(const Links& links, const Budgets& budgets) {
  return budgets.nvme_bytes > 0 && links.nvme_write > 0 && links.nvme_read > 0;
}

Phases block_phases(const BlockProfile& p, const Links& links, const TierTable& tiers, BlockMode mode,
                    SwapTier tier) {
  // s = base + slope * alpha; recompute = recompute0 - recompute_slope * alpha (Note [Activation planner]).
  double base = 0, slope = 0, recompute0 = 0, recompute_slope = 0;
  switch (mode) {
    case BlockMode::kKeep: break;
    case BlockMode::kSwap: base = static_cast<double>(p.saved_bytes()); break;
    case BlockMode::kSplit:
      base = static_cast<double>(p.input_bytes + p.whole_bytes);
      slope = static_cast<double>(p.split_bytes);
      recompute0 = p.split_recompute_seconds + p.cheap_recompute_seconds;
      recompute_slope = p.split_recompute_seconds;
      break;
    case BlockMode::kRecompute:
      base = static_cast<double>(p.input_bytes);
      recompute0 = p.forward_seconds;
      break;
  }
  const auto row = static_cast<std::size_t>(tier);
  const double write = tiers.path_write(row), read = tiers.path_read(row);
  const double up = static_cast<double>(p.upload_bytes), down = static_cast<double>(p.download_bytes);
  const double fetch = static_cast<double>(p.fetch_bytes);  // fetched parameters, each phase (0: resident)
  // Fetched parameters cross PCIe (links.h2d) and, from a tier behind the host, that row's own link too; a swap
  // to a row whose path crosses that link shares it. Rows 0 and 1 are core's Tier::kHost and kNvme.
  const std::size_t fetch_row = fetch > 0 ? index(p.fetch_tier) - index(Tier::kHost) : 0;
  const bool fetch_own_link = fetch > 0 && tiers[fetch_row].via >= 0;
  const double fetch_read = fetch_own_link ? tiers[fetch_row].link_read : 0;
  // The compute share applies to a phase that copies at alpha = 0 already (a split swaps its input), so it is
  // one constant per phase and the time stays linear in alpha between breakpoints.
  const double c_fwd = base + up + fetch > 0 ? links.compute_share_during_copies : 1.0;
  const double c_bwd = base + down + fetch > 0 ? links.compute_share_during_copies : 1.0;
  const double k = down > 0 ? links.copy_share_during_cpu_step : 1.0;
  // A line in alpha for `bytes0 + bytes_slope * alpha` bytes at `speed` bytes/s (no bytes: no line).
  auto transfer = [](std::vector<Line>& out, double bytes0, double bytes_slope, double speed) {
    if (bytes0 <= 0 && bytes_slope <= 0) return;
    if (speed > 0) out.push_back({bytes0 / speed, bytes_slope / speed});
    else out.push_back(bytes0 > 0 ? Line{kInf, 0} : Line{0, kInf});  // no link: any byte takes forever
  };
  Phases ph;
  ph.forward.push_back({p.forward_seconds / c_fwd, 0});
  transfer(ph.forward, base, slope, write);
  transfer(ph.forward, up + fetch, 0, links.h2d);
  if (fetch_own_link) transfer(ph.forward, fetch, 0, fetch_read);
  if (links.duplex > 0 && up + fetch > 0) transfer(ph.forward, base + up + fetch, slope, links.duplex);
  ph.backward.push_back({(p.backward_seconds + recompute0) / c_bwd, -recompute_slope / c_bwd});
  transfer(ph.backward, base, slope, read * k);
  transfer(ph.backward, down, 0, links.d2h * k);
  if (fetch > 0) {  // the parameters share host->device with the swap-in (and NVMe reads with an NVMe swap)
    transfer(ph.backward, base + fetch, slope, links.h2d * k);
    if (fetch_own_link && tiers.shares_own_link(row, fetch_row)) transfer(ph.backward, base + fetch, slope, fetch_read * k);
    else if (fetch_own_link) transfer(ph.backward, fetch, 0, fetch_read * k);
  }
  if (links.duplex > 0 && down + fetch > 0) transfer(ph.backward, base + down + fetch, slope, links.duplex * k);
  return ph;
}

double phase_seconds(const std::vector<Line>& lines, double alpha) {
  double t = 0;
  for (const auto& l : lines) {
    if (std::isinf(l.slope)) t = std::max(t, alpha > 0 ? kInf : l.at0);
    else t = std::max(t, l.slope == 0 ? l.at0 : l.at0 + l.slope * alpha);
  }
  return t;
}

std::vector<double> split_breakpoints(const BlockProfile& p, const Links& links, const TierTable& tiers,
                                      SwapTier tier) {
  std::vector<double> out = {0.0, 1.0};
  const Phases ph = block_phases(p, links, tiers, BlockMode::kSplit, tier);
  for (const auto* lines : {&ph.forward, &ph.backward}) {
    for (std::size_t i = 0; i < lines->size(); ++i) {
      for (std::size_t j = i + 1; j < lines->size(); ++j) {
        const Line& a = (*lines)[i];
        const Line& b = (*lines)[j];
        if (a.slope == b.slope || !std::isfinite(a.at0 + a.slope) || !std::isfinite(b.at0 + b.slope)) continue;
        const double x = (b.at0 - a.at0) / (a.slope - b.slope);
        if (x > 0 && x < 1) out.push_back(x);
      }
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Times block_times(const BlockProfile& p, const Links& links, const TierTable& tiers, BlockMode mode, double alpha,
                  SwapTier tier) {
  const Phases ph = block_phases(p, links, tiers, mode, tier);
  return {phase_seconds(ph.forward, alpha), phase_seconds(ph.backward, alpha)};
}

std::uint64_t swap_bytes_of(const BlockProfile& p, BlockMode mode, double alpha) {
  switch (mode) {
    case BlockMode::kKeep: return 0;
    case BlockMode::kSwap: return p.saved_bytes();
    case BlockMode::kSplit: return p.input_bytes + p.whole_bytes + split_rows_bytes(p, alpha);
    case BlockMode::kRecompute: return p.input_bytes;
  }
  return 0;
}

double link_alpha(const BlockProfile& p, const TierTable& tiers, SwapTier tier) {
  if (p.split_bytes == 0) return 1.0;
  const double fits = p.forward_seconds * tiers.path_write(static_cast<std::size_t>(tier)) -
                      static_cast<double>(p.input_bytes + p.whole_bytes);
  return std::clamp(fits / static_cast<double>(p.split_bytes), 0.0, 1.0);
}

bool same_profile(const BlockProfile& a, const BlockProfile& b) {
  auto key = [](const BlockProfile& p) {
    return std::make_tuple(p.forward_seconds, p.backward_seconds, p.input_bytes, p.whole_bytes, p.split_bytes,
                           p.split_recompute_seconds, p.cheap_bytes, p.cheap_recompute_seconds, p.splittable, p.replayable,
                           p.transient_bytes, p.upload_bytes, p.download_bytes, p.parameter_bytes, p.fetch_bytes,
                           p.fetch_tier);
  };
  return key(a) == key(b);
}

}  // namespace detail

namespace {

using detail::block_times;
using detail::kInf;
using detail::link_alpha;
using detail::nvme_available;
using detail::swap_bytes_of;

// Fills swap_bytes, the fractions and the times of `b` from its mode, alpha and tier.
void fill_block(const BlockProfile& p, const Links& links, const TierTable& tiers, BlockPlan& b) {
  if (b.mode != BlockMode::kSplit) b.alpha = 0;
  if (b.mode == BlockMode::kKeep) b.tier = SwapTier::kHost;
  b.swap_bytes = swap_bytes_of(p, b.mode, b.alpha);
  const double saved = static_cast<double>(p.saved_bytes());
  b.keep = b.swap = b.recompute = 0;
  if (b.mode == BlockMode::kKeep) {
    b.keep = 1;
  } else if (b.mode == BlockMode::kSwap) {
    b.swap = 1;
  } else if (saved > 0) {
    b.swap = static_cast<double>(b.swap_bytes) / saved;
    b.recompute = 1 - b.swap;
  } else {
    b.recompute = 1;
  }
  const auto t = block_times(p, links, tiers, b.mode, b.alpha, b.tier);
  b.forward_seconds = t.forward;
  b.backward_seconds = t.backward;
}

// Refuses an alpha outside [0, 1] or a split of a block that has no exact token split.
void check_assignment(const char* who, std::size_t i, const BlockProfile& p, const BlockPlan& b) {
  TIERFLOW_EXPECTS(b.alpha >= 0 && b.alpha <= 1, std::string(who) + ": block " + std::to_string(i) + " has alpha " +
                                                     std::to_string(b.alpha) + " outside [0, 1]");
  TIERFLOW_EXPECTS(b.mode != BlockMode::kSplit || p.splittable,
                   std::string(who) + ": block " + std::to_string(i) + " is not splittable");
  TIERFLOW_EXPECTS(p.replayable || b.mode == BlockMode::kKeep || b.mode == BlockMode::kSwap,
                   std::string(who) + ": block " + std::to_string(i) +
                       " may not be replayed (Note [Replay side effects]): keep or swap only");
}

// The sums of Note [Activation planner] over a plan's blocks (each filled in by fill_block).
struct PlanTotals {
  std::uint64_t kept = 0, working = 0;
  std::vector<std::uint64_t> tier_bytes;  // per row of the swap tiers: host, NVMe, further rows
  bool any_swapped = false;
  std::uint64_t swapped = 0;  // every block's swap bytes: no more than these can be in the prefetch window
  double step_seconds = 0;
  bool count_params = false;  // Budgets::params is not kResident
  detail::ParamTotals params;
  Tier outside = Tier::kGpu;         // where the saved tensors outside the blocks go (kGpu: kept)
  std::uint64_t outside_device = 0;  // the saved tensors outside the blocks on the device at the peak
  double outside_seconds = 0;        // their round trip, swapped
  std::uint64_t outside_staging = 0; // their host staging on the way to NVMe (in the host's row)
  std::uint64_t largest_transient = 0;

  PlanTotals(const Budgets& budgets, const TierTable& tiers, Tier outside)
      : tier_bytes(tiers.size(), 0), count_params(budgets.params != ParamPolicy::kResident), outside(outside) {}

  void add(const BlockProfile& p, const BlockPlan& b) {
    if (count_params) params.add(p.parameter_bytes, b.params);
    largest_transient = std::max(largest_transient, p.transient_bytes);
    step_seconds += b.forward_seconds + b.backward_seconds;
    if (b.mode == BlockMode::kKeep) {
      kept += p.saved_bytes();
      working = std::max(working, p.transient_bytes);
    } else {
      working = std::max(working, p.saved_bytes() + p.transient_bytes);
      tier_bytes.at(static_cast<std::size_t>(b.tier)) += b.swap_bytes;
      any_swapped = any_swapped || b.swap_bytes > 0;
      swapped += b.swap_bytes;
    }
  }
  // Adds the saved tensors outside the blocks, the rest unit and the parameters' tier bytes (once, after every
  // block).
  void finish(const Links& links, const Budgets& budgets, Tier rest) {
    outside_device = detail::outside_device_bytes(budgets.outside_saved_bytes, largest_transient,
                                                  outside == Tier::kGpu);
    if (outside != Tier::kGpu) {
      tier_bytes[outside == Tier::kNvme ? 1 : 0] += budgets.outside_saved_bytes;  // NVMe's row, or the host's
      if (outside == Tier::kNvme) {  // through the host's staging, the largest of them at a time
        outside_staging = outside_staging_bytes(budgets);
        tier_bytes[0] += outside_staging;
      }
      outside_seconds = outside_tier_seconds(links, budgets.outside_saved_bytes, outside);
      step_seconds += outside_seconds;
    }
    if (!count_params) return;
    params.add(budgets.rest_parameter_bytes, rest);
    tier_bytes[0] += params.host;
    tier_bytes[1] += params.nvme;
    step_seconds += detail::rest_fetch_seconds(links, budgets, rest);
  }
  std::uint64_t peak(const Budgets& budgets) const {
    return budgets.fixed_device_bytes + kept + working + detail::window_bytes(budgets.prefetch_bytes, swapped) +
           params.device + params.window() + outside_device;
  }
};

// The profile a block is timed with: its parameters' fetches when it fetches them.
BlockProfile timed_profile(const BlockProfile& p, const Budgets& budgets, const BlockPlan& b) {
  if (budgets.params == ParamPolicy::kResident) return p;
  BlockProfile out = p;
  out.fetch_bytes = b.params == Tier::kGpu ? 0 : p.parameter_bytes;
  out.fetch_tier = b.params == Tier::kNvme ? Tier::kNvme : Tier::kHost;
  return out;
}

// Whether rows `first` and on hold their bytes.
bool within_rows(const TierTable& tiers, const std::vector<std::uint64_t>& bytes, std::size_t first) {
  for (std::size_t t = first; t < tiers.size(); ++t) {
    if (bytes[t] > tiers[t].budget_bytes) return false;
  }
  return true;
}

Tier default_rest(const Budgets& budgets) {
  return budgets.params == ParamPolicy::kFetchAll ? budgets.param_tier : Tier::kGpu;
}

}  // namespace

std::vector<BlockProfile> average_same_shape_blocks(const std::vector<BlockProfile>& blocks) {
  auto shape = [](const BlockProfile& p) {
    return std::make_tuple(p.input_bytes, p.whole_bytes, p.split_bytes, p.cheap_bytes, p.transient_bytes,
                           p.splittable, p.replayable, p.upload_bytes, p.download_bytes, p.parameter_bytes,
                           p.fetch_bytes,
                           p.fetch_tier);
  };
  std::vector<BlockProfile> out = blocks;
  std::vector<bool> done(blocks.size(), false);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (done[i]) continue;
    std::vector<std::size_t> same;
    for (std::size_t j = i; j < blocks.size(); ++j) {
      if (!done[j] && shape(blocks[j]) == shape(blocks[i])) same.push_back(j);
    }
    BlockProfile mean = blocks[i];
    mean.forward_seconds = mean.backward_seconds = mean.split_recompute_seconds = mean.cheap_recompute_seconds = 0;
    for (std::size_t j : same) {
      mean.forward_seconds += blocks[j].forward_seconds / same.size();
      mean.backward_seconds += blocks[j].backward_seconds / same.size();
      mean.split_recompute_seconds += blocks[j].split_recompute_seconds / same.size();
      mean.cheap_recompute_seconds += blocks[j].cheap_recompute_seconds / same.size();
    }
    for (std::size_t j : same) {
      out[j] = mean;
      done[j] = true;
    }
  }
  return out;
}

Plan evaluate_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   std::vector<BlockPlan> assignment) {
  return evaluate_plan(blocks, links, budgets, std::move(assignment), default_rest(budgets));
}

Plan evaluate_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   std::vector<BlockPlan> assignment, Tier rest_params, bool outside_kept) {
  return evaluate_plan(blocks, links, budgets, std::move(assignment), rest_params,
                       outside_kept ? Tier::kGpu : Tier::kHost);
}

Plan evaluate_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   std::vector<BlockPlan> assignment, Tier rest_params, Tier outside_tier) {
  TIERFLOW_EXPECTS(assignment.size() == blocks.size(),
                   "evaluate_plan: " + std::to_string(assignment.size()) + " block plans for " +
                       std::to_string(blocks.size()) + " blocks");
  TIERFLOW_EXPECTS(budgets.params != ParamPolicy::kResident || rest_params == Tier::kGpu,
                   "evaluate_plan: the rest unit's parameters are fetched while Budgets::params is resident");
  Plan plan;
  plan.device_budget_bytes = budgets.device_bytes;
  const TierTable tiers = swap_tiers(links, budgets);
  PlanTotals totals(budgets, tiers, outside_tier);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto& p = blocks[i];
    auto& b = assignment[i];
    check_assignment("evaluate_plan", i, p, b);
    TIERFLOW_EXPECTS(budgets.params != ParamPolicy::kResident || b.params == Tier::kGpu,
                     "evaluate_plan: block " + std::to_string(i) +
                         " fetches its parameters while Budgets::params is resident");
    TIERFLOW_EXPECTS(b.mode == BlockMode::kKeep || static_cast<std::size_t>(b.tier) < tiers.size(),
                     "evaluate_plan: block " + std::to_string(i) + " swaps to row " +
                         std::to_string(static_cast<int>(b.tier)) + " of " + std::to_string(tiers.size()) +
                         " swap tiers (Note [Tier descriptors])");
    fill_block(timed_profile(p, budgets, b), links, tiers, b);
    plan.keep_all_step_seconds += block_times(p, links, tiers, BlockMode::kKeep, 0, SwapTier::kHost).total();
    totals.add(p, b);
  }
  totals.finish(links, budgets, rest_params);
  plan.rest_params = budgets.params == ParamPolicy::kResident ? Tier::kGpu : rest_params;
  plan.device_param_bytes = totals.params.device;
  plan.param_window_bytes = totals.params.window();
  plan.param_prefetch_bytes = totals.params.largest;
  plan.host_param_bytes = totals.params.host;
  plan.nvme_param_bytes = totals.params.nvme;
  plan.rest_fetch_seconds = detail::rest_fetch_seconds(links, budgets, plan.rest_params);
  plan.outside_kept = outside_tier == Tier::kGpu;
  plan.outside_tier = outside_tier;
  plan.outside_bytes = budgets.outside_saved_bytes;
  plan.outside_swap_seconds = totals.outside_seconds;
  plan.outside_staging_bytes = totals.outside_staging;
  plan.predicted_step_seconds = totals.step_seconds;
  plan.host_bytes = totals.tier_bytes[0];
  plan.nvme_bytes = totals.tier_bytes[1];
  plan.tier_bytes = totals.tier_bytes;
  for (const TierRow& row : tiers.rows) plan.tier_names.push_back(row.name);
  plan.predicted_device_peak_bytes = totals.peak(budgets);
  plan.fits = plan.predicted_device_peak_bytes <= budgets.device_bytes && within_rows(tiers, totals.tier_bytes, 0);
  plan.blocks = std::move(assignment);
  return plan;
}

AlternativeCost evaluate_alternative(const std::vector<BlockProfile>& blocks, const Links& links,
                                     const Budgets& budgets, const Plan& plan, std::size_t i,
                                     BlockPlan alternative) {
  TIERFLOW_EXPECTS(plan.blocks.size() == blocks.size() && i < blocks.size(),
                   "evaluate_alternative: block " + std::to_string(i) + " of a plan of " +
                       std::to_string(plan.blocks.size()) + " blocks for " + std::to_string(blocks.size()));
  check_assignment("evaluate_alternative", i, blocks[i], alternative);
  if (budgets.params == ParamPolicy::kResident) alternative.params = Tier::kGpu;
  const TierTable tiers = swap_tiers(links, budgets);
  fill_block(timed_profile(blocks[i], budgets, alternative), links, tiers, alternative);
  PlanTotals totals(budgets, tiers, plan.outside_tier);  // in evaluate_plan's order: the chosen assignment gives the plan's figures exactly
  for (std::size_t j = 0; j < blocks.size(); ++j) totals.add(blocks[j], j == i ? alternative : plan.blocks[j]);
  totals.finish(links, budgets, plan.rest_params);
  AlternativeCost out;
  out.block = alternative;
  out.step_seconds = totals.step_seconds;
  out.device_peak_bytes = totals.peak(budgets);
  out.host_bytes = totals.tier_bytes[0];
  out.nvme_bytes = totals.tier_bytes[1];
  out.fits_device = out.device_peak_bytes <= budgets.device_bytes;
  out.fits_host = out.host_bytes <= budgets.host_bytes;
  out.fits_nvme = out.nvme_bytes <= budgets.nvme_bytes;
  out.fits_further = within_rows(tiers, totals.tier_bytes, 2);
  return out;
}

Plan forced_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                 BlockMode mode) {
  const TierTable tiers = swap_tiers(links, budgets);
  // kFetchAll: every unit's parameters on their tier first, beside which the activations find room.
  const bool fetch = budgets.params == ParamPolicy::kFetchAll;
  std::uint64_t param_bytes = fetch ? budgets.rest_parameter_bytes : 0;
  for (const auto& p : blocks) param_bytes += fetch ? p.parameter_bytes : 0;
  const bool params_on_host = fetch && budgets.param_tier == Tier::kHost;
  // What TIERFLOW_OFFLOAD_ACTIVATIONS=recompute does outside the blocks: swap them (Note [Activation planner]).
  const bool outside_kept = mode == BlockMode::kKeep;
  // The rows in order (host, then NVMe, then further rows); alphas capped at `cap`. Returns whether everything
  // found room.
  auto assign = [&](double cap, std::vector<BlockPlan>& out) {
    std::vector<std::uint64_t> used(tiers.size(), 0);
    used[0] = (params_on_host ? param_bytes : 0) + (outside_kept ? 0 : budgets.outside_saved_bytes);
    used[1] = fetch && !params_on_host ? param_bytes : 0;
    bool room = true;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const auto& p = blocks[i];
      auto& b = out[i];
      b.mode = replay_mode(mode == BlockMode::kSplit && !p.splittable ? BlockMode::kRecompute : mode, p.replayable);
      b.tier = SwapTier::kHost;
      b.params = fetch ? budgets.param_tier : Tier::kGpu;
      if (b.mode == BlockMode::kKeep) continue;
      auto place = [&](SwapTier tier) {
        b.tier = tier;
        b.alpha = b.mode == BlockMode::kSplit ? std::min(cap, link_alpha(p, tiers, tier)) : 0.0;
        return swap_bytes_of(p, b.mode, b.alpha);
      };
      bool placed = false;
      for (std::size_t t = 0; t < tiers.size() && !placed; ++t) {
        if (!tiers[t].present) continue;
        const std::uint64_t bytes = place(static_cast<SwapTier>(t));
        if (used[t] + bytes <= tiers[t].budget_bytes) {
          used[t] += bytes;
          placed = true;
        }
      }
      if (placed) continue;
      used[0] += place(SwapTier::kHost);  // no room anywhere: host, over budget
      room = false;
    }
    return room;
  };
  std::vector<BlockPlan> out(blocks.size());
  if (!assign(1.0, out) && mode == BlockMode::kSplit) {
    // MEMO's host-memory bound: the largest common cap on alpha that finds room for every block.
    double lo = 0, hi = 1;
    std::vector<BlockPlan> trial(blocks.size());
    if (assign(0.0, trial)) {
      for (int it = 0; it < 60; ++it) {
        const double mid = (lo + hi) / 2;
        (assign(mid, trial) ? lo : hi) = mid;
      }
    }
    assign(lo, out);
  }
  return evaluate_plan(blocks, links, budgets, std::move(out), default_rest(budgets), outside_kept);
}

}  // namespace tierflow::tiering
