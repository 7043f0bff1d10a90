// The recorder's rules (Note [Block table]): an attention op's kind and FLOPs, when a matmul may split by rows,
// and the names of the planner's enums as Python passes them.
#include <gtest/gtest.h>

#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/block_table.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/saved_actions.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

using namespace tierflow::tiering;

TEST(RecorderRules, AttentionWithDropoutIsRecordedAsOther) {
  EXPECT_EQ(attention_kind(0.0), OpKind::kAttention);
  EXPECT_EQ(attention_kind(0.1), OpKind::kOther);  // it draws from the generator: run again in the replay
}

TEST(RecorderRules, AttentionFlopsHalveWhenCausal) {
  EXPECT_DOUBLE_EQ(attention_flops(2 * 8 * 128 * 64, 128, false), 4.0 * 2 * 8 * 128 * 64 * 128);
  EXPECT_DOUBLE_EQ(attention_flops(2 * 8 * 128 * 64, 128, true), 2.0 * 2 * 8 * 128 * 64 * 128);
}

namespace {
const MatmulOperand kActivation{{64, 32}, {32, 1}, false};
const MatmulOperand kWeight{{32, 96}, {1, 32}, true};
}  // namespace

TEST(RecorderRules, ActivationByParametersSplitsByRows) {
  const auto r = row_matmul(kActivation, kWeight, true);
  EXPECT_EQ(r.kind, OpKind::kMatmul);
  EXPECT_EQ(r.rows, 64);
  EXPECT_DOUBLE_EQ(r.flops, 2.0 * 64 * 32 * 96);
}

TEST(RecorderRules, EachConditionOfARowSplitIsNeeded) {
  auto other = [](const MatmulOperand& m1, const MatmulOperand& m2, bool out_ok) {
    const auto r = row_matmul(m1, m2, out_ok);
    EXPECT_DOUBLE_EQ(r.flops, 2.0 * static_cast<double>(m1.sizes[0] * m1.sizes[1] * m2.sizes[1]));
    return r.kind == OpKind::kOther && r.rows == 0;
  };
  EXPECT_TRUE(other(kActivation, kWeight, false));                         // output not contiguous at 0
  EXPECT_TRUE(other({{64, 32}, {1, 64}, false}, kWeight, true));           // m1 column-major
  EXPECT_TRUE(other({{64, 32}, {64, 1}, false}, kWeight, true));           // m1 rows padded
  EXPECT_TRUE(other({{1, 32}, {32, 1}, false}, kWeight, true));            // one row
  EXPECT_TRUE(other({{64, 32}, {32, 1}, true}, kWeight, true));            // m1 from parameters
  EXPECT_TRUE(other(kActivation, {{32, 96}, {96, 1}, false}, true));       // m2 an activation
  EXPECT_THROW(row_matmul({{64}, {1}, false}, kWeight, true), tierflow::logic_error);
}

TEST(RecorderRules, BatchedMatmulFlops) { EXPECT_DOUBLE_EQ(batched_matmul_flops(4 * 64 * 32, 16), 2.0 * 4 * 64 * 32 * 16); }

TEST(EnumNames, ParseWhatToStringWrites) {
  for (auto k : {OpKind::kAttention, OpKind::kMatmul, OpKind::kOther}) EXPECT_EQ(parse_op_kind(to_string(k)), k);
  for (auto m : {BlockMode::kKeep, BlockMode::kSwap, BlockMode::kSplit, BlockMode::kRecompute})
    EXPECT_EQ(parse_block_mode(to_string(m)), m);
  for (auto c : {SavedClass::kExternal, SavedClass::kInput, SavedClass::kAttention, SavedClass::kSplit,
                 SavedClass::kCheap})
    EXPECT_EQ(parse_saved_class(to_string(c)), c);
  EXPECT_EQ(parse_optimizer_placement("nvme"), tierflow::OffloadTarget::kNvme);
}

TEST(EnumNames, AnUnknownNameSaysWhatIsAccepted) {
  auto message = [](auto parse, const char* text) {
    try {
      parse(text);
    } catch (const tierflow::config_error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(parse_op_kind, "conv"), "op kind 'conv'; accepted: attention, matmul, other");
  EXPECT_EQ(message(parse_block_mode, "drop"), "block mode 'drop'; accepted: keep, swap, split, recompute");
  EXPECT_EQ(message(parse_saved_class, "x"), "saved-tensor class 'x'; accepted: external, input, attention, split, cheap");
  EXPECT_EQ(message(parse_optimizer_placement, "auto"), "optimizer placement 'auto' is not one of none, host, nvme");
}
