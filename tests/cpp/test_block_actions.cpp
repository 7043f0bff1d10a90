// tiering::BlockActionTable (Note [C++ block actions]): a C++ trainer's per-block actions from the
// configuration, a plan, and per-block overrides.
#include <gtest/gtest.h>

#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/block_actions.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

TEST(BlockActions, ConfigGivesEveryBlockItsDefault) {
  Config c;
  c.offload_activations = OffloadTarget::kNone;
  EXPECT_EQ(block_action_from_config(c), BlockAction::kKeep);
  c.offload_activations = OffloadTarget::kHost;
  EXPECT_EQ(block_action_from_config(c), BlockAction::kSwapHost);
  c.offload_activations = OffloadTarget::kNvme;
  EXPECT_EQ(block_action_from_config(c), BlockAction::kSwapNvme);
  c.offload_activations = OffloadTarget::kRecompute;  // the memory floor
  EXPECT_EQ(block_action_from_config(c), BlockAction::kSwapHost);
  c.offload_activations = OffloadTarget::kAuto;
  EXPECT_EQ(block_action_from_config(c), BlockAction::kSwapHost);
}

TEST(BlockActions, PlanModeAndTierPickTheAction) {
  BlockPlan p;
  p.mode = BlockMode::kKeep;
  p.tier = SwapTier::kNvme;
  EXPECT_EQ(block_action_from_plan(p), BlockAction::kKeep);
  for (BlockMode m : {BlockMode::kSwap, BlockMode::kSplit, BlockMode::kRecompute}) {
    p.mode = m;
    p.tier = SwapTier::kHost;
    EXPECT_EQ(block_action_from_plan(p), BlockAction::kSwapHost);
    p.tier = SwapTier::kNvme;
    EXPECT_EQ(block_action_from_plan(p), BlockAction::kSwapNvme);
  }
}

TEST(BlockActions, OverridesDefaultAndApplyPlan) {
  BlockActionTable t(BlockAction::kSwapHost, false);
  EXPECT_EQ(t.action(7), BlockAction::kSwapHost);
  t.set(2, BlockAction::kRecompute);
  EXPECT_EQ(t.action(1), BlockAction::kSwapHost);
  EXPECT_EQ(t.action(2), BlockAction::kRecompute);
  t.set_default(BlockAction::kKeep);
  EXPECT_EQ(t.action(1), BlockAction::kKeep);
  EXPECT_EQ(t.action(2), BlockAction::kRecompute);
  t.set_all({BlockAction::kSwapHost});  // replaces every override
  EXPECT_EQ(t.action(0), BlockAction::kSwapHost);
  EXPECT_EQ(t.action(2), BlockAction::kKeep);
  Plan plan;
  plan.blocks.resize(2);
  plan.blocks[0].mode = BlockMode::kKeep;
  plan.blocks[1].mode = BlockMode::kSplit;
  t.apply_plan(plan);
  EXPECT_EQ(t.action(0), BlockAction::kKeep);
  EXPECT_EQ(t.action(1), BlockAction::kSwapHost);
  EXPECT_EQ(t.action(2), BlockAction::kKeep);
}

TEST(BlockActions, SwapNvmeWithoutTheTierIsRefusedAndChangesNothing) {
  BlockActionTable t(BlockAction::kRecompute, false);
  t.set(0, BlockAction::kKeep);
  try {
    t.set_all({BlockAction::kSwapHost, BlockAction::kSwapNvme});
    FAIL() << "swap-nvme without the NVMe tier was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("needs the NVMe tier: set TIERFLOW_NVME_PATHS"), std::string::npos);
  }
  EXPECT_EQ(t.action(0), BlockAction::kKeep);
  EXPECT_THROW(t.set(1, BlockAction::kSwapNvme), config_error);
  EXPECT_THROW(t.set_default(BlockAction::kSwapNvme), config_error);
  EXPECT_EQ(t.action(1), BlockAction::kRecompute);
  BlockActionTable with_nvme(BlockAction::kKeep, true);
  with_nvme.set(1, BlockAction::kSwapNvme);
  EXPECT_EQ(with_nvme.action(1), BlockAction::kSwapNvme);
  EXPECT_EQ(to_string(BlockAction::kSwapNvme), "swap-nvme");
}

TEST(BlockCalls, ABlockIndexNotAboveThePreviousStartsAForward) {
  BlockCalls calls;
  EXPECT_TRUE(calls.call(0, BlockAction::kSwapHost, true).new_forward);
  EXPECT_FALSE(calls.call(1, BlockAction::kSwapHost, true).new_forward);
  EXPECT_FALSE(calls.call(3, BlockAction::kSwapHost, true).new_forward);  // a skipped index is the same pass
  EXPECT_TRUE(calls.call(3, BlockAction::kSwapHost, true).new_forward);   // the same block again: a new pass
  EXPECT_TRUE(calls.call(1, BlockAction::kSwapHost, true).new_forward);
  EXPECT_EQ(calls.stats().forwards, 3u);
}

TEST(BlockCalls, ACallWithNothingToDifferentiateJustRunsAndEachActionIsCounted) {
  BlockCalls calls;
  EXPECT_EQ(calls.call(0, BlockAction::kSwapNvme, false).action, BlockAction::kKeep);
  EXPECT_EQ(calls.call(1, BlockAction::kSwapNvme, true).action, BlockAction::kSwapNvme);
  EXPECT_EQ(calls.call(2, BlockAction::kSwapHost, true).action, BlockAction::kSwapHost);
  EXPECT_EQ(calls.call(3, BlockAction::kRecompute, true).action, BlockAction::kRecompute);
  EXPECT_EQ(calls.call(4, BlockAction::kKeep, true).action, BlockAction::kKeep);
  const BlockCallStats& s = calls.stats();
  EXPECT_EQ(s.kept, 2u);
  EXPECT_EQ(s.swapped_nvme, 1u);
  EXPECT_EQ(s.swapped_host, 1u);
  EXPECT_EQ(s.recomputed, 1u);
}

TEST(BlockCalls, OnlyTheFirstBackwardOfAStepStartsThePrefetch) {
  BlockCalls calls;
  calls.call(0, BlockAction::kSwapHost, true);
  calls.call(1, BlockAction::kSwapHost, true);
  EXPECT_TRUE(calls.reached_backward());
  EXPECT_FALSE(calls.reached_backward());
  calls.rerun(5);
  calls.rerun(7);
  calls.call(0, BlockAction::kSwapHost, true);  // the next step
  EXPECT_TRUE(calls.reached_backward());
  EXPECT_EQ(calls.stats().reruns, 2u);
  EXPECT_EQ(calls.stats().rerun_ns, 12u);
}

TEST(BlockCallAction, ARefusedRerunKeepsTheBlockUnlessItsParametersAreFetched) {
  EXPECT_EQ(block_call_action(0, BlockAction::kSwapHost, false, false, false), BlockAction::kSwapHost);
  EXPECT_EQ(block_call_action(0, BlockAction::kSwapNvme, true, false, false), BlockAction::kKeep);
  EXPECT_EQ(block_call_action(0, BlockAction::kRecompute, true, false, true), BlockAction::kKeep);
  // Fetched parameters: a refused rerun does not keep it (autograd would hold them); its action stays.
  EXPECT_EQ(block_call_action(0, BlockAction::kSwapHost, true, true, false), BlockAction::kSwapHost);
  EXPECT_EQ(block_call_action(0, BlockAction::kRecompute, false, true, false), BlockAction::kRecompute);
}

TEST(BlockCallAction, AKeptBlockWithFetchedParametersIsRecomputedByAutoAndRefusedByHand) {
  EXPECT_EQ(block_call_action(3, BlockAction::kKeep, false, false, false), BlockAction::kKeep);
  EXPECT_EQ(block_call_action(3, BlockAction::kKeep, false, true, true), BlockAction::kRecompute);
  EXPECT_EQ(block_call_action(3, BlockAction::kKeep, true, true, true), BlockAction::kRecompute);
  try {
    block_call_action(3, BlockAction::kKeep, false, true, false);
    FAIL() << "a trainer's kKeep for a block whose parameters are fetched was accepted";
  } catch (const config_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("block 3 is kKeep"), std::string::npos) << what;
    EXPECT_NE(what.find("kSwapHost, kSwapNvme or kRecompute"), std::string::npos) << what;
  }
}

TEST(BlockParamUnits, KeptBlocksStayOnTheDeviceAndTheLargestFetchedBlockIsPrefetched) {
  BlockActionTable actions(BlockAction::kSwapHost, false);
  actions.set(1, BlockAction::kKeep);
  const std::vector<std::vector<ParamRef>> params = {{{1, 100}, {2, 50}}, {{3, 400}}, {{4, 120}}};
  const auto [units, options] = block_param_units(actions, params, Tier::kHost);
  ASSERT_EQ(units.size(), 4u);  // the blocks and the rest unit
  EXPECT_EQ(units[0].residence, Tier::kHost);
  EXPECT_EQ(units[1].residence, Tier::kGpu);  // autograd holds a kept block's weights
  EXPECT_EQ(units[2].residence, Tier::kHost);
  EXPECT_EQ(units[0].params.size(), 2u);
  EXPECT_EQ(units[3].residence, Tier::kGpu);
  EXPECT_TRUE(units[3].params.empty());
  EXPECT_EQ(options.prefetch_bytes, 150u);  // block 0's, not the kept block's 400
}

TEST(BlockParamUnits, OnlyTheHostTierIsAccepted) {
  BlockActionTable actions(BlockAction::kSwapHost, false);
  try {
    block_param_units(actions, {{{1, 8}}}, Tier::kNvme);
    FAIL() << "parameters on NVMe were accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("accepted: host"), std::string::npos) << e.what();
  }
}
