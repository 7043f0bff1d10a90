// tiering::BlockMeasures (Note [C++ auto activations]): what a C++ trainer's block calls measure while no plan is
// in force, as the plan driver reads it.
#include <gtest/gtest.h>

#include <vector>

#include "tierflow/tiering/block_measures.hpp"

using namespace tierflow::tiering;

TEST(BlockMeasures, ABlockIndexNotAboveThePreviousStartsAForward) {
  BlockMeasures m;
  EXPECT_TRUE(m.starts_forward(0));
  EXPECT_FALSE(m.starts_forward(1));
  EXPECT_FALSE(m.starts_forward(2));
  EXPECT_TRUE(m.starts_forward(0));
  EXPECT_FALSE(m.starts_forward(3));
  EXPECT_TRUE(m.starts_forward(3));  // the same block again: a new pass
}

TEST(BlockMeasures, TheTimedStepSumsFromItsStartAndTheRecordsKeepTheLastCall) {
  BlockMeasures m;
  m.forward(0, 100, 40, 1.0);  // the profiling step, before the timing starts
  m.rerun(0, 300, 2.0);
  m.start_timing();
  m.forward(0, 100, 40, 0.5);
  m.forward(1, 200, 60, 0.25);  // a block first met in the timed step
  m.rerun(1, 500, 1.5);
  m.rerun(0, 350, 1.0);
  const TimedStepMeasures t = m.timed_step();
  ASSERT_EQ(t.blocks.size(), 2u);
  EXPECT_EQ(t.blocks[0].input_bytes, 100u);
  EXPECT_EQ(t.blocks[0].attention_bytes, 350u);  // what its rerun left saved: one class
  EXPECT_DOUBLE_EQ(t.blocks[0].forward_seconds, 0.5);
  EXPECT_DOUBLE_EQ(t.blocks[0].backward_seconds, 1.0);
  EXPECT_EQ(t.blocks[1].parameter_bytes, 60u);
  EXPECT_DOUBLE_EQ(t.blocks_forward_seconds, 0.75);
  EXPECT_DOUBLE_EQ(t.blocks_replay_seconds, 0.75);  // the rerun's forward is the replay
  EXPECT_DOUBLE_EQ(t.blocks_backward_seconds, 2.5);
}

TEST(BlockMeasures, TheBudgetsCountTheModelsParametersOrTheBlocksWhicheverIsLarger) {
  BlockMeasures m;
  m.forward(0, 1, 40, 0.1);
  m.forward(2, 1, 60, 0.1);
  EXPECT_EQ(m.parameter_bytes(0), 100u);
  EXPECT_EQ(m.parameter_bytes(70), 100u);
  EXPECT_EQ(m.parameter_bytes(1000), 1000u);
}

TEST(BlockMeasures, EverySplitBlockIsInexactWithoutASplitAction) {
  std::vector<BlockPlan> blocks(4);
  blocks[1].mode = BlockMode::kSplit;
  blocks[3].mode = BlockMode::kSplit;
  blocks[2].mode = BlockMode::kRecompute;
  EXPECT_EQ(split_blocks(blocks), std::vector<std::size_t>({1, 3}));
}
