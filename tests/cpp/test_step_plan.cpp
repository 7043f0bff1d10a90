// The CPU AdamW's step plan (Note [Step plan] in step_plan.hpp): states' tier and format, steps during
// backward, routes, paths, weight targets and Note [Steady step]'s gates, without torch.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/step_plan.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;

namespace {

Config settings(const std::map<std::string, std::string>& overrides = {}) { return Config::parse({}, overrides); }

std::string config_error_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

RouteFacts streamable() {
  RouteFacts p;
  p.requires_grad = p.on_device = p.contiguous = p.kernel_dtype = true;
  return p;
}

}  // namespace

TEST(StepPlan, StatesTierAndFormatFromTheSettingsOrTheKeyword) {
  const StepPlan host(settings({{"offload_optimizer", "host"}, {"optimizer_states", "bf16"}}), std::nullopt, false);
  EXPECT_FALSE(host.states_on_nvme());
  EXPECT_STREQ(host.tier_name(), "host");
  EXPECT_EQ(host.format(), StateFormat::kBf16);
  const StepPlan keyword(settings({{"optimizer_states", "bf16"}}), std::string(" 8BIT "), false);
  EXPECT_EQ(keyword.format(), StateFormat::k8bit) << "the keyword wins, stripped and lower-cased";
  const std::string why = config_error_text([] { StepPlan(settings(), std::string("int4"), false); });
  EXPECT_NE(why.find("optimizer_states='int4' (TIERFLOW_OPTIMIZER_STATES); accepted: fp32, bf16, 8bit"),
            std::string::npos) << why;
}

TEST(StepPlan, AmsgradIsRefusedWithPackedMomentsOnly) {
  const StepPlan fp32(settings(), std::nullopt, false);
  EXPECT_NO_THROW(fp32.check_amsgrad(true, 0));
  const StepPlan packed(settings({{"optimizer_states", "8bit"}}), std::nullopt, false);
  EXPECT_NO_THROW(packed.check_amsgrad(false, 0));
  const std::string why = config_error_text([&] { packed.check_amsgrad(true, 2); });
  EXPECT_NE(why.find("param group 2 has amsgrad=True, and amsgrad keeps fp32 moments; TIERFLOW_OPTIMIZER_STATES=8bit "
                     "(keyword optimizer_states=8bit) is refused with it (accepted: fp32)"),
            std::string::npos) << why;
}

TEST(StepPlan, StepsDuringBackwardNeedTheOverlapAndHostStates) {
  EXPECT_TRUE(StepPlan(settings({{"overlap_step", "on"}}), std::nullopt, false).steps_during_backward());
  EXPECT_FALSE(StepPlan(settings({{"overlap_step", "off"}}), std::nullopt, false).overlap());
  const Config nvme = settings({{"offload_optimizer", "nvme"}, {"nvme_paths", "/tmp"}});
  EXPECT_FALSE(StepPlan(nvme, std::nullopt, false).overlap()) << "states on NVMe step in step()";
  StepPlan plan(settings(), std::nullopt, false);
  EXPECT_FALSE(plan.steps_during_backward(/*master_stale=*/true)) << "a stale master steps in step()";
  EXPECT_TRUE(plan.stop_steps_during_backward("DDP all-reduces"));
  EXPECT_FALSE(plan.steps_during_backward());
  EXPECT_TRUE(plan.overlap()) << "the stream stays; its steps are off";
  EXPECT_EQ(plan.steps_after_backward(), "DDP all-reduces");
  EXPECT_FALSE(plan.stop_steps_during_backward("again")) << "off already";
  StepPlan off(settings({{"overlap_step", "off"}}), std::nullopt, false);
  EXPECT_FALSE(off.stop_steps_during_backward("DDP")) << "none to turn off";
}

TEST(StepPlan, OffloadedGradientsAreRefusedWithoutStepsDuringBackward) {
  const std::string why = config_error_text(
      [] { StepPlan(settings({{"offload_gradients", "on"}, {"overlap_step", "off"}}), std::nullopt, false); });
  EXPECT_NE(why.find("TIERFLOW_OVERLAP_STEP=on (it is off)"), std::string::npos) << why;
  EXPECT_NO_THROW(StepPlan(settings({{"offload_gradients", "on"}}), std::nullopt, false));
}

TEST(StepPlan, ShardsStepDuringBackwardOnlyOnceWrapStreamsThem) {
  StepPlan plan(settings({{"gpu_optimizer_fraction", "0.5"}}), std::nullopt, true);
  EXPECT_FALSE(plan.steps_during_backward());
  EXPECT_NE(plan.steps_after_backward().find("FSDP2's shards"), std::string::npos);
  EXPECT_EQ(plan.gpu_share_setting(), "0") << "none of FSDP2's shards";
  EXPECT_TRUE(plan.stream_shards());
  EXPECT_TRUE(plan.steps_during_backward());
  StepPlan off(settings({{"overlap_step", "off"}}), std::nullopt, true);
  EXPECT_FALSE(off.stream_shards());
  EXPECT_FALSE(off.steps_during_backward());
  StepPlan plain(settings(), std::nullopt, false);
  EXPECT_FALSE(plain.stream_shards()) << "no shards to stream";
}

TEST(StepPlan, GpuShareSettingReadsBackToTheFraction) {
  EXPECT_EQ(StepPlan(settings({{"gpu_optimizer_fraction", "auto"}}), std::nullopt, false).gpu_share_setting(), "auto");
  const std::string text =
      StepPlan(settings({{"gpu_optimizer_fraction", "0.1"}}), std::nullopt, false).gpu_share_setting();
  EXPECT_EQ(GpuShareChoice(text).fraction(), 0.1) << text;
  EXPECT_FALSE(GpuShareChoice(text).pending());
}

TEST(StepPlan, RoutesAtTheStreamsStart) {
  const StepPlan plan(settings(), std::nullopt, false);
  EXPECT_EQ(plan.route(streamable()), ParamRoute::kStream);
  for (bool RouteFacts::*fact : {&RouteFacts::requires_grad, &RouteFacts::on_device, &RouteFacts::contiguous,
                                 &RouteFacts::kernel_dtype}) {
    RouteFacts p = streamable();
    p.*fact = false;
    EXPECT_EQ(plan.route(p), ParamRoute::kStepInStep);
  }
  RouteFacts carried = streamable(), shared = streamable();
  carried.carried = shared.in_gpu_share = true;
  EXPECT_EQ(plan.route(carried), ParamRoute::kStepInStep) << "carried already";
  EXPECT_EQ(plan.route(shared), ParamRoute::kStepInStep) << "the GPU share steps it";
  const StepPlan shards(settings(), std::nullopt, true);
  RouteFacts strided_host = streamable();
  strided_host.on_device = strided_host.contiguous = false;
  EXPECT_EQ(shards.route(strided_host), ParamRoute::kFeed) << "a shard is fed, wherever its local tensor is";
  strided_host.kernel_dtype = false;
  EXPECT_EQ(shards.route(strided_host), ParamRoute::kStepInStep);
}

TEST(StepPlan, EachStepsPath) {
  const StepPlan host(settings({{"skip_nonfinite", "on"}}), std::nullopt, false);
  EXPECT_EQ(host.path(true, false), StepPath::kSkipped);
  EXPECT_EQ(host.path(true, true), StepPath::kStreamed);
  EXPECT_EQ(host.path(false, true), StepPath::kHost);
  const StepPlan nvme(settings({{"offload_optimizer", "nvme"}, {"nvme_paths", "/tmp"}}), std::nullopt, false);
  EXPECT_EQ(nvme.path(false, false), StepPath::kNvme) << "without skip_nonfinite a non-finite step steps";
  EXPECT_EQ(nvme.path(false, true), StepPath::kNvme);
}

TEST(StepPlan, WeightTargets) {
  EXPECT_EQ(StepPlan::weight_target(true, false, true), WeightTarget::kHome);
  EXPECT_EQ(StepPlan::weight_target(false, true, true), WeightTarget::kParameter);
  EXPECT_EQ(StepPlan::weight_target(false, true, false), WeightTarget::kStaging) << "strided host memory";
  EXPECT_EQ(StepPlan::weight_target(false, false, true), WeightTarget::kStaging) << "the device";
}

TEST(StepPlanRoom, APlannersRoomIsAValue) {
  EXPECT_EQ(plan_room(false, false, 5), (PlanRoom{false, 0})) << "profiling: no plan in force";
  EXPECT_EQ(plan_room(true, false, 5), (PlanRoom{true, 0})) << "a forced plan, no predicted peak";
  EXPECT_EQ(plan_room(false, true, 3 << 20), (PlanRoom{true, 3 << 20}));
}

TEST(StepPlanWindow, SeesWhatEachWindowStreamedAndGrew) {
  WindowWatch watch(4);
  StepWindow w = watch.seen(true, 0, 4, 0);
  EXPECT_FALSE(w.streamed);
  EXPECT_FALSE(w.pool_grew);
  w = watch.seen(true, 100, 6, 12.5);
  EXPECT_TRUE(w.streamed);
  EXPECT_TRUE(w.pool_grew);
  EXPECT_EQ(w.backward_ms, 12.5);
  w = watch.seen(true, 100, 6, 12.5);
  EXPECT_FALSE(w.streamed) << "nothing stepped since";
  EXPECT_FALSE(w.pool_grew);
  EXPECT_FALSE(watch.seen(false, 200, 6, 1).streamed) << "carrying none, nothing streamed";
}

TEST(StepPlanShare, WaitsForAPlanInForceWithoutCounting) {
  GpuShareChoice choice("auto");
  const StepWindow steady{true, 10.0, false};
  for (int i = 0; i < kSteadyStepLimit + 1; ++i) EXPECT_FALSE(share_due(choice, steady, PlanRoom{false, 0}));
  EXPECT_TRUE(choice.pending()) << "no plan in force: nothing counted";
  EXPECT_FALSE(share_due(choice, steady, PlanRoom{})) << "the first streamed step it sees is not steady";
  EXPECT_TRUE(share_due(choice, steady, PlanRoom{}));
  EXPECT_FALSE(choice.pending());
  EXPECT_FALSE(share_due(choice, steady, PlanRoom{})) << "once";
  GpuShareChoice fixed("0.5");
  EXPECT_FALSE(share_due(fixed, steady, PlanRoom{}));
}

TEST(StepPlanShare, TookBytesCountStreamedChosenElements) {
  const std::vector<ShareCandidate> fp32{{100, true, false}, {50, false, false}, {10, true, false}};
  EXPECT_EQ(share_took_bytes(fp32, {true, true, false}), 100 * 8) << "an unstreamed one has no state to move";
  const std::vector<ShareCandidate> mixed{{100, true, false}, {50, false, true}};
  EXPECT_EQ(share_took_bytes(mixed, {true, false}), 100 * 12) << "any 16-bit candidate: an fp32 master each";
}

TEST(StepPlanShards, AMixOfShardsAndPlainParametersIsRefusedNamingThePlainOnes) {
  EXPECT_EQ(shards_refusal(settings(), 0, 5, {"a", "b", "c", "d", "e"}, false), "") << "no shards: nothing to refuse";
  const std::string why = shards_refusal(settings(), 2, 6, {"a", "b", "c", "d"}, false);
  EXPECT_NE(why.find("2 of its 6 parameters are FSDP2's DTensor shards and 4 are not ('a', 'b', 'c' and more)"),
            std::string::npos) << why;
  EXPECT_EQ(shards_refusal(settings(), 3, 3, {}, false), "") << "all shards, settings they take";
  const std::string fraction = shards_refusal(settings({{"gpu_optimizer_fraction", "0.5"}}), 3, 3, {}, false);
  EXPECT_EQ(fraction.rfind("tierflow's CPU optimizer over FSDP2's shards: ", 0), 0u) << fraction;
  EXPECT_NE(shards_refusal(settings(), 3, 3, {}, true), "") << "shards in host memory beside a CUDA runtime";
}

TEST(StepPlanShards, AGroupAddedMustBeShardsExactlyWhenTheOptimizersAre) {
  const StepPlan plain(settings(), std::nullopt, false), shards(settings(), std::nullopt, true);
  EXPECT_NO_THROW(plain.check_group_sharding(false));
  EXPECT_NO_THROW(shards.check_group_sharding(true));
  EXPECT_NE(config_error_text([&] { plain.check_group_sharding(true); }).find("shards and the optimizer's are not"),
            std::string::npos);
  EXPECT_NE(config_error_text([&] { shards.check_group_sharding(false); }).find("not DTensors"), std::string::npos);
}

TEST(StepPlanShare, NotesFp32MomentsBesidePackedHostOnes) {
  EXPECT_EQ(gpu_share_format_note(3, StateFormat::kFp32), "");
  const std::string note = gpu_share_format_note(3, StateFormat::k8bit);
  EXPECT_NE(note.find("GPU share (3 parameters) keeps fp32 moments on the device, not TIERFLOW_OPTIMIZER_STATES=8bit"),
            std::string::npos) << note;
}
