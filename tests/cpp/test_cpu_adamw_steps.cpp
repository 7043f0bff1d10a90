// The C++ CpuAdamW's torch-free part (optimizer/cpu_adamw_steps.hpp), without torch: its settings read from the
// table and refused by name, the GPU share it picks, and the records of its step(): where each parameter steps,
// the retry of a step that failed part way (Note [C++ CpuAdamW faults]), the carried slots written here, the
// masters re-read after a load, and the counters.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/cpu_adamw_steps.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/step_engine.hpp"

namespace {

using namespace tierflow;
using namespace tierflow::optimizer;
using Route = CpuAdamWSteps::Route;

template <typename F>
std::string config_refusal(F&& f) {
  try {
    f();
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Two parameters, as the adapter names them (any distinct addresses).
const int kA = 0, kB = 0, kC = 0;
const void* const a = &kA;
const void* const b = &kB;
const void* const c = &kC;

TEST(CpuAdamWOptions, FromConfigReadsTheTableAsPythonDoes) {
  const Config cfg = Config::parse({}, {{"TIERFLOW_OVERLAP_STEP", "off"},
                                        {"TIERFLOW_GRAD_BUCKET_BYTES", "4096"},
                                        {"TIERFLOW_MAX_GRAD_NORM", "1.5"},
                                        {"TIERFLOW_SKIP_NONFINITE", "on"},
                                        {"TIERFLOW_GRAD_ACCUMULATION_STEPS", "3"},
                                        {"TIERFLOW_WEIGHTS_RETURN", "forward"},
                                        {"TIERFLOW_GPU_OPTIMIZER_FRACTION", "0.25"}});
  const CpuAdamWOptions o = CpuAdamWOptions::from_config(cfg);
  EXPECT_FALSE(o.step_during_backward);
  EXPECT_EQ(o.grad_bucket_bytes, 4096u);
  EXPECT_EQ(o.max_grad_norm, 1.5);
  EXPECT_TRUE(o.skip_nonfinite);
  EXPECT_EQ(o.accumulation_steps, 3);
  EXPECT_TRUE(o.weights_in_forward);
  EXPECT_EQ(o.gpu_fraction, 0.25);
  // TIERFLOW_GPU_OPTIMIZER_FRACTION=auto (the default) is not served from C++: it reads as 0.
  const CpuAdamWOptions d = CpuAdamWOptions::from_config(Config::parse({}, {}));
  EXPECT_EQ(d.gpu_fraction, 0.0);
  EXPECT_TRUE(d.step_during_backward);
  EXPECT_FALSE(d.offload_gradients);
}

TEST(CpuAdamWOptions, StepsDuringBackwardOnlyWithStatesOnTheHost) {
  CpuAdamWOptions o;
  EXPECT_TRUE(check_stream_options(o, false, OffloadTarget::kHost));
  EXPECT_FALSE(check_stream_options(o, true, OffloadTarget::kNvme));
  o.step_during_backward = false;
  EXPECT_FALSE(check_stream_options(o, false, OffloadTarget::kHost));
}

TEST(CpuAdamWOptions, WhatCppCannotServeIsRefusedByName) {
  auto refusal = [](CpuAdamWOptions o, bool nvme = false) {
    return config_refusal([&] { check_stream_options(o, nvme, nvme ? OffloadTarget::kNvme : OffloadTarget::kHost); });
  };
  CpuAdamWOptions forward;
  forward.weights_in_forward = true;
  EXPECT_TRUE(has(refusal(forward), "TIERFLOW_WEIGHTS_RETURN=forward (CpuAdamWOptions::weights_in_forward)"));
  EXPECT_TRUE(has(refusal(forward), "accepted from C++: TIERFLOW_WEIGHTS_RETURN=step"));
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    CpuAdamWOptions norm;
    norm.max_grad_norm = bad;
    const std::string why = refusal(norm);
    EXPECT_TRUE(has(why, "TIERFLOW_MAX_GRAD_NORM (CpuAdamWOptions::max_grad_norm) is ")) << bad << ": " << why;
    EXPECT_TRUE(has(why, "accepted: a finite number >= 0")) << why;
  }
  CpuAdamWOptions accumulation;
  accumulation.accumulation_steps = 0;
  EXPECT_TRUE(has(refusal(accumulation), "TIERFLOW_GRAD_ACCUMULATION_STEPS (CpuAdamWOptions::accumulation_steps) is 0; "
                                         "accepted: an integer >= 1"));
  // Gradients freed as they stream need the steps during backward: off, or states on NVMe, is refused.
  CpuAdamWOptions offload;
  offload.offload_gradients = true;
  EXPECT_EQ(refusal(offload), "");
  EXPECT_TRUE(has(refusal(offload, true), "TIERFLOW_OFFLOAD_GRADIENTS=on")) << refusal(offload, true);
  EXPECT_TRUE(has(refusal(offload, true), "nvme")) << refusal(offload, true);
  offload.step_during_backward = false;
  EXPECT_TRUE(has(refusal(offload), "TIERFLOW_OFFLOAD_GRADIENTS=on")) << refusal(offload);
  // Fine values pass.
  CpuAdamWOptions fine;
  fine.max_grad_norm = 0.0;
  fine.accumulation_steps = 1;
  EXPECT_EQ(refusal(fine), "");
}

TEST(CpuAdamWOptions, TheGpuShareIsTheFractionOfTheCudaParameters) {
  const std::vector<std::size_t> numels = {100, 300, 50, 550};
  const std::string range = config_refusal([&] { choose_gpu_share(1.5, numels); });
  EXPECT_TRUE(has(range, "TIERFLOW_GPU_OPTIMIZER_FRACTION (CpuAdamWOptions::gpu_fraction) is 1.5")) << range;
  EXPECT_TRUE(has(range, "accepted: a number from 0 to 1")) << range;
  EXPECT_TRUE(has(config_refusal([&] { choose_gpu_share(-0.1, {}); }), "is -0.1")) << "refused without parameters too";
  EXPECT_EQ(choose_gpu_share(0.0, numels), std::vector<bool>(4, false));
  EXPECT_TRUE(choose_gpu_share(0.5, {}).empty()) << "no CUDA parameter: nothing to pick, on any build";
  if (cuda_adam_compiled()) {
    EXPECT_EQ(choose_gpu_share(0.5, numels), GpuShareChoice("0.5").assign(numels));
    EXPECT_EQ(choose_gpu_share(1.0, numels), std::vector<bool>(4, true));
  } else {
    const std::string why = config_refusal([&] { choose_gpu_share(0.5, numels); });
    EXPECT_TRUE(has(why, "needs the CUDA AdamW, which this build lacks (TIERFLOW_WITH_CUDA); accepted: 0")) << why;
  }
}

TEST(CpuAdamWOptions, TheStreamGetsTheSettingsOfStepsDuringBackward) {
  CpuAdamWOptions o;
  o.grad_bucket_bytes = 1 << 20;
  o.accumulation_steps = 3;
  o.max_grad_norm = 0.5;
  o.skip_nonfinite = true;
  o.offload_gradients = true;
  const StreamOptions s = stream_options(o);
  EXPECT_EQ(s.bucket_bytes, std::size_t{1} << 20);
  EXPECT_EQ(s.accumulation_steps, 3);
  EXPECT_EQ(s.max_grad_norm, 0.5);
  EXPECT_TRUE(s.skip_nonfinite);
  EXPECT_TRUE(s.offload_gradients);
  EXPECT_FALSE(s.weights_in_forward);  // refused from C++ before a stream is made
}

TEST(CpuAdamWOptions, AmsgradIsRefusedWithMomentsOtherThanFp32NamingTheGroup) {
  check_amsgrad_format({true, true}, StateFormat::kFp32);
  check_amsgrad_format({false, false}, StateFormat::k8bit);
  try {
    check_amsgrad_format({false, true, true}, StateFormat::kBf16);
    FAIL() << "amsgrad with bf16 moments was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("param group 1 has amsgrad"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TIERFLOW_OPTIMIZER_STATES=bf16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(accepted: fp32)"), std::string::npos) << e.what();
  }
}

TEST(CpuAdamWSteps, EachParameterStepsOnceAndWhereItIsPlaced) {
  CpuAdamWSteps r;
  r.carry(a, 4);
  r.share_on_gpu(b);
  EXPECT_TRUE(r.carried(a));
  EXPECT_FALSE(r.carried(b));
  EXPECT_EQ(r.stream_slot(a), 4u);
  EXPECT_EQ(r.gpu_share_size(), 1u);
  r.begin(1.0);
  EXPECT_EQ(r.route(a, false), Route::kSkip) << "no gradient";
  EXPECT_EQ(r.route(a, true), Route::kCpu) << "carried, left to step() by the stream";
  EXPECT_EQ(r.route(b, true), Route::kGpu);
  EXPECT_EQ(r.route(b, false), Route::kSkip);
  EXPECT_EQ(r.route(c, true), Route::kCpu);
  r.stream_confirmed(a);
  EXPECT_EQ(r.route(a, true), Route::kSkip) << "the stream stepped it this step()";
  r.finish(false);
  r.begin(1.0);
  EXPECT_EQ(r.route(a, true), Route::kCpu) << "the stream's confirmations last one step()";
}

TEST(CpuAdamWSteps, TheStreamConfirmsEveryCarriedParameterItDidNotLeaveAndRereadsBySlot) {
  CpuAdamWSteps r;
  r.carry(a, 0);
  r.carry(b, 1);
  r.begin(1.0);
  r.stream_finished({1, 7});  // slot 1 is left to step(); 7 is nobody's
  EXPECT_EQ(r.route(a, true), Route::kSkip) << "confirmed by the stream";
  EXPECT_EQ(r.route(b, true), Route::kCpu) << "left to step()";
  EXPECT_EQ(r.route(c, true), Route::kCpu) << "not carried";
  r.reread_slots({1});
  EXPECT_TRUE(r.rereads(b));
  EXPECT_FALSE(r.rereads(a));
}

TEST(CpuAdamWSteps, ACarriedParameterIsNeverItsOwnMaster) {
  CpuAdamWSteps r;
  r.carry(a, 0);
  const ParamLayout host_fp32{true, true, true}, host_16bit{true, false, true}, device{false, true, true};
  // Not carried: Note [CPU AdamW state placement].
  EXPECT_TRUE(r.own_master(b, host_fp32));
  EXPECT_EQ(r.weight_update(b, host_fp32), WeightUpdate::kInPlace);
  EXPECT_EQ(r.weight_update(b, host_16bit), WeightUpdate::kIntoParameter);
  EXPECT_EQ(r.weight_update(b, device), WeightUpdate::kStaged);
  // Carried (an fp32 host tensor playing device memory on the emulated device): stepped out of place during
  // backward from its own master, so step() writes it from that master too.
  EXPECT_FALSE(r.own_master(a, host_fp32));
  EXPECT_EQ(r.weight_update(a, host_fp32), WeightUpdate::kIntoParameter);
  EXPECT_EQ(r.weight_update(a, device), WeightUpdate::kStaged);
}

TEST(CpuAdamWSteps, ARetryStepsOnlyWhatDidNotStep) {
  CpuAdamWSteps r;
  const GradIdentity ga(1, 0), gb(2, 0), gc(3, 0);
  r.begin(1.0);
  r.stepped(a, ga, 10);
  r.unstepped({0, 1, {300, 70}}, "no space left on device");
  r.unstepped({1, 0, {4}}, "a later error");
  r.stepped(c, gc, 5);
  try {
    r.finish(true);
    FAIL() << "a step with unstepped parameters throws";
  } catch (const io_error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(has(what, "2 parameters did not step")) << what;
    EXPECT_TRUE(has(what, "group 0 parameter 1 [300, 70], group 1 parameter 0 [4]")) << what;
    EXPECT_TRUE(has(what, "First error: no space left on device")) << what;
  }
  EXPECT_EQ(r.stats().steps, 0u) << "a failed step is not counted";
  EXPECT_EQ(r.stats().elements, 15u) << "what stepped is";
  EXPECT_TRUE(r.stepped_before(a, ga)) << "the retry skips what stepped with this gradient";
  EXPECT_FALSE(r.stepped_before(a, GradIdentity(1, 1))) << "a new version of the gradient is a new step";
  EXPECT_FALSE(r.stepped_before(a, gb)) << "another gradient is a new step";
  EXPECT_FALSE(r.stepped_before(b, gb)) << "what did not step steps at the retry";
  // The retry: only b steps, and the step completes.
  r.begin(1.0);
  r.stepped(b, gb, 7);
  r.finish(true);
  EXPECT_EQ(r.stats().steps, 1u);
  EXPECT_EQ(r.stats().elements, 22u);
  EXPECT_FALSE(r.stepped_before(a, ga)) << "a step that completed clears the marks";
  EXPECT_FALSE(r.stepped_before(b, gb));
  // A step with nothing to step is not counted; its failures of before are gone.
  r.begin(0.5);
  EXPECT_EQ(r.scale(), 0.5);
  r.finish(false);
  EXPECT_EQ(r.stats().steps, 1u);
  r.skipped();
  EXPECT_EQ(r.stats().skipped_steps, 1u);
}

TEST(CpuAdamWSteps, CarriedParametersSteppedHereAreWrittenBackToTheStream) {
  CpuAdamWSteps r;
  r.carry(a, 3);
  r.carry(b, 9);
  r.begin(1.0);
  r.stepped(a, GradIdentity(1, 0), 1);
  r.stepped(c, GradIdentity(2, 0), 1);  // not carried: the stream never hears of it
  EXPECT_EQ(r.take_written(), std::vector<std::size_t>{3});
  EXPECT_TRUE(r.take_written().empty()) << "taken once";
  r.finish(true);
}

TEST(CpuAdamWSteps, StaleMastersAreReReadUntilAStepFinishes) {
  CpuAdamWSteps r;
  r.carry(a, 0);
  r.set_masters_stale();  // a load()
  EXPECT_TRUE(r.masters_stale());
  r.begin(1.0);
  r.reread(a);
  EXPECT_TRUE(r.rereads(a));
  EXPECT_FALSE(r.rereads(b));
  r.finish(false);
  EXPECT_FALSE(r.masters_stale());
  EXPECT_FALSE(r.rereads(a)) << "re-read for one step()";
}

TEST(CpuAdamWSteps, RetryIndicesAreDistinctAndStable) {
  CpuAdamWSteps r;
  const std::size_t ia = r.index_of(a), ib = r.index_of(b);
  EXPECT_NE(ia, ib);
  EXPECT_EQ(r.index_of(a), ia);
}

TEST(StepEngineStats, StepsDuringBackwardAreDescribedAsPythonsReportDoes) {
  StepEngineStats s;
  s.early_steps = 30;
  s.committed = 27;
  s.redone = 2;
  s.taken_back = 1;
  s.held = 4;
  EXPECT_EQ(describe_steps_during_backward(s),
            "stepped during backward 30 (committed 27, redone 2, taken back 1, held 4)");
}

}  // namespace
