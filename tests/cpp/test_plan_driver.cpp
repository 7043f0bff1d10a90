// Note [Plan driver]: every phase and path of `auto` without torch: a fake front end measures and applies, the
// driver decides (profile, plan, unsplittable re-plan, calibration re-plan, batch growth, settling, the plan of a
// model without blocks, a profile read back, forced recompute).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace {

using namespace tierflow::tiering;
using tierflow::LogLevel;
using Json = nlohmann::ordered_json;

// Routine planning lines are info (Note [Plan messages]): a test reading them asks for info while it runs.
struct InfoLogs {
  LogLevel before = tierflow::log_level();
  InfoLogs() { tierflow::set_log_level(LogLevel::kInfo); }
  ~InfoLogs() { tierflow::set_log_level(before); }
  InfoLogs(const InfoLogs&) = delete;
  InfoLogs& operator=(const InfoLogs&) = delete;
};

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::size_t kBlocks = 4;

BlockRecord block_record() {
  BlockRecord r;
  r.input_bytes = 1 * kMiB;
  r.attention_bytes = 4 * kMiB;
  r.split_bytes = 8 * kMiB;
  r.cheap_bytes = 4 * kMiB;
  r.split_flops = 6e9;
  r.attention_flops = 2e9;
  r.total_flops = 10e9;
  r.has_split_ops = true;
  r.forward_seconds = 0.010;
  r.backward_seconds = 0.020;
  r.parameter_bytes = 1 * kMiB;
  return r;
}

Links links() {
  Links l;
  l.d2h = l.h2d = 1e9;
  l.duplex = 2e9;
  return l;
}

// Measures nothing, applies nothing: records what the driver asked for.
struct FakeFront : PlanFrontEnd {
  SessionBudgetInputs inputs;
  std::vector<std::size_t> inexact;  // split blocks the first probe of each plan finds inexact
  bool inexact_once = true;
  int probes = 0, timings = 0, measures = 0;
  std::vector<DrivenPlan> applied;
  std::vector<AutoProfile> written;
  std::uint64_t first_saved = 0;
  std::uint64_t outside_bytes = 0;

  FakeFront() {
    inputs.device_budget_bytes = 1ull << 40;
    inputs.host_budget_bytes = 1ull << 40;
    inputs.prefetch_bytes = 4 * kMiB;
    inputs.parameter_bytes = kBlocks * kMiB;
  }
  SessionBudgetInputs budget_inputs() override { return inputs; }
  std::vector<std::size_t> inexact_splits(const std::vector<BlockPlan>& blocks) override {
    ++probes;
    std::vector<std::size_t> out;
    for (const std::size_t i : inexact)
      if (blocks.at(i).mode == BlockMode::kSplit) out.push_back(i);
    if (inexact_once) inexact.clear();
    return out;
  }
  std::optional<std::uint64_t> apply(const DrivenPlan& plan) override {
    applied.push_back(plan);
    return std::nullopt;
  }
  void start_timing() override { ++timings; }
  double probe_seconds = 0;  // how long measuring the timed step (its link probes) takes
  TimedStepMeasures measure_timed_step() override {
    ++measures;
    now += probe_seconds;
    TimedStepMeasures m;
    m.blocks.assign(kBlocks, block_record());
    m.links = links();
    m.outside_saved_bytes = outside_bytes;
    m.blocks_forward_seconds = 0.040;
    m.blocks_backward_seconds = 0.080;
    m.blocks_replay_seconds = 0.040;
    return m;
  }
  std::uint64_t first_step_saved_bytes() override { return first_saved; }
  void write_profile(const AutoProfile& profile) override { written.push_back(profile); }
  double now = 0;  // the clock: each forward's time, set by forward()
  double now_seconds() override { return now; }
};

// A forward of the model at time `t` (seconds).
PhaseAction forward(PlanDriver& d, FakeFront& f, const InputElements& inputs, double t) {
  f.now = t;
  return d.before_forward(inputs, f);
}

PlanDriverSettings settings(std::size_t blocks = kBlocks) {
  PlanDriverSettings s;
  s.blocks = blocks;
  s.prefetch_bytes = 4 * kMiB;
  return s;
}

InputElements batch(std::uint64_t tokens) { return {{"[0][0]", tokens}, {"[1]['labels']", tokens}}; }

// Three forwards of `tokens` a second apart: the profiling steps; the plan comes before the third.
void profile_and_plan(PlanDriver& d, FakeFront& f, std::uint64_t tokens = 128) {
  EXPECT_EQ(forward(d, f, batch(tokens), 1.0), PhaseAction::kNone);
  EXPECT_EQ(forward(d, f, batch(tokens), 2.0), PhaseAction::kStartTiming);
  EXPECT_EQ(forward(d, f, batch(tokens), 3.0), PhaseAction::kMeasureAndPlan);
}

// A device budget between recomputing every block and keeping them all: the plan moves bytes over the link.
std::uint64_t tight_budget(FakeFront& f) {
  PlanDriver probe(settings());
  profile_and_plan(probe, f);
  const Budgets b = probe.budgets(*probe.profile(), f);
  const auto& blocks = probe.profile()->file.blocks;
  const Plan low = forced_plan(blocks, links(), b, BlockMode::kRecompute);
  const Plan high = forced_plan(blocks, links(), b, BlockMode::kKeep);
  f.applied.clear();
  f.written.clear();
  f.probes = f.timings = f.measures = 0;
  return low.predicted_device_peak_bytes + (high.predicted_device_peak_bytes - low.predicted_device_peak_bytes) / 3;
}

bool any_mode(const DrivenPlan& p, BlockMode mode) {
  return std::any_of(p.plan.blocks.begin(), p.plan.blocks.end(), [mode](const BlockPlan& b) { return b.mode == mode; });
}

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

// Steps `seconds` apart from t = 3 on, the forwards after the plan's.
double run_steps(PlanDriver& d, FakeFront& f, int steps, double seconds, double t = 3.0,
                 std::uint64_t tokens = 128) {
  for (int i = 0; i < steps; ++i) {
    t += seconds;
    forward(d, f, batch(tokens), t);
  }
  return t;
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
                                            "batch_elements", "outside_saved_bytes", "host_gaps_seconds",
                                            "timed_step_seconds", "rest_of_step_seconds", "fixed_device_bytes"}));
  EXPECT_EQ(measured["batch_tensor_elements"], Json({{"[0][0]", 128}, {"[1]['labels']", 128}}));
  // What the file reader takes back: the same blocks and links.
  const ProfileFile back = profile_from_json(auto_profile_json(f.written[1]));
  EXPECT_EQ(back.blocks.size(), kBlocks);
  EXPECT_EQ(back.links.d2h, f.written[1].file.links.d2h);
  const Json calibrated = Json::parse(auto_profile_json(f.written[1]));
  EXPECT_EQ(calibrated["calibrated"]["link_factor"].get<double>(), d.replanned()->link_factor);
  EXPECT_EQ(calibrated["rest_of_step_seconds"], measured["rest_of_step_seconds"]);
}

}  // namespace
