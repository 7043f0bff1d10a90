// optimizer::StepLedger with reduced gradients (Note [Step ledger], "Reduced
// gradients"; DDP in Note [Distributed training]): the local gradient never
// streams, the reduced one does and is confirmed once rebound to what p.grad
// became; no_sync accumulation; the reduction seen before the local gradient;
// a later change takes the step back.
#include <gtest/gtest.h>

#include <vector>

#include "tierflow/optimizer/step_ledger.hpp"

namespace {

using tierflow::optimizer::Confirmation;
using tierflow::optimizer::GradArrival;
using tierflow::optimizer::GradIdentity;
using tierflow::optimizer::Landed;
using tierflow::optimizer::StepLedger;
using tierflow::optimizer::StepLedgerOptions;

constexpr std::size_t kBytes = 64;

// Slot i's gradient has the bytes {i + 1, 0} (Note [Gradient content]): the reduced ones as streamed and written back.
tierflow::optimizer::GradContent bytes_of(std::size_t slot) { return {slot + 1, 0, true}; }
GradIdentity local_grad(std::size_t slot, std::int64_t version = 0) { return {100 + slot, version, bytes_of(slot)}; }
GradIdentity written_back(std::size_t slot) { return {100 + slot, 1, bytes_of(slot)}; }  // DDP's copy_ bumps it

// n reduced slots with state, one bucket.
StepLedger make_reduced(std::size_t n, StepLedgerOptions o = {}) {
  o.bucket_bytes = n * kBytes;
  StepLedger l(o);
  for (std::size_t i = 0; i < n; ++i) l.add(kBytes, 0, true);
  l.set_group(0, {});
  for (std::size_t i = 0; i < n; ++i) {
    l.state_set(i);
    l.set_reduced(i, true);
  }
  return l;
}

// Streams `slot`'s reduced gradient (its identity is unknown until rebind); true when that filled its bucket.
bool stream_reduced(StepLedger& l, std::size_t slot) {
  EXPECT_EQ(l.arrive_reduced(slot), GradArrival::kStream) << slot;
  EXPECT_TRUE(l.may_stream(slot)) << slot;
  return l.streamed(slot, GradIdentity{0, 0, bytes_of(slot)}, false);
}

void land_and_step(StepLedger& l, std::size_t bucket) {
  const auto gen = l.generation();
  const auto slots = l.launch(bucket);
  ASSERT_EQ(l.landed(gen, slots, 0.0), Landed::kStep);
  l.stepped_early(gen, slots, std::vector<bool>(slots.size(), false));
}

TEST(StepLedgerReduced, TheLocalGradientNeverStreamsTheReboundReducedOneCommits) {
  StepLedger l = make_reduced(2);
  l.backward_begins(0);
  EXPECT_EQ(l.arrive(1), GradArrival::kIgnore);  // local: counted only
  EXPECT_EQ(l.arrive(0), GradArrival::kIgnore);
  EXPECT_FALSE(stream_reduced(l, 1));
  EXPECT_TRUE(stream_reduced(l, 0));
  land_and_step(l, 0);
  // DDP writes the reduced values into p.grad after the reduction: until rebound, nothing matches.
  EXPECT_TRUE(l.rebind(0, written_back(0)));
  l.backward_ends(10);
  EXPECT_EQ(l.confirm(0, written_back(0), 1.0, false).kind, Confirmation::kCommit);
  EXPECT_EQ(l.confirm(1, written_back(1), 1.0, false).kind, Confirmation::kUnhandled);  // never rebound
  l.end_window(false);
  const auto s = l.stats();
  EXPECT_EQ(s.early_steps, 2u);
  EXPECT_EQ(s.committed, 1u);
  EXPECT_EQ(s.redone, 1u);
}

TEST(StepLedgerReduced, ABindingClipRedoesFromTheLandedReducedGradient) {
  StepLedger l = make_reduced(1);
  l.backward_begins(0);
  l.arrive(0);
  stream_reduced(l, 0);
  land_and_step(l, 0);
  l.rebind(0, written_back(0));
  const Confirmation c = l.confirm(0, written_back(0), 0.5, false);
  EXPECT_EQ(c.kind, Confirmation::kRedo);
  EXPECT_EQ(c.scale, 0.5);
}

TEST(StepLedgerReduced, NoSyncBackwardsAccumulateAndTheReducingOneStreams) {
  StepLedger l = make_reduced(1);  // accumulation_steps = 1: the reducing backward streams all the same
  l.backward_begins(0);            // under no_sync: a local gradient, no reduction
  EXPECT_EQ(l.arrive(0), GradArrival::kIgnore);
  l.backward_ends(1);
  l.backward_begins(2);  // the reducing backward
  EXPECT_EQ(l.arrive(0), GradArrival::kIgnore);
  EXPECT_TRUE(stream_reduced(l, 0));
  land_and_step(l, 0);
  EXPECT_TRUE(l.rebind(0, written_back(0)));
  l.backward_ends(3);
  EXPECT_EQ(l.confirm(0, written_back(0), 1.0, false).kind, Confirmation::kCommit);
}

TEST(StepLedgerReduced, ReducedBeforeTheNthLocalBackwardIsNotStreamed) {
  StepLedgerOptions o;
  o.accumulation_steps = 2;  // the reduction of the first backward is not the last one
  StepLedger l = make_reduced(1, o);
  l.backward_begins(0);
  l.arrive(0);
  EXPECT_EQ(l.arrive_reduced(0), GradArrival::kIgnore);
  l.backward_ends(1);
  l.backward_begins(2);
  l.arrive(0);
  EXPECT_EQ(l.arrive_reduced(0), GradArrival::kStream);
}

TEST(StepLedgerReduced, TheReductionSeenBeforeTheLocalGradientStreamsAndTheLocalOneIsNoChange) {
  StepLedger l = make_reduced(1);
  l.backward_begins(0);
  EXPECT_TRUE(stream_reduced(l, 0));  // the reduction implies this backward's local gradient
  EXPECT_EQ(l.arrive(0), GradArrival::kIgnore);  // the same backward's: not a change
  land_and_step(l, 0);
  EXPECT_TRUE(l.rebind(0, written_back(0)));
  l.backward_ends(1);
  EXPECT_EQ(l.confirm(0, written_back(0), 1.0, false).kind, Confirmation::kCommit);
}

TEST(StepLedgerReduced, ALaterBackwardOrASecondReductionTakesTheStepBack) {
  StepLedger l = make_reduced(2);
  l.backward_begins(0);
  for (std::size_t i : {1u, 0u}) {
    l.arrive(i);
    stream_reduced(l, i);
  }
  land_and_step(l, 0);
  l.rebind(0, written_back(0));
  l.rebind(1, written_back(1));
  l.backward_ends(1);
  l.backward_begins(2);  // another backward before step(), under no_sync: slot 0's local gradient changes
  EXPECT_EQ(l.arrive(0), GradArrival::kTakeBack);
  EXPECT_FALSE(l.rebind(0, written_back(0)));  // nothing of this backward streamed
  EXPECT_EQ(l.arrive(1), GradArrival::kTakeBack);
  EXPECT_EQ(l.arrive_reduced(1), GradArrival::kTakeBack);  // reduced again, already taken back: no stream
  l.backward_ends(3);
  EXPECT_EQ(l.confirm(0, {100, 2}, 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.stats().committed, 0u);
  EXPECT_EQ(l.stats().taken_back, 2u);
}

TEST(StepLedgerReduced, OnlyReducedSlotsTakeReducedGradientsAndRebinding) {
  StepLedger l = make_reduced(2);
  l.set_reduced(1, false);  // not reduced by DDP: streams its local gradient
  l.backward_begins(0);
  EXPECT_EQ(l.arrive_reduced(1), GradArrival::kIgnore);
  EXPECT_EQ(l.arrive(1), GradArrival::kStream);
  l.streamed(1, local_grad(1), false);
  EXPECT_FALSE(l.rebind(1, written_back(1)));
  EXPECT_FALSE(l.rebind(0, written_back(0)));  // reduced, but nothing streamed
}

}  // namespace

namespace {

// FSDP2 (Note [Distributed training]): shards have no local arrival at all; the reductions' order cuts the buckets.
TEST(StepLedgerReduced, ReducedOnlySlotsAreBucketedInTheOrderTheirReductionsCame) {
  StepLedgerOptions o;
  o.bucket_bytes = kBytes;  // one slot per bucket
  StepLedger l(o);
  for (std::size_t i = 0; i < 3; ++i) l.add(kBytes, 0, true);
  l.set_group(0, {});
  for (std::size_t i = 0; i < 3; ++i) {
    l.state_set(i);
    l.set_reduced(i, true);
  }
  l.backward_begins(0);
  for (std::size_t slot : {1, 0, 2}) {
    EXPECT_EQ(l.arrive_reduced(slot), GradArrival::kStream) << slot;  // no local arrival counted: one backward
    ASSERT_TRUE(l.may_stream(slot));
    l.streamed(slot, GradIdentity{0, 0, bytes_of(slot)}, false);
  }
  // Planned at the first reduction: it first, then the rest in the reverse of registration.
  EXPECT_EQ(l.bucket_of(1), 0u);
  EXPECT_EQ(l.bucket_of(2), 1u);
  EXPECT_EQ(l.bucket_of(0), 2u);
  l.backward_ends(1);
  l.end_window(true);
  EXPECT_EQ(l.bucket_of(1), 0u);  // then the reductions' order
  EXPECT_EQ(l.bucket_of(0), 1u);
  EXPECT_EQ(l.bucket_of(2), 2u);
}

}  // namespace
