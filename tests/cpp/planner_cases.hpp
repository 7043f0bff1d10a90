// The activation planner's test cases: random profiles, the brute force over its own model, and the checks
// the planner's tests share (tests/cpp/test_planner*.cpp; Note [Activation planner]).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering::planner_cases {

using namespace tierflow;
using namespace tierflow::tiering;

constexpr double kGBps = 1e9;
constexpr double kMs = 1e-3;

inline BlockProfile random_profile(std::mt19937_64& rng, bool allow_unsplittable) {
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

inline std::uint64_t total_saved(const std::vector<BlockProfile>& blocks) {
  std::uint64_t s = 0;
  for (const auto& p : blocks) s += p.saved_bytes();
  return s;
}

inline std::uint64_t largest_working_set(const std::vector<BlockProfile>& blocks) {
  std::uint64_t w = 0;
  for (const auto& p : blocks) w = std::max(w, p.saved_bytes() + p.transient_bytes);
  return w;
}

// One option of one block, as the model predicts it (from evaluate_plan on that block alone).
struct Option {
  BlockPlan plan;
  double seconds;
};

inline std::vector<Option> block_options(const BlockProfile& p, const Links& links, bool nvme, int alpha_steps) {
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
inline BruteForce brute_force(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
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

inline void expect_well_formed(const Plan& plan, const std::vector<BlockProfile>& blocks, const Budgets& budgets) {
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
inline void add_optimizer_traffic(Case& c, std::uint64_t seed) {
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

inline Case random_case(std::uint64_t seed, std::size_t n, Kind kind, bool with_nvme, bool tight_host) {
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
inline bool check_against_brute_force(const Case& c, int alpha_steps) {
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

}  // namespace tierflow::tiering::planner_cases
