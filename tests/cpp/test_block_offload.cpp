// BlockOffload (Note [C++ block offload]): every action gives the gradients,
// losses and RNG stream of running the blocks plainly, bit for bit on CPU,
// on both emulated modes; the error paths name the problem.
#include "tierflow/bindings/block_offload.hpp"
#include "tierflow/bindings/cpu_adamw.hpp"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"

namespace tb = tierflow::bindings;
namespace fs = std::filesystem;

namespace {

// The tensors here are CPU tensors: the emulated device, also on a machine with a GPU (where auto means CUDA).
std::shared_ptr<tb::Runtime> make_runtime(std::map<std::string, std::string> overrides) {
  overrides.emplace("device", "emulated");
  overrides.emplace("host_memory", "256MiB");
  overrides.emplace("pinned_slab_bytes", "8MiB");
  return std::make_shared<tb::Runtime>(tierflow::Config::parse({}, overrides));
}

std::string nvme_dir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "-" + info->name();
  for (auto& ch : name)
    if (ch == '/') ch = '-';
  auto dir = fs::current_path() / "block-offload-nvme" / name;
  fs::create_directories(dir);
  return dir.string();
}

// Three blocks with dropout; block inputs of 128 KiB, above TIERFLOW_MIN_OFFLOAD_BYTES.
struct Model {
  std::vector<torch::nn::Sequential> blocks;
  torch::Tensor leaf;
  Model() {
    torch::manual_seed(7);
    for (int i = 0; i < 3; ++i)
      blocks.push_back(torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::GELU(),
                                             torch::nn::Dropout(0.25), torch::nn::Linear(128, 64)));
    leaf = torch::randn({8, 64, 64}, torch::requires_grad());
  }
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> all{leaf};
    for (const auto& b : blocks)
      for (const auto& p : b->parameters()) all.push_back(p);
    return all;
  }
  void zero_grad() {
    for (auto& p : parameters()) p.mutable_grad() = torch::Tensor();
  }
  // Loss of one forward, blocks through `offload` when given.
  torch::Tensor loss(tb::BlockOffload* offload) {
    auto x = leaf * 2;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      auto block = blocks[i];
      if (offload)
        x = offload->forward(i, [block](const at::Tensor& in) mutable { return block->forward(in); }, x,
                             block->parameters());
      else
        x = block->forward(x);
    }
    return x.pow(2).mean();
  }
};

struct Outcome {
  std::vector<double> losses;
  std::vector<torch::Tensor> grads;  // of the last step
  torch::Tensor next_random;         // the RNG stream after training
};

Outcome run(Model& m, tb::BlockOffload* offload, int steps = 2) {
  Outcome o;
  torch::manual_seed(11);
  for (int s = 0; s < steps; ++s) {
    m.zero_grad();
    auto loss = m.loss(offload);
    loss.backward();
    o.losses.push_back(loss.item<double>());
  }
  for (const auto& p : m.parameters()) o.grads.push_back(p.grad().clone());
  o.next_random = torch::rand({4});
  return o;
}

void expect_identical(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (std::size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "gradient " << i;
  EXPECT_TRUE(torch::equal(a.next_random, b.next_random)) << "the RNG stream moved differently";
}

struct Case {
  tb::BlockAction action;
  const char* device_mode;
};

class EveryAction : public testing::TestWithParam<Case> {};

TEST_P(EveryAction, GivesTheGradientsOfThePlainBlocks) {
  const Case c = GetParam();
  Model m;
  const Outcome plain = run(m, nullptr);

  std::map<std::string, std::string> o{{"emulated_device", c.device_mode}};
  if (c.action == tb::BlockAction::kSwapNvme) {
    o["offload_activations"] = "nvme";
    o["nvme_paths"] = nvme_dir();
    o["nvme_memory"] = "64MiB";
  }
  auto runtime = make_runtime(o);
  tb::BlockOffload offload(runtime);
  offload.set_default_action(c.action);
  const Outcome with = run(m, &offload);
  offload.synchronize();
  expect_identical(plain, with);

  const auto st = offload.stats();
  EXPECT_EQ(st.forwards, 2u);
  if (c.action == tb::BlockAction::kKeep) {
    EXPECT_EQ(st.kept, 6u);
    EXPECT_EQ(st.reruns, 0u);
    return;
  }
  EXPECT_EQ(st.reruns, 6u);
  if (c.action == tb::BlockAction::kSwapHost) {
    EXPECT_EQ(st.swapped_host, 6u);
    EXPECT_EQ(offload.host_stats().offloaded_blocks, 6u);
    EXPECT_EQ(offload.host_stats().unpacks, 6u);
  }
  if (c.action == tb::BlockAction::kSwapNvme) {
    EXPECT_EQ(st.swapped_nvme, 6u);
    // Written to NVMe behind the compute, unless backward overtook the write-behind (a loaded machine; the
    // adversarial device delays copies): then served from the staging before its write started, or from the
    // device copy still held. CI's loaded runs saw each, twice with no counter moving (served from the staging
    // before the write-behind began), so the counts are shown, not asserted; what is asserted: the NVMe
    // offloader saw every block, and no write failed.
    const auto nv = offload.nvme_stats();
    std::printf("NVMe: writes %llu, forwarded from staging %llu, from the device %llu, full %llu\n",
                static_cast<unsigned long long>(nv.nvme_writes), static_cast<unsigned long long>(nv.nvme_forwarded),
                static_cast<unsigned long long>(nv.forwarded), static_cast<unsigned long long>(nv.nvme_full));
    EXPECT_EQ(nv.nvme_write_failures, 0u);
    EXPECT_EQ(nv.offloaded_blocks, 6u);
  }
  if (c.action == tb::BlockAction::kRecompute) {
    EXPECT_EQ(st.recomputed, 6u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    BlockOffload, EveryAction,
    testing::Values(Case{tb::BlockAction::kKeep, "polite"}, Case{tb::BlockAction::kSwapHost, "polite"},
                    Case{tb::BlockAction::kSwapNvme, "polite"}, Case{tb::BlockAction::kRecompute, "polite"},
                    Case{tb::BlockAction::kSwapHost, "adversarial"}, Case{tb::BlockAction::kSwapNvme, "adversarial"},
                    Case{tb::BlockAction::kRecompute, "adversarial"}),
    [](const testing::TestParamInfo<Case>& info) {
      std::string name = std::string(tb::to_string(info.param.action)) + "_" + info.param.device_mode;
      for (auto& ch : name)
        if (ch == '-') ch = '_';
      return name;
    });

TEST(BlockOffload, MixedPlanPerBlock) {
  Model m;
  const Outcome plain = run(m, nullptr);
  tb::BlockOffload offload(make_runtime({}));
  offload.set_actions({tb::BlockAction::kRecompute, tb::BlockAction::kKeep, tb::BlockAction::kSwapHost});
  const Outcome with = run(m, &offload);
  expect_identical(plain, with);
  const auto st = offload.stats();
  EXPECT_EQ(st.recomputed, 2u);
  EXPECT_EQ(st.kept, 2u);
  EXPECT_EQ(st.swapped_host, 2u);
}

TEST(BlockOffload, AppliesThePlannersPlan) {
  // A plan from tiering::plan_activations for three identical blocks whose budget holds one of them.
  tierflow::tiering::BlockProfile p;
  p.forward_seconds = 1e-3;
  p.backward_seconds = 2e-3;
  p.input_bytes = 1 << 20;
  p.cheap_bytes = 8 << 20;
  p.splittable = false;
  tierflow::tiering::Links links;
  links.d2h = links.h2d = 1e9;
  tierflow::tiering::Budgets budgets;
  budgets.device_bytes = 20 << 20;
  budgets.host_bytes = 1 << 30;
  const auto plan = tierflow::tiering::plan_activations({p, p, p}, links, budgets);
  ASSERT_EQ(plan.blocks.size(), 3u);
  std::size_t kept = 0;
  for (const auto& b : plan.blocks) kept += b.mode == tierflow::tiering::BlockMode::kKeep;
  ASSERT_EQ(kept, 1u) << plan.summary();

  Model m;
  const Outcome plain = run(m, nullptr);
  tb::BlockOffload offload(make_runtime({}));
  offload.apply_plan(plan);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_EQ(offload.action(i), tb::block_action_from_plan(plan.blocks[i])) << plan.summary();
  expect_identical(plain, run(m, &offload));

  tierflow::tiering::BlockPlan on_nvme;
  on_nvme.mode = tierflow::tiering::BlockMode::kSplit;
  on_nvme.tier = tierflow::tiering::SwapTier::kNvme;
  EXPECT_EQ(tb::block_action_from_plan(on_nvme), tb::BlockAction::kSwapNvme);
  tierflow::Config c = tierflow::Config::parse({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "recompute"}});
  EXPECT_EQ(tb::block_action_from_config(c), tb::BlockAction::kSwapHost);  // the floor
}

TEST(BlockOffload, RecomputeRunsUnderTheForwardsAutocast) {
  // CPU autocast runs the Linear layers in bf16; a rerun in fp32 would give other gradients.
  const auto loss_in_autocast = [](Model& m, tb::BlockOffload* offload) {
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    auto loss = m.loss(offload);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return loss.to(at::kFloat);
  };
  Model m;
  torch::manual_seed(3);
  loss_in_autocast(m, nullptr).backward();
  std::vector<torch::Tensor> plain;
  for (const auto& p : m.parameters()) plain.push_back(p.grad().clone());

  m.zero_grad();
  tb::BlockOffload offload(make_runtime({}));
  offload.set_default_action(tb::BlockAction::kRecompute);
  torch::manual_seed(3);
  loss_in_autocast(m, &offload).backward();
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "backward left autocast on";
  const auto params = m.parameters();
  for (std::size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], params[i].grad())) << "gradient " << i;
}

TEST(BlockOffload, RecomputeLeavesNoAutocastCopyOfAWeightBehind) {
  // Steps as a training loop runs them with torch.autocast (the nesting counted, the cache of bf16 weight
  // copies cleared when the region ends), backward outside the region, the weights updated in between. The
  // rerun's bf16 copies of the weights must not outlive it: the next use of a weight under autocast would
  // compute with last step's values (and they hold a 16-bit copy of every block weight meanwhile).
  const auto step = [](Model& m, tb::BlockOffload* offload) {
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::increment_nesting();
    auto loss = m.loss(offload).to(at::kFloat);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : m.parameters()) p.sub_(p.grad() * 0.5);
    }
    m.zero_grad();
    return loss.item<double>();
  };
  // A block's first Linear under autocast, with the cache and without it: they differ when a stale copy is used.
  const auto uses_a_stale_copy = [](Model& m) {
    auto linear = m.blocks[0]->ptr<torch::nn::LinearImpl>(0);
    auto x = torch::randn({2, 64});
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::increment_nesting();
    auto cached = linear->forward(x);
    at::autocast::set_autocast_cache_enabled(false);
    auto fresh = linear->forward(x);
    at::autocast::set_autocast_cache_enabled(true);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    return !torch::equal(cached, fresh);
  };
  std::vector<double> plain, offloaded;
  {
    Model m;
    torch::manual_seed(3);
    for (int s = 0; s < 3; ++s) {
      plain.push_back(step(m, nullptr));
      EXPECT_FALSE(uses_a_stale_copy(m));  // draws from the RNG as the run below does
    }
  }
  {
    Model m;
    tb::BlockOffload offload(make_runtime({}));
    offload.set_default_action(tb::BlockAction::kRecompute);
    torch::manual_seed(3);
    for (int s = 0; s < 3; ++s) {
      offloaded.push_back(step(m, &offload));
      EXPECT_FALSE(uses_a_stale_copy(m)) << "step " << s << " left a bf16 copy of a weight in the autocast cache";
    }
    EXPECT_EQ(offload.stats().reruns, 9u);
  }
  EXPECT_EQ(plain, offloaded);
  EXPECT_EQ(at::autocast::decrement_nesting(), -1) << "the reruns left the autocast nesting count raised";
  at::autocast::increment_nesting();
}

TEST(BlockOffload, TheDefaultActionComesFromTheConfiguration) {
  EXPECT_EQ(tb::BlockOffload(make_runtime({{"offload_activations", "none"}})).action(5), tb::BlockAction::kKeep);
  EXPECT_EQ(tb::BlockOffload(make_runtime({{"offload_activations", "host"}})).action(0), tb::BlockAction::kSwapHost);
  EXPECT_EQ(tb::BlockOffload(make_runtime({{"offload_activations", "auto"}})).action(0), tb::BlockAction::kSwapHost);
  tb::BlockOffload offload(make_runtime({{"offload_activations", "none"}}));
  offload.set_action(2, tb::BlockAction::kRecompute);
  EXPECT_EQ(offload.action(1), tb::BlockAction::kKeep);
  EXPECT_EQ(offload.action(2), tb::BlockAction::kRecompute);
}

TEST(BlockOffload, SwapToNvmeWithoutTheTierIsAConfigError) {
  tb::BlockOffload offload(make_runtime({}));
  try {
    offload.set_action(0, tb::BlockAction::kSwapNvme);
    FAIL() << "no error";
  } catch (const tierflow::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("TIERFLOW_NVME_PATHS"), std::string::npos) << e.what();
  }
}

TEST(BlockOffload, WithoutAutogradTheBlockJustRuns) {
  Model m;
  tb::BlockOffload offload(make_runtime({}));
  torch::NoGradGuard no_grad;
  m.loss(&offload);
  EXPECT_EQ(offload.stats().kept, 3u);
  EXPECT_EQ(offload.host_stats().packs, 0u);
}

TEST(BlockOffload, ASecondBackwardThroughASwappedBlockSaysWhy) {
  Model m;
  tb::BlockOffload offload(make_runtime({}));
  auto loss = m.loss(&offload);
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a second time"), std::string::npos) << e.what();
  }
}

}  // namespace

// Note [C++ parameter residency]: eight blocks whose parameters live on the host between uses train as the
// plain blocks do, step by step with tierflow's CPU AdamW, and the device holds at most two blocks' parameters.
namespace {

struct Deep {
  std::vector<torch::nn::Sequential> blocks;
  torch::Tensor leaf;
  Deep() {
    torch::manual_seed(5);
    for (int i = 0; i < 8; ++i)
      blocks.push_back(torch::nn::Sequential(torch::nn::Linear(32, 96), torch::nn::GELU(), torch::nn::Dropout(0.1),
                                             torch::nn::Linear(96, 32)));
    leaf = torch::randn({4, 16, 32}, torch::requires_grad());
  }
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> all{leaf};
    for (const auto& b : blocks)
      for (const auto& p : b->parameters()) all.push_back(p);
    return all;
  }
  std::vector<std::vector<torch::Tensor>> block_parameters() const {
    std::vector<std::vector<torch::Tensor>> out;
    for (const auto& b : blocks) out.push_back(b->parameters());
    return out;
  }
};

struct Trained {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
};

Trained train_deep(tb::BlockOffload* offload, const std::string& mode, bool offload_params) {
  Deep m;
  auto runtime = make_runtime({{"emulated_device", mode}});
  if (offload_params) offload->offload_parameters(m.block_parameters());
  tb::CpuAdamW opt(runtime, m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  Trained t;
  torch::manual_seed(3);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto x = m.leaf * 2;
    for (std::size_t i = 0; i < m.blocks.size(); ++i) {
      auto block = m.blocks[i];
      x = offload->forward(i, [block](const at::Tensor& in) mutable { return block->forward(in); }, x,
                           block->parameters());
    }
    auto loss = x.pow(2).mean();
    loss.backward();
    opt.step();
    t.losses.push_back(loss.item<double>());
  }
  offload->synchronize();
  for (const auto& p : m.parameters()) t.params.push_back(p.detach().clone());
  return t;
}

}  // namespace

class ParamResidency : public testing::TestWithParam<const char*> {};

TEST_P(ParamResidency, BlocksWhoseParametersLiveOnTheHostTrainAsThePlainBlocks) {
  auto runtime = make_runtime({{"emulated_device", GetParam()}});
  tb::BlockOffload plain(runtime), fetched(runtime);
  plain.set_default_action(tb::BlockAction::kSwapHost);
  fetched.set_default_action(tb::BlockAction::kSwapHost);
  const Trained a = train_deep(&plain, GetParam(), false);
  const Trained b = train_deep(&fetched, GetParam(), true);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i;
  for (std::size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << "param " << i;

  const Deep shape;
  std::uint64_t block_bytes = 0;
  for (const auto& p : shape.blocks[0]->parameters()) block_bytes += p.nbytes();
  const auto st = fetched.parameter_stats();
  EXPECT_EQ(st.fetches, 3u * 2u * 8u * 4u) << "each block's 4 parameters, in forward and backward, 3 steps";
  EXPECT_GT(st.device_peak_bytes, 0u);
  EXPECT_LE(st.device_peak_bytes, 2 * block_bytes) << "a block and the one prefetched: 8 blocks' weights never are";
  EXPECT_EQ(st.device_bytes, 0u) << "released after the step's last backward";
  EXPECT_EQ(st.host_bytes, 8 * block_bytes);
  EXPECT_GT(st.prefetch_hits, 0u);
  EXPECT_EQ(plain.parameter_stats().fetches, 0u);
}

INSTANTIATE_TEST_SUITE_P(BlockOffload, ParamResidency, testing::Values("polite", "adversarial"));

TEST(BlockOffload, ParameterOffloadRefusesWhatItCannotCarryOut) {
  Deep m;
  auto runtime = make_runtime({});
  tb::BlockOffload offload(runtime);
  try {
    offload.offload_parameters(m.block_parameters(), tierflow::Tier::kNvme);
    FAIL() << "accepted the NVMe tier";
  } catch (const tierflow::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("accepted: host"), std::string::npos) << e.what();
  }
  offload.set_default_action(tb::BlockAction::kSwapHost);
  offload.offload_parameters(m.block_parameters());
  EXPECT_THROW(offload.offload_parameters(m.block_parameters()), tierflow::config_error) << "twice";
  try {  // the tier is named before "called twice"
    offload.offload_parameters(m.block_parameters(), tierflow::Tier::kNvme);
    FAIL() << "accepted the NVMe tier on a second call";
  } catch (const tierflow::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("tier 'nvme'"), std::string::npos) << e.what();
  }
  offload.set_action(2, tb::BlockAction::kKeep);  // its parameters are fetched: the next call of block 2 says so
  auto x = m.leaf * 2;
  for (std::size_t i = 0; i < 2; ++i) x = offload.forward(i, m.blocks[i], x);
  try {
    offload.forward(2, m.blocks[2], x);
    FAIL() << "kept a block whose parameters are fetched";
  } catch (const tierflow::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("block 2 is kKeep"), std::string::npos) << e.what();
  }
}

// ---- what a rerun restores (Note [C++ block offload]; Note [Replay side effects]) ---------------------------------

namespace {

// Blocks with BatchNorm: its running statistics are written by every forward in training.
struct NormModel {
  std::vector<torch::nn::Sequential> blocks;
  NormModel() {
    torch::manual_seed(5);
    for (int i = 0; i < 2; ++i)
      blocks.push_back(torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::BatchNorm1d(64),
                                             torch::nn::GELU(), torch::nn::Dropout(0.25)));
  }
  torch::Tensor loss(tb::BlockOffload* offload, const torch::Tensor& input) {
    auto x = input;
    for (std::size_t i = 0; i < blocks.size(); ++i) x = offload ? offload->forward(i, blocks[i], x) : blocks[i]->forward(x);
    return x.pow(2).mean();
  }
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> all;
    for (const auto& b : blocks) {
      for (const auto& p : b->parameters()) all.push_back(p.grad().clone());
      for (const auto& t : b->buffers()) all.push_back(t.clone());
    }
    return all;
  }
};

std::vector<torch::Tensor> train_norm_model(tb::BlockOffload* offload) {
  NormModel m;
  torch::manual_seed(3);
  const auto input = torch::randn({16, 64}, torch::requires_grad());
  for (int step = 0; step < 3; ++step) {
    for (const auto& b : m.blocks)
      for (auto& p : b->parameters()) p.mutable_grad() = torch::Tensor();
    m.loss(offload, input).backward();
  }
  return m.state();
}

}  // namespace

class RerunRestores : public testing::TestWithParam<Case> {};

TEST_P(RerunRestores, BatchNormStatisticsAreUpdatedOncePerForward) {
  // The rerun ran BatchNorm again: its batches counted twice, its running means off. Restored around the
  // rerun, every gradient and buffer (running_mean, running_var, num_batches_tracked) is the plain run's.
  const Case c = GetParam();
  const auto plain = train_norm_model(nullptr);
  tb::BlockOffload offload(make_runtime({{"emulated_device", c.device_mode}}));
  offload.set_default_action(c.action);
  const auto with = train_norm_model(&offload);
  offload.synchronize();
  ASSERT_EQ(plain.size(), with.size());
  for (std::size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], with[i])) << "tensor " << i;
  EXPECT_EQ(offload.stats().reruns, 6u);
  EXPECT_EQ(offload.restoring_reruns(), 6u);
  EXPECT_EQ(offload.not_replayed(0), "");
}

INSTANTIATE_TEST_SUITE_P(BlockOffload, RerunRestores,
                         testing::Values(Case{tb::BlockAction::kRecompute, "polite"},
                                         Case{tb::BlockAction::kSwapHost, "adversarial"}),
                         [](const testing::TestParamInfo<Case>& info) {
                           std::string name = std::string(tb::to_string(info.param.action)) + "_" +
                                              info.param.device_mode;
                           for (auto& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

TEST(BlockOffload, AWriteItsFirstCallDidNotMakeIsRefusedAndTheBlockKept) {
  // A block that writes a tensor only from its second call on: no value from before was copied, so its
  // reruns could not be exact; it is kept from its next call on, and says why.
  tb::BlockOffload offload(make_runtime({}));
  offload.set_default_action(tb::BlockAction::kRecompute);
  auto counter = torch::zeros({1});
  auto weight = torch::randn({8, 8}, torch::requires_grad());
  int calls = 0;
  const tb::BlockForward fn = [&](const at::Tensor& x) {
    if (++calls >= 2) counter.add_(1);  // not in its first call
    return torch::tanh(x.matmul(weight));
  };
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, 8}, torch::requires_grad());
    offload.forward(0, fn, x, {weight}, {counter}).sum().backward();
  }
  EXPECT_NE(offload.not_replayed(0).find("state tensor 0"), std::string::npos) << offload.not_replayed(0);
  EXPECT_EQ(offload.stats().kept, 1u);  // the third call
}

// Note [C++ auto activations]: TIERFLOW_OFFLOAD_ACTIVATIONS=auto profiles in forwards 1 and 2 (every block swapped
// to the host), plans before forward 3, and trains bit for bit as the plain blocks throughout.
struct AutoCase {
  const char* device_mode;
  const char* gpu_memory;
  bool moves;  // the plan moves a block off the device
};

class AutoActivations : public testing::TestWithParam<AutoCase> {};

TEST_P(AutoActivations, PlansByTheThirdForwardAndTrainsAsThePlainBlocks) {
  const AutoCase c = GetParam();
  Model m;
  const Outcome plain = run(m, nullptr, 4);
  tb::BlockOffload offload(make_runtime({{"emulated_device", c.device_mode},
                                         {"offload_activations", "auto"},
                                         {"gpu_memory", c.gpu_memory},
                                         {"prefetch_bytes", "256KiB"}}));
  ASSERT_TRUE(offload.plans_automatically());
  m.zero_grad();
  torch::manual_seed(11);
  // Two profiling forwards: every block swapped, no plan yet.
  for (int s = 0; s < 2; ++s) m.loss(&offload).backward();
  EXPECT_EQ(offload.activation_plan(), "") << "planned before the third forward";
  EXPECT_EQ(offload.stats().swapped_host, 6u);
  EXPECT_EQ(offload.stats().kept, 0u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(offload.action(i), tb::BlockAction::kSwapHost);

  Model again;
  const Outcome with = run(again, &offload, 4);
  expect_identical(plain, with);
  EXPECT_EQ(offload.forwards_counted(), 6);
  const std::string plan = offload.activation_plan();
  EXPECT_NE(plan, "") << "no plan by the third forward";
  std::size_t moved = 0;
  for (std::size_t i = 0; i < 3; ++i) moved += offload.action(i) != tb::BlockAction::kKeep;
  std::string lines;
  for (const auto& l : offload.activation_plan_lines()) lines += "\n  " + l;
  if (c.moves) {
    EXPECT_GT(moved, 0u) << plan << lines;
    EXPECT_LT(moved, 3u) << "a budget that holds one block's saved bytes keeps one: " << plan << lines;
  } else {
    EXPECT_EQ(moved, 0u) << plan << lines;
    EXPECT_EQ(offload.stats().kept, 3u * 4u) << "the plan's forwards keep every block";
  }
}

// The blocks' inputs are 128 KiB and each saves about 0.75 MiB more; 3 MiB holds the parameters, their gradients,
// one block's saved bytes and the working set, not three: counted without what the blocks save (their inputs
// alone), all three would fit.
INSTANTIATE_TEST_SUITE_P(BlockOffload, AutoActivations,
                         testing::Values(AutoCase{"polite", "8GiB", false}, AutoCase{"adversarial", "8GiB", false},
                                         AutoCase{"polite", "3MiB", true}, AutoCase{"adversarial", "3MiB", true}));

// Note [C++ auto activations]: a block the automatic plan keeps whose parameters are fetched from the host runs
// kRecompute (autograd would hold its weights), and trains as the blocks swapped by hand.
TEST(BlockOffload, AnAutoKeptBlockWithFetchedParametersIsRecomputed) {
  auto plain_runtime = make_runtime({{"emulated_device", "polite"}});
  tb::BlockOffload swapped(plain_runtime);
  swapped.set_default_action(tb::BlockAction::kSwapHost);
  tb::BlockOffload automatic(
      make_runtime({{"emulated_device", "polite"}, {"offload_activations", "auto"}, {"gpu_memory", "8GiB"}}));
  const Trained a = train_deep(&swapped, "polite", true);
  const Trained b = train_deep(&automatic, "polite", true);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i;
  for (std::size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << "param " << i;
  ASSERT_NE(automatic.activation_plan(), "");
  EXPECT_NE(automatic.activation_plan().find("0 swap"), std::string::npos) << automatic.activation_plan();
  const auto st = automatic.stats();
  EXPECT_EQ(st.recomputed, 8u) << "the third step's 8 kept blocks, their parameters fetched";
  EXPECT_EQ(st.kept, 0u);
  EXPECT_GT(automatic.parameter_stats().fetches, 0u);
}
