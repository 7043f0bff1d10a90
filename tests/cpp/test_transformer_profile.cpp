// The transformer estimate (Note [Transformer estimate]) and the plan it gives for the issue's preset.
#include <gtest/gtest.h>

#include <algorithm>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

TEST(TransformerProfile, SavedBytesPerClassMatchWhatTorchSaves) {
  // The shape checked against torch on the CPU (see the Note): 2080 saved bytes per token.
  TransformerShape s{1, 32, 4, 64, 2, 4, 16, 4};
  auto blocks = estimate_transformer(s, 1e12);
  ASSERT_EQ(blocks.size(), 1u);
  const auto& p = blocks[0];
  const std::uint64_t tokens = 128;
  EXPECT_EQ(p.input_bytes, tokens * 32 * 4);
  EXPECT_EQ(p.whole_bytes, tokens * (32 * 4 + 4 * 4));
  EXPECT_EQ(p.split_bytes, tokens * 7 * 32 * 4);
  EXPECT_EQ(p.cheap_bytes, tokens * (7 * 32 * 4 + 16));
  EXPECT_EQ(p.saved_bytes(), tokens * 2080);
}

TEST(TransformerProfile, TimesFollowTheFlops) {
  TransformerShape s{24, 2048, 16, 4096, 2, 2, 50304, 4};
  const double flops = 400e12;
  auto blocks = estimate_transformer(s, flops);
  ASSERT_EQ(blocks.size(), 24u);
  const double tokens = 8192, h = 2048;
  EXPECT_DOUBLE_EQ(blocks[0].forward_seconds, tokens * (24 * h * h + 2 * 4096 * h) / flops);
  EXPECT_DOUBLE_EQ(blocks[0].backward_seconds, 2 * blocks[0].forward_seconds);
  EXPECT_DOUBLE_EQ(blocks[0].split_recompute_seconds, tokens * 14 * h * h / flops);
  EXPECT_DOUBLE_EQ(blocks[0].cheap_recompute_seconds, tokens * 2 * h * h / flops);
  EXPECT_THROW(estimate_transformer(TransformerShape{24, 2048, 15, 4096, 2, 2, 50304, 4}, flops), config_error);
}

TEST(TransformerProfile, StateBytesPerOptimizerTier) {
  TransformerShape s{24, 2048, 16, 4096, 2, 2, 50304, 4};
  const std::uint64_t n = transformer_parameters(s);
  EXPECT_EQ(n, 50304ull * 2048 * 2 + 4096ull * 2048 + 24ull * (12ull * 2048 * 2048 + 13ull * 2048) + 2 * 2048);
  auto none = estimate_training_state(s, OffloadTarget::kNone);
  auto host = estimate_training_state(s, OffloadTarget::kHost);
  auto nvme = estimate_training_state(s, OffloadTarget::kNvme);
  EXPECT_EQ(none.device, 16 * n);  // bf16 params and grads, fp32 master, m, v
  EXPECT_EQ(host.device, 4 * n);
  EXPECT_EQ(host.host, 12 * n);
  EXPECT_EQ(nvme.nvme, 12 * n);
  EXPECT_EQ(nvme.host, 0u);
  s.dtype_bytes = 4;  // fp32 parameters are their own master
  EXPECT_EQ(estimate_training_state(s, OffloadTarget::kHost).host, 8 * transformer_parameters(s));
}

TEST(TransformerProfile, IssuePresetSplitsTokens) {
  // python -m tierflow plan --layers 24 --hidden 2048 --heads 16 --seq 4096 --batch 2 --dtype bf16
  //   --gpu-memory 16GiB --tflops 400 --pcie-gbps 55: MEMO's regime, the link hides part of the rows.
  TransformerShape s{24, 2048, 16, 4096, 2, 2, 50304, 4};
  auto blocks = estimate_transformer(s, 400e12);
  Links links{55e9, 55e9, 91e9, 0, 0};
  Budgets budgets;
  budgets.device_bytes = 16 * GiB;
  budgets.fixed_device_bytes = estimate_training_state(s, OffloadTarget::kHost).device + estimate_head_device_bytes(s);
  budgets.host_bytes = 64 * GiB;
  budgets.prefetch_bytes = 64 * MiB;
  Plan plan = plan_activations(blocks, links, budgets);
  EXPECT_TRUE(plan.fits);
  EXPECT_TRUE(plan.proven_optimal);
  EXPECT_LE(plan.predicted_device_peak_bytes, budgets.device_bytes);
  EXPECT_TRUE(std::any_of(plan.blocks.begin(), plan.blocks.end(), [](const BlockPlan& b) {
    return b.mode == BlockMode::kSplit && b.alpha > 0 && b.alpha < 1;
  })) << plan.summary();
}

}  // namespace
