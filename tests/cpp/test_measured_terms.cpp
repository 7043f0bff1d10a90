// Each term's measurement beside its prediction, and the CPU optimizer as the timed step measured it
// (tiering/measured_terms.hpp, Note [Step prediction]).
#include "tierflow/tiering/measured_terms.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {
namespace {

using Json = nlohmann::json;

// A report with a timed step of four blocks, each 4 s forward of which 2 s split and 1 s cheap recompute.
Json timed_report() {
  const Json block = {{"forward_seconds", 4.0}, {"split_recompute_seconds", 2.0}, {"cheap_recompute_seconds", 1.0}};
  return {{"timed_step", {{"blocks_forward_seconds", 10.0}, {"blocks_backward_seconds", 20.0},
                          {"blocks_replay_seconds", 12.0}, {"blocks", {block, block, block, block}}}},
          {"modes", {"keep", "swap", "recompute", "split"}},
          {"alpha", {0, 0, 0, 0.5}},
          {"batch_elements", 512},
          {"profiled_batch_elements", 512}};
}

const std::vector<std::optional<double>> kReplays(4, 3.0);

TEST(MeasuredTermsTest, ComputeCountsOnlyTheReplaysThePlanDoes) {
  Json report = timed_report();
  MeasuredCompute c = measured_compute(report.dump(), kReplays);
  ASSERT_TRUE(c.seconds);
  // Forward and backward, the recompute block's replay whole, the split block's share (2 * 0.5 + 1) / 4 of it.
  EXPECT_DOUBLE_EQ(*c.seconds, 30.0 + 3.0 + 3.0 * (2.0 * 0.5 + 1.0) / 4.0);
  EXPECT_NE(c.over.find("replays the plan in force does"), std::string::npos) << c.over;
  report["modes"] = {"keep", "keep", "keep", "keep"};
  EXPECT_DOUBLE_EQ(*measured_compute(report.dump(), kReplays).seconds, 30.0);
}

TEST(MeasuredTermsTest, NoComputeAfterBatchGrowthOrWithoutAReplayOrATimedStep) {
  Json grown = timed_report();
  grown["batch_elements"] = 1536;
  const MeasuredCompute c = measured_compute(grown.dump(), kReplays);
  EXPECT_FALSE(c.seconds);
  EXPECT_NE(c.over.find("1536"), std::string::npos) << c.over;
  EXPECT_FALSE(measured_compute(timed_report().dump(), {3.0, 3.0, std::nullopt, 3.0}).seconds);
  const MeasuredCompute none = measured_compute(R"({"modes": ["recompute"]})", kReplays);
  EXPECT_FALSE(none.seconds);
  EXPECT_EQ(none.over, "none: no timed step");
  EXPECT_THROW(measured_compute("{not json", kReplays), config_error);
}

WaitCounters plan_counters() {
  WaitCounters c;
  c.forwards = 3;
  c.optimizer_steps = 2;
  c.activation_wait_ms = 1.0;
  c.step_wait_ms = 10.0;
  c.grad_copy_wait_ms = 4.0;
  c.streaming = true;
  return c;
}

Json terms(const WaitCounters& now, const std::optional<WaitCounters>& then) {
  Json report = {{"measured", {{"step_seconds", 0.25}}}};
  return Json::parse(measured_terms_json(report.dump(), {}, now, then));
}

TEST(MeasuredTermsTest, StepWaitsSplitBetweenGradientCopiesAndTheOptimizer) {
  const WaitCounters then = plan_counters();
  WaitCounters now = then;
  now.forwards = 7;
  now.optimizer_steps = 6;  // 4 optimizer steps: 50 ms of step() waits each, 20 of them for copies
  now.activation_wait_ms = 9.0;
  now.step_wait_ms = 10.0 + 4 * 50.0;
  now.grad_copy_wait_ms = 4.0 + 4 * 20.0;
  Json t = terms(now, then);
  EXPECT_NEAR(t["measured"]["gradient_copies"].get<double>(), 0.020, 1e-12) << t;
  EXPECT_NEAR(t["measured"]["optimizer"].get<double>(), 0.030, 1e-12) << t;
  EXPECT_NEAR(t["measured"]["activation_copies"].get<double>(), 0.002, 1e-12) << t;
  EXPECT_EQ(t["measured"]["total"].get<double>(), 0.25);
  EXPECT_TRUE(t["measured"]["rest"].is_null());
  EXPECT_TRUE(t["measured"]["parameter_fetches"].is_null());  // no fetched parameters counted
  EXPECT_EQ(t["over"]["steps"], 4);
  EXPECT_EQ(t["over"]["optimizer_steps"], 4);
  now.grad_copy_wait_ms = 4.0 + 4 * 80.0;  // a copy wait longer than step()'s is capped at it
  t = terms(now, then);
  EXPECT_NEAR(t["measured"]["gradient_copies"].get<double>(), 0.050, 1e-12) << t;
  EXPECT_NEAR(t["measured"]["optimizer"].get<double>(), 0.0, 1e-12) << t;
}

TEST(MeasuredTermsTest, PythonPathStepsAreTheOptimizersWithAndWithoutAStream) {
  for (const bool streaming : {true, false}) {
    WaitCounters then = plan_counters();
    then.python_step_ms = 5.0;
    then.streaming = streaming;
    WaitCounters now = then;
    now.forwards = 7;
    now.optimizer_steps = 6;
    now.step_wait_ms = 10.0 + 4 * 50.0;
    now.grad_copy_wait_ms = 4.0 + 80.0;
    now.python_step_ms = 5.0 + 4 * 12.0;
    const Json t = terms(now, then);
    EXPECT_NEAR(t["measured"]["optimizer"].get<double>(), streaming ? 0.030 + 0.012 : 0.012, 1e-12) << t;
  }
}

TEST(MeasuredTermsTest, WithoutPlanCountersNothingIsPerStep) {
  WaitCounters now = plan_counters();
  now.param_wait_ms = 7.0;
  const Json t = terms(now, std::nullopt);
  for (const char* name : {"activation_copies", "parameter_fetches", "gradient_copies", "optimizer", "compute"})
    EXPECT_TRUE(t["measured"][name].is_null()) << name << ": " << t;
  EXPECT_EQ(t["over"]["steps"], 0);
  EXPECT_EQ(t["measured"]["total"].get<double>(), 0.25);
}

TEST(MeasuredTermsTest, TimedOptimizerInputs) {
  WaitCounters before, after;
  before.python_step_ms = 2.0;
  before.adam_elements = 500;
  after = before;
  after.python_step_ms = 6.0;
  after.adam_elements = 1500;
  // No stream: step() steps all, at the Python path's rate (1000 parameters in 4 ms).
  OptimizerStepInputs o = timed_optimizer_inputs(before, after, 1000, 4, StateFormat::kBf16);
  EXPECT_TRUE(o.on_cpu);
  EXPECT_FALSE(o.steps_during_backward);
  EXPECT_EQ(o.parameters, 1000u);
  EXPECT_EQ(o.states, StateFormat::kBf16);
  EXPECT_DOUBLE_EQ(o.params_per_second, 1000 / 0.004);
  EXPECT_FALSE(timed_optimizer_inputs({}, {}, 1000, 4, StateFormat::kFp32).on_cpu);  // not a CPUAdamW
  // A stream: the kernel's gradient bytes (2-byte elements) over its time, stepping during backward.
  WaitCounters k0, k1;
  k0.streaming = k1.streaming = true;
  k1.kernel_ms = 10.0;
  k1.kernel_grad_bytes = 2000.0;
  o = timed_optimizer_inputs(k0, k1, 1000, 2, StateFormat::kFp32);
  EXPECT_TRUE(o.on_cpu && o.steps_during_backward);
  EXPECT_DOUBLE_EQ(o.params_per_second, 1000 / 0.010);
  EXPECT_EQ(timed_optimizer_inputs(k1, k1, 1000, 2, StateFormat::kFp32).params_per_second, 0.0);  // no time: unknown
}

TEST(MeasuredTermsTest, TimedOptimizerWaitAddsThePythonPath) {
  WaitCounters before, after;
  before.step_wait_ms = 5.0;
  after.step_wait_ms = 25.0;
  EXPECT_DOUBLE_EQ(timed_optimizer_wait_seconds(before, after), 0.020);
  after.python_step_ms = 30.0;  // before none: counted from 0
  EXPECT_DOUBLE_EQ(timed_optimizer_wait_seconds(before, after), 0.050);
  EXPECT_DOUBLE_EQ(timed_optimizer_wait_seconds(after, before), 0.0);  // never negative
}

TEST(MeasuredTermsTest, MeasuredBesidePredictedGivesTheAllocatedPeaksOwnRatio) {
  MeasuredBesidePredicted m;
  m.step_seconds = 0.5;
  m.steps = 3;
  m.step_vs_predicted = 1.25;
  m.peak_vs_predicted = 1.5;
  Json j = Json::parse(measured_beside_predicted_json(m, 1500, 1200, 1000));
  EXPECT_EQ(j["measured"]["steps"], 3);
  EXPECT_EQ(j["measured"]["device_peak_reserved_bytes"], 1500);
  EXPECT_EQ(j["measured"]["device_peak_allocated_bytes"], 1200);
  EXPECT_DOUBLE_EQ(j["step_vs_predicted"].get<double>(), 1.25);
  EXPECT_DOUBLE_EQ(j["allocated_peak_vs_predicted"].get<double>(), 1.2);
  // The emulated device has no peaks; a plan without a predicted peak has no ratio.
  j = Json::parse(measured_beside_predicted_json(MeasuredBesidePredicted{}, std::nullopt, std::nullopt, 1000));
  EXPECT_TRUE(j["measured"]["step_seconds"].is_null());
  EXPECT_TRUE(j["measured"]["device_peak_reserved_bytes"].is_null());
  EXPECT_TRUE(j["allocated_peak_vs_predicted"].is_null());
  EXPECT_TRUE(Json::parse(measured_beside_predicted_json(m, 1, 1, 0))["allocated_peak_vs_predicted"].is_null());
}

}  // namespace
}  // namespace tierflow::tiering
