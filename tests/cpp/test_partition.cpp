// Note [Partitioned optimizer]: which rank owns each parameter, and which loaded state dicts a rank refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "tierflow/optimizer/partition.hpp"

using namespace tierflow::optimizer;

namespace {
std::uint64_t total(const std::vector<std::uint64_t>& v) { return std::accumulate(v.begin(), v.end(), 0ull); }
}  // namespace

TEST(Partition, EveryParameterHasOneOwnerAndNoRankHoldsMoreThanItsShareAndTheLargest) {
  std::mt19937_64 rng(7);
  for (int world : {1, 2, 3, 4, 8}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<std::uint64_t> elements(1 + rng() % 40);
      for (auto& e : elements) e = 1 + rng() % (trial % 2 ? 1000 : 4'000'000);
      const auto owners = partition_parameters(elements, world);
      ASSERT_EQ(owners.size(), elements.size());
      for (int o : owners) ASSERT_TRUE(o >= 0 && o < world);
      const auto owned = owned_elements(owners, elements, world);
      ASSERT_EQ(total(owned), total(elements));
      const std::uint64_t largest = *std::max_element(elements.begin(), elements.end());
      for (auto o : owned) EXPECT_LE(o, total(elements) / world + largest) << "world " << world;
    }
  }
}

TEST(Partition, LargestFirstOntoTheLeastLoadedRankTheSameOnEveryRank) {
  // 10, 10, 6, 4, 4 over 2 ranks: 10 -> 0, 10 -> 1, 6 -> 0 (tie: the lowest rank), 4 -> 1, 4 -> 1: 16 and 18.
  const std::vector<std::uint64_t> elements{4, 10, 6, 10, 4};
  const auto owners = partition_parameters(elements, 2);
  EXPECT_EQ(owners, (std::vector<int>{1, 0, 0, 1, 1}));
  EXPECT_EQ(owned_elements(owners, elements, 2), (std::vector<std::uint64_t>{16, 18}));
  EXPECT_EQ(partition_parameters(elements, 2), owners);  // deterministic: nothing to exchange
  EXPECT_EQ(partition_parameters(elements, 1), (std::vector<int>(5, 0)));
  // More ranks than parameters: some own nothing.
  EXPECT_EQ(owned_elements(partition_parameters({5, 3}, 4), {5, 3}, 4), (std::vector<std::uint64_t>{5, 3, 0, 0}));
  EXPECT_THROW(partition_parameters(elements, 0), std::invalid_argument);
}

TEST(Partition, AnotherRanksStatesAloneAreRefusedItsOwnAWholeOneOrNoneLoad) {
  const std::vector<int> owners{0, 1, 0, 1};
  EXPECT_EQ(loaded_partition_refusal(owners, {true, false, true, false}, 0, 2), "");  // its own
  EXPECT_EQ(loaded_partition_refusal(owners, {true, true, true, true}, 1, 2), "");    // a whole one
  EXPECT_EQ(loaded_partition_refusal(owners, {false, false, false, false}, 1, 2), "");  // before any step
  EXPECT_EQ(loaded_partition_refusal(owners, {false, true, false, false}, 1, 2), "");  // its own, partly
  const std::string why = loaded_partition_refusal(owners, {true, false, true, false}, 1, 2);
  EXPECT_NE(why.find("states of 2 parameters of rank 0 and none of rank 1's"), std::string::npos) << why;
  EXPECT_NE(why.find("TIERFLOW_PARTITION_OPTIMIZER=on"), std::string::npos) << why;
  EXPECT_NE(why.find("each rank loads the state dict it saved itself"), std::string::npos) << why;
}

TEST(Partition, AShareLoadsOnlyIntoTheSameRankOfTheSamePartitionAWholeOneAnywhere) {
  const PartitionLayout whole;
  const PartitionLayout r0{0, 2, {0, 1, 0, PartitionLayout::kEveryRank}};
  PartitionLayout r1 = r0;
  r1.rank = 1;
  EXPECT_EQ(partition_layout_refusal(whole, whole), "");
  EXPECT_EQ(partition_layout_refusal(whole, r1), "");
  EXPECT_EQ(partition_layout_refusal(r0, r0), "");
  std::string why = partition_layout_refusal(r0, whole);
  EXPECT_NE(why.find("rank 0's share of a CPU optimizer partitioned across 2 ranks"), std::string::npos) << why;
  EXPECT_NE(why.find("this optimizer is not partitioned"), std::string::npos) << why;
  why = partition_layout_refusal(r0, r1);
  EXPECT_NE(why.find("this is rank 1"), std::string::npos) << why;
  EXPECT_NE(why.find("each rank loads the state dict it saved itself"), std::string::npos) << why;
  const PartitionLayout four{0, 4, {0, 1, 2, 3}};
  why = partition_layout_refusal(r0, four);
  EXPECT_NE(why.find("partitioned differently (4 ranks)"), std::string::npos) << why;
  PartitionLayout moved = r0;
  moved.owners = {1, 0, 0, PartitionLayout::kEveryRank};  // a parameter group added: other owners
  why = partition_layout_refusal(r0, moved);
  EXPECT_NE(why.find("partitioned differently (2 ranks, other owners)"), std::string::npos) << why;
}

TEST(Partition, RanksAgreeOnTheStepBeforeTheWeightsMove) {
  // Every rank stepped, or every rank skipped (a non-finite gradient DDP reduced everywhere): nothing to say.
  EXPECT_EQ(step_agreement_refusal(false, 0, 0, 4), "");
  EXPECT_EQ(step_agreement_refusal(false, 0, 4, 4), "");
  // This rank failed: its own error is raised, not this one.
  EXPECT_EQ(step_agreement_refusal(true, 1, 0, 4), "");
  EXPECT_EQ(step_agreement_refusal(true, 2, 0, 4), "");
  std::string why = step_agreement_refusal(false, 1, 0, 4);
  EXPECT_NE(why.find("another rank's step() failed"), std::string::npos) << why;
  EXPECT_NE(why.find("resume from the last checkpoint"), std::string::npos) << why;
  why = step_agreement_refusal(false, 0, 1, 4);
  EXPECT_NE(why.find("1 of 4 ranks skipped this step"), std::string::npos) << why;
  EXPECT_NE(why.find("keep every parameter's gradient reduced by DDP"), std::string::npos) << why;
  // A failure elsewhere says so first, whatever was skipped.
  why = step_agreement_refusal(false, 1, 2, 4);
  EXPECT_NE(why.find("another rank's step() failed"), std::string::npos) << why;
}
