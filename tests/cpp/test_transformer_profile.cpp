// The transformer estimate (Note [Transformer estimate]) and the plan it gives for the issue's preset.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>

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
  EXPECT_DOUBLE_EQ(blocks[0].cheap_recompute_seconds, tokens * (2 * h * h + 8 * h * h) / flops);  // proj, MLP down
  EXPECT_THROW(estimate_transformer(TransformerShape{24, 2048, 15, 4096, 2, 2, 50304, 4}, flops), config_error);
}

TEST(TransformerProfile, StateBytesPerOptimizerTier) {
  TransformerShape s{24, 2048, 16, 4096, 2, 2, 50304, 4};
  const std::uint64_t n = transformer_parameters(s);
  EXPECT_EQ(n, 50304ull * 2048 * 2 + 4096ull * 2048 + 24ull * (12ull * 2048 * 2048 + 13ull * 2048) + 2 * 2048);
  auto none = estimate_training_state(s, OffloadTarget::kNone);
  auto host = estimate_training_state(s, OffloadTarget::kHost);
  auto nvme = estimate_training_state(s, OffloadTarget::kNvme);
  EXPECT_EQ(none.device, 8 * n);  // bf16 params and grads, torch AdamW's m and v in bf16 (zeros_like): no master
  EXPECT_EQ(none.optimizer_bytes, 4 * n);
  EXPECT_EQ(host.device, 4 * n);
  EXPECT_EQ(host.host, 12 * n);
  EXPECT_EQ(nvme.nvme, 12 * n);
  EXPECT_EQ(nvme.host, 0u);
  EXPECT_EQ(host.optimizer_bytes, 12 * n) << "tierflow's CPU AdamW: fp32 master, m and v";
  s.dtype_bytes = 4;  // fp32 parameters keep a host master too: the parameter is the device's (as measured)
  EXPECT_EQ(estimate_training_state(s, OffloadTarget::kHost).host, 12 * transformer_parameters(s));
  EXPECT_EQ(estimate_training_state(s, OffloadTarget::kNone).device, 16 * transformer_parameters(s));
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

// ---- issue 16: a shape is checked before anything is built, its arithmetic for overflow ----

namespace {

std::string shape_error(const TransformerShape& s) {
  try {
    check_transformer_shape(s);
  } catch (const config_error& e) {
    EXPECT_THROW(estimate_transformer(s, 1e12), config_error);
    EXPECT_THROW(transformer_parameters(s), config_error);
    EXPECT_THROW(estimate_head_device_bytes(s), config_error);
    EXPECT_THROW(estimate_training_state(s, OffloadTarget::kNvme), config_error);
    return e.what();
  }
  ADD_FAILURE() << "shape accepted";
  return {};
}

TEST(TransformerShapeIssue16, TokensOverflowIsAnErrorNotZeroBytes) {
  // seq 64 x batch 2^57 wrapped to 0 tokens: `plan` exited 0 with 0 B of activations (UBSan: signed overflow).
  TransformerShape s{2, 64, 4, 64, std::int64_t{1} << 57, 2, 50304, 4};
  EXPECT_THROW(s.tokens(), config_error);
  EXPECT_NE(shape_error(s).find("batch"), std::string::npos);
  TransformerShape t{2, 64, 4, std::int64_t{1} << 40, std::int64_t{1} << 40, 2, 50304, 4};
  EXPECT_THROW(t.tokens(), config_error);
}

TEST(TransformerShapeIssue16, ByteCountsThatOverflowAreRefused) {
  // Every field within its limits, but tokens x hidden x bytes past 64 bits.
  TransformerShape s{4, 1 << 20, 4, 1 << 24, 1 << 24, 2, 50304, 4};
  const std::string msg = shape_error(s);
  EXPECT_NE(msg.find("overflow 64 bits"), std::string::npos) << msg;
  EXPECT_NE(msg.find("seq 16777216"), std::string::npos) << msg;
  // The parameters: vocab x hidden at their limits fits, but with 10000 layers of hidden 2^20 it does not.
  TransformerShape p{10000, 1 << 20, 1 << 10, 1, 1, 4, 1 << 24, 64};
  EXPECT_NE(shape_error(p).find("overflow 64 bits"), std::string::npos);
  // The head: tokens x vocab x fp32.
  TransformerShape h{1, 64, 4, 1 << 24, 1 << 24, 4, 1 << 24, 1};
  EXPECT_NE(shape_error(h).find("overflow 64 bits"), std::string::npos);
}

TEST(TransformerShapeIssue16, FieldsPastTheirLimitsAreRefusedBeforeBuilding) {
  const auto& limits = transformer_shape_limits();
  ASSERT_EQ(limits.size(), 7u);
  EXPECT_EQ(limits[0].field, "layers");
  EXPECT_EQ(limits[0].max, 10000);
  // --layers 1e9 was std::bad_alloc and 1e7 took 44 s and 3 GB before refusing: now refused at once.
  TransformerShape big{1000000000, 64, 4, 8, 1, 2, 1000, 4};
  const std::string msg = shape_error(big);
  EXPECT_NE(msg.find("layers 1000000000 is not valid; accepted: an integer from 1 to 10000"), std::string::npos)
      << msg;
  for (int field = 0; field < 7; ++field) {
    TransformerShape s{2, 64, 4, 8, 1, 2, 1000, 4};
    std::int64_t* fields64[] = {nullptr, nullptr, nullptr, &s.seq, &s.batch, &s.vocab, nullptr};
    int* fields32[] = {&s.layers, &s.hidden, &s.heads, nullptr, nullptr, nullptr, &s.ffn_mult};
    for (std::int64_t v : {std::int64_t{0}, std::int64_t{-1}, limits[field].max + 1}) {
      if (fields64[field]) *fields64[field] = v;
      else *fields32[field] = static_cast<int>(v);
      EXPECT_NE(shape_error(s).find(std::string(limits[field].field) + " " + std::to_string(v)), std::string::npos)
          << limits[field].field << " " << v;
    }
  }
  // At the limits, nothing overflows and the estimate is built.
  TransformerShape edge{10000, 1024, 16, 8, 1, 2, 1 << 24, 4};
  EXPECT_EQ(estimate_transformer(edge, 1e12).size(), 10000u);
}

TEST(TransformerShapeIssue16, FlopsMustBeFinite) {
  TransformerShape s{2, 64, 4, 8, 1, 2, 1000, 4};
  for (double f : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()})
    EXPECT_THROW(estimate_transformer(s, f), config_error) << f;
}

}  // namespace
