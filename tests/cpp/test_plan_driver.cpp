// Note [Plan driver]: every phase and path of `auto` without torch: a fake front end measures and applies, the
// driver decides (profile, plan, unsplittable re-plan, calibration re-plan, settling, forced recompute, the JSON);
// batch growth, the plan of a model without blocks and a profile read back are test_plan_driver_growth.cpp's.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plan_driver_fake_front.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace {

using namespace tierflow::tiering;
using namespace tierflow::tiering::plan_driver_fakes;
using Json = nlohmann::ordered_json;

TEST(PlanDriver, ProfilesInTheFirstStepsThenPlansBeforeTheThird) {
  FakeFront f;
  f.outside_bytes = 2 * kMiB;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  EXPECT_EQ(f.timings, 1);
  EXPECT_EQ(f.measures, 1);
  ASSERT_TRUE(d.plan().has_value());
  ASSERT_EQ(f.applied.size(), 1u);
  const DrivenPlan& p = *d.plan();
  // Room for everything: every block and what is outside them kept, no hooks at all.
  EXPECT_TRUE(p.keep_all && p.outside_kept) << p.summary;
  EXPECT_EQ(p.batch_elements, 256u);
  EXPECT_EQ(p.profiled_batch_elements, 256u);
  // The profile: the timed forward's blocks and size, the rest of the step, written once.
  ASSERT_EQ(f.written.size(), 1u);
  const AutoProfile& w = f.written[0];
  EXPECT_EQ(w.file.blocks.size(), kBlocks);
  EXPECT_EQ(w.file.blocks[0].input_bytes, 1 * kMiB);
  EXPECT_EQ(w.batch_elements, 256u);
  EXPECT_EQ(w.batch_tensor_elements->size(), 2u);
  EXPECT_TRUE(w.outside_measured);
  EXPECT_EQ(w.file.outside_saved_bytes, 2 * kMiB);
  EXPECT_DOUBLE_EQ(*w.timed_step_seconds, 1.0);
  const double rest = 1.0 - 0.16 - outside_swap_seconds(links(), 2 * kMiB);
  EXPECT_NEAR(*w.rest_of_step_seconds, rest, 1e-12);
  EXPECT_NEAR(p.rest_of_step_seconds, rest, 1e-12);
  EXPECT_NEAR(*p.predicted_step_seconds, p.predicted_blocks_seconds + rest, 1e-12);
  EXPECT_EQ(w.file.fixed_device_bytes, d.budgets(w, f).fixed_device_bytes);
  EXPECT_NEAR(d.timed_step()->rest_of_step_seconds, rest, 1e-12);
  EXPECT_EQ(d.kept_bytes(), kBlocks * 17 * kMiB);
  // No plan again under the same size: the phases are over.
  EXPECT_EQ(forward(d, f, batch(128), 4.0), PhaseAction::kNone);
  EXPECT_EQ(f.applied.size(), 1u);
  EXPECT_EQ(d.phases().forwards(), 4);
}

TEST(PlanDriver, ATightBudgetMovesBytesAndWidensTheWindow) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const DrivenPlan& p = *d.plan();
  EXPECT_FALSE(p.keep_all) << p.summary;
  EXPECT_LE(p.predicted_device_peak_bytes, f.inputs.device_budget_bytes);
  EXPECT_GE(p.window_bytes, 4 * kMiB);
  EXPECT_EQ(p.lines.size(), kBlocks);
  EXPECT_EQ(p.why.size(), kBlocks);
}

TEST(PlanDriver, SplitBlocksThatProbeInexactArePlannedAgainWithoutTheSplit) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  {
    PlanDriver d(settings());
    profile_and_plan(d, f);
    ASSERT_TRUE(any_mode(*d.plan(), BlockMode::kSplit)) << d.plan()->summary;  // the premise
    EXPECT_EQ(f.probes, 1);
  }
  f.applied.clear();
  f.probes = 0;
  f.inexact = {0, 1, 2, 3};
  PlanDriver d(settings());
  profile_and_plan(d, f);
  EXPECT_EQ(f.probes, 2) << "the plan made again is probed once more";
  EXPECT_FALSE(any_mode(*d.plan(), BlockMode::kSplit)) << d.plan()->summary;
  ASSERT_EQ(f.applied.size(), 1u) << "only the final plan is applied";
}

TEST(PlanDriver, StepsThatStrayReplanOnceFromCalibratedFigures) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const double predicted = *d.plan()->predicted_step_seconds;
  const InfoLogs info;  // the re-plan's line is info (Note [Plan messages])
  testing::internal::CaptureStderr();
  // The first step under the plan is not judged; three more are.
  run_steps(d, f, 3, 3 * predicted);
  EXPECT_FALSE(d.replanned().has_value());
  run_steps(d, f, 1, 3 * predicted, 3.0 + 3 * 3 * predicted);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(d.replanned().has_value());
  const Replanned& r = *d.replanned();
  EXPECT_TRUE(r.replanned) << r.why;
  EXPECT_EQ(r.steps, 3u);
  EXPECT_NEAR(*r.measured_step_seconds, 3 * predicted, 1e-9);
  EXPECT_TRUE(r.link_factor < 1 || r.compute_factor > 1) << r.why;
  EXPECT_NE(err.find("tierflow: re-planning once: measured step"), std::string::npos) << err;
  EXPECT_EQ(f.applied.size(), 2u);
  ASSERT_EQ(f.written.size(), 2u) << "the calibrated profile is written for the next run";
  ASSERT_TRUE(f.written[1].calibrated.has_value());
  EXPECT_EQ(f.written[1].calibrated->link_factor, r.link_factor);
  EXPECT_DOUBLE_EQ(f.written[1].file.links.d2h, links().d2h * r.link_factor);
  EXPECT_DOUBLE_EQ(f.written[1].file.blocks[0].forward_seconds,
                   f.written[0].file.blocks[0].forward_seconds * r.compute_factor);
  // Once only, however far the steps stray from here.
  EXPECT_FALSE(d.phases().may_replan());
  run_steps(d, f, 6, 10 * predicted, 100.0);
  EXPECT_EQ(f.applied.size(), 2u);
}

TEST(PlanDriver, ThePlansOwnStepsGiveTheRestAndTheStepsAfterAreMeasuredBesideIt) {
  // Note [Rest calibration]: a plan that keeps everything (no re-plan) whose steps take 0.5 s where the timed step
  // gave a rest of 0.84 s: after its first kRestCalibrationSkip steps and kRestCalibrationSteps more, the whole
  // step predicted is their median; the steps measured beside it are the ones after.
  FakeFront f;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const double timed_rest = d.plan()->rest_of_step_seconds;
  const double blocks = d.plan()->predicted_blocks_seconds;
  ASSERT_GT(timed_rest, 0.5 - blocks);
  const std::uint64_t revision = d.revision();
  double t = run_steps(d, f, 1, 3.0);  // the first steps under the plan: not among them
  t = run_steps(d, f, kRestCalibrationSkip - 1, 0.9, t);
  t = run_steps(d, f, kRestCalibrationSteps - 1, 0.5, t);
  EXPECT_FALSE(d.plan()->rest_calibration.has_value());
  EXPECT_EQ(d.plan()->rest_of_step_seconds, timed_rest);
  t = run_steps(d, f, 1, 0.9, t);  // one slower step: the median holds
  ASSERT_TRUE(d.plan()->rest_calibration.has_value());
  EXPECT_GT(d.revision(), revision) << "the front end reads the plan again";
  const RestCalibration& c = *d.plan()->rest_calibration;
  EXPECT_EQ(c.steps, kRestCalibrationSteps);
  EXPECT_DOUBLE_EQ(c.step_seconds, 0.5);
  EXPECT_EQ(c.timed_rest_seconds, timed_rest);
  EXPECT_DOUBLE_EQ(d.plan()->rest_of_step_seconds, 0.5 - blocks);
  EXPECT_DOUBLE_EQ(*d.plan()->predicted_step_seconds, 0.5);
  ASSERT_TRUE(d.plan()->step.has_value());
  EXPECT_DOUBLE_EQ(d.plan()->step->total_seconds, 0.5);
  EXPECT_DOUBLE_EQ(d.plan()->step->rest_seconds, 0.5 - blocks);
  // Held out: nothing measured yet, then only the steps after the calibration.
  EXPECT_EQ(d.measured_beside_predicted(std::nullopt).steps, 0u);
  run_steps(d, f, 3, 0.6, t);
  const MeasuredBesidePredicted m = d.measured_beside_predicted(std::nullopt);
  EXPECT_EQ(m.steps, 3u);
  EXPECT_DOUBLE_EQ(*m.step_seconds, 0.6);
  EXPECT_DOUBLE_EQ(*m.step_vs_predicted, 0.6 / 0.5);
  EXPECT_EQ(Json::parse(plan_json(*d.plan()))["rest_calibration"]["steps"], kRestCalibrationSteps);
  EXPECT_EQ(f.applied.size(), 1u) << "the plan stays: only its prediction moved";
}

TEST(PlanDriver, BlocksPricedLongerThanThePlansStepsAreScaledToThem) {
  // Note [Rest calibration]: the timed step ran slow, so its blocks are priced above the steps that followed.
  FakeFront f;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const double blocks = d.plan()->predicted_blocks_seconds;
  const double compute = d.plan()->step->compute_seconds;
  run_steps(d, f, kRestCalibrationSkip + kRestCalibrationSteps, blocks / 2);
  ASSERT_TRUE(d.plan()->rest_calibration.has_value());
  EXPECT_NEAR(d.plan()->rest_calibration->blocks_factor, 0.5, 1e-9);
  EXPECT_NEAR(d.plan()->predicted_blocks_seconds, blocks / 2, 1e-9);
  EXPECT_EQ(d.plan()->rest_of_step_seconds, 0.0);
  EXPECT_NEAR(*d.plan()->predicted_step_seconds, blocks / 2, 1e-9);
  EXPECT_NEAR(d.plan()->step->compute_seconds, compute / 2, 1e-9);
  EXPECT_NEAR(d.plan()->step->total_seconds, blocks / 2, 1e-9);
}

TEST(PlanDriver, TheRestIsNotCalibratedOnBatchesOfVaryingSizeNorWithReplanOff) {
  for (const bool replan : {true, false}) {
    FakeFront f;
    PlanDriverSettings s = settings();
    s.replan = s.calibrate_rest = replan;
    PlanDriver d(s);
    profile_and_plan(d, f);
    double t = run_steps(d, f, 2, 0.5);
    t = run_steps(d, f, 1, 0.5, t, replan ? 100 : 128);  // 22% shorter (replan on), or all alike (off)
    run_steps(d, f, kRestCalibrationSkip + kRestCalibrationSteps + 2, 0.5, t);
    EXPECT_FALSE(d.plan()->rest_calibration.has_value()) << replan;
  }
}

TEST(PlanDriver, AFailedReplanKeepsThePlanInForce) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const double predicted = *d.plan()->predicted_step_seconds;
  const std::string summary = d.plan()->summary;
  f.inputs.device_budget_bytes = 1 * kMiB;  // device memory taken since: no plan fits
  run_steps(d, f, 4, 3 * predicted);
  ASSERT_TRUE(d.replanned().has_value());
  EXPECT_FALSE(d.replanned()->replanned);
  EXPECT_NE(d.replanned()->why.find("; the re-plan failed, the plan in force stays: "), std::string::npos)
      << d.replanned()->why;
  EXPECT_EQ(d.plan()->summary, summary);
  EXPECT_EQ(f.applied.size(), 1u);
  EXPECT_EQ(f.written.size(), 1u) << "nothing calibrated is written";
}

TEST(PlanDriver, APlanThatKeepsEverythingIsNotReplannedAndSaysWhy) {
  FakeFront f;
  PlanDriver d(settings());
  profile_and_plan(d, f);
  run_steps(d, f, 4, 5.0);
  ASSERT_TRUE(d.replanned().has_value());
  EXPECT_FALSE(d.replanned()->replanned);
  EXPECT_NE(d.replanned()->why.find("keeps every block"), std::string::npos);
  EXPECT_EQ(f.applied.size(), 1u);
}

TEST(PlanDriver, ReplanOffNeverJudgesTheSteps) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriverSettings s = settings();
  s.replan = false;
  PlanDriver d(s);
  profile_and_plan(d, f);
  run_steps(d, f, 5, 10.0);
  EXPECT_FALSE(d.replanned().has_value());
  EXPECT_FALSE(d.phases().may_replan());
}

TEST(PlanDriver, ForcedRecomputeHasNoPhases) {
  FakeFront f;
  PlanDriverSettings s = settings();
  s.forced = true;
  testing::internal::CaptureStderr();
  PlanDriver d(s);
  for (int i = 1; i <= 5; ++i) EXPECT_EQ(forward(d, f, {}, i), PhaseAction::kNone);
  EXPECT_TRUE(testing::internal::GetCapturedStderr().empty()) << "a forced plan tracks no batch size";
  EXPECT_FALSE(d.plan().has_value());
  EXPECT_EQ(f.timings + f.measures + static_cast<int>(f.applied.size()), 0);
}

TEST(PlanDriver, ARefusedForwardIsNotOneOfTheProfilingForwards) {
  FakeFront f;
  PlanDriver d(settings());
  forward(d, f, batch(128), 1.0);
  EXPECT_EQ(forward(d, f, batch(128), 2.0), PhaseAction::kStartTiming);
  d.forward_refused();
  EXPECT_EQ(forward(d, f, batch(128), 2.5), PhaseAction::kStartTiming);
  EXPECT_EQ(forward(d, f, batch(128), 3.0), PhaseAction::kMeasureAndPlan);
  EXPECT_DOUBLE_EQ(d.timed_step()->step_seconds, 0.5);
}

TEST(PlanDriver, TheMeasuredStepStartsOnceThePlanIsInForce) {
  FakeFront f;
  f.probe_seconds = 10;  // the links probed before the plan: not part of any step
  PlanDriver d(settings());
  profile_and_plan(d, f);
  EXPECT_DOUBLE_EQ(d.timed_step()->step_seconds, 1.0);
  forward(d, f, batch(128), 14.0);
  const MeasuredBesidePredicted m = d.measured_beside_predicted(std::nullopt);
  EXPECT_EQ(m.steps, 1u);
  EXPECT_DOUBLE_EQ(*m.step_seconds, 1.0);
}

TEST(PlanDriver, SettlingOnceAPlanIsInForceIsSaidAndStops) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const auto revision = d.revision();
  d.settle("the CPU optimizer's GPU share took 4 bytes");
  EXPECT_FALSE(d.phases().may_replan());
  EXPECT_EQ(d.plan()->settled.value_or(""), "the CPU optimizer's GPU share took 4 bytes");
  EXPECT_GT(d.revision(), revision);
  d.settle("again");
  EXPECT_EQ(d.plan()->settled.value_or(""), "the CPU optimizer's GPU share took 4 bytes");
}

TEST(PlanDriver, SettingsComeFromTheConfiguration) {
  auto c = tierflow::Config::parse({}, {{"TIERFLOW_OFFLOAD_ACTIVATIONS", "recompute"},
                                        {"TIERFLOW_PREFETCH_BYTES", "1048576"},
                                        {"TIERFLOW_REPLAN", "off"}});
  const PlanDriverSettings s = PlanDriverSettings::of(c, 3);
  EXPECT_TRUE(s.forced);
  EXPECT_FALSE(s.replan);
  EXPECT_EQ(s.prefetch_bytes, 1u << 20);
  EXPECT_EQ(s.blocks, 3u);
  EXPECT_TRUE(s.growth_refusal.empty());
}


TEST(PlanDriverJson, ThePlanAsTheSessionReadsIt) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  const Json p = Json::parse(plan_json(*d.plan()));
  ASSERT_EQ(p["blocks"].size(), kBlocks);
  EXPECT_EQ(p["blocks"][0]["mode"], "split");
  EXPECT_EQ(p["blocks"][0]["tier"], "host");
  EXPECT_EQ(p["blocks"][0]["params"], "gpu");
  EXPECT_EQ(p["rest_params"], "gpu");
  EXPECT_EQ(p["summary"], d.plan()->summary);
  EXPECT_EQ(p["window_bytes"], d.plan()->window_bytes);
  EXPECT_EQ(p["predicted_step_seconds"].get<double>(), *d.plan()->predicted_step_seconds);
  EXPECT_EQ(p["rest_of_step_seconds"].get<double>(), d.plan()->rest_of_step_seconds);
  EXPECT_TRUE(p["settled"].is_null());
  EXPECT_EQ(p["why"].size(), kBlocks);
}

TEST(PlanDriverJson, TheReportShowsThePlanTheReplanAndTheTimedStep) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  run_steps(d, f, 4, 3 * *d.plan()->predicted_step_seconds);
  run_steps(d, f, 1, 1.0, 100.0, 100);  // a shorter batch: nothing to plan
  const Json r = Json::parse(d.report_json());
  EXPECT_EQ(r["modes"].size(), kBlocks);
  EXPECT_EQ(r["replanned"]["replanned"], true);
  EXPECT_EQ(r["replanned"]["steps"], 3);
  EXPECT_EQ(r["replanned"]["link_factor"].get<double>(), d.replanned()->link_factor);
  EXPECT_EQ(r["timed_step"]["step_seconds"].get<double>(), 1.0);
  EXPECT_EQ(r["timed_step"]["links"]["d2h"].get<double>(), links().d2h) << "as measured, not as calibrated";
  EXPECT_EQ(r["timed_step"]["blocks"].size(), kBlocks);
  EXPECT_EQ(r["batch_growth"], Json({{"replans", 0}, {"refused", nullptr}}));
  EXPECT_EQ(r["kept_bytes"], d.kept_bytes());
  EXPECT_TRUE(r.contains("released_cached_bytes") && r["released_cached_bytes"].is_null());
  // A plan given by hand (a forced session's): its own fields, nothing measured.
  PlanDriverSettings forced = settings();
  forced.forced = true;
  const Json hand = Json::parse(PlanDriver(forced).report_json(
      R"({"blocks": [{"mode": "split", "alpha": 0.5, "tier": "host"}], "summary": "forced split"})"));
  EXPECT_EQ(hand["summary"], "forced split");
  EXPECT_EQ(hand["modes"], Json::array({"split"}));
  EXPECT_EQ(hand["params"], Json::array({"gpu"}));
  EXPECT_TRUE(hand["replanned"].is_null() && hand["timed_step"].is_null() && hand["window_bytes"].is_null());
}

TEST(PlanDriverJson, TheProfileFileKeepsItsFormatAndTheTimedStepsFigures) {
  FakeFront f;
  f.inputs.device_budget_bytes = tight_budget(f);
  PlanDriver d(settings());
  profile_and_plan(d, f);
  run_steps(d, f, 4, 3 * *d.plan()->predicted_step_seconds);
  ASSERT_EQ(f.written.size(), 2u);
  const Json measured = Json::parse(auto_profile_json(f.written[0]));
  std::vector<std::string> keys;
  for (const auto& [k, v] : measured.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"format", "version", "blocks", "links", "batch_tensor_elements",
                                            "batch_elements", "outside_saved_bytes", "outside_largest_bytes",
                                            "host_gaps_seconds", "timed_step_seconds", "rest_of_step_seconds",
                                            "fixed_device_bytes"}));
  EXPECT_EQ(measured["batch_tensor_elements"], Json({{"[0][0]", 128}, {"[1]['labels']", 128}}));
  // What the file reader takes back: the same blocks and links.
  const ProfileFile back = profile_from_json(auto_profile_json(f.written[1]));
  EXPECT_EQ(back.blocks.size(), kBlocks);
  EXPECT_EQ(back.links.d2h, f.written[1].file.links.d2h);
  // ... and the tensors outside the blocks, the largest of them too (Budgets::outside_largest_bytes).
  AutoProfile outside = f.written[0];
  outside.file.outside_saved_bytes = 5 * kMiB;
  outside.file.outside_largest_bytes = 3 * kMiB;
  const ProfileFile read = profile_from_json(auto_profile_json(outside));
  EXPECT_EQ(read.outside_saved_bytes, 5 * kMiB);
  EXPECT_EQ(read.outside_largest_bytes, 3 * kMiB);
  const Json calibrated = Json::parse(auto_profile_json(f.written[1]));
  EXPECT_EQ(calibrated["calibrated"]["link_factor"].get<double>(), d.replanned()->link_factor);
  EXPECT_EQ(calibrated["rest_of_step_seconds"], measured["rest_of_step_seconds"]);
}

}  // namespace
