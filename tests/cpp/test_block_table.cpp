// tiering::BlockTable (Note [Block table]): the classes of a block's saved tensors, which attention ops are
// restored and which matmuls split, the probe's exact rows, and what the planner measures.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "tierflow/tiering/block_table.hpp"

using namespace tierflow::tiering;

namespace {

// A transformer block as the recorder sees it: a norm, a q/k/v matmul, attention (output and a statistic),
// an MLP matmul, a pointwise op.
struct Block {
  BlockTable table;
  std::size_t norm, qkv, attention, mlp, gelu;
  Block() {
    norm = table.add_op(RecordedOp{OpKind::kOther, 10, 0, {64}});
    qkv = table.add_op(RecordedOp{OpKind::kMatmul, 600, 64, {192}});
    attention = table.add_op(RecordedOp{OpKind::kAttention, 400, 0, {64, 8, -1}});
    mlp = table.add_op(RecordedOp{OpKind::kMatmul, 800, 64, {256}});
    gelu = table.add_op(RecordedOp{OpKind::kOther, 5, 0, {256}});
  }
};

}  // namespace

TEST(BlockTable, ProducedTensorsTakeTheirClassFromTheOp) {
  Block b;
  b.table.add_saved(SavedClass::kExternal, 4096, true);
  b.table.add_saved(SavedClass::kInput, 256, true);
  b.table.add_produced(b.norm, 0, 256, true, false);
  b.table.add_produced(b.qkv, 0, 768, true, false);
  b.table.add_produced(b.attention, 0, 256, true, false);
  b.table.add_produced(b.attention, 1, 32, true, false);
  const auto& s = b.table.saved();
  ASSERT_EQ(s.size(), 6u);
  EXPECT_EQ(s[0].cls, SavedClass::kExternal);
  EXPECT_EQ(s[1].cls, SavedClass::kInput);
  EXPECT_EQ(s[2].cls, SavedClass::kCheap);
  EXPECT_EQ(s[3].cls, SavedClass::kSplit);
  EXPECT_EQ(s[4].cls, SavedClass::kAttention);
  EXPECT_EQ(s[4].op, static_cast<std::int64_t>(b.attention));
  EXPECT_EQ(s[5].out, 1);
  EXPECT_TRUE(b.table.mutated_ops().empty());
}

TEST(BlockTable, RefusesAProducedClassWithoutAnOpAndAnOpNotRecorded) {
  BlockTable t;
  EXPECT_THROW(t.add_saved(SavedClass::kSplit, 8, true), std::logic_error);
  EXPECT_THROW(t.add_produced(0, 0, 8, true, false), std::logic_error);
}

TEST(BlockTable, AttentionWithEveryNonEmptyOutputSavedIsRestorable) {
  Block b;
  b.table.add_produced(b.attention, 0, 256, true, false);
  b.table.add_produced(b.attention, 1, 32, true, false);  // output 2 is not a tensor: nothing to save
  b.table.finish();
  EXPECT_EQ(b.table.restorable(), std::set<std::size_t>{b.attention});
  EXPECT_EQ(b.table.saved()[0].cls, SavedClass::kAttention);
  EXPECT_EQ(b.table.actions(BlockMode::kSplit),
            (std::vector<SavedAction>{SavedAction::kSwap, SavedAction::kSwap}));
}

TEST(BlockTable, AttentionWithAnOutputNotSavedIsCheap) {
  Block b;
  b.table.add_produced(b.attention, 0, 256, true, false);  // the statistic (output 1) is not saved
  b.table.finish();
  EXPECT_TRUE(b.table.restorable().empty());
  EXPECT_EQ(b.table.saved()[0].cls, SavedClass::kCheap);
  EXPECT_EQ(b.table.actions(BlockMode::kSplit), std::vector<SavedAction>{SavedAction::kRecompute});
}

TEST(BlockTable, AnEmptyAttentionOutputNeedsNoSave) {
  BlockTable t;
  const auto a = t.add_op(RecordedOp{OpKind::kAttention, 1, 0, {64, 0}});
  t.add_produced(a, 0, 256, true, false);
  t.finish();
  EXPECT_EQ(t.restorable(), std::set<std::size_t>{a});
}

TEST(BlockTable, AMatmulWrittenInPlaceNeverSplitsAndTheOthersStill) {
  Block b;
  b.table.add_produced(b.qkv, 0, 768, true, /*mutated=*/true);
  b.table.add_produced(b.mlp, 0, 1024, true, false);
  b.table.finish();
  EXPECT_EQ(b.table.mutated_ops(), std::set<std::size_t>{b.qkv});
  EXPECT_EQ(b.table.split_ops(), std::set<std::size_t>{b.mlp});
  EXPECT_EQ(b.table.saved()[0].cls, SavedClass::kCheap);
  EXPECT_EQ(b.table.saved()[1].cls, SavedClass::kSplit);
}

TEST(BlockTable, AMatmulWithBothAMutatedAndACleanSaveIsRerunWhole) {
  Block b;
  b.table.add_produced(b.qkv, 0, 768, true, false);
  b.table.add_produced(b.qkv, 0, 768, false, /*mutated=*/true);
  b.table.finish();
  EXPECT_TRUE(b.table.split_ops().empty());
  EXPECT_EQ(b.table.saved()[0].cls, SavedClass::kCheap);  // reclassified by finish
}

TEST(BlockTable, ProbeSetsExactRowsAndAsksOnlyForAProperSuffix) {
  Block b;
  b.table.add_produced(b.qkv, 0, 768, true, false);
  b.table.add_produced(b.mlp, 0, 1024, true, false);
  b.table.finish();
  std::vector<std::pair<std::size_t, std::int64_t>> asked;
  // The device says the MLP's suffix matmul differs from the full one.
  const bool any = b.table.probe(0.5, 8, [&](std::size_t op, std::int64_t r0) {
    asked.emplace_back(op, r0);
    return op == b.qkv;
  });
  EXPECT_TRUE(any);
  EXPECT_EQ(asked, (std::vector<std::pair<std::size_t, std::int64_t>>{{b.qkv, 32}, {b.mlp, 32}}));
  EXPECT_EQ(b.table.exact_rows(), (std::map<std::size_t, std::int64_t>{{b.qkv, 32}}));
  EXPECT_EQ(b.table.actions(BlockMode::kSplit),
            (std::vector<SavedAction>{SavedAction::kSwapRows, SavedAction::kRecompute}));
  // Whole outputs need no probe; no rows at all are not a split.
  asked.clear();
  EXPECT_TRUE(b.table.probe(1.0, 8, [&](std::size_t op, std::int64_t r0) {
    asked.emplace_back(op, r0);
    return false;
  }));
  EXPECT_TRUE(asked.empty());
  EXPECT_EQ(b.table.exact_rows().size(), 2u);
  EXPECT_FALSE(b.table.probe(0.05, 8, [](std::size_t, std::int64_t) { return true; }));  // 3 rows < granule
  EXPECT_TRUE(b.table.exact_rows().empty());
  EXPECT_EQ(b.table.actions(BlockMode::kSplit),
            (std::vector<SavedAction>{SavedAction::kRecompute, SavedAction::kRecompute}));
}

TEST(BlockTable, BytesCountFirstSavesAndFlopsCountRestoredAndSplitOps) {
  Block b;
  b.table.add_saved(SavedClass::kExternal, 4096, true);
  b.table.add_saved(SavedClass::kInput, 256, true);
  b.table.add_saved(SavedClass::kInput, 256, false);  // the same storage saved again
  b.table.add_produced(b.norm, 0, 100, true, false);
  b.table.add_produced(b.qkv, 0, 768, true, false);
  b.table.add_produced(b.attention, 0, 256, true, false);
  b.table.add_produced(b.attention, 1, 32, true, false);
  b.table.add_produced(b.mlp, 0, 1024, true, true);  // mutated: cheap
  b.table.finish();
  const ClassBytes bytes = b.table.bytes_by_class();
  EXPECT_EQ(bytes.input, 256u);
  EXPECT_EQ(bytes.attention, 288u);
  EXPECT_EQ(bytes.split, 768u);
  EXPECT_EQ(bytes.cheap, 1124u);
  const ClassFlops flops = b.table.flops_by_class();
  EXPECT_DOUBLE_EQ(flops.attention, 400);
  EXPECT_DOUBLE_EQ(flops.split, 600);
  EXPECT_DOUBLE_EQ(flops.total, 1815);
  const BlockRecord r = b.table.record(0.25);
  EXPECT_EQ(r.input_bytes, 256u);
  EXPECT_EQ(r.cheap_bytes, 1124u);
  EXPECT_DOUBLE_EQ(r.split_flops, 600);
  EXPECT_TRUE(r.has_split_ops);
  EXPECT_DOUBLE_EQ(r.forward_seconds, 0.25);
}

TEST(BlockTable, ActionsFollowTheModeForEveryClass) {
  Block b;
  b.table.add_saved(SavedClass::kExternal, 8, true);
  b.table.add_saved(SavedClass::kInput, 8, true);
  b.table.add_produced(b.gelu, 0, 8, true, false);
  b.table.finish();
  EXPECT_EQ(b.table.actions(BlockMode::kKeep), std::vector<SavedAction>(3, SavedAction::kReference));
  EXPECT_EQ(b.table.actions(BlockMode::kSwap),
            (std::vector<SavedAction>{SavedAction::kReference, SavedAction::kSwap, SavedAction::kSwap}));
  EXPECT_EQ(b.table.actions(BlockMode::kRecompute),
            (std::vector<SavedAction>{SavedAction::kReference, SavedAction::kSwap, SavedAction::kRecompute}));
}
