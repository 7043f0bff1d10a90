// Note [Plan driver], batch sizes: growth from the scaled profile, batches of varying size settling the re-plan,
// which of a forward's tensors are tracked, the plan of a model without blocks, and a profile read back, each
// without torch through the fake front end of plan_driver_fake_front.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "plan_driver_fake_front.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace {

using namespace tierflow::tiering;
using namespace tierflow::tiering::plan_driver_fakes;

TEST(PlanDriver, ALargerBatchPlansAgainFromTheScaledProfile) {
  FakeFront f;
  f.inputs.device_budget_bytes = 120 * kMiB;  // every block kept at the profile's size, not at twice it
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const InfoLogs info;  // planning again is info (Note [Plan messages])
  testing::internal::CaptureStderr();
  run_steps(d, f, 1, 1.0, 3.0, 256);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tierflow: a batch of 512 input elements, x2 the 256 the activation plan in force was made "
                     "for: planning again for it (Note [Batch growth])"),
            std::string::npos)
      << err;
  ASSERT_EQ(f.applied.size(), 2u);
  const DrivenPlan& p = *d.plan();
  EXPECT_EQ(p.batch_elements, 512u);
  EXPECT_EQ(p.profiled_batch_elements, 256u);
  EXPECT_TRUE(f.applied[0].keep_all);
  EXPECT_FALSE(p.keep_all) << p.summary;
  EXPECT_LE(p.predicted_device_peak_bytes, f.inputs.device_budget_bytes);
  EXPECT_EQ(d.batch_growth().replans, 1);
  EXPECT_FALSE(d.batch_growth().refused.has_value());
  // The plan for a larger batch than the profile's is not calibrated on: settled.
  ASSERT_TRUE(p.settled.has_value());
  EXPECT_NE(p.settled->find("larger batch than the profile's"), std::string::npos);
  EXPECT_EQ(d.profile()->batch_elements, 256u) << "the profile stays the measured one";
  // A smaller batch holds under the larger plan; the same size again does not plan again.
  run_steps(d, f, 2, 1.0, 10.0, 128);
  run_steps(d, f, 1, 1.0, 20.0, 256);
  EXPECT_EQ(f.applied.size(), 2u);
}

TEST(PlanDriver, ScalingABatchScalesTheBlocksAndTheOutsideBytes) {
  FakeFront f;
  f.outside_bytes = 5;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const auto [scaled, target] = d.for_batch(*d.profile(), 640);
  EXPECT_EQ(target, 640u);
  EXPECT_DOUBLE_EQ(scaled.batch_ratio, 2.5);
  EXPECT_EQ(scaled.file.blocks[0].split_bytes, 20 * kMiB);
  EXPECT_EQ(scaled.file.outside_saved_bytes, 12u) << "12.5 rounds half to even, as Python's round";
  const auto [same, base] = d.for_batch(*d.profile(), 100);
  EXPECT_EQ(base, 256u);
  EXPECT_DOUBLE_EQ(same.batch_ratio, 1.0);
}

TEST(PlanDriver, NoPlanForAMuchLargerBatchKeepsThePlanInForceAndSaysSo) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const std::string summary = d.plan()->summary;
  testing::internal::CaptureStderr();
  run_steps(d, f, 1, 1.0, 3.0, 128 * 64);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(d.batch_growth().refused.has_value());
  EXPECT_EQ(d.batch_growth().refused->first, 2u * 128 * 64);
  EXPECT_EQ(d.batch_growth().refused->second.rfind("no activation plan fits it: ", 0), 0u);
  EXPECT_EQ(d.batch_growth().replans, 0);
  EXPECT_EQ(d.plan()->summary, summary);
  EXPECT_EQ(d.plan()->batch_elements, 256u) << "the plan in force is still the short batches'";
  EXPECT_NE(err.find("tierflow: a batch of 16384 input elements, larger than the 256 the activation plan in force "
                     "was made for, which stays and may exceed TIERFLOW_GPU_MEMORY: no activation plan fits it"),
            std::string::npos)
      << err;
  ASSERT_TRUE(d.plan()->settled.has_value());
  // Said once per size: the same size again tries nothing.
  run_steps(d, f, 1, 1.0, 10.0, 128 * 64);
  EXPECT_EQ(f.applied.size(), 1u);
}

TEST(PlanDriver, ParametersPlannedPerBlockRefuseToGrow) {
  FakeFront f;
  PlanDriverSettings s = settings();
  s.growth_refusal = "TIERFLOW_OFFLOAD_PARAMS=auto made them resident for good";
  PlanDriver d(s);
  profile_and_plan(d, f);
  run_steps(d, f, 1, 1.0, 3.0, 512);
  ASSERT_TRUE(d.batch_growth().refused.has_value());
  EXPECT_EQ(d.batch_growth().refused->second, s.growth_refusal);
  EXPECT_EQ(f.applied.size(), 1u);
  EXPECT_EQ(d.planned_elements(), 1024u);
}

TEST(PlanDriver, BatchesOfVaryingSizeSettleTheReplan) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  EXPECT_TRUE(d.phases().may_replan());
  run_steps(d, f, 1, 1.0, 3.0, 100);  // 22% shorter
  EXPECT_FALSE(d.phases().may_replan());
  ASSERT_TRUE(d.plan()->settled.has_value());
  EXPECT_NE(d.plan()->settled->find("the batches' sizes vary"), std::string::npos);
  EXPECT_FALSE(d.replanned().has_value());
}

TEST(PlanDriver, ALargerThirdForwardPlansForItsSizeAndSettles) {
  FakeFront f;
  PlanDriver d(settings());
  forward(d, f, batch(128), 1.0);
  forward(d, f, batch(128), 2.0);
  forward(d, f, batch(512), 3.0);
  EXPECT_EQ(d.plan()->batch_elements, 1024u);
  EXPECT_EQ(d.plan()->profiled_batch_elements, 256u);
  EXPECT_NE(d.plan()->settled.value_or("").find("larger batch than the profile's"), std::string::npos);
}

TEST(PlanDriver, OtherTensorsAreMeasuredOnThoseBothHaveAndSaidOnce) {
  FakeFront f;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  testing::internal::CaptureStderr();
  InputElements other = {{"[0][0]", 512}, {"[1]['mask']", 7}};
  forward(d, f, other, 4.0);
  forward(d, f, other, 5.0);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tierflow: the model is called with other tensors (['[0][0]', \"[1]['mask']\"]) than in the "
                     "forward its activation plan was profiled on (['[0][0]', \"[1]['labels']\"])"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("other tensors", err.find("other tensors") + 1), std::string::npos) << "said once";
  EXPECT_EQ(d.plan()->batch_elements, 1024u) << "x4 on the tensor both have";
}

TEST(PlanDriver, AForwardWithoutTensorsIsNotTrackedAndSaidOnce) {
  FakeFront f;
  PlanDriver d(settings());
  testing::internal::CaptureStderr();
  forward(d, f, {}, 1.0);
  forward(d, f, {}, 2.0);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("no tensor among its arguments that tierflow can count"), std::string::npos) << err;
  EXPECT_EQ(err.find("can count", err.find("can count") + 1), std::string::npos) << "said once";
}

TEST(PlanDriver, WithoutBlocksKeepsWhatTheFirstStepSavedWhenItFitsAndScalesItForALargerBatch) {
  FakeFront f;
  f.first_saved = 10 * kMiB;
  f.inputs.parameter_bytes = 1 * kMiB;
  f.inputs.device_budget_bytes = 40 * kMiB;
  testing::internal::CaptureStderr();
  PlanDriver d(settings(0));
  EXPECT_EQ(forward(d, f, batch(128), 1.0), PhaseAction::kNone);
  EXPECT_EQ(forward(d, f, batch(128), 2.0), PhaseAction::kPlanWithoutBlocks);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tierflow: no repeated blocks found in the model (pass blocks=[...] to tierflow.wrap); "
                     "TIERFLOW_OFFLOAD_ACTIVATIONS=auto swaps every saved tensor to the host in the first step"),
            std::string::npos)
      << err;
  ASSERT_TRUE(d.plan().has_value());
  EXPECT_TRUE(d.plan()->without_blocks);
  EXPECT_TRUE(d.plan()->keep_all && d.plan()->outside_kept) << d.plan()->summary;
  EXPECT_EQ(d.plan()->outside_bytes, 10 * kMiB);
  EXPECT_FALSE(d.plan()->predicted_step_seconds.has_value());
  EXPECT_EQ(d.plan()->window_bytes, 4 * kMiB);
  EXPECT_TRUE(f.applied.empty()) << "no blocks: nothing to apply";
  EXPECT_FALSE(d.phases().may_replan());
  // Eight times the batch: eight times the bytes, which no longer fit.
  forward(d, f, batch(1024), 3.0);
  EXPECT_FALSE(d.plan()->keep_all) << d.plan()->summary;
  EXPECT_EQ(d.plan()->outside_bytes, 80 * kMiB);
  EXPECT_EQ(d.plan()->batch_elements, 2048u);
  EXPECT_EQ(d.batch_growth().replans, 1);
}

TEST(PlanDriver, AProfileReadBackPlansBeforeTheFirstForwardForItsSize) {
  FakeFront f;
  PlanDriver measured(settings());
  profile_and_plan(measured, f);
  AutoProfile loaded = *measured.profile();
  loaded.batch_tensor_elements.reset();  // a file from before Note [Batch growth]
  loaded.batch_elements = 0;
  f.applied.clear();
  f.written.clear();
  PlanDriver d(settings(), loaded);
  EXPECT_EQ(forward(d, f, batch(64), 1.0), PhaseAction::kPlanFromProfile);
  ASSERT_TRUE(d.plan().has_value());
  EXPECT_EQ(f.timings + f.measures, 2) << "only the measured run timed and measured";
  EXPECT_EQ(d.plan()->batch_elements, 128u) << "taken to be for the first forward's size";
  EXPECT_EQ(d.profile()->batch_tensor_elements->size(), 2u);
  EXPECT_TRUE(f.written.empty());
  EXPECT_FALSE(d.timed_step().has_value());
  // Its size is the reference from here: a larger batch plans again.
  forward(d, f, batch(128), 2.0);
  EXPECT_EQ(d.plan()->batch_elements, 256u);
  EXPECT_EQ(d.batch_growth().replans, 1);
}

TEST(PlanDriver, AProfileWithoutOutsideBytesSwapsThemUnlessEveryBlockIsKept) {
  FakeFront f;
  f.outside_bytes = 2 * kMiB;
  PlanDriver measured(settings());
  profile_and_plan(measured, f);
  AutoProfile loaded = *measured.profile();
  loaded.outside_measured = false;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings(), loaded);
  forward(d, f, batch(128), 1.0);
  EXPECT_FALSE(d.plan()->outside_measured);
  EXPECT_FALSE(d.plan()->outside_kept) << d.plan()->summary;
  EXPECT_FALSE(d.plan()->keep_all);
}

// Note [Activation planner], Outside the blocks: the largest tensor saved outside the blocks in the timed step
// (their host staging on the way to NVMe) reaches the planner's budgets and the profile written, and grows with
// the batch as they do; a profile without the outside bytes measured counts none.
TEST(PlanDriver, TheLargestTensorOutsideTheBlocksReachesTheBudgetsAndGrowsWithTheBatch) {
  struct Front : FakeFront {
    TimedStepMeasures measure_timed_step() override {
      TimedStepMeasures m = FakeFront::measure_timed_step();
      m.outside_largest_bytes = 3 * kMiB;
      return m;
    }
  } f;
  f.outside_bytes = 5 * kMiB;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  ASSERT_EQ(f.written.size(), 1u);
  EXPECT_EQ(f.written[0].file.outside_largest_bytes, 3 * kMiB);
  const Budgets b = d.budgets(*d.profile(), f);
  EXPECT_EQ(b.outside_largest_bytes, 3 * kMiB);
  EXPECT_EQ(b.outside_saved_bytes, 5 * kMiB);
  const auto [scaled, target] = d.for_batch(*d.profile(), 640);  // x2.5
  EXPECT_EQ(scaled.file.outside_largest_bytes, 15 * kMiB / 2);
  EXPECT_EQ(d.budgets(scaled, f).outside_largest_bytes, 15 * kMiB / 2);
  AutoProfile older = *d.profile();
  older.outside_measured = false;
  EXPECT_EQ(d.budgets(older, f).outside_largest_bytes, 0u);
}

}  // namespace
