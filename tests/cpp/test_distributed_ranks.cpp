// Note [Rank decisions under DDP]: which parameters a rank owns and broadcasts, what a state dict of a share loads
// into, DDP's bucket scaling, and the refusals and warnings that name their setting.
#include <gtest/gtest.h>

#include <string>

#include "tierflow/optimizer/distributed_ranks.hpp"

using namespace tierflow::optimizer;

namespace {
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
constexpr int kEvery = PartitionLayout::kEveryRank;
}  // namespace

TEST(DistributedRanks, OnlyReducedParametersHaveOneOwnerAndAreBroadcastInTheOptimizersOrder) {
  // 0: big, reduced; 1: frozen; 2: reduced; 3: outside DDP; 4: reduced (2 bytes an element).
  const std::vector<RankParameter> params = {{100, 4, true}, {50, 4, false}, {60, 4, true}, {7, 4, false}, {40, 2, true}};
  const RankPartition r0 = partition_ranks(params, 0, 2), r1 = partition_ranks(params, 1, 2);
  // Largest first to the least loaded: 100 -> 0, 60 -> 1, 40 -> 1; the others every rank's.
  EXPECT_EQ(r0.owners, (std::vector<int>{0, kEvery, 1, kEvery, 1}));
  EXPECT_EQ(r1.owners, r0.owners);  // every rank computes the same, nothing exchanged
  EXPECT_EQ(r0.broadcasts, (std::vector<std::size_t>{0, 2, 4}));
  EXPECT_EQ(r0.broadcast_bytes, 100u * 4 + 60u * 4 + 40u * 2);
  EXPECT_EQ(r0.elements, 257u);
  EXPECT_EQ(r0.owned_elements, 100u + 50 + 7);
  EXPECT_EQ(r0.owned_parameters, 3u);
  EXPECT_EQ(r1.owned_elements, 50u + 60 + 7 + 40);
  EXPECT_TRUE(r0.owns(1) && r1.owns(1) && r0.owns(3) && r1.owns(3));
  EXPECT_TRUE(r0.owns(0) && !r1.owns(0) && !r0.owns(2) && r1.owns(2));
  EXPECT_TRUE(r0.owns(99));  // not the optimizer's: stepped where it is
  EXPECT_EQ(r1.layout().owners, r1.owners);
  EXPECT_EQ(r1.layout().rank, 1);
  EXPECT_THROW(partition_ranks(params, 2, 2), std::invalid_argument);
}

TEST(DistributedRanks, AShareLoadsIntoItsOwnRankAndAStateDictWithoutLayoutIsJudgedByItsStates) {
  const std::vector<RankParameter> params = {{100, 4, true}, {60, 4, true}, {5, 4, false}};
  const RankPartition r0 = partition_ranks(params, 0, 2), r1 = partition_ranks(params, 1, 2);
  EXPECT_EQ(loaded_share_refusal(r0, r0.layout(), {true, false, true}), "");
  EXPECT_EQ(loaded_share_refusal(r0, std::nullopt, {true, true, true}), "");  // a whole one
  const std::string other = loaded_share_refusal(r1, r0.layout(), {true, false, true});
  EXPECT_TRUE(has(other, "holds rank 0's share") && has(other, "this is rank 1")) << other;
  // No layout (torch.distributed.checkpoint): rank 0's states only, on rank 1, is refused; with the state of the
  // parameter every rank steps, which counts as this rank's own, it loads (the others' are dropped after).
  const std::string theirs = loaded_share_refusal(r1, std::nullopt, {true, false, false});
  EXPECT_TRUE(has(theirs, "of rank 0 and none of rank 1's") && has(theirs, "TIERFLOW_PARTITION_OPTIMIZER=on"))
      << theirs;
  EXPECT_EQ(loaded_share_refusal(r1, std::nullopt, {true, false, true}), "");
  EXPECT_EQ(loaded_share_refusal(r1, std::nullopt, {false, true, false}), "");
}

TEST(DistributedRanks, DdpScalesEachBucketAsItsOwnReduction) {
  const BucketScaling view = ddp_bucket_scaling(true, 3), copy = ddp_bucket_scaling(false, 4);
  EXPECT_TRUE(view.divide);
  EXPECT_EQ(view.factor, 3.0);
  EXPECT_FALSE(copy.divide);
  EXPECT_EQ(copy.factor, 0.25);
  EXPECT_THROW(ddp_bucket_scaling(false, 0), std::invalid_argument);
}

TEST(DistributedRanks, RefusalsNameTheSettingAndWhatIsAccepted) {
  EXPECT_EQ(partitioned_join_refusal(false), "");
  EXPECT_TRUE(has(partitioned_join_refusal(true), "accepted with join(): TIERFLOW_PARTITION_OPTIMIZER=off"));
  EXPECT_EQ(ddp_join_divisor_refusal(false, false), "");
  EXPECT_EQ(ddp_join_divisor_refusal(true, true), "");
  EXPECT_TRUE(has(ddp_join_divisor_refusal(true, false), "join(divide_by_initial_world_size=False)"));
  EXPECT_TRUE(has(ddp_join_divisor_refusal(true, false), "TIERFLOW_OVERLAP_STEP=off"));
  EXPECT_EQ(ddp_offload_gradients_refusal(false, "wrap"), "");
  const std::string grads = ddp_offload_gradients_refusal(true, "tierflow.wrap of a DDP model");
  EXPECT_TRUE(has(grads, "(DDP; tierflow.wrap of a DDP model)") && has(grads, "TIERFLOW_OFFLOAD_GRADIENTS=off")) << grads;
  EXPECT_TRUE(has(ddp_builtin_hook_refusal("BuiltinCommHookType.FP16_COMPRESS"),
                  "_register_builtin_comm_hook(BuiltinCommHookType.FP16_COMPRESS) after tierflow.wrap"));
  EXPECT_TRUE(has(ddp_second_hook_refusal("my_hook"), "a hook is registered already: my_hook)"));
}

TEST(DistributedRanks, TheStepsDuringBackwardGoOffOnlyForAForeignHookOrEveryStepRedoneAcrossProcesses) {
  EXPECT_EQ(ddp_feed_refusal("", false, false), "");
  EXPECT_EQ(ddp_feed_refusal("tierflow_reduce_and_stream", true, false), "");  // ours: it feeds the new optimizer
  EXPECT_TRUE(has(ddp_feed_refusal("fp16_compress_hook", false, false), "registered on it already (fp16_compress_hook;"));
  EXPECT_TRUE(has(ddp_feed_refusal("", false, true), "Python reducer"));
  const std::string warning = ddp_steps_after_backward_warning("DDP(model)", "why not");
  EXPECT_TRUE(has(warning, "(DDP(model)), and") && has(warning, "backward: why not. So") &&
              has(warning, "TIERFLOW_OVERLAP_STEP=off")) << warning;
  EXPECT_EQ(redone_steps_warning(3, 0, 1.0, 1), "");   // one process: no all-reduce behind tierflow's back
  EXPECT_EQ(redone_steps_warning(3, 1, 1.0, 2), "");   // some committed: a clip that bound, not an all-reduce
  EXPECT_EQ(redone_steps_warning(0, 0, 1.0, 2), "");
  EXPECT_EQ(redone_steps_warning(3, 0, 0.5, 2), "");   // a GradScaler's unscale redoes them all
  EXPECT_TRUE(has(redone_steps_warning(3, 0, 1.0, 4), "in this 4-process run"));
}
