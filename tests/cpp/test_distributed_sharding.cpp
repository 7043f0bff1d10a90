// Note [Sharded models]: what FSDP2 and DTensor models are refused with, each unit's own parameters, and this
// rank's bytes of the parameters.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "tierflow/tiering/distributed_sharding.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
Config config(std::map<std::string, std::string> vars) {
  vars.emplace("TIERFLOW_DEVICE", "emulated");
  return Config::parse(vars);
}
}  // namespace

TEST(DistributedSharding, SomeNamesShowsThreeAndCountsTheRest) {
  EXPECT_EQ(some_names({}), "");
  EXPECT_EQ(some_names({"a"}), "'a'");
  EXPECT_EQ(some_names({"a", "b", "c"}), "'a', 'b', 'c'");
  EXPECT_EQ(some_names({"a", "b", "c", "d", "e"}), "'a', 'b', 'c' and 2 more");
}

TEST(DistributedSharding, WrapRefusesFsdp2SettingsTensorParallelismAndAnotherModelsOptimizer) {
  const Config plain = config({}), params = config({{"TIERFLOW_OFFLOAD_PARAMS", "host"}});
  const ShardedModel fsdp{{"", "blocks.0"}, {"w"}}, tp{{}, {"a.w", "b.w"}}, none{};
  EXPECT_EQ(sharded_wrap_refusal(plain, fsdp, true, false, {}), "");
  const std::string why = sharded_wrap_refusal(params, fsdp, false, false, {});
  EXPECT_TRUE(has(why, "(FSDP2): '(the model itself)', 'blocks.0' are FSDPModules, and TIERFLOW_OFFLOAD_PARAMS='host'"))
      << why;
  const std::string policy = sharded_wrap_refusal(plain, ShardedModel{{"b"}, {}}, true, true, {});
  EXPECT_TRUE(has(policy, "'b' is an FSDPModule, and") && has(policy, "CPUOffloadPolicy")) << policy;
  EXPECT_EQ(sharded_wrap_refusal(plain, ShardedModel{{"b"}, {}}, false, true, {}), "");  // the user's optimizer
  const std::string parallel = sharded_wrap_refusal(plain, tp, false, false, {});
  EXPECT_TRUE(has(parallel, "2 of the model's parameters are DTensors ('a.w', 'b.w')") &&
              has(parallel, "or train on one process")) << parallel;
  EXPECT_EQ(sharded_wrap_refusal(plain, none, true, false, {}), "");
  const std::string other = sharded_wrap_refusal(plain, none, true, false, {2, 5, {4, 8}});
  EXPECT_TRUE(has(other, "2 of the optimizer's 5 parameters are DTensors (the first has shape [4, 8])")) << other;
  // The model's FSDP2 shards are the optimizer's DTensors: not another model's.
  EXPECT_EQ(sharded_wrap_refusal(plain, fsdp, false, false, {2, 5, {4, 8}}), "");
}

TEST(DistributedSharding, FullyShardAfterWrapIsRefusedWithTheCpuOptimizerMadeAtWrap) {
  const Config plain = config({});
  const ShardedModel fsdp{{"blocks.0"}, {}};
  EXPECT_EQ(sharded_later_refusal(plain, ShardedModel{}, true), "");
  EXPECT_EQ(sharded_later_refusal(plain, fsdp, false), "");
  const std::string made = sharded_later_refusal(plain, fsdp, true);
  EXPECT_TRUE(has(made, "after tierflow.wrap ('blocks.0' is an FSDPModule), and tierflow's CPU optimizer, made at wrap") &&
              has(made, "; or call tierflow.unwrap(model)")) << made;
  const std::string params = sharded_later_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "host"}}), fsdp, false);
  EXPECT_TRUE(has(params, "TIERFLOW_OFFLOAD_PARAMS='host'")) << params;
  const std::string tp = sharded_later_refusal(plain, ShardedModel{{}, {"w"}}, false);
  EXPECT_TRUE(has(tp, "1 of the model's parameters became DTensors after tierflow.wrap ('w')") &&
              has(tp, "or train on one process; or call tierflow.unwrap(model)")) << tp;
}

TEST(DistributedSharding, AParameterBelongsToTheInnermostUnitListingIt) {
  // The root lists every parameter 0-4; block a lists 1, 2; block b lists 3; a's inner c lists 2.
  const auto own = fsdp_unit_parameters({{0, 1, 2, 3, 4}, {1, 2}, {3}, {2}});
  EXPECT_EQ(own, (std::vector<std::vector<std::size_t>>{{0, 4}, {1}, {3}, {2}}));
  EXPECT_EQ(fsdp_unit_parameters({}), (std::vector<std::vector<std::size_t>>{}));
}

TEST(DistributedSharding, ThisRanksBytesAreItsLocalShardsAndFsdp2sDimZeroChunksOfWhatIsGathered) {
  // A DTensor's local 6 floats; a gathered 10x3 (ceil(10/4) = 3 rows a rank: ranks 0-2 hold 3, rank 3 holds 1);
  // a gathered scalar and a plain parameter whole.
  const std::vector<ParameterShard> params = {{true, false, 4, 6, 4}, {false, true, 10, 30, 4},
                                              {false, true, -1, 1, 4}, {false, false, 5, 5, 2}};
  EXPECT_EQ(rank_shard_bytes(params, 0, 4), 6u * 4 + 9 * 4 + 4 + 10);
  EXPECT_EQ(rank_shard_bytes(params, 3, 4), 6u * 4 + 3 * 4 + 4 + 10);
  // 3 rows over 4 ranks: rank 3 holds none.
  EXPECT_EQ(rank_shard_bytes({{true, false, 1, 1, 4}, {false, true, 3, 3, 4}}, 3, 4), 4u);
  // Nothing sharded: every parameter whole, gathered or not.
  EXPECT_EQ(rank_shard_bytes({{false, true, 10, 30, 4}}, 0, 4), 120u);
}
