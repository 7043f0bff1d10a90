// Note [Auto plan phases]: when `auto` records, times and plans, what a
// measured block costs, the budgets the planner gets and the probes' sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/auto_plan.hpp"

namespace {

using namespace tierflow::tiering;

std::vector<PhaseAction> run(AutoPlanPhases& p, int forwards) {
  std::vector<PhaseAction> out;
  for (int i = 0; i < forwards; ++i) out.push_back(p.before_forward());
  return out;
}

TEST(AutoPlanPhases, RecordsThenTimesThenPlansBeforeTheThirdForward) {
  AutoPlanPhases p(/*forced=*/false, /*blocks=*/true, /*loaded_profile=*/false);
  EXPECT_EQ(run(p, 3), (std::vector<PhaseAction>{PhaseAction::kNone, PhaseAction::kStartTiming,
                                                 PhaseAction::kMeasureAndPlan}));
  p.planned();
  EXPECT_EQ(run(p, 2), (std::vector<PhaseAction>{PhaseAction::kNone, PhaseAction::kNone}));
  EXPECT_EQ(p.forwards(), 5);
  // A refused forward (it raised before running) does not count.
  AutoPlanPhases refused(false, true, false);
  EXPECT_EQ(refused.before_forward(), PhaseAction::kNone);
  refused.forward_refused();
  EXPECT_EQ(refused.forwards(), 0);
  EXPECT_EQ(refused.before_forward(), PhaseAction::kNone);
  EXPECT_EQ(refused.before_forward(), PhaseAction::kStartTiming);
  // A plan that failed (budgets too small) is not tried again by the phases.
  AutoPlanPhases failed(false, true, false);
  run(failed, 3);
  EXPECT_EQ(failed.before_forward(), PhaseAction::kNone);
}

TEST(AutoPlanPhases, AProfileFilePlansBeforeTheFirstForwardUntilAPlanHolds) {
  AutoPlanPhases p(false, true, /*loaded_profile=*/true);
  EXPECT_EQ(p.before_forward(), PhaseAction::kPlanFromProfile);
  EXPECT_EQ(p.before_forward(), PhaseAction::kPlanFromProfile);  // the first attempt failed
  p.planned();
  EXPECT_EQ(p.before_forward(), PhaseAction::kNone);
}

TEST(AutoPlanPhases, WithoutBlocksDecidesOnceBeforeTheSecondForward) {
  AutoPlanPhases p(false, /*blocks=*/false, true);
  EXPECT_EQ(run(p, 3), (std::vector<PhaseAction>{PhaseAction::kNone, PhaseAction::kPlanWithoutBlocks,
                                                 PhaseAction::kNone}));
  AutoPlanPhases forced(/*forced=*/true, true, true);
  EXPECT_EQ(run(forced, 3), (std::vector<PhaseAction>(3, PhaseAction::kNone)));
}

TEST(MeasuredBlockProfile, SharesTheForwardOutByFlops) {
  BlockRecord r;
  r.input_bytes = 100;
  r.attention_bytes = 200;
  r.split_bytes = 300;
  r.cheap_bytes = 50;
  r.split_flops = 6;
  r.attention_flops = 2;
  r.total_flops = 10;
  r.has_split_ops = true;
  r.forward_seconds = 1.0;
  const BlockProfile p = measured_block_profile(r);
  EXPECT_DOUBLE_EQ(p.forward_seconds, 1.0);
  EXPECT_DOUBLE_EQ(p.backward_seconds, kBackwardPerForward);
  EXPECT_DOUBLE_EQ(p.split_recompute_seconds, 0.6);
  EXPECT_DOUBLE_EQ(p.cheap_recompute_seconds, 1.0 - 0.6 - 0.2);
  EXPECT_EQ(p.whole_bytes, 200u);
  EXPECT_EQ(p.saved_bytes(), 650u);
  EXPECT_EQ(p.transient_bytes, kTransientPerInput * 100);
  EXPECT_TRUE(p.splittable);
  // No flops recorded, nothing timed: no division by zero, nothing negative.
  const BlockProfile empty = measured_block_profile(BlockRecord{});
  EXPECT_EQ(empty.cheap_recompute_seconds, 0.0);
  EXPECT_FALSE(empty.splittable);
}

TEST(MeasuredBlockProfile, ATimedBackwardIsTakenAsMeasured) {
  BlockRecord r;
  r.forward_seconds = 1.0;
  r.backward_seconds = 2.7;
  EXPECT_DOUBLE_EQ(measured_block_profile(r).backward_seconds, 2.7);
  r.backward_seconds = 0;  // none timed: the estimate stands in
  EXPECT_DOUBLE_EQ(measured_block_profile(r).backward_seconds, kBackwardPerForward);
}

// A block that saves 30 bytes (10 of input) and needs 5 more while it runs.
BlockProfile small_block() {
  BlockProfile b;
  b.input_bytes = 10;
  b.whole_bytes = 20;
  b.transient_bytes = 5;
  return b;
}

TEST(SessionBudgets, FsdpGatheredCopiesAtTheirMost) {
  EXPECT_EQ(fsdp_gathered_bytes({}, 0), 0u);  // no FSDP2
  EXPECT_EQ(fsdp_gathered_bytes({}, 7), 7u);  // the root alone: gathered for the whole step
  EXPECT_EQ(fsdp_gathered_bytes({10}, 0), 20u);  // its parameters and unsharded gradients
  // Uniform units: backward of an inner one holds its neighbours' too.
  EXPECT_EQ(fsdp_gathered_bytes({10, 10, 10, 10}, 3), 3u + 40u);
  EXPECT_EQ(fsdp_gathered_bytes({10, 10}, 0), 30u);
  // One large unit: forward beside its neighbour counts once, backward twice.
  EXPECT_EQ(fsdp_gathered_bytes({1, 100, 1}, 0), 202u);
  // Neighbours count: 50 beside 40 holds 1 + 2*50 + 40; apart, 2*50 + 1 is the most.
  EXPECT_EQ(fsdp_gathered_bytes({1, 50, 40, 1}, 0), 1u + 100u + 40u);
  EXPECT_EQ(fsdp_gathered_bytes({50, 1, 40, 1}, 0), 100u + 1u);
}

TEST(SessionBudgets, FsdpGatheredCopiesAreFixedBytes) {
  SessionBudgetInputs in;
  in.device_budget_bytes = 1000;
  in.parameter_bytes = 40;  // this rank's shards
  BlockProfile b;
  b.parameter_bytes = 20;
  const std::uint64_t plain = session_budgets(in, {b, b}).fixed_device_bytes;
  in.sharded_unit_bytes = {40, 40};
  in.sharded_root_bytes = 0;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, plain + fsdp_gathered_bytes({40, 40}, 0));
}

TEST(SessionBudgets, FromTheTiersAndWhatTrainingHolds) {
  const BlockProfile b = small_block();
  SessionBudgetInputs in;
  in.device_budget_bytes = 1000;
  in.host_budget_bytes = 500;
  in.host_in_use_bytes = 120;
  in.nvme_available_bytes = 7;
  in.prefetch_bytes = 1 << 20;
  in.parameter_bytes = 40;
  Budgets out = session_budgets(in, {b, b});
  EXPECT_EQ(out.device_bytes, 1000u);
  EXPECT_EQ(out.fixed_device_bytes, 80u);  // parameters and gradients
  EXPECT_EQ(out.host_bytes, 380u);
  EXPECT_EQ(out.nvme_bytes, 7u);
  EXPECT_EQ(out.prefetch_bytes, 60u);  // never more than the blocks save
  in.optimizer_on_device = true;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 80u + 80u);  // + m and v, in the parameters' dtype
  in.parameter_bytes = 20;  // the same 10 parameters in bf16: bf16 states (torch's AdamW), not fp32
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 40u + 40u);
  in.parameter_bytes = 40;
  // A measured peak above the largest working set and the window says what training holds.
  in.measured_peak_bytes = 1000;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 1000u - 35u - 60u);
  // The caching allocator held more (blocks cached by earlier steps, free for the taking): reported, not
  // counted (an H100 found no plan at checkpointing's allocated peak when it was).
  in.measured_reserved_peak_bytes = 1200;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 1000u - 35u - 60u);
  in.measured_reserved_peak_bytes = 0;
  in.measured_peak_bytes = 50;  // below: the estimate stands
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 160u);
  in.host_in_use_bytes = 900;  // more in use than the budget
  EXPECT_EQ(session_budgets(in, {}).host_bytes, 0u);
  EXPECT_EQ(session_budgets(in, {}).prefetch_bytes, 0u);
}

TEST(SessionBudgets, FetchedParametersAreThePlansToCount) {
  const BlockProfile b = small_block();
  SessionBudgetInputs in;
  in.device_budget_bytes = 1000;
  in.prefetch_bytes = 1 << 20;
  in.parameter_bytes = 40;
  in.rest_parameter_bytes = 12;
  in.params = ParamPolicy::kFetchAll;
  Budgets out = session_budgets(in, {b, b});
  EXPECT_EQ(out.fixed_device_bytes, 40u);  // their gradients only
  in.gradients_offloaded = true;            // ... freed once on the host: one block's in flight
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 0u);  // blocks without parameters here
  BlockProfile heavy = b;
  heavy.parameter_bytes = 15;
  EXPECT_EQ(session_budgets(in, {b, heavy}).fixed_device_bytes, 15u);
  in.gradients_offloaded = false;
  EXPECT_EQ(out.params, ParamPolicy::kFetchAll);
  EXPECT_EQ(out.rest_parameter_bytes, 12u);
  EXPECT_EQ(out.param_tier, tierflow::Tier::kHost);
  in.param_tier = tierflow::Tier::kNvme;
  EXPECT_EQ(session_budgets(in, {b, b}).param_tier, tierflow::Tier::kNvme);
  // The measured peak held fetched parameters too: taken out before it says what training holds.
  in.measured_peak_bytes = 1000;
  in.measured_parameter_peak_bytes = 300;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 1000u - 300u - 35u - 60u);
  in.measured_parameter_peak_bytes = 5000;  // never below zero
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 40u);
  // Resident parameters: the rest bytes are not the plan's, and the measured peak is taken whole.
  in.params = ParamPolicy::kResident;
  EXPECT_EQ(session_budgets(in, {b, b}).rest_parameter_bytes, 0u);
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 1000u - 35u - 60u);
}

TEST(ProbeSizes, FitTheRoomInGranules) {
  EXPECT_EQ(link_probe_bytes(1ull << 40, 0), kLinkProbeBytes);
  EXPECT_EQ(link_probe_bytes(16 * 10000, 0), 8192u);  // a sixteenth, in 4 KiB granules
  EXPECT_EQ(link_probe_bytes(100, 200), kProbeGranule);  // at least one granule
  EXPECT_EQ(nvme_probe_bytes(1ull << 40), kNvmeProbeBytes);
  EXPECT_EQ(nvme_probe_bytes(10000), 8192u);
  EXPECT_EQ(nvme_probe_bytes(100), 0u);
  EXPECT_EQ(next_nvme_probe_bytes(kNvmeProbeBytes), kNvmeProbeBytes / 2);
  EXPECT_EQ(next_nvme_probe_bytes(12288), 4096u);
  EXPECT_EQ(next_nvme_probe_bytes(4096), 0u);
}

}  // namespace

TEST(AutoPlanTraffic, TheCpuOptimizersTrafficInsideTheBlocks) {
  // Note [Auto plan phases]: streaming sends the gradients down in backward; with weights back in
  // forward the weights come up during the forward; states on NVMe or on the device move nothing.
  auto traffic = [](std::map<std::string, std::string> v) { return optimizer_traffic(tierflow::Config::parse({}, v)); };
  OptimizerTraffic t = traffic({{"TIERFLOW_OFFLOAD_OPTIMIZER", "host"}});
  EXPECT_TRUE(t.grads_down_in_backward);
  EXPECT_FALSE(t.weights_up_in_forward);
  t = traffic({{"TIERFLOW_OFFLOAD_OPTIMIZER", "host"}, {"TIERFLOW_WEIGHTS_RETURN", "forward"}});
  EXPECT_TRUE(t.grads_down_in_backward && t.weights_up_in_forward);
  t = traffic({{"TIERFLOW_OFFLOAD_OPTIMIZER", "host"}, {"TIERFLOW_OVERLAP_STEP", "off"},
               {"TIERFLOW_WEIGHTS_RETURN", "forward"}});
  EXPECT_FALSE(t.grads_down_in_backward || t.weights_up_in_forward) << "no step during backward: no stream";
  t = traffic({{"TIERFLOW_OFFLOAD_OPTIMIZER", "none"}});
  EXPECT_FALSE(t.grads_down_in_backward || t.weights_up_in_forward);
  BlockRecord r;
  r.forward_seconds = 1e-3;
  r.input_bytes = 100;
  r.parameter_bytes = 4096;
  const BlockProfile quiet = measured_block_profile(r);
  EXPECT_EQ(quiet.upload_bytes, 0u);
  EXPECT_EQ(quiet.download_bytes, 0u);
  const BlockProfile busy = measured_block_profile(r, {true, true});
  EXPECT_EQ(busy.upload_bytes, 4096u);
  EXPECT_EQ(busy.download_bytes, 4096u);
  EXPECT_EQ(busy.forward_seconds, quiet.forward_seconds) << "the rest of the profile is unchanged";
}

TEST(AutoPlanWithoutBlocks, KeepsEverythingWhenTheStepsSavesFit) {
  Budgets b;
  b.device_bytes = 10 << 20;
  b.fixed_device_bytes = 4 << 20;
  PlanWithoutBlocks p = plan_without_blocks(6 << 20, b);
  EXPECT_TRUE(p.keep_all);
  EXPECT_EQ(p.predicted_device_peak_bytes, 10u << 20);
  EXPECT_EQ(p.summary, "no blocks; the 6.00 MiB a step saves fit (device peak 10.00 MiB of 10.00 MiB): keep everything");
  p = plan_without_blocks((6 << 20) + 1, b);
  EXPECT_FALSE(p.keep_all) << "one byte over the budget";
  EXPECT_EQ(p.predicted_device_peak_bytes, 4u << 20) << "everything swapped: the rest of training only";
  EXPECT_NE(p.summary.find("do not fit"), std::string::npos);
  EXPECT_NE(p.summary.find("swap every saved tensor to the host"), std::string::npos);
}

TEST(MeasuredBesidePredicted, MedianGapAndRatios) {
  using namespace tierflow::tiering;
  EXPECT_EQ(median_seconds({}), 0);
  EXPECT_EQ(median_seconds({3, 1, 2}), 2);
  EXPECT_EQ(median_seconds({4, 1, 2, 3}), 2.5);
  const auto m = measured_beside_predicted({0, 1, 3, 4}, 300, 2.0, 100.0);  // gaps 1, 2, 1
  EXPECT_EQ(m.steps, 3u);
  EXPECT_EQ(m.step_seconds, 1.0);
  EXPECT_EQ(m.step_vs_predicted, 0.5);
  EXPECT_EQ(m.peak_vs_predicted, 3.0);
  const auto none = measured_beside_predicted({5}, std::nullopt, 0.0, std::nullopt);
  EXPECT_EQ(none.steps, 0u);
  EXPECT_FALSE(none.step_seconds || none.step_vs_predicted || none.peak_vs_predicted);
  EXPECT_FALSE(measured_beside_predicted({0, 1}, 5, std::nullopt, 0.0).peak_vs_predicted);
}

// ---- Note [Re-plan] -----------------------------------------------------------------------------------------

TEST(Replan, TheRestOfTheStep) {
  EXPECT_DOUBLE_EQ(rest_of_step_seconds(1.0, 0.75), 0.25);
  EXPECT_DOUBLE_EQ(rest_of_step_seconds(1.0, 0.5, 0.25), 0.25) << "the outside round trip is the plan's to add";
  EXPECT_EQ(rest_of_step_seconds(0.5, 0.75), 0.0) << "timing's own syncs can make the blocks longer than the step";
  EXPECT_DOUBLE_EQ(rest_of_step_seconds(1.0, 0.5, 0.125, 0.125), 0.25) << "the host's gaps are the timing's";
  EXPECT_DOUBLE_EQ(rest_of_step_seconds(1.0, 0.5, 0.125, 0.125, 0.125), 0.125)
      << "the inputs' swaps are the timed step's, priced by the plan where it makes them";
  EXPECT_EQ(rest_of_step_seconds(1.0, 0.5, 0.25, 0.125, 0.25), 0.0);
}

TEST(Replan, TheHostsGapsAreBetweenNeighbouringBlocksOnly) {
  // Forward of blocks 0, 1, 2 with gaps of 1 and 2; the head's forward and backward (3 s) between the last
  // forward and the first backward is the model's; backwards of 2, 1, 0 with gaps of 0.5 and 0.25.
  // Out of order on input: sorted by start.
  const std::vector<TimedInterval> timed = {
      {true, 1, 20.5, 22.0}, {false, 0, 0.0, 1.0}, {false, 2, 7.0, 9.0}, {false, 1, 2.0, 5.0},
      {true, 2, 12.0, 20.0}, {true, 0, 22.25, 23.0},
  };
  EXPECT_DOUBLE_EQ(host_gaps_seconds(timed), 1 + 2 + 0.5 + 0.25);
  // What the synchronize before a block waited for is device work queued in the gap (FSDP2's all-gather, a module
  // between the blocks): it stays in the rest of the step.
  EXPECT_DOUBLE_EQ(host_gaps_seconds({{false, 0, 0.0, 1.0}, {false, 1, 2.0, 3.0, 0.75}}), 0.25);
  EXPECT_DOUBLE_EQ(host_gaps_seconds({{false, 0, 0.0, 1.0}, {false, 1, 2.0, 3.0, 1.5}}), 0.0) << "never negative";
  // A block that is not the next one (a model that skips a block) makes no gap.
  EXPECT_DOUBLE_EQ(host_gaps_seconds({{false, 0, 0.0, 1.0}, {false, 2, 2.0, 3.0}}), 0.0);
  // Two forwards of one block (gradient accumulation's micro-batches) are not neighbours either; overlap is 0.
  EXPECT_DOUBLE_EQ(host_gaps_seconds({{false, 0, 0.0, 1.0}, {false, 0, 2.0, 3.0}, {false, 1, 2.5, 4.0}}), 0.0);
  EXPECT_DOUBLE_EQ(host_gaps_seconds({}), 0.0);
}

TEST(Replan, WhenAMeasurementStrays) {
  EXPECT_FALSE(strays_from_prediction(2.0, kReplanAfterSteps - 1, 1.0)) << "too few steps to judge";
  EXPECT_TRUE(strays_from_prediction(1.3, kReplanAfterSteps, 1.0));
  EXPECT_FALSE(strays_from_prediction(1.2, kReplanAfterSteps, 1.0));
  EXPECT_TRUE(strays_from_prediction(0.75, kReplanAfterSteps, 1.0)) << "faster than predicted strays too";
  EXPECT_FALSE(strays_from_prediction(0.85, kReplanAfterSteps, 1.0));
  EXPECT_FALSE(strays_from_prediction(std::nullopt, 5, 1.0));
  EXPECT_FALSE(strays_from_prediction(3.0, 5, std::nullopt));
  EXPECT_FALSE(strays_from_prediction(3.0, 5, 0.0));
}

TEST(Replan, OncePerSessionAndOnlyWhereItCanBeUndone) {
  auto replans_under = [](std::map<std::string, std::string> v) { return replans(tierflow::Config::parse({}, v)); };
  EXPECT_TRUE(replans_under({})) << "on by default";
  EXPECT_FALSE(replans_under({{"TIERFLOW_REPLAN", "off"}}));
  EXPECT_FALSE(replans_under({{"TIERFLOW_OFFLOAD_PARAMS", "auto"}})) << "resident units stay resident";
  EXPECT_TRUE(replans_under({{"TIERFLOW_OFFLOAD_PARAMS", "host"}}));
  EXPECT_THROW(replans_under({{"TIERFLOW_REPLAN", "sometimes"}}), tierflow::config_error);

  AutoPlanPhases p(/*forced=*/false, /*blocks=*/true, /*loaded_profile=*/false);
  run(p, 2);
  EXPECT_FALSE(p.may_replan()) << "no plan in force yet";
  run(p, 1);
  p.planned();
  EXPECT_TRUE(p.may_replan());
  p.replan_settled();
  EXPECT_FALSE(p.may_replan()) << "at most once";
  AutoPlanPhases off(false, true, false, /*replan=*/false), forced(true, true, false), bare(false, false, false);
  for (auto* q : {&off, &forced, &bare}) {
    run(*q, 3);
    q->planned();
    EXPECT_FALSE(q->may_replan());
  }
}

namespace {

// Four blocks of a transformer's proportions on a PCIe-like link; the device holds about one block's bytes.
struct Swapping {
  std::vector<BlockProfile> blocks;
  Links links;
  Budgets budgets;
  Swapping() {
    BlockProfile b;
    b.forward_seconds = 10e-3;
    b.backward_seconds = 20e-3;
    b.input_bytes = 100 << 20;
    b.whole_bytes = 200 << 20;
    b.split_bytes = 300 << 20;
    b.split_recompute_seconds = 4e-3;
    b.cheap_bytes = 50 << 20;
    b.cheap_recompute_seconds = 1e-3;
    b.transient_bytes = 100 << 20;
    blocks.assign(4, b);
    links.d2h = links.h2d = 50e9;
    links.duplex = 90e9;
    budgets.fixed_device_bytes = 1ull << 30;
    budgets.device_bytes = budgets.fixed_device_bytes + 1600ull * (1 << 20);
    budgets.host_bytes = 64ull << 30;
    budgets.prefetch_bytes = 64 << 20;
  }
};

double step_of(const Swapping& s, const std::vector<BlockProfile>& blocks, const Links& links, const Plan& plan) {
  return evaluate_plan(blocks, links, s.budgets, plan.blocks, plan.rest_params).predicted_step_seconds;
}

Links times(Links l, double f) {
  for (double* v : {&l.d2h, &l.h2d, &l.duplex, &l.nvme_write, &l.nvme_read}) *v *= f;
  return l;
}

}  // namespace

TEST(Replan, SlowLinksAreFoundAndThePlanIsTheOneTheTruthGives) {
  const Swapping s;
  const Plan plan = plan_activations(s.blocks, s.links, s.budgets);
  ASSERT_TRUE(std::any_of(plan.blocks.begin(), plan.blocks.end(), [](const BlockPlan& b) { return b.swap_bytes > 0; }))
      << "the case needs a plan that moves bytes";
  // The machine's links are four times slower than probed (contention the probe did not see).
  const Links truth = times(s.links, 0.25);
  const double rest = 0.05;
  const double measured = step_of(s, s.blocks, truth, plan) + rest;
  const CalibratedFigures cal = calibrate_figures(s.blocks, s.links, s.budgets, plan, measured, rest);
  ASSERT_TRUE(cal.calibrated) << cal.why;
  EXPECT_NEAR(cal.link_factor, 0.25, 1e-9);
  EXPECT_EQ(cal.compute_factor, 1.0);
  EXPECT_NEAR(step_of(s, cal.blocks, cal.links, plan) + rest, measured, 1e-9 * measured)
      << "the calibrated model predicts what was measured for the plan in force";
  EXPECT_NE(cal.why.find("link speed x0.25"), std::string::npos) << cal.why;
  const Plan again = plan_activations(cal.blocks, cal.links, s.budgets);
  const Plan knowing = plan_activations(s.blocks, truth, s.budgets);
  ASSERT_EQ(again.blocks.size(), knowing.blocks.size());
  for (std::size_t i = 0; i < again.blocks.size(); ++i) {
    EXPECT_EQ(again.blocks[i].mode, knowing.blocks[i].mode) << i;
    EXPECT_NEAR(again.blocks[i].alpha, knowing.blocks[i].alpha, 1e-6) << i;
  }
  EXPECT_NEAR(again.predicted_step_seconds, knowing.predicted_step_seconds, 1e-9);
  EXPECT_LT(step_of(s, s.blocks, truth, again), step_of(s, s.blocks, truth, plan))
      << "on the real machine the new plan is faster than the one it replaces";
}

TEST(Replan, AFasterStepThanHiddenTransfersAllowIsTheComputes) {
  Swapping s;
  s.links = times(s.links, 8);  // fast links: the plan's transfers hide behind compute
  const Plan plan = plan_activations(s.blocks, s.links, s.budgets);
  const double predicted = plan.predicted_step_seconds;
  ASSERT_NEAR(step_of(s, s.blocks, times(s.links, kCalibrationRange), plan), predicted, 1e-12)
      << "the case needs a compute-bound plan";
  const CalibratedFigures cal = calibrate_figures(s.blocks, s.links, s.budgets, plan, 0.5 * predicted + 0.01, 0.01);
  ASSERT_TRUE(cal.calibrated) << cal.why;
  EXPECT_EQ(cal.link_factor, 1.0);
  EXPECT_NEAR(cal.compute_factor, 0.5, 1e-9);
  EXPECT_NEAR(cal.blocks[0].forward_seconds, 5e-3, 1e-12);
  EXPECT_NEAR(cal.blocks[0].split_recompute_seconds, 2e-3, 1e-12);
  EXPECT_NEAR(step_of(s, cal.blocks, cal.links, plan), 0.5 * predicted, 1e-9 * predicted);
  EXPECT_NE(cal.why.find("compute x0.5"), std::string::npos) << cal.why;
}

TEST(Replan, NothingToCalibrateIsSaid) {
  Swapping s;
  s.budgets.device_bytes = 64ull << 30;  // everything fits: every block kept
  const Plan keep = plan_activations(s.blocks, s.links, s.budgets);
  const CalibratedFigures kept = calibrate_figures(s.blocks, s.links, s.budgets, keep, 2 * keep.predicted_step_seconds, 0);
  EXPECT_FALSE(kept.calibrated);
  EXPECT_NE(kept.why.find("keeps every block"), std::string::npos) << kept.why;
  const Swapping t;
  const Plan plan = plan_activations(t.blocks, t.links, t.budgets);
  const CalibratedFigures rest = calibrate_figures(t.blocks, t.links, t.budgets, plan, 0.1, 0.2);
  EXPECT_FALSE(rest.calibrated);
  EXPECT_NE(rest.why.find("the rest of the step alone is longer"), std::string::npos) << rest.why;
  EXPECT_EQ(rest.link_factor, 1.0);
  EXPECT_EQ(rest.compute_factor, 1.0);
}

TEST(OverlapWindow, TheLargestSwapOfTwoNeighbouringBlocksWithinTheRoomTheBudgetLeaves) {
  Swapping s;
  const Plan plan = plan_activations(s.blocks, s.links, s.budgets);
  std::uint64_t wanted = 0, largest = 0;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    largest = std::max(largest, plan.blocks[i].swap_bytes);
    wanted = std::max(wanted, plan.blocks[i].swap_bytes + (i > 0 ? plan.blocks[i - 1].swap_bytes : 0));
  }
  ASSERT_GT(wanted, largest) << "the case needs two neighbouring blocks that swap";
  ASSERT_GT(wanted, s.budgets.prefetch_bytes) << "the case needs a block that swaps more than the window";
  // Room enough: the window is the largest swap of two neighbouring blocks, and the peak grows by what it adds.
  Budgets roomy = s.budgets;
  roomy.device_bytes = plan.predicted_device_peak_bytes + wanted;
  const Plan same = plan_activations(s.blocks, s.links, roomy);
  PlanWindow w = plan_window(same, roomy);
  if (same.predicted_device_peak_bytes == plan.predicted_device_peak_bytes) {
    EXPECT_EQ(w.bytes, wanted);
    EXPECT_EQ(w.peak_bytes, plan.predicted_device_peak_bytes + wanted - s.budgets.prefetch_bytes);
  }
  EXPECT_LE(w.peak_bytes, roomy.device_bytes);
  EXPECT_GE(w.bytes, roomy.prefetch_bytes);
  // A configured window above what the blocks save (the budgets cap it there) is never shrunk.
  EXPECT_EQ(plan_window(plan, s.budgets, 1ull << 40).bytes, 1ull << 40);
  // No room: the configured window stays.
  Plan tight = plan;
  tight.device_budget_bytes = plan.predicted_device_peak_bytes;
  w = plan_window(tight, s.budgets);
  EXPECT_EQ(w.bytes, s.budgets.prefetch_bytes);
  EXPECT_EQ(w.peak_bytes, plan.predicted_device_peak_bytes);
  EXPECT_EQ(w.wanted_bytes, wanted);
  // Some room: as far as it goes.
  tight.device_budget_bytes = plan.predicted_device_peak_bytes + 10;
  w = plan_window(tight, s.budgets);
  EXPECT_EQ(w.bytes, s.budgets.prefetch_bytes + 10);
  EXPECT_EQ(w.peak_bytes, tight.device_budget_bytes);
  // A plan that swaps nothing keeps the configured window and its peak.
  Budgets all = s.budgets;
  all.device_bytes = 64ull << 30;
  const Plan keep = plan_activations(s.blocks, s.links, all);
  w = plan_window(keep, all);
  EXPECT_EQ(w.bytes, all.prefetch_bytes);
  EXPECT_EQ(w.peak_bytes, keep.predicted_device_peak_bytes);
  EXPECT_EQ(w.wanted_bytes, 0u);
}

TEST(Replan, CalibrationPricesTheOutsideTensorsAsThePlanDoes) {
  // What is saved outside the blocks, swapped (the only choice that fits here): its round trip is on the links
  // too, so the calibrated links reproduce the measurement with it.
  Swapping s;
  s.budgets.outside_saved_bytes = 850ull << 20;
  const Plan plan = plan_activations(s.blocks, s.links, s.budgets);
  ASSERT_FALSE(plan.outside_kept) << plan.summary();
  ASSERT_GT(plan.outside_swap_seconds, 0.0);
  const Links truth = times(s.links, 0.5);
  const double rest = 0.02;
  const double measured =
      evaluate_plan(s.blocks, truth, s.budgets, plan.blocks, plan.rest_params, false).predicted_step_seconds + rest;
  const CalibratedFigures cal = calibrate_figures(s.blocks, s.links, s.budgets, plan, measured, rest);
  ASSERT_TRUE(cal.calibrated) << cal.why;
  EXPECT_NEAR(cal.link_factor, 0.5, 1e-9);
  // At the plan's own prediction nothing changes.
  const CalibratedFigures same =
      calibrate_figures(s.blocks, s.links, s.budgets, plan, plan.predicted_step_seconds + rest, rest);
  ASSERT_TRUE(same.calibrated) << same.why;
  EXPECT_NEAR(same.link_factor, 1.0, 1e-9);
}

TEST(Replan, NoFactorInRangeMeansNoReplan) {
  Swapping s;
  s.links = times(s.links, 8);  // compute-bound: links cannot explain a slower step
  const Plan plan = plan_activations(s.blocks, s.links, s.budgets);
  const CalibratedFigures cal =
      calibrate_figures(s.blocks, s.links, s.budgets, plan, 1000 * plan.predicted_step_seconds, 0);
  EXPECT_FALSE(cal.calibrated);
  EXPECT_NE(cal.why.find("nor does a compute factor"), std::string::npos) << cal.why;
}

// Note [Batch growth]
TEST(BatchGrowth, BlocksScaleTheirSavedBytesWorkingSetAndTimesNotTheirParameters) {
  BlockProfile b;
  b.input_bytes = 100;
  b.whole_bytes = 200;
  b.split_bytes = 300;
  b.cheap_bytes = 50;
  b.transient_bytes = 80;
  b.forward_seconds = 1.0;
  b.backward_seconds = 2.0;
  b.split_recompute_seconds = 0.5;
  b.cheap_recompute_seconds = 0.25;
  b.parameter_bytes = 1000;
  b.upload_bytes = 1000;
  b.download_bytes = 1000;
  const auto out = blocks_for_batch({b}, 2.5);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].saved_bytes(), 1625u);
  EXPECT_EQ(out[0].input_bytes, 250u);
  EXPECT_EQ(out[0].transient_bytes, 200u);
  EXPECT_DOUBLE_EQ(out[0].forward_seconds, 2.5);
  EXPECT_DOUBLE_EQ(out[0].backward_seconds, 5.0);
  EXPECT_DOUBLE_EQ(out[0].split_recompute_seconds, 1.25);
  EXPECT_DOUBLE_EQ(out[0].cheap_recompute_seconds, 0.625);
  EXPECT_EQ(out[0].parameter_bytes, 1000u);
  EXPECT_EQ(out[0].upload_bytes, 1000u);
  EXPECT_EQ(out[0].download_bytes, 1000u);
}

TEST(BatchGrowth, OnlyALargerBatchReplansAndOnlyAVaryingOneSettlesCalibration) {
  EXPECT_EQ(grown_batch(1000, 1000), 0u);
  EXPECT_EQ(grown_batch(1000, 400), 0u);  // a plan for more holds for less
  EXPECT_EQ(grown_batch(1000, 1001), 1001u);
  EXPECT_EQ(grown_batch(0, 5000), 0u);  // the size not tracked
  EXPECT_EQ(grown_batch(1000, 0), 0u);
  EXPECT_FALSE(batch_varies(1000, 1090));
  EXPECT_FALSE(batch_varies(1000, 910));
  EXPECT_TRUE(batch_varies(1000, 1200));
  EXPECT_TRUE(batch_varies(1000, 500));
  EXPECT_FALSE(batch_varies(0, 500));
}

TEST(BatchGrowth, TheMeasuredPeakBeyondTheBlocksGrowsWithTheBatchTheFixedBytesDoNot) {
  SessionBudgetInputs in;
  in.device_budget_bytes = 1 << 30;
  in.parameter_bytes = 1000;  // + its gradients: 2000 fixed
  in.prefetch_bytes = 64;
  BlockProfile b;
  b.input_bytes = 100;
  b.transient_bytes = 50;
  // Measured at the profile's size: the fixed 2000, the largest block 150, the window 64, and 500 more (logits).
  in.measured_peak_bytes = 2000 + 150 + 64 + 500;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 2500u);  // as before batch growth existed
  in.batch_ratio = 4.0;
  const auto grown = blocks_for_batch({b, b}, 4.0);
  const Budgets at4 = session_budgets(in, grown);
  EXPECT_EQ(at4.fixed_device_bytes, 2000u + 4 * 500u);
  EXPECT_EQ(at4.prefetch_bytes, 64u);
  // A peak that held nothing beyond the blocks: the fixed bytes alone, at any size.
  in.measured_peak_bytes = 2000 + 150 + 64;
  EXPECT_EQ(session_budgets(in, grown).fixed_device_bytes, 2000u);
}

TEST(BatchGrowth, ParametersPlannedPerUnitRefuseToPlanAgainAndSayWhatToDo) {
  tierflow::Config c;
  EXPECT_EQ(batch_growth_refusal(c), "");
  c.offload_params = tierflow::OffloadTarget::kHost;
  EXPECT_EQ(batch_growth_refusal(c), "");
  c.offload_params = tierflow::OffloadTarget::kAuto;
  const std::string why = batch_growth_refusal(c);
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_PARAMS=auto"), std::string::npos);
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_PARAMS=host"), std::string::npos);
}

TEST(BatchGrowth, ABatchsSizeFollowsTheInputThatGrewMostNotOneOfFixedSize) {
  // input ids and labels of 2 x 100 tokens beside an image of 3072 elements, profiled at 2 x 50 tokens
  const std::vector<std::uint64_t> profiled{100, 100, 3072};
  const std::uint64_t all = 3272;
  EXPECT_EQ(batch_size(profiled, {200, 200, 3072}, all, 3472), 2u * all);  // x2: the tokens' growth
  EXPECT_EQ(batch_size(profiled, {50, 50, 3072}, all, 3172), all / 2);     // none grew: the one that shrank most
  EXPECT_EQ(batch_size(profiled, {100, 100, 3072}, all, all), all);
  // Called with fewer tensors than the profiled forward (no labels): measured on those both have, ids and image.
  EXPECT_EQ(batch_size({100, 3072}, {300, 3072}, all, 3372), 3u * all);
  EXPECT_EQ(batch_size({}, {}, 0, 400), 400u);        // no profiled forward yet: its elements
  EXPECT_EQ(batch_size({}, {}, all, 400), 400u);      // no tensor in common: its elements
  EXPECT_EQ(batch_size({0, 100}, {7, 300}, 100, 307), 300u);  // an empty profiled tensor is no measure
  EXPECT_EQ(batch_size({}, {}, 0, 0), 0u);            // nothing to count: not tracked
}

TEST(BatchGrowth, WhatTheStepStartedFromDoesNotGrowWithTheBatch) {
  SessionBudgetInputs in;
  in.device_budget_bytes = 1 << 30;
  in.parameter_bytes = 1000;  // + its gradients: 2000 fixed
  in.prefetch_bytes = 64;
  BlockProfile b;
  b.input_bytes = 100;
  b.transient_bytes = 50;
  // Before the first forward a frozen model of 1000 bytes was there beside the parameters; the step held its
  // parameters and gradients (2000), the frozen model, the largest block (150), the window (64) and 500 more
  // (logits) at its peak.
  in.measured_peak_bytes = 2000 + 1000 + 150 + 64 + 500;
  in.measured_beside_bytes = 1000;
  EXPECT_EQ(session_budgets(in, {b, b}).fixed_device_bytes, 3500u);  // ratio 1: as before
  in.batch_ratio = 4.0;
  EXPECT_EQ(session_budgets(in, blocks_for_batch({b, b}, 4.0)).fixed_device_bytes, 3000u + 4 * 500u);
  in.measured_beside_bytes = 0;  // not measured: the frozen model taken to grow with the rest
  EXPECT_EQ(session_budgets(in, blocks_for_batch({b, b}, 4.0)).fixed_device_bytes, 2000u + 4 * 1500u);
  // With the optimizer on the device, bytes beside up to its states are taken for a resumed optimizer's.
  in.optimizer_on_device = true;  // fixed: 1000 + 1000 + 2000
  in.measured_peak_bytes = 4000 + 1000 + 150 + 64 + 500;
  in.measured_beside_bytes = 2000 + 1000;  // the states of a resumed optimizer and the frozen model
  EXPECT_EQ(session_budgets(in, blocks_for_batch({b, b}, 4.0)).fixed_device_bytes, 5000u + 4 * 500u);
}
