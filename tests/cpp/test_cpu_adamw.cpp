// CpuAdamW (Note [C++ CpuAdamW]): steps like torch::optim::AdamW (to a few
// ulp), per param group, with states on the host or NVMe; its archives load
// into torch::optim::AdamW and back; LR schedulers drive it; it steps during
// backward as it steps after (Note [C++ steps during backward]).
#include "tierflow/bindings/cpu_adamw.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>
#include <map>
#include <sstream>
#include <string>

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/nvme_engine.hpp"

namespace tb = tierflow::bindings;
namespace fs = std::filesystem;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

namespace {

std::shared_ptr<tb::Runtime> make_runtime(bool nvme, tierflow::swap::NvmeFaults* faults = nullptr,
                                          const std::string& states = "fp32") {
  std::map<std::string, std::string> o{{"host_memory", "256MiB"}, {"pinned_slab_bytes", "8MiB"},
                                       {"optimizer_states", states},
                                       // These models live on the CPU: on a CUDA machine the runtime's device
                                       // would be the GPU, their parameters not on it, and nothing would stream
                                       // (six cases failed so on an H200). make cpp-example covers CUDA.
                                       {"device", "emulated"}};
  if (nvme) {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "-" + info->name();
    for (auto& ch : name)
      if (ch == '/') ch = '-';
    auto dir = fs::current_path() / "cpu-adamw-nvme" / name;
    fs::create_directories(dir);
    o["offload_optimizer"] = "nvme";
    o["nvme_paths"] = dir.string();
    o["nvme_memory"] = "64MiB";
  }
  return std::make_shared<tb::Runtime>(tierflow::Config::parse({}, o), faults);
}

std::vector<torch::Tensor> make_params(std::uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({300, 70}, torch::requires_grad()), torch::randn({70}, torch::requires_grad()),
          torch::randn({1000}, torch::requires_grad())};
}

// The same gradients for every run: step s, parameter i.
void set_grads(const std::vector<torch::Tensor>& params, int s) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    torch::manual_seed(100 * s + i);
    params[i].mutable_grad() = torch::randn(params[i].sizes()) * 0.1;
  }
}

std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<torch::Tensor>& p) {
  return {torch::optim::OptimizerParamGroup({p[0], p[1]}),
          torch::optim::OptimizerParamGroup({p[2]}, std::make_unique<AdamWOptions>(AdamWOptions(0.02).weight_decay(0)))};
}

double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs() / b.abs().clamp_min(1e-3)).max().item<double>();
}

class OnEachTier : public testing::TestWithParam<bool> {};

TEST_P(OnEachTier, StepsLikeTorchAdamW) {
  const AdamWOptions defaults = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  auto theirs = make_params(1), ours = make_params(1);
  torch::optim::AdamW torch_opt(two_groups(theirs), defaults);
  tb::CpuAdamW opt(make_runtime(GetParam()), two_groups(ours), defaults);
  EXPECT_EQ(opt.states_on_nvme(), GetParam());
  for (int s = 0; s < 5; ++s) {
    set_grads(theirs, s);
    set_grads(ours, s);
    torch_opt.step();
    opt.step();
  }
  // LibTorch's C++ AdamW rounds a few operations differently (Note [C++ CpuAdamW]).
  for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_LT(max_rel_diff(ours[i], theirs[i]), 1e-5) << "parameter " << i;
  EXPECT_EQ(opt.stats().steps, 5u);
}

TEST_P(OnEachTier, ArchivesLoadIntoTorchAdamWAndBack) {
  auto params = make_params(2);
  tb::CpuAdamW opt(make_runtime(GetParam()), params, AdamWOptions(1e-2));
  for (int s = 0; s < 3; ++s) {
    set_grads(params, s);
    opt.step();
  }
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive out;
    opt.save(out);
    out.save_to(buffer);
  }
  torch::optim::AdamW torch_opt(params, AdamWOptions(1e-2));
  {
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    torch_opt.load(in);
  }
  for (const auto& p : params) {
    auto& st = static_cast<AdamWParamState&>(*torch_opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.step(), 3);
    EXPECT_EQ(st.exp_avg().sizes(), p.sizes());
    EXPECT_GT(st.exp_avg().abs().max().item<double>(), 0.0);
  }

  // Back into a fresh CpuAdamW: one more step from it equals one more step of the original.
  auto copy = std::vector<torch::Tensor>();
  for (const auto& p : params) copy.push_back(p.detach().clone().requires_grad_(true));
  tb::CpuAdamW restored(make_runtime(GetParam()), copy, AdamWOptions(1e-2));
  {
    std::stringstream again;
    torch::serialize::OutputArchive out;
    torch_opt.save(out);
    out.save_to(again);
    torch::serialize::InputArchive in;
    in.load_from(again);
    restored.load(in);
  }
  set_grads(params, 3);
  set_grads(copy, 3);
  opt.step();
  restored.step();
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], copy[i])) << "parameter " << i;
}

// Note [Optimizer state formats]: 8-bit moments step exactly as the fp32 step does when its moments are
// encoded and decoded back after every step (the reference: an fp32 CpuAdamW on the host, quantized by hand).
TEST_P(OnEachTier, EightBitMomentsStepAsTheFp32StepQuantized) {
  auto params = make_params(4), ref = make_params(4);
  tb::CpuAdamW opt(make_runtime(GetParam(), nullptr, "8bit"), two_groups(params), AdamWOptions(1e-2).weight_decay(0.1));
  tb::CpuAdamW fp32(make_runtime(false), two_groups(ref), AdamWOptions(1e-2).weight_decay(0.1));
  EXPECT_EQ(opt.state_format(), tierflow::StateFormat::k8bit);
  for (int s = 0; s < 4; ++s) {
    set_grads(params, s);
    set_grads(ref, s);
    opt.step();
    fp32.step();
    for (const auto& p : ref) {
      auto& st = static_cast<AdamWParamState&>(*fp32.state().at(p.unsafeGetTensorImpl()));
      const auto bytes = static_cast<std::int64_t>(tierflow::optimizer::moment_bytes(tierflow::StateFormat::k8bit,
                                                                                     static_cast<std::size_t>(p.numel())));
      at::Tensor m = torch::zeros({bytes}, torch::kUInt8), v = torch::zeros({bytes}, torch::kUInt8);
      tb::encode_moments(tierflow::StateFormat::k8bit, st.exp_avg(), st.exp_avg_sq(), m, v);
      tb::decode_moments(m, v, static_cast<std::size_t>(p.numel()), st.exp_avg().view({-1}), st.exp_avg_sq().view({-1}));
    }
    for (std::size_t i = 0; i < params.size(); ++i)
      ASSERT_TRUE(torch::equal(params[i], ref[i])) << "step " << s << ", parameter " << i;
  }
  if (!GetParam()) {
    for (const auto& p : params) {
      auto& st = static_cast<AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      EXPECT_EQ(st.exp_avg().scalar_type(), torch::kUInt8);
      EXPECT_EQ(static_cast<std::size_t>(st.exp_avg().numel()),
                tierflow::optimizer::moment_bytes(tierflow::StateFormat::k8bit, static_cast<std::size_t>(p.numel())));
    }
  }
}

// An 8-bit CpuAdamW's archive (fp32 moments, torch's layout) resumes bit for bit, and holds what it decodes to.
TEST_P(OnEachTier, EightBitArchivesResumeBitForBit) {
  auto params = make_params(6);
  tb::CpuAdamW opt(make_runtime(GetParam(), nullptr, "8bit"), params, AdamWOptions(1e-2));
  for (int s = 0; s < 3; ++s) {
    set_grads(params, s);
    opt.step();
  }
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive out;
    opt.save(out);
    out.save_to(buffer);
  }
  auto copy = std::vector<torch::Tensor>();
  for (const auto& p : params) copy.push_back(p.detach().clone().requires_grad_(true));
  tb::CpuAdamW restored(make_runtime(GetParam(), nullptr, "fp32"), copy, AdamWOptions(1e-2));
  restored.set_state_format(tierflow::StateFormat::k8bit);
  {
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    restored.load(in);
  }
  if (!GetParam()) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto& a = static_cast<AdamWParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
      auto& b = static_cast<AdamWParamState&>(*restored.state().at(copy[i].unsafeGetTensorImpl()));
      EXPECT_TRUE(torch::equal(a.exp_avg(), b.exp_avg()) && torch::equal(a.exp_avg_sq(), b.exp_avg_sq())) << i;
    }
  }
  for (int s = 3; s < 5; ++s) {
    set_grads(params, s);
    set_grads(copy, s);
    opt.step();
    restored.step();
  }
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], copy[i])) << "parameter " << i;
}

INSTANTIATE_TEST_SUITE_P(CpuAdamW, OnEachTier, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "nvme" : "host"; });

TEST(CpuAdamW, AmsgradIsRefusedWithPackedMoments) {
  auto params = make_params(8);
  try {
    tb::CpuAdamW opt(make_runtime(false, nullptr, "bf16"), params, AdamWOptions(1e-2).amsgrad(true));
    FAIL() << "amsgrad with bf16 moments was accepted";
  } catch (const tierflow::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("amsgrad keeps fp32 moments; TIERFLOW_OPTIMIZER_STATES=bf16"),
              std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(accepted: fp32)"), std::string::npos) << e.what();
  }
  tb::CpuAdamW opt(make_runtime(false), params, AdamWOptions(1e-2).amsgrad(true));
  EXPECT_THROW(opt.set_state_format(tierflow::StateFormat::k8bit), tierflow::config_error);
  EXPECT_EQ(opt.state_format(), tierflow::StateFormat::kFp32);
}

TEST(CpuAdamW, ParametersWithoutGradientsAreLeftAlone) {
  auto params = make_params(3);
  tb::CpuAdamW opt(make_runtime(false), params, AdamWOptions(1e-2));
  const auto before = params[1].detach().clone();
  set_grads(params, 0);
  params[1].mutable_grad() = torch::Tensor();
  opt.step();
  EXPECT_TRUE(torch::equal(before, params[1]));
  EXPECT_EQ(opt.state().count(params[1].unsafeGetTensorImpl()), 0u);
  opt.zero_grad();
  EXPECT_FALSE(params[0].grad().defined());
}

TEST(CpuAdamW, RefusesInvalidHyperparametersInTorchsWords) {
  // optimizer::adam_options_problem decides; the error stays torch's c10::Error with torch's text.
  auto runtime = make_runtime(false);
  auto refusal = [&](AdamWOptions o) -> std::string {
    try {
      tb::CpuAdamW opt(runtime, make_params(1), o);
    } catch (const c10::Error& e) {
      return e.msg();
    }
    return "";
  };
  EXPECT_EQ(refusal(AdamWOptions(1e-2)), "");
  EXPECT_NE(refusal(AdamWOptions(-0.5)).find("Invalid learning rate: -0.5"), std::string::npos);
  EXPECT_NE(refusal(AdamWOptions(1e-2).eps(-1)).find("Invalid epsilon value: -1"), std::string::npos);
  EXPECT_NE(refusal(AdamWOptions(1e-2).betas({0.9, 1.0})).find("Invalid beta parameter at index 1"),
            std::string::npos);
  EXPECT_NE(refusal(AdamWOptions(1e-2).weight_decay(-0.01)).find("Invalid weight_decay value: -0.01"),
            std::string::npos);
}

TEST(CpuAdamW, Bf16ParametersStepFromAnFp32Master) {
  torch::manual_seed(4);
  auto fp32 = torch::randn({4096}, torch::requires_grad());
  auto bf16 = fp32.detach().to(torch::kBFloat16).to(torch::kFloat).requires_grad_(true);
  auto half = fp32.detach().to(torch::kBFloat16).requires_grad_(true);
  torch::optim::AdamW reference({bf16}, AdamWOptions(1e-3));
  tb::CpuAdamW opt(make_runtime(false), {half}, AdamWOptions(1e-3));
  for (int s = 0; s < 4; ++s) {
    torch::manual_seed(s);
    auto g = torch::randn({4096}).to(torch::kBFloat16);
    bf16.mutable_grad() = g.to(torch::kFloat);
    half.mutable_grad() = g;
    reference.step();
    opt.step();
  }
  // Steps of 1e-3 are below bf16's resolution for most elements: without an
  // fp32 master they would be lost; with it the bf16 weight is the rounded master.
  EXPECT_TRUE(torch::equal(half, bf16.detach().to(torch::kBFloat16)) ||
              max_rel_diff(half.to(torch::kFloat), bf16.detach()) < 1e-2);
  EXPECT_FALSE(torch::equal(half, fp32.detach().to(torch::kBFloat16)));
}

TEST(CpuAdamW, LrSchedulersDriveIt) {
  auto params = make_params(5);
  tb::CpuAdamW opt(make_runtime(false), params, AdamWOptions(0.1));
  torch::optim::StepLR scheduler(opt, /*step_size=*/1, /*gamma=*/0.5);
  for (int s = 0; s < 2; ++s) {  // LibTorch's StepLR decays from its second step() on
    set_grads(params, s);
    opt.step();
    scheduler.step();
  }
  EXPECT_DOUBLE_EQ(static_cast<AdamWOptions&>(opt.param_groups()[0].options()).lr(), 0.05);
}

// Note [C++ steps during backward]: a small model trained by real backward passes.
struct Mlp {
  torch::nn::Sequential net;
  explicit Mlp(std::uint64_t seed) {
    torch::manual_seed(seed);
    net = torch::nn::Sequential(torch::nn::Linear(24, 64), torch::nn::GELU(), torch::nn::Linear(64, 48),
                                torch::nn::GELU(), torch::nn::Linear(48, 8));
  }
  // One step on batch `s`: zero_grad, forward, backward, step.
  void train_step(torch::optim::Optimizer& opt, int s, tb::CpuAdamW* ours = nullptr) {
    torch::manual_seed(1000 + s);
    auto x = torch::randn({16, 24});
    ours ? ours->zero_grad() : opt.zero_grad();
    auto loss = net->forward(x).pow(2).mean() * 10;
    loss.backward();
    opt.step();
  }
};

tb::CpuAdamWOptions streaming(bool on) {
  tb::CpuAdamWOptions o;
  o.step_during_backward = on;
  o.grad_bucket_bytes = 4096;  // several buckets over these 5.2k parameters
  return o;
}

// The first moments as torch::optim::AdamW loads them from `opt`'s archive.
std::vector<torch::Tensor> exp_avgs_through_torch(const torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params) {
  std::stringstream buffer;
  torch::serialize::OutputArchive out;
  opt.save(out);
  out.save_to(buffer);
  torch::optim::AdamW loaded(params, AdamWOptions(1e-2));
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  loaded.load(in);
  std::vector<torch::Tensor> m;
  for (const auto& p : params) {
    auto& st = static_cast<AdamWParamState&>(*loaded.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.step(), 5) << "the archive's step count";
    m.push_back(st.exp_avg().clone());
  }
  return m;
}

// The early steps committed by step() are the steps after backward, bit for bit (the same kernel on the same
// gradients), their states reach the archive, and both are LibTorch's AdamW to its rounding.
TEST(CpuAdamW, StepsDuringBackwardAreTheStepsAfterBackward) {
  const AdamWOptions defaults = AdamWOptions(1e-2).weight_decay(0.1);
  Mlp during(7), after(7), plain(7);
  tb::CpuAdamW opt_during(make_runtime(false), during.net->parameters(), defaults, streaming(true));
  tb::CpuAdamW opt_after(make_runtime(false), after.net->parameters(), defaults, streaming(false));
  torch::optim::AdamW opt_plain(plain.net->parameters(), defaults);
  ASSERT_TRUE(opt_during.steps_during_backward());
  ASSERT_FALSE(opt_after.steps_during_backward());
  for (int s = 0; s < 5; ++s) {
    during.train_step(opt_during, s, &opt_during);
    after.train_step(opt_after, s);
    plain.train_step(opt_plain, s);
  }
  const auto pd = during.net->parameters(), pa = after.net->parameters(), pp = plain.net->parameters();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    EXPECT_TRUE(torch::equal(pd[i], pa[i])) << "parameter " << i;
    EXPECT_LT(max_rel_diff(pd[i], pp[i]), 1e-4) << "parameter " << i;
  }
  const tb::GradStreamStats st = opt_during.stream_stats();
  EXPECT_EQ(st.early_steps, 5 * pd.size()) << "every parameter stepped during every backward";
  EXPECT_EQ(st.committed, st.early_steps);
  EXPECT_EQ(st.redone + st.taken_back, 0u);
  EXPECT_GT(st.buckets, 5u);
  EXPECT_EQ(opt_after.stream_stats().early_steps, 0u);
  EXPECT_EQ(tb::describe_steps_during_backward(st).rfind("stepped during backward 30 (committed 30, redone 0, ", 0), 0u)
      << tb::describe_steps_during_backward(st);
  const auto md = exp_avgs_through_torch(opt_during, pd), ma = exp_avgs_through_torch(opt_after, pa);
  for (std::size_t i = 0; i < md.size(); ++i) EXPECT_TRUE(torch::equal(md[i], ma[i])) << "exp_avg " << i;
}

// TIERFLOW_MAX_GRAD_NORM: the stream steps the landed gradients with clip_grad_norm_'s coefficient in step(),
// as the step after backward steps; with TIERFLOW_OFFLOAD_GRADIENTS the released gradients enter the norm by the norm the
// stream took, and p.grad is undefined from backward to step().
class ClippedDuringBackward : public testing::TestWithParam<bool> {};

TEST_P(ClippedDuringBackward, AsAfterBackward) {
  const bool offload = GetParam();
  const AdamWOptions defaults = AdamWOptions(1e-2).weight_decay(0.1);
  Mlp during(9), after(9), plain(9);
  tb::CpuAdamWOptions on = streaming(true), off = streaming(false);
  on.max_grad_norm = off.max_grad_norm = 0.05;
  on.offload_gradients = offload;
  tb::CpuAdamW opt_during(make_runtime(false), during.net->parameters(), defaults, on);
  tb::CpuAdamW opt_after(make_runtime(false), after.net->parameters(), defaults, off);
  torch::optim::AdamW opt_plain(plain.net->parameters(), defaults);
  for (int s = 0; s < 4; ++s) {
    during.train_step(opt_during, s, &opt_during);
    after.train_step(opt_after, s);
    torch::manual_seed(1000 + s);  // Mlp::train_step's batch, clipped by torch's clip_grad_norm_
    auto x = torch::randn({16, 24});
    opt_plain.zero_grad();
    (plain.net->forward(x).pow(2).mean() * 10).backward();
    torch::nn::utils::clip_grad_norm_(plain.net->parameters(), 0.05);
    opt_plain.step();
  }
  const auto pd = during.net->parameters(), pa = after.net->parameters(), pp = plain.net->parameters();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    EXPECT_TRUE(torch::equal(pd[i], pa[i])) << "parameter " << i;
    EXPECT_LT(max_rel_diff(pd[i], pp[i]), 1e-4) << "parameter " << i;
    EXPECT_EQ(pd[i].grad().defined(), !offload) << "parameter " << i;
  }
  const tb::GradStreamStats st = opt_during.stream_stats();
  // The norm is over 0.05 in every step: speculation stops, and step() steps every landed gradient with the
  // coefficient (none is left to the step after backward's path).
  std::uint64_t grad_bytes = 0;
  for (const auto& p : pd) grad_bytes += p.nbytes();
  EXPECT_EQ(st.speculation_stops, 4u);
  EXPECT_EQ(st.kernel_grad_bytes, 4 * grad_bytes);
  EXPECT_EQ(st.grads_released, offload ? 4 * pd.size() : 0u);
}

INSTANTIATE_TEST_SUITE_P(CpuAdamW, ClippedDuringBackward, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "offload" : "kept"; });

// TIERFLOW_GRAD_ACCUMULATION_STEPS=2: the window's second backward streams the sums; and an lr changed between
// backward and step() (a scheduler stepped there) redoes the early steps with it. Both as after backward.
TEST(CpuAdamW, AccumulatedAndRescheduledStepsDuringBackwardAreTheStepsAfterBackward) {
  const AdamWOptions defaults = AdamWOptions(1e-2).weight_decay(0.1);
  Mlp during(13), after(13);
  tb::CpuAdamWOptions on = streaming(true), off = streaming(false);
  on.accumulation_steps = off.accumulation_steps = 2;
  tb::CpuAdamW opt_during(make_runtime(false), during.net->parameters(), defaults, on);
  tb::CpuAdamW opt_after(make_runtime(false), after.net->parameters(), defaults, off);
  for (int s = 0; s < 4; ++s) {
    for (auto [m, opt] : {std::pair<Mlp*, tb::CpuAdamW*>{&during, &opt_during}, {&after, &opt_after}}) {
      opt->zero_grad();
      for (int micro = 0; micro < 2; ++micro) {
        torch::manual_seed(2000 + 2 * s + micro);
        (m->net->forward(torch::randn({16, 24})).pow(2).mean() * 10).backward();
      }
      if (s == 2) static_cast<AdamWOptions&>(opt->param_groups()[0].options()).lr(5e-3);
      opt->step();
    }
  }
  const auto pd = during.net->parameters(), pa = after.net->parameters();
  for (std::size_t i = 0; i < pd.size(); ++i) EXPECT_TRUE(torch::equal(pd[i], pa[i])) << "parameter " << i;
  const tb::GradStreamStats st = opt_during.stream_stats();
  EXPECT_EQ(st.early_steps, 4 * pd.size()) << "one early step per window, at its last backward";
  EXPECT_EQ(st.redone, pd.size()) << "the window whose lr changed after backward";
  EXPECT_EQ(st.committed, 3 * pd.size());
}

// TIERFLOW_SKIP_NONFINITE: a step with an inf gradient changes nothing, the early steps included.
TEST(CpuAdamW, ANonFiniteStepDuringBackwardIsSkipped) {
  Mlp m(11);
  tb::CpuAdamWOptions o = streaming(true);
  o.skip_nonfinite = true;
  tb::CpuAdamW opt(make_runtime(false), m.net->parameters(), AdamWOptions(1e-2), o);
  m.train_step(opt, 0, &opt);
  std::vector<torch::Tensor> before;
  for (const auto& p : m.net->parameters()) before.push_back(p.detach().clone());
  opt.zero_grad();
  auto loss = m.net->forward(torch::full({2, 24}, std::numeric_limits<float>::infinity())).sum();
  loss.backward();
  opt.step();
  EXPECT_EQ(opt.stats().skipped_steps, 1u);
  const auto params = m.net->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i])) << "parameter " << i;
  EXPECT_GT(opt.stream_stats().taken_back, 0u);
}

// The settings C++ cannot serve are refused by name, with what is accepted.
TEST(CpuAdamW, SettingsWithoutACppMeaningAreRefusedByName) {
  auto refusal = [](tb::CpuAdamWOptions o) -> std::string {
    try {
      tb::CpuAdamW opt(make_runtime(false), make_params(1), AdamWOptions(1e-2), o);
    } catch (const tierflow::config_error& e) {
      return e.what();
    }
    return "";
  };
  tb::CpuAdamWOptions forward = streaming(true);
  forward.weights_in_forward = true;
  EXPECT_NE(refusal(forward).find("TIERFLOW_WEIGHTS_RETURN=forward"), std::string::npos);
  EXPECT_NE(refusal(forward).find("accepted from C++: TIERFLOW_WEIGHTS_RETURN=step"), std::string::npos);
  tb::CpuAdamWOptions offload = streaming(false);
  offload.offload_gradients = true;
  EXPECT_NE(refusal(offload).find("TIERFLOW_OFFLOAD_GRADIENTS=on"), std::string::npos) << refusal(offload);
  tb::CpuAdamWOptions norm = streaming(true);
  norm.max_grad_norm = -1;
  EXPECT_NE(refusal(norm).find("TIERFLOW_MAX_GRAD_NORM"), std::string::npos);
  tb::CpuAdamWOptions share = streaming(true);
  share.gpu_fraction = 1.5;
  EXPECT_NE(refusal(share).find("TIERFLOW_GPU_OPTIMIZER_FRACTION (CpuAdamWOptions::gpu_fraction) is 1.5"),
            std::string::npos) << refusal(share);
  share.gpu_fraction = 0.5;  // Note [C++ GPU share]: CUDA parameters only; these stream to the CPU
  tb::CpuAdamW shared(make_runtime(false), make_params(1), AdamWOptions(1e-2), share);
  EXPECT_EQ(shared.gpu_share_size(), 0u);
  EXPECT_TRUE(shared.steps_during_backward());
  // From the table: TIERFLOW_OVERLAP_STEP=off steps after backward.
  auto runtime = std::make_shared<tb::Runtime>(tierflow::Config::parse({}, {{"overlap_step", "off"}}));
  EXPECT_FALSE(tb::CpuAdamW(runtime, make_params(1), AdamWOptions(1e-2)).steps_during_backward());
  EXPECT_TRUE(tb::CpuAdamW(make_runtime(false), make_params(1), AdamWOptions(1e-2)).steps_during_backward());
}

}  // namespace

// Note [C++ CpuAdamW faults]: a write that fails in the middle of an NVMe step
// fails only its parameter; the error names it, the retry steps only it, and
// the run ends where one that never failed ends, bit for bit.
TEST(CpuAdamW, ARetryAfterAPartialNvmeStepStepsEachParameterOnce) {
  const AdamWOptions defaults = AdamWOptions(1e-2).weight_decay(0.1);
  auto clean = make_params(1), ours = make_params(1);
  tierflow::swap::NvmeFaults faults;
  tb::CpuAdamW reference(make_runtime(true), two_groups(clean), defaults);
  tb::CpuAdamW opt(make_runtime(true, &faults), two_groups(ours), defaults);
  for (int s = 0; s < 4; ++s) {
    set_grads(clean, s);
    set_grads(ours, s);
    reference.step();
    if (s != 2) {
      opt.step();
      continue;
    }
    const auto before = ours[0].detach().clone();
    faults.fail_writes = 1;  // the first parameter's new state cannot be written
    try {
      opt.step();
      FAIL() << "a failed write must fail the step";
    } catch (const tierflow::io_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("1 parameters did not step"), std::string::npos) << what;
      EXPECT_NE(what.find("group 0 parameter 0 [300, 70]"), std::string::npos) << what;
    }
    EXPECT_TRUE(torch::equal(ours[0], before)) << "the parameter that failed kept its weight";
    EXPECT_TRUE(torch::equal(ours[2], clean[2])) << "the others stepped";
    opt.step();  // the retry, same gradients: only parameter 0 steps
  }
  for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(torch::equal(ours[i], clean[i])) << "parameter " << i;
  for (const auto& p : ours) {
    const auto& st = static_cast<AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.step(), 4) << "every parameter stepped once per step";
  }
}
