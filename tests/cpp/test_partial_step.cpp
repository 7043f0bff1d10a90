// optimizer/partial_step.hpp and state_placement.hpp: the decisions of CpuAdamW
// (Note [C++ CpuAdamW faults], Note [CPU AdamW state placement]) without torch:
// which parameters a retry skips, the error's text, one kernel call per step
// number, and where states and masters live.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/partial_step.hpp"
#include "tierflow/optimizer/state_placement.hpp"

namespace {

namespace opt = tierflow::optimizer;
using opt::GradIdentity;
using opt::StepRetryMarks;
using opt::UnsteppedParameter;

TEST(StepRetryMarks, ARetryWithTheSameGradientSkipsOnlyTheSlotsThatStepped) {
  StepRetryMarks marks;
  const GradIdentity g0{100, 3}, g1{101, 0}, g2{102, 7};
  marks.mark(0, g0);  // slot 0 stepped; slot 1 failed; slot 2 stepped
  marks.mark(2, g2);
  EXPECT_TRUE(marks.stepped_with(0, g0));
  EXPECT_FALSE(marks.stepped_with(1, g1)) << "the slot that failed steps in the retry";
  EXPECT_TRUE(marks.stepped_with(2, g2));
  EXPECT_FALSE(marks.stepped_with(7, {107, 0})) << "a slot never seen is not marked";
  EXPECT_EQ(marks.marked(), 2u);
}

TEST(StepRetryMarks, ANewGradientIsANewStep) {
  StepRetryMarks marks;
  marks.mark(0, {100, 3});
  EXPECT_FALSE(marks.stepped_with(0, {100, 4})) << "written in place since (zero_grad + backward accumulate)";
  EXPECT_FALSE(marks.stepped_with(0, {200, 3})) << "another gradient tensor";
  EXPECT_FALSE(marks.stepped_with(0, {})) << "no gradient";
}

TEST(StepRetryMarks, ACompletedStepClearsTheMarks) {
  StepRetryMarks marks;
  marks.mark(0, {100, 3});
  marks.mark(1, {101, 3});
  marks.clear();
  EXPECT_FALSE(marks.stepped_with(0, {100, 3}));
  EXPECT_FALSE(marks.stepped_with(1, {101, 3}));
  EXPECT_EQ(marks.marked(), 0u);
  marks.mark(1, {101, 4});  // marks again after a clear
  EXPECT_TRUE(marks.stepped_with(1, {101, 4}));
}

TEST(StepRetryMarks, ASecondStepWithANewGradientReplacesTheMark) {
  StepRetryMarks marks;
  marks.mark(0, {100, 3});
  marks.mark(0, {100, 5});
  EXPECT_FALSE(marks.stepped_with(0, {100, 3}));
  EXPECT_TRUE(marks.stepped_with(0, {100, 5}));
  EXPECT_THROW(marks.mark(0, {}), tierflow::logic_error) << "a slot steps with a gradient";
}

TEST(UnsteppedMessage, NamesGroupIndexAndShapeOfEachAndTheFirstError) {
  const std::string what =
      opt::unstepped_message({{0, 0, {300, 70}}, {1, 2, {}}, {1, 3, {5}}}, "write failed: No space left on device");
  EXPECT_EQ(what,
            "tierflow CpuAdamW: 3 parameters did not step and kept their state and weights (group 0 parameter 0 "
            "[300, 70], group 1 parameter 2 [], group 1 parameter 3 [5]); the others stepped. Call step() again once "
            "the cause is fixed: it steps only those. First error: write failed: No space left on device");
}

TEST(UnsteppedMessage, NamesEightAndCountsTheRest) {
  std::vector<UnsteppedParameter> unstepped;
  for (std::size_t i = 0; i < 11; ++i) unstepped.push_back({0, i, {2}});
  const std::string what = opt::unstepped_message(unstepped, "e");
  EXPECT_NE(what.find("11 parameters did not step"), std::string::npos) << what;
  EXPECT_NE(what.find("group 0 parameter 7 [2] and 3 more)"), std::string::npos) << what;
  EXPECT_EQ(what.find("parameter 8 "), std::string::npos) << what;
}

TEST(GroupsByNextStep, OneGroupPerStepNumberInAscendingOrder) {
  // After a partial step, parameters 1 and 3 are one step behind the others.
  const auto batches = opt::groups_by_next_step({4, 3, 4, 3, 0});
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].step, 1);
  EXPECT_EQ(batches[0].members, (std::vector<std::size_t>{4}));
  EXPECT_EQ(batches[1].step, 4);
  EXPECT_EQ(batches[1].members, (std::vector<std::size_t>{1, 3}));
  EXPECT_EQ(batches[2].step, 5);
  EXPECT_EQ(batches[2].members, (std::vector<std::size_t>{0, 2}));
  EXPECT_TRUE(opt::groups_by_next_step({}).empty());
}

TEST(StatePlacement, OnlyNvmeMovesTheStatesOffTheHost) {
  using tierflow::OffloadTarget;
  using tierflow::Tier;
  EXPECT_EQ(opt::adamw_state_tier(OffloadTarget::kNvme), Tier::kNvme);
  EXPECT_EQ(opt::adamw_state_tier(OffloadTarget::kHost), Tier::kHost);
  EXPECT_EQ(opt::adamw_state_tier(OffloadTarget::kNone), Tier::kHost) << "choosing the optimizer asks for it";
  EXPECT_EQ(opt::adamw_state_tier(OffloadTarget::kAuto), Tier::kHost);
}

TEST(StatePlacement, OnlyAContiguousFp32HostParameterIsItsOwnMaster) {
  EXPECT_TRUE(opt::is_own_master({true, true, true}));
  EXPECT_FALSE(opt::is_own_master({false, true, true})) << "on the device";
  EXPECT_FALSE(opt::is_own_master({true, false, true})) << "16-bit";
  EXPECT_FALSE(opt::is_own_master({true, true, false})) << "strided";
}

TEST(StatePlacement, ADeviceParameterIsUpdatedThroughStaging) {
  using opt::WeightUpdate;
  EXPECT_EQ(opt::weight_update({true, true, true}), WeightUpdate::kInPlace);
  EXPECT_EQ(opt::weight_update({true, false, true}), WeightUpdate::kIntoParameter) << "a 16-bit host parameter";
  EXPECT_EQ(opt::weight_update({false, true, true}), WeightUpdate::kStaged) << "an fp32 device parameter";
  EXPECT_EQ(opt::weight_update({false, false, true}), WeightUpdate::kStaged);
}

}  // namespace
