// The joint plan of parameters and activations: which blocks fetch their parameters, searched over
// counts per group of identical blocks around the activation search. See Note [Activation planner]
// (Parameters) and Note [Parameter residency].
#include <algorithm>
#include <numeric>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/detail/plan_params.hpp"
#include "tierflow/tiering/detail/plan_search.hpp"

namespace tierflow::tiering::detail {

void ParamTotals::add(std::uint64_t bytes, Tier where) {
  if (where == Tier::kGpu) {
    device += bytes;
    return;
  }
  (where == Tier::kHost ? host : nvme) += bytes;
  if (bytes > largest) {
    second = largest;
    largest = bytes;
  } else if (bytes > second) {
    second = bytes;
  }
}

double rest_fetch_seconds(const Links& links, const Budgets& budgets, Tier rest) {
  if (rest == Tier::kGpu || budgets.rest_parameter_bytes == 0) return 0;
  // Its home's row read back to the device: the host's PCIe, or NVMe's path through the host.
  const double bw = swap_tiers(links, budgets).path_read(index(rest) - index(Tier::kHost));
  return bw > 0 ? 2.0 * static_cast<double>(budgets.rest_parameter_bytes) / bw : kInf;
}

namespace {

// One joint choice: which blocks fetch their parameters, and where the rest unit's live.
struct Choice {
  std::vector<bool> fetched;
  Tier rest = Tier::kGpu;
};

// `blocks` with the fetches of `c` in their profiles (the model's times of a fetched block).
std::vector<BlockProfile> timed_profiles(const std::vector<BlockProfile>& blocks, const Budgets& budgets,
                                         const Choice& c) {
  std::vector<BlockProfile> out = blocks;
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i].fetch_bytes = c.fetched[i] ? out[i].parameter_bytes : 0;
    out[i].fetch_tier = budgets.param_tier == Tier::kNvme ? Tier::kNvme : Tier::kHost;
  }
  return out;
}

// The fastest plan of one choice: the activation search with the resident parameters and the window in
// the fixed bytes and the fetched ones out of their tier's budget; none when nothing fits.
std::optional<Plan> plan_choice(const std::vector<BlockProfile>& blocks, const Links& links,
                                const Budgets& budgets, const Choice& c) {
  ParamTotals t;
  for (std::size_t i = 0; i < blocks.size(); ++i)
    t.add(blocks[i].parameter_bytes, c.fetched[i] ? budgets.param_tier : Tier::kGpu);
  t.add(budgets.rest_parameter_bytes, c.rest);
  if (t.host > budgets.host_bytes || t.nvme > budgets.nvme_bytes) return std::nullopt;
  Budgets inner = budgets;
  inner.params = ParamPolicy::kResident;
  inner.rest_parameter_bytes = 0;
  inner.fixed_device_bytes += t.device + t.window();
  inner.host_bytes -= t.host;
  inner.nvme_bytes -= t.nvme;
  const auto activations = plan_within(timed_profiles(blocks, budgets, c), links, inner);
  if (!activations) return std::nullopt;
  std::vector<BlockPlan> assignment = activations->blocks;
  for (std::size_t i = 0; i < blocks.size(); ++i) assignment[i].params = c.fetched[i] ? budgets.param_tier : Tier::kGpu;
  Plan plan = evaluate_plan(blocks, links, budgets, std::move(assignment), c.rest);
  plan.proven_optimal = activations->proven_optimal;
  return plan;
}

// No plan of `c` is faster than every block kept with its fetches, plus the rest unit's.
double lower_bound(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   const Choice& c) {
  double t = rest_fetch_seconds(links, budgets, c.rest);
  const TierTable tiers = swap_tiers(links, budgets);
  for (const auto& p : timed_profiles(blocks, budgets, c))
    t += block_times(p, links, tiers, BlockMode::kKeep, 0, SwapTier::kHost).total();
  return t;
}

// The fetched sets to try: every count per group of identical profiles (the earliest of a group fetched),
// or, past kMaxParamChoices (or with `only_largest`), the k largest blocks for every k; `exact` false then.
std::vector<std::vector<bool>> fetch_sets(const std::vector<BlockProfile>& blocks, bool only_largest,
                                          bool& exact) {
  const std::size_t n = blocks.size();
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < n; ++i) {
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const auto& members) { return same_profile(blocks[members[0]], blocks[i]); });
    if (g == groups.end()) groups.push_back({i});
    else g->push_back(i);
  }
  std::size_t combos = 1;
  for (const auto& g : groups) combos = std::min(combos * (g.size() + 1), kMaxParamChoices + 1);
  std::vector<std::vector<bool>> out;
  if (only_largest || combos > kMaxParamChoices) {
    exact = false;
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return blocks[a].parameter_bytes > blocks[b].parameter_bytes; });
    for (std::size_t k = 0; k <= n; ++k) {
      std::vector<bool> set(n, false);
      for (std::size_t j = 0; j < k; ++j) set[order[j]] = true;
      out.push_back(std::move(set));
    }
    return out;
  }
  std::vector<std::size_t> count(groups.size(), 0);
  for (;;) {
    std::vector<bool> set(n, false);
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (std::size_t j = 0; j < count[g]; ++j) set[groups[g][j]] = true;
    out.push_back(std::move(set));
    std::size_t g = 0;
    while (g < groups.size() && ++count[g] > groups[g].size()) count[g++] = 0;
    if (g == groups.size()) return out;
  }
}

[[noreturn]] void throw_nothing_fits(const std::vector<BlockProfile>& blocks, const Budgets& budgets) {
  ParamTotals all;
  std::uint64_t working = 0, largest_params = 0, inputs = 0;
  for (const auto& p : blocks) {
    all.add(p.parameter_bytes, budgets.param_tier);
    working = std::max(working, p.saved_bytes() + p.transient_bytes);
    largest_params = std::max(largest_params, p.parameter_bytes);
    inputs += p.input_bytes;
  }
  all.add(budgets.rest_parameter_bytes, budgets.param_tier);
  // The window counts only what the cheapest plan swaps (every block's input), as plan_activations.cpp's floor does.
  const std::uint64_t window = window_bytes(budgets.prefetch_bytes, inputs);
  const std::uint64_t floor = budgets.fixed_device_bytes + working + all.window() + window;
  std::string msg = "tierflow: no plan of parameters and activations fits: with every unit's parameters fetched "
                    "the cheapest in device memory needs " + std::to_string(floor) + " bytes (" +
                    format_bytes(floor) + ": " + format_bytes(budgets.fixed_device_bytes) +
                    " for the rest of training, " + format_bytes(working) + " for the largest block's working set, " +
                    format_bytes(all.window()) + " for the parameters of the running and the prefetched unit (the "
                    "largest block holds " + format_bytes(largest_params) + "), " +
                    format_bytes(window) + " of prefetch window) and the device budget is " +
                    format_bytes(budgets.device_bytes);
  if (floor <= budgets.device_bytes) {
    msg += "; the host (" + format_bytes(budgets.host_bytes) + ") and NVMe (" + format_bytes(budgets.nvme_bytes) +
           ") budgets cannot hold the fetched parameters (" + format_bytes(all.host + all.nvme) +
           ") with the block inputs the device cannot keep";
  }
  throw out_of_memory(msg);
}

}  // namespace

Plan plan_with_params(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets) {
  const bool fetch_all = budgets.params == ParamPolicy::kFetchAll;
  bool exact = true, averaged = false;
  std::vector<BlockProfile> chosen_on = blocks;
  std::vector<std::vector<bool>> sets;
  if (fetch_all) {
    sets.assign(1, std::vector<bool>(blocks.size(), true));
  } else {
    sets = fetch_sets(blocks, false, exact);
    if (!exact) {  // measured layers of one shape: choose on their averaged times (they group)
      chosen_on = average_same_shape_blocks(blocks);
      averaged = true;
      bool grouped = true;  // false: the k largest (exact is false either way)
      sets = fetch_sets(chosen_on, false, grouped);
    }
  }
  std::vector<Tier> rests = {budgets.param_tier};
  if (!fetch_all) rests.insert(rests.begin(), Tier::kGpu);
  std::optional<Plan> best;
  std::optional<Choice> best_choice;
  for (const auto& set : sets) {
    for (Tier rest : rests) {
      const Choice c{set, rest};
      if (best && lower_bound(chosen_on, links, budgets, c) >= best->predicted_step_seconds) continue;
      auto plan = plan_choice(chosen_on, links, budgets, c);
      if (plan && (!best || plan->predicted_step_seconds < best->predicted_step_seconds)) {
        best = std::move(plan);
        best_choice = c;
      }
    }
  }
  if (!best) throw_nothing_fits(blocks, budgets);
  if (averaged) {  // the chosen residences, planned on the measured times
    auto plan = plan_choice(blocks, links, budgets, *best_choice);
    if (!plan) throw_nothing_fits(blocks, budgets);
    best = std::move(plan);
  }
  // Everything kept and resident is the fastest plan there is, whatever the sets tried.
  const bool fastest = best->predicted_step_seconds <= best->keep_all_step_seconds;
  best->proven_optimal = best->proven_optimal && (exact || fastest);
  return *best;
}

}  // namespace tierflow::tiering::detail
