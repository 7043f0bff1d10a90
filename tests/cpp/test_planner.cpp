// The activation planner against brute force over its own model (Note [Activation planner]).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

BlockProfile random_profile(std::mt19937_64& rng, bool allow_unsplittable) {
  auto u = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto mib = [&](double lo, double hi) { return static_cast<std::uint64_t>(u(lo, hi) * MiB); };
  BlockProfile p;
  p.forward_seconds = u(1, 4) * kMs;
  p.backward_seconds = 2 * p.forward_seconds * u(0.8, 1.2);
  p.input_bytes = mib(8, 32);
  p.whole_bytes = mib(8, 40);
  p.split_bytes = mib(50, 250);
  p.split_recompute_seconds = u(0.3, 0.7) * p.forward_seconds;
  p.cheap_bytes = mib(20, 200);
  p.cheap_recompute_seconds = u(0.02, 0.2) * p.forward_seconds;
  p.splittable = !allow_unsplittable || u(0, 1) < 0.7;
  p.transient_bytes = mib(10, 100);
  return p;
}

std::uint64_t total_saved(const std::vector<BlockProfile>& blocks) {
  std::uint64_t s = 0;
  for (const auto& p : blocks) s += p.saved_bytes();
  return s;
}

std::uint64_t largest_working_set(const std::vector<BlockProfile>& blocks) {
  std::uint64_t w = 0;
  for (const auto& p : blocks) w = std::max(w, p.saved_bytes() + p.transient_bytes);
  return w;
}

// One option of one block, as the model predicts it (from evaluate_plan on that block alone).
struct Option {
  BlockPlan plan;
  double seconds;
};

std::vector<Option> block_options(const BlockProfile& p, const Links& links, bool nvme, int alpha_steps) {
  std::vector<BlockPlan> raw;
  raw.push_back(BlockPlan{});
  for (SwapTier tier : {SwapTier::kHost, SwapTier::kNvme}) {
    if (tier == SwapTier::kNvme && !nvme) continue;
    for (BlockMode mode : {BlockMode::kSwap, BlockMode::kRecompute}) {
      BlockPlan b;
      b.mode = mode;
      b.tier = tier;
      raw.push_back(b);
    }
    if (!p.splittable) continue;
    for (int k = 0; k <= alpha_steps; ++k) {
      BlockPlan b;
      b.mode = BlockMode::kSplit;
      b.tier = tier;
      b.alpha = static_cast<double>(k) / alpha_steps;
      raw.push_back(b);
    }
  }
  std::vector<Option> out;
  for (const auto& b : raw) {
    Plan one = evaluate_plan({p}, links, Budgets{}, {b});
    out.push_back({one.blocks[0], one.predicted_step_seconds});
  }
  return out;
}

struct BruteForce {
  double best = std::numeric_limits<double>::infinity();
  std::vector<BlockPlan> assignment;
};

// Every combination of per-block options; peak and tier usage as in Note [Activation planner].
BruteForce brute_force(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                       int alpha_steps) {
  const bool nvme = budgets.nvme_bytes > 0 && links.nvme_read > 0 && links.nvme_write > 0;
  std::vector<std::vector<Option>> options;
  for (const auto& p : blocks) options.push_back(block_options(p, links, nvme, alpha_steps));
  BruteForce result;
  std::vector<BlockPlan> current(blocks.size());
  auto recurse = [&](auto&& self, std::size_t i, double seconds, std::uint64_t kept, std::uint64_t working,
                     std::uint64_t host, std::uint64_t disk, bool swapped) -> void {
    if (host > budgets.host_bytes || disk > budgets.nvme_bytes) return;
    if (i == blocks.size()) {
      const std::uint64_t peak =
          budgets.fixed_device_bytes + kept + working + (swapped ? budgets.prefetch_bytes : 0);
      if (peak <= budgets.device_bytes && seconds < result.best) {
        result.best = seconds;
        result.assignment = current;
      }
      return;
    }
    const auto& p = blocks[i];
    for (const auto& o : options[i]) {
      current[i] = o.plan;
      const bool keep = o.plan.mode == BlockMode::kKeep;
      const bool on_host = o.plan.tier == SwapTier::kHost;
      self(self, i + 1, seconds + o.seconds, kept + (keep ? p.saved_bytes() : 0),
           std::max(working, p.transient_bytes + (keep ? 0 : p.saved_bytes())),
           host + (!keep && on_host ? o.plan.swap_bytes : 0), disk + (!keep && !on_host ? o.plan.swap_bytes : 0),
           swapped || o.plan.swap_bytes > 0);
    }
  };
  recurse(recurse, 0, 0.0, 0, 0, 0, 0, false);
  return result;
}

void expect_well_formed(const Plan& plan, const std::vector<BlockProfile>& blocks, const Budgets& budgets) {
  ASSERT_EQ(plan.blocks.size(), blocks.size());
  EXPECT_TRUE(plan.fits) << plan.summary();
  EXPECT_LE(plan.predicted_device_peak_bytes, budgets.device_bytes);
  EXPECT_LE(plan.host_bytes, budgets.host_bytes);
  EXPECT_LE(plan.nvme_bytes, budgets.nvme_bytes);
  std::uint64_t host = 0, disk = 0;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    EXPECT_NEAR(b.keep + b.swap + b.recompute, 1.0, 1e-12) << plan.block_line(i);
    EXPECT_GE(b.keep, 0);
    EXPECT_GE(b.swap, 0);
    EXPECT_GE(b.recompute, -1e-12);
    if (!blocks[i].splittable) {
      EXPECT_NE(b.mode, BlockMode::kSplit) << plan.block_line(i);
    }
    if (b.mode != BlockMode::kKeep) (b.tier == SwapTier::kHost ? host : disk) += b.swap_bytes;
  }
  EXPECT_EQ(host, plan.host_bytes);
  EXPECT_EQ(disk, plan.nvme_bytes);
  // The plan's numbers are the model's numbers.
  Plan again = evaluate_plan(blocks, Links{}, budgets, plan.blocks);
  EXPECT_EQ(again.predicted_device_peak_bytes, plan.predicted_device_peak_bytes);
}

struct Case {
  std::vector<BlockProfile> blocks;
  Links links;
  Budgets budgets;
};

enum class Kind { kIdentical, kSameBytes, kMixed };

// The optimizer offloaded (Note [Activation planner]): weights up in forward, gradients down in backward,
// a shared link limit below the sum, compute and copies slowed by each other.
void add_optimizer_traffic(Case& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 1);
  auto u = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  const bool identical = std::all_of(c.blocks.begin(), c.blocks.end(),
                                     [&](const BlockProfile& p) { return p.saved_bytes() == c.blocks[0].saved_bytes(); });
  const auto up = static_cast<std::uint64_t>(u(20, 300) * MiB);
  for (auto& p : c.blocks) {
    p.upload_bytes = identical ? up : static_cast<std::uint64_t>(u(20, 300) * MiB);
    p.download_bytes = p.upload_bytes;  // the parameters' bytes, each way
  }
  c.links.duplex = u(0.6, 1.0) * (c.links.d2h + c.links.h2d);
  c.links.compute_share_during_copies = u(0.7, 1.0);
  c.links.copy_share_during_cpu_step = u(0.5, 1.0);
}

Case random_case(std::uint64_t seed, std::size_t n, Kind kind, bool with_nvme, bool tight_host) {
  std::mt19937_64 rng(seed);
  auto u = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  Case c;
  if (kind == Kind::kIdentical) {
    c.blocks.assign(n, random_profile(rng, false));
  } else if (kind == Kind::kSameBytes) {  // measured layers: the same bytes, times apart
    const BlockProfile base = random_profile(rng, true);
    for (std::size_t i = 0; i < n; ++i) {
      BlockProfile p = base;
      p.forward_seconds *= u(0.8, 1.2);
      p.backward_seconds *= u(0.8, 1.2);
      p.split_recompute_seconds *= u(0.8, 1.2);
      p.cheap_recompute_seconds *= u(0.8, 1.2);
      c.blocks.push_back(p);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) c.blocks.push_back(random_profile(rng, true));
  }
  c.links.d2h = u(10, 60) * kGBps;
  c.links.h2d = u(10, 60) * kGBps;
  c.links.duplex = c.links.d2h + c.links.h2d;
  if (with_nvme) {
    c.links.nvme_write = u(2, 8) * kGBps;
    c.links.nvme_read = u(2, 8) * kGBps;
    c.budgets.nvme_bytes = 64 * GiB;
  }
  c.budgets.fixed_device_bytes = 1 * GiB;
  c.budgets.prefetch_bytes = 64 * MiB;
  c.budgets.device_bytes = c.budgets.fixed_device_bytes + largest_working_set(c.blocks) + c.budgets.prefetch_bytes +
                           static_cast<std::uint64_t>(u(0, 1) * static_cast<double>(total_saved(c.blocks)));
  std::uint64_t inputs = 0;
  for (const auto& p : c.blocks) inputs += p.input_bytes;
  c.budgets.host_bytes = tight_host ? static_cast<std::uint64_t>(inputs * u(1.0, 4.0)) : 1024 * GiB;
  return c;
}

// The planner's predicted step is at most the brute force's best, and its plan is within budget.
// Returns whether the case was a real trade-off: a split with 0 < alpha < 1, or NVMe used.
bool check_against_brute_force(const Case& c, int alpha_steps) {
  const BruteForce bf = brute_force(c.blocks, c.links, c.budgets, alpha_steps);
  if (!std::isfinite(bf.best)) {
    // Nothing on the grid fits; the planner (continuous alphas) may still find a plan.
    try {
      Plan plan = plan_activations(c.blocks, c.links, c.budgets);
      expect_well_formed(plan, c.blocks, c.budgets);
    } catch (const out_of_memory&) {
    }
    return false;
  }
  Plan plan = plan_activations(c.blocks, c.links, c.budgets);
  expect_well_formed(plan, c.blocks, c.budgets);
  EXPECT_TRUE(plan.proven_optimal);
  EXPECT_LE(plan.predicted_step_seconds, bf.best * (1 + 1e-9))
      << plan.summary() << "\nbrute force: "
      << evaluate_plan(c.blocks, c.links, c.budgets, bf.assignment).summary();
  return plan.nvme_bytes > 0 || std::any_of(plan.blocks.begin(), plan.blocks.end(), [](const BlockPlan& b) {
           return b.mode == BlockMode::kSplit && b.alpha > 0 && b.alpha < 1;
         });
}

TEST(ActivationPlanner, EverythingFitsKeepsEverything) {
  std::mt19937_64 rng(1);
  std::vector<BlockProfile> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(random_profile(rng, true));
  Budgets budgets;
  budgets.fixed_device_bytes = 2 * GiB;
  budgets.prefetch_bytes = 64 * MiB;
  std::uint64_t transient = 0;
  for (const auto& p : blocks) transient = std::max(transient, p.transient_bytes);
  budgets.device_bytes = budgets.fixed_device_bytes + total_saved(blocks) + transient;  // exactly enough
  budgets.host_bytes = 64 * GiB;
  Links links{20 * kGBps, 20 * kGBps, 35 * kGBps, 0, 0};
  Plan plan = plan_activations(blocks, links, budgets);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(plan.blocks[i].mode, BlockMode::kKeep) << plan.block_line(i);
    EXPECT_EQ(plan.blocks[i].keep, 1.0);
  }
  EXPECT_EQ(plan.predicted_device_peak_bytes, budgets.device_bytes);
  EXPECT_DOUBLE_EQ(plan.predicted_step_seconds, plan.keep_all_step_seconds);
  EXPECT_EQ(plan.host_bytes, 0u);
  // One byte less and a block must leave the device.
  budgets.device_bytes -= 1;
  Plan tighter = plan_activations(blocks, links, budgets);
  EXPECT_TRUE(std::any_of(tighter.blocks.begin(), tighter.blocks.end(),
                          [](const BlockPlan& b) { return b.mode != BlockMode::kKeep; }));
  expect_well_formed(tighter, blocks, budgets);
}

TEST(ActivationPlanner, BelowTheFloorSaysHowMuchIsNeeded) {
  std::mt19937_64 rng(2);
  std::vector<BlockProfile> blocks(4, random_profile(rng, false));
  Budgets budgets;
  budgets.fixed_device_bytes = 3 * GiB;
  budgets.prefetch_bytes = 64 * MiB;
  budgets.host_bytes = 64 * GiB;
  const std::uint64_t floor = budgets.fixed_device_bytes + largest_working_set(blocks) + budgets.prefetch_bytes;
  budgets.device_bytes = floor - 1;
  Links links{20 * kGBps, 20 * kGBps, 35 * kGBps, 0, 0};
  try {
    plan_activations(blocks, links, budgets);
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(floor)), std::string::npos) << e.what();
  }
  budgets.device_bytes = floor;  // exactly the floor: nothing kept, everything comes back in turn
  Plan plan = plan_activations(blocks, links, budgets);
  expect_well_formed(plan, blocks, budgets);
  EXPECT_EQ(plan.predicted_device_peak_bytes, floor);
  for (const auto& b : plan.blocks) EXPECT_NE(b.mode, BlockMode::kKeep);
}

TEST(ActivationPlanner, MatchesBruteForceOnIdenticalBlocks) {
  int tradeoffs = 0;
  for (std::uint64_t seed = 10; seed < 30; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    tradeoffs += check_against_brute_force(random_case(seed, 4, Kind::kIdentical, false, seed % 2 == 0), 20);
  }
  EXPECT_GE(tradeoffs, 5);  // the cases exercise the split, not only keep and recompute
}

TEST(ActivationPlanner, MatchesBruteForceOnMixedBlocks) {
  int tradeoffs = 0;
  for (std::uint64_t seed = 100; seed < 120; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    tradeoffs += check_against_brute_force(random_case(seed, 4, Kind::kMixed, false, seed % 2 == 0), 16);
  }
  for (std::uint64_t seed = 200; seed < 206; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    tradeoffs += check_against_brute_force(random_case(seed, 5, Kind::kMixed, false, seed % 2 == 0), 8);
  }
  EXPECT_GE(tradeoffs, 5);
}

TEST(ActivationPlanner, MatchesBruteForceOnSameBytesBlocks) {
  // Blocks that may trade choices (the search's symmetry rule) with and without NVMe.
  int tradeoffs = 0;
  for (std::uint64_t seed = 400; seed < 420; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    tradeoffs += check_against_brute_force(random_case(seed, 4, Kind::kSameBytes, false, seed % 2 == 0), 16);
  }
  for (std::uint64_t seed = 500; seed < 510; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    tradeoffs += check_against_brute_force(random_case(seed, 3, Kind::kSameBytes, true, true), 12);
  }
  EXPECT_GE(tradeoffs, 5);
}

TEST(ActivationPlanner, MatchesBruteForceWithNvme) {
  int tradeoffs = 0;
  for (std::uint64_t seed = 300; seed < 316; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Kind kind = seed % 4 == 0 ? Kind::kIdentical : Kind::kMixed;
    tradeoffs += check_against_brute_force(random_case(seed, 3, kind, true, true), 16);
  }
  EXPECT_GE(tradeoffs, 3);
}

TEST(ActivationPlanner, MatchesBruteForceWithOptimizerTraffic) {
  int tradeoffs = 0;
  for (std::uint64_t seed = 400; seed < 424; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Kind kind = seed % 3 == 0 ? Kind::kIdentical : seed % 3 == 1 ? Kind::kMixed : Kind::kSameBytes;
    Case c = random_case(seed, seed % 2 ? 3 : 4, kind, seed % 4 == 0, seed % 2 == 0);
    add_optimizer_traffic(c, seed);
    tradeoffs += check_against_brute_force(c, 12);
  }
  EXPECT_GE(tradeoffs, 3);
}

TEST(ActivationPlannerCostModel, OptimizerTrafficSharesTheLink) {
  // One block swapped whole to the host, by hand from Note [Activation planner].
  BlockProfile p;
  p.forward_seconds = 1;
  p.backward_seconds = 2;
  p.input_bytes = 30;  // s = 30 bytes swapped
  p.upload_bytes = 20;
  p.download_bytes = 40;
  Links l;
  l.d2h = 10;
  l.h2d = 20;
  BlockPlan swap;
  swap.mode = BlockMode::kSwap;
  auto times = [&](const Links& links) {
    const Plan plan = evaluate_plan({p}, links, Budgets{}, {swap});
    return std::make_pair(plan.blocks[0].forward_seconds, plan.blocks[0].backward_seconds);
  };
  // No shared limit: forward max(1, 30/10, 20/20) = 3; backward max(2, 30/20, 40/10) = 4.
  EXPECT_EQ(times(l), std::make_pair(3.0, 4.0));
  l.duplex = 12.5;  // (30 + 20) / 12.5 = 4 in forward, (30 + 40) / 12.5 = 5.6 in backward
  EXPECT_DOUBLE_EQ(times(l).first, 4.0);
  EXPECT_DOUBLE_EQ(times(l).second, 5.6);
  l.duplex = 0;
  l.copy_share_during_cpu_step = 0.5;  // the CPU kernel halves the links in backward: 40 / 5 = 8
  EXPECT_DOUBLE_EQ(times(l).second, 8.0);
  EXPECT_DOUBLE_EQ(times(l).first, 3.0) << "the kernel runs in backward only";
  l.copy_share_during_cpu_step = 1;
  l.compute_share_during_copies = 0.25;  // compute 1 / 0.25 = 4 beside copies, 2 / 0.25 = 8
  EXPECT_EQ(times(l), std::make_pair(4.0, 8.0));
  // A kept block with no optimizer traffic copies nothing: its compute is not slowed.
  BlockProfile quiet = p;
  quiet.upload_bytes = quiet.download_bytes = 0;
  const Plan kept = evaluate_plan({quiet}, l, Budgets{}, {BlockPlan{}});
  EXPECT_EQ(kept.predicted_step_seconds, 3.0);
  // Kept, it still carries the weights and gradients: keep-all is bound by them.
  const Plan kept_busy = evaluate_plan({p}, l, Budgets{}, {BlockPlan{}});
  EXPECT_DOUBLE_EQ(kept_busy.blocks[0].forward_seconds, 4.0);  // max(1/0.25, 20/20)
  EXPECT_DOUBLE_EQ(kept_busy.blocks[0].backward_seconds, 8.0);  // max(2/0.25, 40/10)
  EXPECT_DOUBLE_EQ(kept_busy.keep_all_step_seconds, 12.0);
}

TEST(ActivationPlannerCostModel, SplitTimeIsConvexWithItsBreakpointsWhereTermsCross) {
  // A split block with optimizer traffic: its time at every alpha on a fine grid lies on the lines
  // between its breakpoints (piecewise linear), and the search's best alpha is a breakpoint's.
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    Case c = random_case(500 + trial, 1, Kind::kIdentical, trial % 2 == 0, false);
    add_optimizer_traffic(c, 500 + trial);
    const BlockProfile& p = c.blocks[0];
    for (SwapTier tier : {SwapTier::kHost, SwapTier::kNvme}) {
      if (tier == SwapTier::kNvme && c.links.nvme_write == 0) continue;
      auto t = [&](double a) {
        BlockPlan b;
        b.mode = BlockMode::kSplit;
        b.tier = tier;
        b.alpha = a;
        return evaluate_plan({p}, c.links, Budgets{}, {b}).predicted_step_seconds;
      };
      double prev_slope = -1e300;
      for (int k = 0; k < 200; ++k) {
        const double a0 = k / 200.0, a1 = (k + 1) / 200.0, mid = (a0 + a1) / 2;
        const double slope = (t(a1) - t(a0)) / (a1 - a0);
        EXPECT_GE(slope, prev_slope - 1e-9 * std::abs(prev_slope) - 1e-12) << "convex, trial " << trial;
        prev_slope = slope;
        EXPECT_LE(t(mid), (t(a0) + t(a1)) / 2 * (1 + 1e-12) + 1e-15) << "trial " << trial;
      }
    }
  }
}

TEST(ActivationPlannerCostModel, SharesOutsideZeroToOneAreRefused) {
  std::mt19937_64 rng(18);
  const std::vector<BlockProfile> blocks(2, random_profile(rng, false));
  Budgets budgets;
  budgets.device_bytes = 64 * GiB;
  budgets.host_bytes = 64 * GiB;
  for (double bad : {0.0, -0.5, 1.5, std::nan(""), HUGE_VAL}) {
    for (int which = 0; which < 2; ++which) {
      Links l{20 * kGBps, 20 * kGBps, 35 * kGBps, 0, 0};
      (which ? l.copy_share_during_cpu_step : l.compute_share_during_copies) = bad;
      try {
        plan_activations(blocks, l, budgets);
        ADD_FAILURE() << "planned with share " << bad;
      } catch (const config_error& e) {
        EXPECT_NE(std::string(e.what()).find("accepted: a fraction in (0, 1]"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(ActivationPlanner, HostBudgetIsRespectedAndNvmeTakesTheRest) {
  std::mt19937_64 rng(3);
  std::vector<BlockProfile> blocks(8, random_profile(rng, false));
  Links links{25 * kGBps, 25 * kGBps, 45 * kGBps, 6 * kGBps, 7 * kGBps};
  Budgets budgets;
  budgets.fixed_device_bytes = 1 * GiB;
  budgets.prefetch_bytes = 64 * MiB;
  budgets.device_bytes = budgets.fixed_device_bytes + largest_working_set(blocks) + budgets.prefetch_bytes;
  // Host holds the inputs of half the blocks: the rest must go to NVMe.
  budgets.host_bytes = 4 * blocks[0].input_bytes + blocks[0].input_bytes / 2;
  budgets.nvme_bytes = 64 * GiB;
  Plan plan = plan_activations(blocks, links, budgets);
  expect_well_formed(plan, blocks, budgets);
  EXPECT_GT(plan.nvme_bytes, 0u) << plan.summary();
  EXPECT_GT(plan.host_bytes, 0u) << plan.summary();
  // Without NVMe the same budgets cannot hold the swapped inputs.
  Budgets no_nvme = budgets;
  no_nvme.nvme_bytes = 0;
  EXPECT_THROW(plan_activations(blocks, links, no_nvme), out_of_memory);
}

TEST(ActivationPlanner, UnsplittableBlocksAreNeverSplit) {
  std::mt19937_64 rng(4);
  std::vector<BlockProfile> blocks(6, random_profile(rng, false));
  for (std::size_t i = 0; i < blocks.size(); i += 2) blocks[i].splittable = false;
  Links links{30 * kGBps, 30 * kGBps, 50 * kGBps, 0, 0};
  Budgets budgets;
  budgets.fixed_device_bytes = 1 * GiB;
  budgets.device_bytes = budgets.fixed_device_bytes + largest_working_set(blocks);
  budgets.host_bytes = 64 * GiB;
  Plan plan = plan_activations(blocks, links, budgets);
  expect_well_formed(plan, blocks, budgets);
  bool split_seen = false;
  for (std::size_t i = 0; i < blocks.size(); ++i) split_seen = split_seen || plan.blocks[i].mode == BlockMode::kSplit;
  EXPECT_TRUE(split_seen) << "the splittable blocks should split here: " << plan.summary();
  Plan forced = forced_plan(blocks, links, budgets, BlockMode::kSplit);
  for (std::size_t i = 0; i < blocks.size(); i += 2) EXPECT_EQ(forced.blocks[i].mode, BlockMode::kRecompute);
  std::vector<BlockPlan> bad(blocks.size());
  bad[0].mode = BlockMode::kSplit;
  EXPECT_THROW(evaluate_plan(blocks, links, budgets, bad), logic_error);
}

TEST(ActivationPlanner, ForcedPlansFollowTheirMode) {
  std::mt19937_64 rng(5);
  std::vector<BlockProfile> blocks(5, random_profile(rng, false));
  const auto& p = blocks[0];
  // A link that moves input, whole and half the split rows in one forward.
  const double d2h = static_cast<double>(p.input_bytes + p.whole_bytes + p.split_bytes / 2) / p.forward_seconds;
  Links links{d2h, d2h, 2 * d2h, 0, 0};
  Budgets budgets;
  budgets.device_bytes = 64 * GiB;
  budgets.host_bytes = 64 * GiB;
  Plan recompute = forced_plan(blocks, links, budgets, BlockMode::kRecompute);
  for (const auto& b : recompute.blocks) {
    EXPECT_EQ(b.mode, BlockMode::kRecompute);
    EXPECT_EQ(b.swap_bytes, p.input_bytes);
    EXPECT_DOUBLE_EQ(b.swap, static_cast<double>(p.input_bytes) / static_cast<double>(p.saved_bytes()));
    EXPECT_DOUBLE_EQ(b.backward_seconds,
                     std::max(p.backward_seconds + p.forward_seconds, p.input_bytes / links.h2d));
  }
  // MEMO's link rule: the swap-out of input, whole and alpha of the split rows takes the forward's time.
  Plan split = forced_plan(blocks, links, budgets, BlockMode::kSplit);
  const double expected =
      std::clamp((p.forward_seconds * links.d2h - static_cast<double>(p.input_bytes + p.whole_bytes)) /
                     static_cast<double>(p.split_bytes), 0.0, 1.0);
  ASSERT_GT(expected, 0.0);
  ASSERT_LT(expected, 1.0);
  for (const auto& b : split.blocks) {
    EXPECT_EQ(b.mode, BlockMode::kSplit);
    EXPECT_NEAR(b.alpha, expected, 1.0 / static_cast<double>(p.split_bytes));
  }
  // A host budget halfway between alpha 0 and the link rule's bytes caps every alpha alike.
  Budgets small = budgets;
  small.host_bytes = (split.host_bytes + blocks.size() * (p.input_bytes + p.whole_bytes)) / 2;
  Plan capped = forced_plan(blocks, links, small, BlockMode::kSplit);
  EXPECT_TRUE(capped.fits) << capped.summary();
  EXPECT_NEAR(capped.blocks[0].alpha, expected / 2, 1e-6);
  EXPECT_EQ(capped.blocks[0].alpha, capped.blocks.back().alpha);
  Plan swap = forced_plan(blocks, links, budgets, BlockMode::kSwap);
  for (const auto& b : swap.blocks) EXPECT_EQ(b.swap, 1.0);
}

TEST(ActivationPlanner, ManyIdenticalLayersPlanQuickly) {
  // 48 identical layers with an NVMe tier and a tight host: the grouped search must stay exact and finish.
  std::mt19937_64 rng(6);
  std::vector<BlockProfile> blocks(48, random_profile(rng, false));
  Links links{25 * kGBps, 25 * kGBps, 45 * kGBps, 6 * kGBps, 7 * kGBps};
  Budgets budgets;
  budgets.fixed_device_bytes = 4 * GiB;
  budgets.prefetch_bytes = 64 * MiB;
  budgets.device_bytes = budgets.fixed_device_bytes + largest_working_set(blocks) + budgets.prefetch_bytes +
                         total_saved(blocks) / 3;
  budgets.host_bytes = 40 * blocks[0].input_bytes;
  budgets.nvme_bytes = 256 * GiB;
  Plan plan = plan_activations(blocks, links, budgets);
  expect_well_formed(plan, blocks, budgets);
  EXPECT_TRUE(plan.proven_optimal);
  // Keep-tail: kept blocks are the last ones.
  bool kept_seen = false;
  for (const auto& b : plan.blocks) {
    if (b.mode == BlockMode::kKeep) {
      kept_seen = true;
    } else {
      EXPECT_FALSE(kept_seen) << plan.summary();
    }
  }
}

}  // namespace

namespace {

// Measured layers: the same bytes, times a little apart (no two profiles identical).
std::vector<BlockProfile> jittered_layers(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 rng(seed);
  const BlockProfile base = random_profile(rng, false);
  std::vector<BlockProfile> blocks;
  for (std::size_t i = 0; i < n; ++i) {
    auto p = base;
    const double j = std::uniform_real_distribution<double>(0.98, 1.02)(rng);
    p.forward_seconds *= j;
    p.backward_seconds *= j;
    p.split_recompute_seconds *= j;
    p.cheap_recompute_seconds *= j;
    blocks.push_back(p);
  }
  return blocks;
}

// With ample host memory the search proves its plan optimal at once. With a tight host and NVMe,
// 24 distinct profiles can exhaust the node limit: the plan is then the best found, still in budget.
TEST(ActivationPlanner, MeasuredLayersPlanWithinBudget) {
  for (bool tight_host : {false, true}) {
    SCOPED_TRACE(tight_host ? "tight host, NVMe" : "ample host");
    auto blocks = jittered_layers(7, 24);
    Links links{25 * kGBps, 25 * kGBps, 45 * kGBps, 6 * kGBps, 7 * kGBps};
    Budgets budgets;
    budgets.fixed_device_bytes = 4 * GiB;
    budgets.prefetch_bytes = 64 * MiB;
    budgets.device_bytes = budgets.fixed_device_bytes + largest_working_set(blocks) + budgets.prefetch_bytes +
                           total_saved(blocks) / 3;
    budgets.host_bytes = tight_host ? 20 * blocks[0].input_bytes : 1024 * GiB;
    budgets.nvme_bytes = tight_host ? 256 * GiB : 0;
    Plan plan = plan_activations(blocks, links, budgets);
    expect_well_formed(plan, blocks, budgets);
    if (!tight_host) {
      EXPECT_TRUE(plan.proven_optimal) << plan.summary();
    }
    Plan forced = forced_plan(blocks, links, budgets, BlockMode::kSplit);
    if (forced.fits) {
      EXPECT_LE(plan.predicted_step_seconds, forced.predicted_step_seconds);
    }
    // Averaged, the layers group: the plan is exact and every split layer gets the same alpha.
    auto averaged = average_same_shape_blocks(blocks);
    for (const auto& p : averaged) {
      EXPECT_EQ(p.saved_bytes(), blocks[0].saved_bytes());
      EXPECT_EQ(p.forward_seconds, averaged[0].forward_seconds);
    }
    Plan exact = plan_activations(averaged, links, budgets);
    expect_well_formed(exact, averaged, budgets);
    EXPECT_TRUE(exact.proven_optimal) << exact.summary();
  }
}

// Issue 16: a profile's bad times, bandwidths and bytes are the user's mistake (config_error, one line),
// and byte totals that would wrap around in the model's sums are refused rather than planned.
TEST(ActivationPlannerIssue16, BadProfilesAreConfigErrors) {
  std::mt19937_64 rng(16);
  const std::vector<BlockProfile> good(3, random_profile(rng, false));
  Budgets budgets;
  budgets.device_bytes = 64 * GiB;
  budgets.host_bytes = 64 * GiB;
  budgets.prefetch_bytes = 64 * MiB;
  const Links links{20 * kGBps, 20 * kGBps, 35 * kGBps, 0, 0};
  EXPECT_NO_THROW(plan_activations(good, links, budgets));
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    auto blocks = good;
    blocks[1].backward_seconds = bad;
    EXPECT_THROW(plan_activations(blocks, links, budgets), config_error) << bad;
    Links l = links;
    l.h2d = bad;
    EXPECT_THROW(plan_activations(good, l, budgets), config_error) << bad;
  }
}

TEST(ActivationPlannerIssue16, TotalsPastTwoToThe63AreRefused) {
  std::mt19937_64 rng(17);
  const std::vector<BlockProfile> good(3, random_profile(rng, false));
  Budgets budgets;
  budgets.device_bytes = UINT64_MAX;
  budgets.host_bytes = 64 * GiB;
  const Links links{20 * kGBps, 20 * kGBps, 35 * kGBps, 0, 0};
  auto expect_refused = [&](const std::vector<BlockProfile>& blocks, const Budgets& b) {
    try {
      plan_activations(blocks, links, b);
      ADD_FAILURE() << "planned";
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find("2^63"), std::string::npos) << e.what();
    }
  };
  Budgets b = budgets;
  b.fixed_device_bytes = UINT64_MAX - 10;  // fixed + prefetch wraps
  b.prefetch_bytes = 64 * MiB;
  expect_refused(good, b);
  b.fixed_device_bytes = std::uint64_t{1} << 63;
  b.prefetch_bytes = 0;
  expect_refused(good, b);
  auto blocks = good;
  blocks[0].split_bytes = UINT64_MAX;  // saved_bytes() itself wraps
  expect_refused(blocks, budgets);
  blocks = std::vector<BlockProfile>(4, good[0]);
  for (auto& p : blocks) p.cheap_bytes = std::uint64_t{1} << 61;  // each fits, the sum does not
  expect_refused(blocks, budgets);
}

}  // namespace

// Note [Activation planner], Outside the blocks: the search over blocks runs once with the saved tensors outside
// the blocks kept (in the fixed bytes) and once swapped (out of the host's budget, their unhidden round trip in the
// step); the plan is the faster, and the brute force over both choices finds nothing faster.
TEST(ActivationPlanner, TensorsOutsideTheBlocksAreKeptOrSwappedWhicheverIsFaster) {
  int kept = 0, swapped = 0;
  for (std::uint64_t seed = 700; seed < 760; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Case c = random_case(seed, 4, seed % 3 == 0 ? Kind::kMixed : Kind::kIdentical, false, seed % 2 == 0);
    std::mt19937_64 rng(seed);
    // Half the cases within the largest transient bytes (swapping them lowers the peak by all of them), half up
    // to more than every block saves (swapping lowers it by the transient bytes only).
    std::uint64_t transient = 0;
    for (const auto& p : c.blocks) transient = std::max(transient, p.transient_bytes);
    const double scale = static_cast<double>(seed % 2 ? transient : total_saved(c.blocks));
    if (seed % 4 == 1) {  // a fast link: their round trip costs less than the blocks' room it buys
      c.links.d2h *= 20;
      c.links.h2d *= 20;
      c.links.duplex *= 20;
    }
    const auto outside =
        static_cast<std::uint64_t>(std::uniform_real_distribution<double>(0.05, seed % 2 ? 1.0 : 1.5)(rng) * scale);
    const double round_trip = outside / c.links.d2h + outside / c.links.h2d;
    Budgets keep_budgets = c.budgets, swap_budgets = c.budgets;
    keep_budgets.fixed_device_bytes += outside;
    // Swapped, they are on the device where they are made and come back: beside every kept block, when no
    // working set is (at least the largest transient bytes).
    swap_budgets.fixed_device_bytes += outside - std::min(outside, transient);
    double best = brute_force(c.blocks, c.links, keep_budgets, 8).best;
    if (c.budgets.host_bytes >= outside) {
      swap_budgets.host_bytes -= outside;
      best = std::min(best, brute_force(c.blocks, c.links, swap_budgets, 8).best + round_trip);
    }
    c.budgets.outside_saved_bytes = outside;
    if (!std::isfinite(best)) {
      try {
        plan_activations(c.blocks, c.links, c.budgets);
      } catch (const out_of_memory& e) {
        EXPECT_NE(std::string(e.what()).find("outside the blocks"), std::string::npos) << e.what();
      }
      continue;
    }
    const Plan plan = plan_activations(c.blocks, c.links, c.budgets);
    EXPECT_TRUE(plan.fits) << plan.summary();
    EXPECT_LE(plan.predicted_step_seconds, best * (1 + 1e-9)) << plan.summary();
    EXPECT_EQ(plan.outside_bytes, outside);
    if (plan.outside_kept) {
      ++kept;
      EXPECT_EQ(plan.outside_swap_seconds, 0.0);
      // The same assignment without them on the device peaks exactly that much lower.
      Budgets none = c.budgets;
      none.outside_saved_bytes = 0;
      EXPECT_EQ(evaluate_plan(c.blocks, c.links, none, plan.blocks).predicted_device_peak_bytes + outside,
                plan.predicted_device_peak_bytes);
    } else {
      ++swapped;
      EXPECT_NEAR(plan.outside_swap_seconds, round_trip, 1e-12);
      std::uint64_t kept_bytes = 0;
      for (std::size_t i = 0; i < c.blocks.size(); ++i)
        kept_bytes += plan.blocks[i].mode == BlockMode::kKeep ? c.blocks[i].saved_bytes() : 0;
      EXPECT_GE(plan.predicted_device_peak_bytes, c.budgets.fixed_device_bytes + kept_bytes + outside)
          << "at the forward's end they are on the device beside every kept block";
      EXPECT_NE(plan.summary().find("outside the blocks"), std::string::npos) << plan.summary();
      std::uint64_t blocks_host = 0;
      for (const auto& b : plan.blocks) blocks_host += b.mode == BlockMode::kKeep ? 0 : b.swap_bytes;
      EXPECT_EQ(plan.host_bytes, blocks_host + outside) << "the host holds them beside the swapped blocks";
    }
    // evaluate_plan with the plan's choice gives the plan's figures.
    const Plan again = evaluate_plan(c.blocks, c.links, c.budgets, plan.blocks, plan.rest_params, plan.outside_kept);
    EXPECT_DOUBLE_EQ(again.predicted_step_seconds, plan.predicted_step_seconds);
    EXPECT_EQ(again.predicted_device_peak_bytes, plan.predicted_device_peak_bytes);
  }
  EXPECT_GE(kept, 3);
  EXPECT_GE(swapped, 1);  // and Replan.CalibrationPricesTheOutsideTensorsAsThePlanDoes: a case only swapping fits
}

TEST(ActivationPlanner, ForcedPlansSwapTheTensorsOutsideTheBlocksAsRecomputeDoes) {
  const Case c0 = random_case(42, 3, Kind::kIdentical, false, false);
  Case c = c0;
  c.budgets.outside_saved_bytes = 100 * MiB;
  const Plan recompute = forced_plan(c.blocks, c.links, c.budgets, BlockMode::kRecompute);
  const Plan bare = forced_plan(c0.blocks, c0.links, c0.budgets, BlockMode::kRecompute);
  EXPECT_FALSE(recompute.outside_kept);
  EXPECT_EQ(recompute.host_bytes, bare.host_bytes + 100 * MiB);
  std::uint64_t transient = 0;
  for (const auto& p : c.blocks) transient = std::max(transient, p.transient_bytes);
  EXPECT_EQ(recompute.predicted_device_peak_bytes,
            bare.predicted_device_peak_bytes + 100 * MiB - std::min<std::uint64_t>(100 * MiB, transient));
  EXPECT_GT(recompute.predicted_step_seconds, bare.predicted_step_seconds);
  const Plan keep = forced_plan(c.blocks, c.links, c.budgets, BlockMode::kKeep);
  EXPECT_TRUE(keep.outside_kept);
  EXPECT_EQ(keep.predicted_device_peak_bytes,
            forced_plan(c0.blocks, c0.links, c0.budgets, BlockMode::kKeep).predicted_device_peak_bytes + 100 * MiB);
}
