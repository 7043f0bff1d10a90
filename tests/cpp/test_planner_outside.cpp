// What is saved outside the blocks, kept or swapped, against brute force over both choices (Note [Activation
// planner], Outside the blocks); their host staging on the way to NVMe, and what it is measured from (auto) or
// estimated from (the plan command).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/plan_command.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/saved_tensors.hpp"
#include "tierflow/tiering/transformer_profile.hpp"
#include "planner_cases.hpp"

using namespace tierflow;
using namespace tierflow::tiering;
using namespace tierflow::tiering::planner_cases;

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

// Note [Activation planner], Outside the blocks: with an NVMe tier the search also runs with them swapped to NVMe
// (out of its budget, their round trip through the host in the step); the plan is the fastest of the three, and
// the brute force over the three choices finds nothing faster.
TEST(ActivationPlanner, TensorsOutsideTheBlocksGoToNvmeWhenThatIsFasterOrAloneFits) {
  int on_nvme = 0;
  for (std::uint64_t seed = 900; seed < 930; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Case c = random_case(seed, 3, Kind::kIdentical, true, true);
    std::mt19937_64 rng(seed);
    std::uint64_t transient = 0;
    for (const auto& p : c.blocks) transient = std::max(transient, p.transient_bytes);
    const auto outside =
        static_cast<std::uint64_t>(std::uniform_real_distribution<double>(0.05, 1.0)(rng) * static_cast<double>(transient));
    if (seed % 3 == 0) {  // the host cannot hold them, the device cannot keep them: NVMe alone
      c.budgets.host_bytes = outside - 1;
      c.budgets.device_bytes =
          c.budgets.fixed_device_bytes + largest_working_set(c.blocks) + c.budgets.prefetch_bytes + outside / 2;
    }
    Budgets keep = c.budgets, host = c.budgets, nvme = c.budgets;
    keep.fixed_device_bytes += outside;
    host.fixed_device_bytes += outside - std::min(outside, transient);
    nvme.fixed_device_bytes += outside - std::min(outside, transient);
    double best = brute_force(c.blocks, c.links, keep, 8).best;
    if (c.budgets.host_bytes >= outside) {
      host.host_bytes -= outside;
      best = std::min(best, brute_force(c.blocks, c.links, host, 8).best + outside_swap_seconds(c.links, outside));
    }
    nvme.nvme_bytes -= outside;
    const double nvme_trip = outside_tier_seconds(c.links, outside, Tier::kNvme);
    EXPECT_NEAR(nvme_trip,
                outside / std::min(c.links.d2h, c.links.nvme_write) + outside / std::min(c.links.h2d, c.links.nvme_read),
                1e-12);
    best = std::min(best, brute_force(c.blocks, c.links, nvme, 8).best + nvme_trip);
    c.budgets.outside_saved_bytes = outside;
    if (!std::isfinite(best)) continue;
    const Plan plan = plan_activations(c.blocks, c.links, c.budgets);
    EXPECT_TRUE(plan.fits) << plan.summary();
    EXPECT_LE(plan.predicted_step_seconds, best * (1 + 1e-9)) << plan.summary();
    EXPECT_EQ(plan.outside_kept, plan.outside_tier == Tier::kGpu);
    if (plan.outside_tier == Tier::kNvme) {
      ++on_nvme;
      EXPECT_NEAR(plan.outside_swap_seconds, nvme_trip, 1e-12);
      std::uint64_t blocks_nvme = 0;
      for (const auto& b : plan.blocks)
        blocks_nvme += b.mode != BlockMode::kKeep && b.tier == SwapTier::kNvme ? b.swap_bytes : 0;
      EXPECT_EQ(plan.nvme_bytes, blocks_nvme + outside) << "the NVMe tier holds them beside the swapped blocks";
      EXPECT_NE(plan.summary().find("outside the blocks " + format_bytes(outside) + " swapped to NVMe"),
                std::string::npos) << plan.summary();
    }
    const Plan again = evaluate_plan(c.blocks, c.links, c.budgets, plan.blocks, plan.rest_params, plan.outside_tier);
    EXPECT_DOUBLE_EQ(again.predicted_step_seconds, plan.predicted_step_seconds);
    EXPECT_EQ(again.predicted_device_peak_bytes, plan.predicted_device_peak_bytes);
    EXPECT_EQ(again.nvme_bytes, plan.nvme_bytes);
  }
  EXPECT_GE(on_nvme, 1);
}

// A budget where only NVMe can take them: the device cannot keep them, the host cannot hold them. Planned to NVMe
// with an NVMe tier; without one, or with one too small for them, refused naming what was tried.
TEST(ActivationPlanner, OnlyNvmeTakesTheTensorsOutsideTheBlocksAndWithoutItTheRefusalSaysWhatWasTried) {
  Case c = random_case(42, 3, Kind::kIdentical, true, false);
  std::uint64_t transient = 0;
  for (const auto& p : c.blocks) transient = std::max(transient, p.transient_bytes);
  const std::uint64_t outside = transient;  // swapped, they add nothing to the peak; kept, all of them
  c.budgets.device_bytes =
      c.budgets.fixed_device_bytes + largest_working_set(c.blocks) + c.budgets.prefetch_bytes + transient / 2;
  c.budgets.host_bytes = outside - 1;
  c.budgets.outside_saved_bytes = outside;
  const Plan plan = plan_activations(c.blocks, c.links, c.budgets);
  ASSERT_EQ(plan.outside_tier, Tier::kNvme) << plan.summary();
  EXPECT_FALSE(plan.outside_kept);
  EXPECT_TRUE(plan.fits) << plan.summary();
  EXPECT_GE(plan.nvme_bytes, outside);
  EXPECT_LE(plan.host_bytes, c.budgets.host_bytes);
  // The NVMe budget counts them: one byte less than the plan's NVMe usage and that plan no longer fits.
  Budgets tight = c.budgets;
  tight.nvme_bytes = plan.nvme_bytes - 1;
  EXPECT_FALSE(evaluate_plan(c.blocks, c.links, tight, plan.blocks, plan.rest_params, Tier::kNvme).fits);

  Case no_nvme = c;
  no_nvme.budgets.nvme_bytes = 0;
  try {
    const Plan p = plan_activations(no_nvme.blocks, no_nvme.links, no_nvme.budgets);
    FAIL() << "planned without an NVMe tier: " << p.summary();
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("saved outside the blocks kept on the device (the host budget cannot hold them)"),
              std::string::npos) << what;
    EXPECT_EQ(what.find("swapped to NVMe"), std::string::npos) << what;
  }
  Case small = c;
  small.budgets.nvme_bytes = outside - 1;
  try {
    const Plan p = plan_activations(small.blocks, small.links, small.budgets);
    FAIL() << "planned with an NVMe budget below them: " << p.summary();
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("the NVMe budget cannot hold them"), std::string::npos) << e.what();
  }
}

// Note [Activation planner], Outside the blocks: on their way to NVMe (and back) they are staged in pinned host
// memory, each tensor whole, the largest at a time at the least: the plan's host usage counts it and the host's
// budget must hold it beside the blocks' swapped bytes, else that choice is refused (and with nothing else that
// fits, the refusal says why).
TEST(ActivationPlanner, TheHostStagesTheLargestTensorOutsideTheBlocksOnItsWayToNvme) {
  Case c = random_case(42, 3, Kind::kIdentical, true, false);
  std::uint64_t transient = 0;
  for (const auto& p : c.blocks) transient = std::max(transient, p.transient_bytes);
  const std::uint64_t outside = transient;  // the device cannot keep them, the host cannot hold them
  const std::uint64_t largest = outside / 4;  // several tensors: the logits, their log-softmax, ...
  c.budgets.device_bytes =
      c.budgets.fixed_device_bytes + largest_working_set(c.blocks) + c.budgets.prefetch_bytes + transient / 2;
  c.budgets.host_bytes = outside - 1;
  c.budgets.outside_saved_bytes = outside;
  c.budgets.outside_largest_bytes = largest;
  const Plan plan = plan_activations(c.blocks, c.links, c.budgets);
  ASSERT_EQ(plan.outside_tier, Tier::kNvme) << plan.summary();
  EXPECT_TRUE(plan.fits) << plan.summary();
  EXPECT_EQ(plan.outside_staging_bytes, largest);
  std::uint64_t blocks_host = 0;
  for (const auto& b : plan.blocks)
    blocks_host += b.mode != BlockMode::kKeep && b.tier == SwapTier::kHost ? b.swap_bytes : 0;
  EXPECT_EQ(plan.host_bytes, blocks_host + largest) << "the host holds their staging beside the swapped blocks";
  EXPECT_LE(plan.host_bytes, c.budgets.host_bytes);
  EXPECT_NE(plan.summary().find(format_bytes(largest) + " host staging"), std::string::npos) << plan.summary();
  // The host budget is checked with it: one byte less than the plan's host usage and that plan no longer fits.
  Budgets tight = c.budgets;
  tight.host_bytes = plan.host_bytes - 1;
  EXPECT_FALSE(evaluate_plan(c.blocks, c.links, tight, plan.blocks, plan.rest_params, Tier::kNvme).fits);
  // Never more than all of them; unknown (0, a profile from before it was measured): not counted.
  Budgets over = c.budgets, unknown = c.budgets;
  over.outside_largest_bytes = 2 * outside;
  EXPECT_EQ(outside_staging_bytes(over), outside);
  unknown.outside_largest_bytes = 0;
  const Plan u = evaluate_plan(c.blocks, c.links, unknown, plan.blocks, plan.rest_params, Tier::kNvme);
  EXPECT_EQ(u.outside_staging_bytes, 0u);
  EXPECT_EQ(u.host_bytes, blocks_host);
  // A host budget below the largest of them: NVMe cannot take them either, and nothing else fits.
  Case small = c;
  small.budgets.host_bytes = largest - 1;
  try {
    const Plan p = plan_activations(small.blocks, small.links, small.budgets);
    FAIL() << "planned with a host budget that cannot stage them: " << p.summary();
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("the host budget cannot stage the largest of them, " + format_bytes(largest) +
                                         ", on its way to NVMe"),
              std::string::npos)
        << e.what();
  }
}

// What that staging is measured from under auto (Budgets::outside_largest_bytes): the largest single tensor the
// policy's packs counted in policy_bytes (the model-level hook's, to the host or to NVMe), exported with the
// saved tensors' stats.
TEST(SavedTensors, PolicyLargestBytesIsTheLargestTensorThePolicysPacksCounted) {
  ActivationScheduleOptions o;
  o.target = OffloadTarget::kAuto;
  SavedTensors saved(o, 16);
  saved.schedule().begin_forward();
  auto pack = [&](std::uint64_t bytes, PackTarget target, bool region = false) {
    SavedTensorFacts f;
    f.bytes = bytes;
    f.in_no_offload_region = region;
    saved.pack(f, target, true);
  };
  pack(100, PackTarget::kOutsideNvme);
  pack(300, PackTarget::kPolicy);
  pack(200, PackTarget::kOutsideNvme);
  pack(8, PackTarget::kPolicy);                 // small: not counted
  pack(900, PackTarget::kNvme);                 // a block plan's: not the policy's
  pack(800, PackTarget::kPolicy, true);         // inside tierflow.no_offload(): kept, not counted
  const SavedTensorStats s = saved.stats({});
  EXPECT_EQ(s.policy_bytes, 600u);
  EXPECT_EQ(s.policy_largest_bytes, 300u);
  bool exported = false;
  for (const auto& f : saved_tensor_stat_fields())
    if (std::string(f.name) == "policy_largest_bytes") exported = f.of(s) == 300.0;
  EXPECT_TRUE(exported);
}

// The plan command's budgets carry the same staging (Note [Plan report], Budgets): a shape's largest tensor outside
// the blocks is its fp32 logits, tokens x vocab x 4 (the head's input when wider); a profile's is its measurement
// (0, a profile from before it was measured: not counted).
TEST(PlanCommand, TheLargestTensorOutsideTheBlocksIsTheLogitsOfAShapeOrTheProfilesMeasurement) {
  PlanCommandInputs in;
  in.gpu_memory = {"16GiB", SettingSource::kFlag};
  in.host_memory = {"64GiB", SettingSource::kVariable};
  in.prefetch = {"256MiB", SettingSource::kVariable};
  in.device_capacity_bytes = in.host_capacity_bytes = 128ull << 30;
  in.device_name = "cpu (emulated device)";
  in.optimizer = "none";
  TransformerShape s;
  s.layers = 2;
  s.hidden = 1024;
  s.heads = 8;
  s.seq = 512;
  s.batch = 3;
  s.vocab = 32000;
  in.shape = s;
  in.state = estimate_training_state(s, OffloadTarget::kNone);
  in.head_bytes = estimate_head_device_bytes(s);
  in.outside_largest_bytes = 7;  // a profile's: not the shape's
  in.blocks_from = "--layers 2";
  in.links = Links{20e9, 20e9, 40e9, 0, 0};
  const Budgets b = plan_command_budgets(in).budgets;
  EXPECT_EQ(b.outside_largest_bytes, 3ull * 512 * 32000 * 4);
  EXPECT_LE(b.outside_largest_bytes, estimate_head_saved_bytes(s));
  in.shape->vocab = 100;  // narrower than the head's input (hidden in bf16)
  EXPECT_EQ(plan_command_budgets(in).budgets.outside_largest_bytes, 3ull * 512 * 1024 * 2);
  in.shape.reset();
  in.state.reset();
  EXPECT_EQ(plan_command_budgets(in).budgets.outside_largest_bytes, 7u);
}
