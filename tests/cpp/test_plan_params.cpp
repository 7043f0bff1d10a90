// The joint plan of parameters and activations against brute force over its own model
// (Note [Activation planner], Parameters).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/planner.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

constexpr double kGBps = 1e9;
constexpr double kMs = 1e-3;

BlockProfile random_block(std::mt19937_64& rng, bool splittable) {
  auto u = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto mib = [&](double lo, double hi) { return static_cast<std::uint64_t>(u(lo, hi) * MiB); };
  BlockProfile p;
  p.forward_seconds = u(2, 6) * kMs;
  p.backward_seconds = 2 * p.forward_seconds * u(0.8, 1.2);
  p.input_bytes = mib(8, 32);
  p.whole_bytes = mib(8, 40);
  p.split_bytes = mib(50, 200);
  p.split_recompute_seconds = u(0.3, 0.7) * p.forward_seconds;
  p.cheap_bytes = mib(20, 100);
  p.cheap_recompute_seconds = u(0.02, 0.2) * p.forward_seconds;
  p.splittable = splittable;
  p.transient_bytes = mib(10, 60);
  p.parameter_bytes = mib(20, 200);
  return p;
}

struct Case {
  std::vector<BlockProfile> blocks;
  Links links;
  Budgets budgets;
};

Case random_case(std::uint64_t seed, std::size_t n, bool identical, bool splittable, bool nvme_params) {
  std::mt19937_64 rng(seed);
  auto u = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  Case c;
  if (identical) c.blocks.assign(n, random_block(rng, splittable));
  else
    for (std::size_t i = 0; i < n; ++i) c.blocks.push_back(random_block(rng, splittable));
  c.links.d2h = u(10, 60) * kGBps;
  c.links.h2d = u(10, 60) * kGBps;
  c.links.duplex = u(0.6, 1.0) * (c.links.d2h + c.links.h2d);
  c.links.compute_share_during_copies = u(0.7, 1.0);
  if (nvme_params) {
    c.links.nvme_write = u(2, 8) * kGBps;
    c.links.nvme_read = u(2, 8) * kGBps;
    c.budgets.nvme_bytes = 64 * GiB;
    c.budgets.param_tier = Tier::kNvme;
  }
  c.budgets.params = ParamPolicy::kAuto;
  c.budgets.rest_parameter_bytes = static_cast<std::uint64_t>(u(0, 300) * MiB);
  c.budgets.fixed_device_bytes = 512 * MiB;
  c.budgets.prefetch_bytes = 32 * MiB;
  // Between the floor (every unit fetched, nothing kept) and everything resident and kept.
  std::uint64_t all = c.budgets.fixed_device_bytes + c.budgets.prefetch_bytes + c.budgets.rest_parameter_bytes;
  std::uint64_t params = 0, working = 0, largest = c.budgets.rest_parameter_bytes;
  for (const auto& p : c.blocks) {
    all += p.saved_bytes() + p.transient_bytes + p.parameter_bytes;
    params += p.parameter_bytes;
    working = std::max(working, p.saved_bytes() + p.transient_bytes);
    largest = std::max(largest, p.parameter_bytes);
  }
  const std::uint64_t floor = c.budgets.fixed_device_bytes + c.budgets.prefetch_bytes + working + 2 * largest;
  c.budgets.device_bytes = floor + static_cast<std::uint64_t>(u(0, 1) * static_cast<double>(all - floor));
  c.budgets.host_bytes = u(0, 1) < 0.5 ? 1024 * GiB : static_cast<std::uint64_t>(u(0.5, 1.5) * params);
  return c;
}

// Every joint choice: per block a mode, tier, alpha on a grid and its parameters' residence; the rest unit's.
struct Best {
  double seconds = std::numeric_limits<double>::infinity();
  std::vector<BlockPlan> assignment;
  Tier rest = Tier::kGpu;
};

Best brute_force(const Case& c, int alpha_steps) {
  const bool nvme = c.budgets.nvme_bytes > 0;
  std::vector<BlockPlan> options;
  for (Tier params : {Tier::kGpu, c.budgets.param_tier}) {
    BlockPlan keep;
    keep.params = params;
    options.push_back(keep);
    for (SwapTier tier : {SwapTier::kHost, SwapTier::kNvme}) {
      if (tier == SwapTier::kNvme && !nvme) continue;
      for (BlockMode mode : {BlockMode::kSwap, BlockMode::kRecompute, BlockMode::kSplit}) {
        for (int k = 0; k <= (mode == BlockMode::kSplit ? alpha_steps : 0); ++k) {
          BlockPlan b;
          b.mode = mode;
          b.tier = tier;
          b.params = params;
          b.alpha = mode == BlockMode::kSplit ? static_cast<double>(k) / alpha_steps : 0;
          options.push_back(b);
        }
      }
    }
  }
  Best best;
  std::vector<BlockPlan> current(c.blocks.size());
  auto recurse = [&](auto&& self, std::size_t i) -> void {
    if (i == c.blocks.size()) {
      for (Tier rest : {Tier::kGpu, c.budgets.param_tier}) {
        const Plan p = evaluate_plan(c.blocks, c.links, c.budgets, current, rest);
        if (p.fits && p.predicted_step_seconds < best.seconds) best = {p.predicted_step_seconds, current, rest};
      }
      return;
    }
    for (const auto& o : options) {
      if (o.mode == BlockMode::kSplit && !c.blocks[i].splittable) continue;
      current[i] = o;
      self(self, i + 1);
    }
  };
  recurse(recurse, 0);
  return best;
}

// The planner's plan is the model's (evaluate_plan gives its figures), within budget, and no slower than the
// brute force's best; with no split on a grid, exactly as fast. Returns whether the case traded residences.
bool check(const Case& c, int alpha_steps) {
  const Best bf = brute_force(c, alpha_steps);
  Plan plan;
  try {
    plan = plan_activations(c.blocks, c.links, c.budgets);
  } catch (const out_of_memory& e) {
    EXPECT_FALSE(std::isfinite(bf.seconds)) << e.what();
    return false;
  }
  const bool splits = c.blocks[0].splittable;
  if (!splits) {
    EXPECT_TRUE(std::isfinite(bf.seconds)) << plan.summary();
  }
  EXPECT_TRUE(plan.fits) << plan.summary();
  EXPECT_TRUE(plan.proven_optimal);
  const Plan again = evaluate_plan(c.blocks, c.links, c.budgets, plan.blocks, plan.rest_params);
  EXPECT_DOUBLE_EQ(again.predicted_step_seconds, plan.predicted_step_seconds);
  EXPECT_EQ(again.predicted_device_peak_bytes, plan.predicted_device_peak_bytes);
  EXPECT_LE(plan.predicted_device_peak_bytes, c.budgets.device_bytes);
  EXPECT_LE(plan.host_bytes, c.budgets.host_bytes);
  if (std::isfinite(bf.seconds)) {
    EXPECT_LE(plan.predicted_step_seconds, bf.seconds * (1 + 1e-9))
        << plan.summary() << "\nbrute force: "
        << evaluate_plan(c.blocks, c.links, c.budgets, bf.assignment, bf.rest).summary();
    if (!splits) {
      EXPECT_NEAR(plan.predicted_step_seconds, bf.seconds, bf.seconds * 1e-9) << plan.summary();
    }
  }
  int fetched = 0;
  for (const auto& b : plan.blocks) fetched += b.params != Tier::kGpu;
  return fetched > 0 && fetched < static_cast<int>(plan.blocks.size());
}

}  // namespace

TEST(JointPlanner, MatchesBruteForceOnUnsplittableMixedBlocks) {
  int traded = 0;
  for (std::uint64_t seed = 1; seed <= 30; ++seed) traded += check(random_case(seed, 4, false, false, seed % 3 == 0), 1);
  EXPECT_GT(traded, 2) << "too few cases traded resident against fetched blocks";
}

TEST(JointPlanner, MatchesBruteForceOnIdenticalBlocks) {
  int traded = 0;
  for (std::uint64_t seed = 20; seed <= 27; ++seed) traded += check(random_case(seed, 3, true, seed % 2 == 0, false), 4);
  EXPECT_GT(traded, 0);
}

TEST(JointPlanner, MatchesBruteForceWithSplitsAndParametersOnNvme) {
  for (std::uint64_t seed = 40; seed <= 45; ++seed) check(random_case(seed, 2, false, true, seed % 2 == 0), 4);
  for (std::uint64_t seed = 46; seed <= 48; ++seed) check(random_case(seed, 3, false, true, true), 2);
}

TEST(JointPlanner, ManyDistinctBlocksFetchTheLargestAndSaySoWithinBudget) {
  int unproven = 0;
  for (std::uint64_t seed = 100; seed < 110; ++seed) {
    const Case c = random_case(seed, 10, false, true, false);  // 2^10 fetched sets: past kMaxParamChoices
    Plan plan;
    try {
      plan = plan_activations(c.blocks, c.links, c.budgets);
    } catch (const out_of_memory&) {
      continue;  // the host budget is drawn too small for some
    }
    EXPECT_TRUE(plan.fits) << plan.summary();
    unproven += !plan.proven_optimal;
    // Unless everything is kept and resident (the fastest plan there is), the search says it is not exact.
    EXPECT_TRUE(!plan.proven_optimal || plan.predicted_step_seconds <= plan.keep_all_step_seconds) << plan.summary();
    // The fetched blocks are the ones with the most parameters.
    std::uint64_t smallest_fetched = ~0ULL, largest_resident = 0;
    for (std::size_t i = 0; i < c.blocks.size(); ++i) {
      if (plan.blocks[i].params == Tier::kGpu) largest_resident = std::max(largest_resident, c.blocks[i].parameter_bytes);
      else smallest_fetched = std::min(smallest_fetched, c.blocks[i].parameter_bytes);
    }
    EXPECT_TRUE(smallest_fetched == ~0ULL || largest_resident <= smallest_fetched) << plan.summary();
  }
  EXPECT_GT(unproven, 0);
}

TEST(JointPlanner, ResidentParametersLeaveThePlansOfActivationsAlone) {
  for (std::uint64_t seed = 60; seed <= 70; ++seed) {
    Case c = random_case(seed, 4, false, true, false);
    c.budgets.params = ParamPolicy::kResident;
    c.budgets.device_bytes *= 2;
    std::vector<BlockProfile> without = c.blocks;
    for (auto& p : without) p.parameter_bytes = 0;
    const Plan a = plan_activations(c.blocks, c.links, c.budgets);
    const Plan b = plan_activations(without, c.links, c.budgets);
    EXPECT_EQ(a.summary(), b.summary());
    EXPECT_EQ(a.predicted_device_peak_bytes, b.predicted_device_peak_bytes);
    EXPECT_EQ(a.device_param_bytes, 0u);
    for (const auto& blk : a.blocks) EXPECT_EQ(blk.params, Tier::kGpu);
  }
}

TEST(JointPlanner, FetchAllFetchesEveryUnitAndCountsTheWindow) {
  Case c = random_case(80, 3, true, true, false);
  c.budgets.params = ParamPolicy::kFetchAll;
  c.budgets.device_bytes = 64 * GiB;
  c.budgets.host_bytes = 1024 * GiB;
  const Plan plan = plan_activations(c.blocks, c.links, c.budgets);
  std::uint64_t params = c.budgets.rest_parameter_bytes;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    EXPECT_EQ(plan.blocks[i].params, Tier::kHost) << plan.block_line(i);
    params += c.blocks[i].parameter_bytes;
  }
  EXPECT_EQ(plan.rest_params, Tier::kHost);
  EXPECT_EQ(plan.device_param_bytes, 0u);
  EXPECT_EQ(plan.host_param_bytes, params);
  const std::uint64_t p = c.blocks[0].parameter_bytes, r = c.budgets.rest_parameter_bytes;
  EXPECT_EQ(plan.param_window_bytes, p + std::max(p, r));
  EXPECT_EQ(plan.param_prefetch_bytes, std::max(p, r));
  EXPECT_NE(plan.summary().find("3 blocks fetched"), std::string::npos) << plan.summary();
  EXPECT_NE(plan.block_line(0).find("params fetched from host"), std::string::npos) << plan.block_line(0);
  // Every block kept: the device holds the window beside the activations, not the parameters.
  EXPECT_EQ(plan.predicted_device_peak_bytes, evaluate_plan(c.blocks, c.links, c.budgets, plan.blocks).predicted_device_peak_bytes);
}

TEST(JointPlannerCostModel, FetchedParametersShareTheHostToDeviceLink) {
  BlockProfile p;
  p.forward_seconds = 1 * kMs;
  p.backward_seconds = 2 * kMs;
  p.input_bytes = 10 * MiB;
  p.parameter_bytes = 100 * MiB;
  p.splittable = false;
  Links links;
  links.d2h = links.h2d = 10 * kGBps;
  Budgets budgets;
  budgets.params = ParamPolicy::kAuto;
  budgets.device_bytes = budgets.host_bytes = 64 * GiB;
  BlockPlan b;
  b.mode = BlockMode::kSwap;
  b.params = Tier::kHost;
  const Plan plan = evaluate_plan({p}, links, budgets, {b});
  const double P = 100.0 * MiB, s = 10.0 * MiB;
  EXPECT_DOUBLE_EQ(plan.blocks[0].forward_seconds, std::max({1 * kMs, s / links.d2h, P / links.h2d}));
  EXPECT_DOUBLE_EQ(plan.blocks[0].backward_seconds, std::max(2 * kMs, (s + P) / links.h2d));
  // Resident: the activations' model alone.
  b.params = Tier::kGpu;
  const Plan resident = evaluate_plan({p}, links, budgets, {b});
  EXPECT_DOUBLE_EQ(resident.blocks[0].backward_seconds, std::max(2 * kMs, s / links.h2d));
  EXPECT_EQ(resident.device_param_bytes, p.parameter_bytes);
  EXPECT_EQ(plan.device_param_bytes, 0u);
  EXPECT_EQ(plan.param_window_bytes, p.parameter_bytes);
  EXPECT_EQ(plan.host_param_bytes, p.parameter_bytes);
  EXPECT_EQ(plan.host_bytes, p.parameter_bytes + p.input_bytes);
}

TEST(JointPlanner, ABudgetBelowOneBlocksParametersAndWorkingSetNamesTheBytes) {
  Case c = random_case(90, 3, true, true, false);
  c.budgets.params = ParamPolicy::kFetchAll;
  c.budgets.rest_parameter_bytes = 0;
  c.budgets.host_bytes = 1024 * GiB;
  const BlockProfile& p = c.blocks[0];
  const std::uint64_t needed = c.budgets.fixed_device_bytes + p.saved_bytes() + p.transient_bytes +
                               2 * p.parameter_bytes + c.budgets.prefetch_bytes;
  c.budgets.device_bytes = needed - 1;
  try {
    plan_activations(c.blocks, c.links, c.budgets);
    FAIL() << "a budget below the floor planned";
  } catch (const out_of_memory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("needs " + std::to_string(needed) + " bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("the device budget is " + format_bytes(needed - 1)), std::string::npos) << m;
    EXPECT_NE(m.find("parameters of the running and the prefetched unit"), std::string::npos) << m;
  }
  c.budgets.device_bytes = needed;
  EXPECT_NO_THROW(plan_activations(c.blocks, c.links, c.budgets));
}

TEST(JointPlanner, BadParameterSettingsAreConfigErrors) {
  Case c = random_case(91, 2, true, true, false);
  c.budgets.param_tier = Tier::kGpu;
  EXPECT_THROW(plan_activations(c.blocks, c.links, c.budgets), config_error);
  c.budgets.param_tier = Tier::kNvme;  // no NVMe tier
  EXPECT_THROW(plan_activations(c.blocks, c.links, c.budgets), config_error);
  c.budgets.param_tier = Tier::kHost;
  c.budgets.params = ParamPolicy::kResident;
  std::vector<BlockPlan> fetched(2);
  fetched[0].params = Tier::kHost;
  EXPECT_THROW(evaluate_plan(c.blocks, c.links, c.budgets, fetched), std::logic_error);
}
