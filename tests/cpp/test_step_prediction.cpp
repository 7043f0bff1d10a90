// The whole step predicted term by term (Note [Step prediction]) and the plan report's grouping of identical
// blocks (Note [Plan report]).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/tiering/plan_driver.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/step_prediction.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

using namespace tierflow;
using namespace tierflow::tiering;
using Json = nlohmann::ordered_json;

namespace {

// A block whose swap takes longer than its compute on a 1 GB/s link: 1 ms forward, 2 ms backward, 4 MB saved.
BlockProfile link_bound_block() {
  BlockProfile b;
  b.forward_seconds = 1e-3;
  b.backward_seconds = 2e-3;
  b.input_bytes = 1'000'000;
  b.whole_bytes = 3'000'000;
  b.transient_bytes = 1'000'000;
  b.splittable = false;
  return b;
}

Links slow_links() { return Links{1e9, 1e9, 0, 0, 0}; }

Budgets roomy() {
  Budgets b;
  b.device_bytes = 1ull << 40;
  b.host_bytes = 1ull << 40;
  return b;
}

OptimizerStepInputs cpu_optimizer(std::uint64_t parameters, double rate) {
  OptimizerStepInputs o;
  o.on_cpu = true;
  o.parameters = parameters;
  o.params_per_second = rate;
  return o;
}

}  // namespace

TEST(OptimizerStepTimes, AStepShorterThanBackwardIsHiddenALongerOneShowsItsExcess) {
  // 1e6 parameters at 1e9 a second: 1 ms of kernel.
  const auto o = cpu_optimizer(1'000'000, 1e9);
  EXPECT_DOUBLE_EQ(optimizer_step_times(o, 5e-3).kernel_seconds, 1e-3);
  EXPECT_DOUBLE_EQ(optimizer_step_times(o, 5e-3).exposed_seconds, 0.0);          // hidden behind backward
  EXPECT_NEAR(optimizer_step_times(o, 0.25e-3).exposed_seconds, 0.75e-3, 1e-15);  // the excess only
  auto after = o;
  after.steps_during_backward = false;  // stepped in step(): nothing overlaps
  EXPECT_DOUBLE_EQ(optimizer_step_times(after, 5e-3).exposed_seconds, 1e-3);
  auto none = o;
  none.on_cpu = false;  // on the device: not the CPU's
  EXPECT_DOUBLE_EQ(optimizer_step_times(none, 0).exposed_seconds, 0.0);
  auto unknown = o;
  unknown.params_per_second = 0;  // not predicted
  EXPECT_DOUBLE_EQ(optimizer_step_times(unknown, 0).busy_seconds, 0.0);
  auto bad = o;
  bad.params_per_second = -1;
  EXPECT_THROW(optimizer_step_times(bad, 0), config_error);
}

TEST(OptimizerStepTimes, NvmeStatesAreReadAndWrittenBesideTheKernel) {
  auto o = cpu_optimizer(1'000'000, 1e9);  // 1 ms of kernel
  o.steps_during_backward = false;
  o.nvme_state_bytes = 12'000'000;
  o.nvme_read = 4e9;   // 3 ms
  o.nvme_write = 2e9;  // 6 ms
  const auto t = optimizer_step_times(o, 1.0);
  EXPECT_DOUBLE_EQ(t.nvme_read_seconds, 3e-3);
  EXPECT_DOUBLE_EQ(t.nvme_write_seconds, 6e-3);
  EXPECT_DOUBLE_EQ(t.busy_seconds, 9e-3);     // reads and writes share the drive, the kernel hides behind them
  EXPECT_DOUBLE_EQ(t.exposed_seconds, 9e-3);  // after backward
  o.nvme_read = o.nvme_write = 1e12;          // a fast drive: the kernel bounds it
  EXPECT_DOUBLE_EQ(optimizer_step_times(o, 1.0).busy_seconds, 1e-3);
  o.nvme_read = -1;
  EXPECT_THROW(optimizer_step_times(o, 1.0), config_error);
}

TEST(CpuAdamRate, TheStatesFormatChangesTheRateByTheBytesTheStepMoves) {
  // bf16 parameters: master 4+4, gradient in 2, weight out 2, and m, v read and written.
  EXPECT_DOUBLE_EQ(cpu_adam_step_bytes_per_param(StateFormat::kFp32, 2), 28.0);
  EXPECT_DOUBLE_EQ(cpu_adam_step_bytes_per_param(StateFormat::kBf16, 2), 20.0);
  EXPECT_DOUBLE_EQ(cpu_adam_step_bytes_per_param(StateFormat::k8bit, 2), 16.0625);
  EXPECT_DOUBLE_EQ(cpu_adam_rate_in(5e9, StateFormat::kFp32, StateFormat::kBf16, 2), 7e9);
  EXPECT_DOUBLE_EQ(cpu_adam_rate_in(5e9, StateFormat::kFp32, StateFormat::kFp32, 2), 5e9);
  // A given rate is fp32's: the command's kernel time follows the format.
  set_cpu_adam_rate_source(nullptr);
  EXPECT_DOUBLE_EQ(cpu_adam_rate(5e9, StateFormat::kBf16, 2), 7e9);
  EXPECT_DOUBLE_EQ(cpu_adam_rate(0, StateFormat::kBf16, 2), 0.0);  // unknown, nothing to measure with
}

namespace {
int measured_calls = 0;
double fake_rate(StateFormat states) {
  ++measured_calls;
  return states == StateFormat::k8bit ? 3e9 : 2e9;
}
}  // namespace

TEST(CpuAdamRate, UnknownIsMeasuredOncePerFormatByTheInstalledSource) {
  set_cpu_adam_rate_source(&fake_rate);
  measured_calls = 0;
  EXPECT_DOUBLE_EQ(cpu_adam_rate(0, StateFormat::k8bit, 2), 3e9);
  EXPECT_DOUBLE_EQ(cpu_adam_rate(0, StateFormat::k8bit, 2), 3e9);
  EXPECT_DOUBLE_EQ(cpu_adam_rate(0, StateFormat::kFp32, 2), 2e9);
  EXPECT_EQ(measured_calls, 2);
  EXPECT_DOUBLE_EQ(cpu_adam_rate(1e9, StateFormat::kFp32, 2), 1e9);  // given: not measured
  EXPECT_EQ(measured_calls, 2);
  set_cpu_adam_rate_source(nullptr);
}

TEST(CpuAdamRate, TierflowsKernelIsMeasuredInAFewHundredthsOfASecond) {
  const auto start = std::chrono::steady_clock::now();
  const auto r = optimizer::measure_cpu_adam_rate(StateFormat::k8bit, 0.02, 1u << 18, 1);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(r.passes, 2);
  EXPECT_GE(r.seconds, 0.02);
  EXPECT_DOUBLE_EQ(r.params_per_second, static_cast<double>(r.parameters) * r.passes / r.seconds);
  EXPECT_GT(r.params_per_second, 1e6);  // any machine that runs the tests
  EXPECT_LT(took, 2.0);
}

TEST(PredictStep, TermsAddUpToThePlanAndTheExposedOptimizer) {
  const std::vector<BlockProfile> blocks(3, link_bound_block());
  auto budgets = roomy();
  // Swap every block: forward max(1 ms, 4 ms), backward max(2 ms, 4 ms) each.
  const Plan plan = forced_plan(blocks, slow_links(), budgets, BlockMode::kSwap);
  const auto o = cpu_optimizer(10'000'000, 1e9);  // 10 ms of kernel beside 12 ms of backward: hidden
  const auto p = predict_step(plan, blocks, slow_links(), budgets, o);
  EXPECT_NEAR(p.compute_seconds, 9e-3, 1e-12);
  EXPECT_NEAR(p.activation_copy_seconds, 24e-3 - 9e-3, 1e-12);
  EXPECT_NEAR(p.parameter_fetch_seconds, 0.0, 1e-12);
  EXPECT_NEAR(p.gradient_copy_seconds, 0.0, 1e-12);
  EXPECT_NEAR(p.blocks_seconds, plan.predicted_step_seconds, 1e-12);
  EXPECT_NEAR(p.backward_seconds, 12e-3, 1e-12);
  EXPECT_DOUBLE_EQ(p.optimizer.exposed_seconds, 0.0);
  EXPECT_NEAR(p.total_seconds, 24e-3, 1e-12);
  // 20 ms of kernel: 8 ms stick out.
  const auto longer = predict_step(plan, blocks, slow_links(), budgets, cpu_optimizer(20'000'000, 1e9), 0.5);
  EXPECT_NEAR(longer.optimizer.exposed_seconds, 8e-3, 1e-12);
  EXPECT_NEAR(longer.total_seconds, 24e-3 + 8e-3 + 0.5, 1e-12);
  double sum = 0;
  for (const auto& [name, seconds] : step_terms(longer))
    if (name != "total") sum += seconds;
  EXPECT_NEAR(sum, longer.total_seconds, 1e-12);
  EXPECT_EQ(step_terms(longer).back().first, "total");
}

TEST(PredictStep, FetchedParametersAndGradientsAreTheirOwnTerms) {
  std::vector<BlockProfile> blocks(2, link_bound_block());
  for (auto& b : blocks) {
    b.parameter_bytes = 2'000'000;  // +2 ms host->device in each phase
    b.download_bytes = 3'000'000;   // +3 ms device->host in backward
  }
  auto budgets = roomy();
  budgets.params = ParamPolicy::kFetchAll;
  const Plan plan = forced_plan(blocks, slow_links(), budgets, BlockMode::kKeep);
  const auto p = predict_step(plan, blocks, slow_links(), budgets, {});
  // Kept: compute 3 ms a block; fetched parameters: forward max(1, 2) = 2 ms, backward max(2, 2) = 2 ms; the
  // gradients then make backward max(2, 2, 3) = 3 ms.
  EXPECT_NEAR(p.compute_seconds, 6e-3, 1e-12);
  EXPECT_NEAR(p.activation_copy_seconds, 0.0, 1e-12);
  EXPECT_NEAR(p.parameter_fetch_seconds, 2e-3, 1e-12);
  EXPECT_NEAR(p.gradient_copy_seconds, 2e-3, 1e-12);
  EXPECT_NEAR(p.blocks_seconds, plan.predicted_step_seconds, 1e-12);
  EXPECT_NEAR(p.backward_seconds, 6e-3, 1e-12);
  EXPECT_THROW(predict_step(plan, {link_bound_block()}, slow_links(), budgets, {}), logic_error);
}

TEST(GroupBlockLines, IdenticalConsecutiveBlocksShareOneLine) {
  const std::vector<std::string> lines{"  block 0: swap x", "  block 1: swap x", "  block 2: swap x",
                                       "  block 3: keep y", "  block 4: swap x", "other"};
  const std::vector<std::string> want{"  blocks 0-2 (3 identical): swap x", "  block 3: keep y", "  block 4: swap x",
                                      "other"};
  EXPECT_EQ(group_block_lines(lines), want);
  EXPECT_EQ(group_block_lines({"block 0: a", "  block 1: a"}), (std::vector<std::string>{"block 0: a", "  block 1: a"}));
}

namespace {
PlanCommandInputs llama_like_inputs() {
  PlanCommandInputs in;
  in.gpu_memory = {"16GiB", SettingSource::kFlag};
  in.host_memory = {"512GiB", SettingSource::kFlag};
  in.prefetch = {"256MiB", SettingSource::kVariable};
  in.device_capacity_bytes = 80 * GiB;
  in.host_capacity_bytes = 1024 * GiB;
  in.device_name = "cuda";
  in.optimizer = "host";
  TransformerShape s;
  s.layers = 8;
  s.hidden = 2048;
  s.heads = 16;
  s.seq = 2048;
  s.batch = 1;
  s.dtype_bytes = 2;
  s.vocab = 32000;
  in.shape = s;
  in.dtype_name = "bf16";
  in.state = estimate_training_state(s, OffloadTarget::kHost);
  in.head_bytes = estimate_head_device_bytes(s);
  in.blocks_from = "--layers 8";
  in.links = Links{20e9, 20e9, 40e9, 0, 0};
  in.flops_per_second = 100e12;
  in.links_given = true;
  in.offload_params = "host";
  return in;
}
}  // namespace

TEST(DescribePlan, TheWholeStepIsInTheTextAndTheJsonTermByTerm) {
  set_cpu_adam_rate_source(nullptr);
  auto in = llama_like_inputs();
  in.cpu_adam_params_per_second = 1e8;  // slow: the CPU step sticks out past backward
  const auto pb = plan_command_budgets(in);
  const auto blocks = estimate_transformer(*in.shape, *in.flops_per_second);
  const auto plan = plan_activations(blocks, pb.links, pb.budgets);
  const auto r = describe_plan(plan, blocks, in, pb);
  const Json j = Json::parse(r.json);
  const auto& terms = j["step"]["terms_seconds"];
  const double params = static_cast<double>(transformer_parameters(*in.shape));
  const double kernel = params / 1e8;
  EXPECT_DOUBLE_EQ(j["step"]["optimizer"]["kernel_seconds"].get<double>(), kernel);
  const double backward = j["step"]["backward_seconds"].get<double>();
  EXPECT_NEAR(terms["optimizer"].get<double>(), kernel - backward, 1e-9);
  const double blocks_seconds = j["step"]["blocks_seconds"].get<double>();
  EXPECT_NEAR(terms["total"].get<double>(), blocks_seconds + kernel - backward, 1e-9);
  EXPECT_GT(terms["parameter_fetches"].get<double>(), 0.0);  // --offload-params host over 20 GB/s
  EXPECT_NEAR(blocks_seconds, plan.predicted_step_seconds + terms["gradient_copies"].get<double>(), 1e-9);
  {
    // --optimizer host: each block's gradients go device->host in its backward; over a slow 1 GB/s they show.
    auto slow = in;
    slow.offload_params = "none";
    slow.gpu_memory = {"80GiB", SettingSource::kFlag};
    slow.links = Links{1e9, 20e9, 0, 0, 0};
    const auto spb = plan_command_budgets(slow);
    const auto splan = plan_activations(blocks, spb.links, spb.budgets);
    const Json sj = Json::parse(describe_plan(splan, blocks, slow, spb).json);
    const double grads = sj["step"]["terms_seconds"]["gradient_copies"].get<double>();
    EXPECT_GT(grads, 0.1);  // 8 blocks of 100 MB at 1 GB/s beside a few ms of backward each
    EXPECT_NEAR(sj["step"]["blocks_seconds"].get<double>(), splan.predicted_step_seconds + grads, 1e-9);
  }
  EXPECT_EQ(j["layers"].size(), 8u);                          // the JSON keeps every block
  bool grouped = false, whole = false;
  for (const auto& l : r.lines) {
    grouped = grouped || l.rfind("  blocks 0-", 0) == 0;
    whole = whole || l.rfind("  CPU optimizer exposed: ", 0) == 0;
  }
  EXPECT_TRUE(grouped);
  EXPECT_TRUE(whole);
  // bf16 states: the given fp32 rate scaled by 28 / 20 bytes a parameter.
  in.optimizer_states = StateFormat::kBf16;
  in.state = estimate_training_state(*in.shape, OffloadTarget::kHost, StateFormat::kBf16);
  const auto pb16 = plan_command_budgets(in);
  const Json j16 = Json::parse(describe_plan(plan, blocks, in, pb16).json);
  EXPECT_DOUBLE_EQ(j16["step"]["optimizer"]["kernel_seconds"].get<double>(), params / 1.4e8);
  // Unknown rate and nothing installed to measure it: said, not guessed.
  in.cpu_adam_params_per_second = 0;
  const auto unknown = describe_plan(plan, blocks, in, pb16);
  EXPECT_TRUE(Json::parse(unknown.json)["step"]["optimizer"]["params_per_second"].is_null());
  bool said = false;
  for (const auto& l : unknown.lines) said = said || l.find("pass --cpu-adam-rate") != std::string::npos;
  EXPECT_TRUE(said);
}

namespace {

// `auto`'s driver with a front end whose timed step had a CPU optimizer (Note [Plan driver]).
struct OptimizerFront : PlanFrontEnd {
  OptimizerStepInputs optimizer;
  double optimizer_wait_seconds = 0;
  double now = 0;
  SessionBudgetInputs budget_inputs() override {
    SessionBudgetInputs in;
    in.device_budget_bytes = in.host_budget_bytes = 1ull << 40;
    in.parameter_bytes = 2'000'000;
    return in;
  }
  std::vector<std::size_t> inexact_splits(const std::vector<BlockPlan>&) override { return {}; }
  std::optional<std::uint64_t> apply(const DrivenPlan&) override { return std::nullopt; }
  void start_timing() override {}
  TimedStepMeasures measure_timed_step() override {
    TimedStepMeasures m;
    BlockRecord r;
    r.input_bytes = 1'000'000;
    r.attention_bytes = 1'000'000;
    r.total_flops = 1e9;
    r.forward_seconds = 0.010;
    r.backward_seconds = 0.020;
    r.parameter_bytes = 1'000'000;
    m.blocks.assign(2, r);
    m.links = Links{1e9, 1e9, 2e9, 0, 0};
    m.blocks_forward_seconds = 0.020;
    m.blocks_backward_seconds = 0.040;
    m.optimizer = optimizer;
    m.optimizer_wait_seconds = optimizer_wait_seconds;
    return m;
  }
  std::uint64_t first_step_saved_bytes() override { return 0; }
  void write_profile(const AutoProfile&) override {}
  double now_seconds() override { return now; }
};

// The plan `front`'s timed step gives, each forward 1 s apart (the timed step: 1 s, its rest 0.94 s).
DrivenPlan driven(OptimizerFront& front) {
  PlanDriverSettings s;
  s.blocks = 2;
  PlanDriver d(s);
  for (int i = 0; i < 3; ++i) {
    front.now = i;
    d.before_forward({{"[0]", 64}}, front);
  }
  EXPECT_TRUE(d.plan().has_value());
  return *d.plan();
}

}  // namespace

TEST(DrivenStep, TheCpuOptimizersTermComesOutOfTheMeasuredRestAndTheTermsAddUp) {
  OptimizerFront front;
  front.optimizer_wait_seconds = 0.25;  // the rate unknown: the term is what step() waited for in the timed step
  const DrivenPlan waited = driven(front);
  ASSERT_TRUE(waited.step && waited.predicted_step_seconds);
  EXPECT_NEAR(waited.step->optimizer.exposed_seconds, 0.25, 1e-12);
  EXPECT_NEAR(waited.step->rest_seconds, waited.rest_of_step_seconds - 0.25, 1e-12);
  EXPECT_NEAR(waited.step->total_seconds, *waited.predicted_step_seconds, 1e-12);
  const Json terms = Json::parse(plan_json(waited))["terms"];
  EXPECT_NEAR(terms["optimizer"]["predicted_s"].get<double>(), 0.25, 1e-12);
  EXPECT_NEAR(terms["total"]["predicted_s"].get<double>(), *waited.predicted_step_seconds, 1e-12);
  // A measured rate: the model's excess past the plan's backward (0.04 s): 1e8 parameters at 1e9 a second.
  front.optimizer = cpu_optimizer(100'000'000, 1e9);
  const DrivenPlan modelled = driven(front);
  EXPECT_NEAR(modelled.step->optimizer.exposed_seconds, 0.1 - modelled.step->backward_seconds, 1e-12);
  EXPECT_NEAR(modelled.step->total_seconds, *modelled.predicted_step_seconds, 1e-12);
  // Never more than the rest the timed step measured.
  front.optimizer = cpu_optimizer(100'000'000, 1e7);
  const DrivenPlan capped = driven(front);
  EXPECT_NEAR(capped.step->optimizer.exposed_seconds, capped.rest_of_step_seconds, 1e-12);
  EXPECT_NEAR(capped.step->rest_seconds, 0.0, 1e-12);
}
