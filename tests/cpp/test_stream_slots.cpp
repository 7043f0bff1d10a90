// The gradient stream's bookkeeping without tensors (optimizer/stream_slots.hpp): DDP's reduced slots and their
// slices of a reduced bucket, when a backward's end runs, which masters the user's writes made stale (Note [Weight
// content]), the released gradients waiting for their copies, the copy each device's clip waits for, and the
// ledger's verdict on a user's clip (Note [Clip picked up]).
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>

#include "step_engine_fixture.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/optimizer/stream_slots.hpp"

namespace {

using namespace tierflow;
using namespace tierflow::optimizer;
using namespace tierflow::step_engine_test;

int kA = 0, kB = 0, kC = 0;  // three parameters' keys: their addresses

TEST(ReducedSlotsTest, SlicesFollowTheBucketOrderAndSkipOtherParameters) {
  ReducedSlots r;
  EXPECT_TRUE(r.empty());
  EXPECT_TRUE(r.add(&kA, 3));
  EXPECT_TRUE(r.add(&kB, 5));
  EXPECT_FALSE(r.add(&kA, 7));  // a parameter is added once
  EXPECT_EQ(r.slots(), (std::vector<std::size_t>{3, 5}));
  // kC is not reduced here; kB's result comes in another dtype (a user's hook): both step in step().
  const auto s = r.slices({{&kA, 4, true}, {&kC, 2, true}, {&kB, 3, true}}, {9, 1, true});
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].slot, 3u);
  EXPECT_EQ(s[0].offset, 0u);
  EXPECT_EQ(s[0].numel, 4u);
  EXPECT_EQ(s[1].slot, 5u);
  EXPECT_EQ(s[1].offset, 6u);
  EXPECT_EQ(s[1].numel, 3u);
  const auto other = r.slices({{&kA, 4, true}, {&kB, 3, false}}, {7, 1, true});
  ASSERT_EQ(other.size(), 1u);
  EXPECT_EQ(other[0].slot, 3u);
}

TEST(ReducedSlotsTest, RefusesABucketThatIsNotItsParametersOneAfterTheOther) {
  ReducedSlots r;
  r.add(&kA, 0);
  const std::vector<ReducedSlots::Member> members{{&kA, 4, true}, {&kB, 5, true}};
  try {
    r.slices(members, {8, 1, true});
    FAIL() << "a bucket of 8 elements for 9 was taken";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("one contiguous 1-D tensor of 9 elements"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("got 8 elements in 1 dimensions"), std::string::npos) << e.what();
  }
  EXPECT_THROW(r.slices(members, {9, 2, true}), logic_error);
  EXPECT_THROW(r.slices(members, {9, 1, false}), logic_error);
  EXPECT_EQ(r.slices(members, {9, 1, true}).size(), 1u);
}

TEST(BackwardEndsTest, QueuedOncePerBackwardFromTheAutogradThread) {
  BackwardEnds e;
  EXPECT_FALSE(e.queue(false));  // a reduction's thread never queues it
  EXPECT_TRUE(e.queue(true));
  EXPECT_FALSE(e.queue(true));   // the backward's later gradients
  e.ended();
  EXPECT_TRUE(e.queue(true));    // the next backward
  e.reset();                     // a failed backward never ran its end
  EXPECT_TRUE(e.queue(true));
}

TEST(BackwardEndsTest, RequeuedOnceAfterDdpsWriteBackOnlyWithReducedSlots) {
  BackwardEnds e;
  EXPECT_FALSE(e.requeue(false));  // no reduced slots: it ends at once
  EXPECT_TRUE(e.requeue(true));    // first run: after DDP's finalize_backward
  EXPECT_FALSE(e.requeue(true));   // the run queued again ends the backward
  EXPECT_TRUE(e.requeue(true));    // the next backward's first run
  e.reset();
  EXPECT_TRUE(e.requeue(true));
}

// Three slots with state; slot 1's gradient streams (an early step would read its master).
StepLedger ledger_with_streamed_slot() {
  StepLedgerOptions o;
  o.bucket_bytes = 1 << 20;
  StepLedger l(o);
  for (int i = 0; i < 3; ++i) l.add(64, 0, true);
  l.set_group(0, {});
  for (std::size_t i = 0; i < 3; ++i) l.state_set(i);
  l.backward_begins(1);
  EXPECT_EQ(l.arrive(1), GradArrival::kStream);
  EXPECT_FALSE(l.streamed(1, {101, 0, {}}, false));  // its bucket waits for the others
  EXPECT_TRUE(l.is_streamed(1));
  return l;
}

TEST(WrittenWeightsTest, AWrittenParameterStaysStaleUntilReReadAndTakesItsEarlyStepBack) {
  StepLedger l = ledger_with_streamed_slot();
  WrittenWeights w;
  w.resize(3);
  EXPECT_EQ(w.judge({false, false, false}, l), std::vector<std::size_t>{});
  EXPECT_EQ(w.judge({false, true, true}, l), (std::vector<std::size_t>{1, 2}));
  EXPECT_TRUE(w.stale(1));
  EXPECT_EQ(l.stats().taken_back, 1u);  // slot 1's early step read the old master; slot 2 had none
  EXPECT_EQ(w.judge({false, false, false}, l), (std::vector<std::size_t>{1, 2}));  // until re-read
  w.reread(1);
  EXPECT_FALSE(w.stale(1));
  EXPECT_EQ(w.judge({}, l), std::vector<std::size_t>{2});
}

TEST(StepLedgerClipRanTest, AClipOfOneKeepsTheStepsWhenTierflowClipsItselfAndIsLearnedOtherwise) {
  StepLedgerOptions clips;
  clips.max_grad_norm = 1.0;
  StepLedger own(clips);
  EXPECT_TRUE(own.clip_ran(5.0, 1.0));   // a norm read (max_norm=inf): nothing changed
  EXPECT_FALSE(own.clip_ran(5.0, 0.5));  // it changed them: stepped from p.grad
  StepLedger user{StepLedgerOptions{}};
  EXPECT_TRUE(user.clip_ran(2.0, 0.5));  // judged: a clip picked up
}

// A gradient copy whose completion the test scripts: not ready until opened; its first `stalls` waits throw
// stall_error, its first `failures` waits (after those) a copy error.
struct ScriptedCopy final : swap::detail::TransferState {
  swap::TransferHandle inner;
  std::atomic<bool> open{true};
  mutable std::atomic<int> stalls{0}, failures{0};
  explicit ScriptedCopy(swap::TransferHandle h) : inner(std::move(h)) {}
  bool ready() const override { return open && inner.ready(); }
  void wait() const override {
    if (stalls > 0 && stalls-- > 0) throw stall_error("a scripted copy stalled");
    inner.wait();
    if (failures > 0 && failures-- > 0) throw std::runtime_error("a scripted copy failed");
  }
  std::size_t bytes() const noexcept override { return inner.bytes(); }
};

class StreamSlotsEngineTest : public StepEngineTest {
 protected:
  // Every gradient copy from now on becomes a ScriptedCopy (`open` or not), kept in copies_made_ in stream order.
  void script_copies(bool open) {
    wrap_copy_ = [this, open](swap::TransferHandle h) {
      copies_made_.push_back(std::make_shared<ScriptedCopy>(std::move(h)));
      copies_made_.back()->open = open;
      return swap::TransferHandle(copies_made_.back());
    };
  }
  std::vector<std::shared_ptr<ScriptedCopy>> copies_made_;
};

TEST_P(StreamSlotsEngineTest, ReleasedGradientsGoOnceTheirCopyIsSeenComplete) {
  build(buckets_of(1 << 20), {16, 16, 16});  // one bucket
  script_copies(false);
  std::vector<std::size_t> held{2, 1, 0};  // the slots whose device gradient the front end holds
  std::function<bool(std::size_t)> holds = [&](std::size_t i) {
    return std::find(held.begin(), held.end(), i) != held.end();
  };
  backward(1.0f, true, true, false);  // released, streamed last slot first; the end not yet
  ReleasedGrads released;
  std::lock_guard<std::mutex> lock(engine_->mutex());
  for (std::size_t i : {2, 1, 0}) released.add(*engine_, i);
  EXPECT_EQ(engine_->counters().grads_released, 3u);
  EXPECT_TRUE(released.take_landed(*engine_, holds).empty());  // no copy is complete yet
  for (auto& c : copies_made_) {
    c->inner.wait();
    c->open = true;
  }
  held = {2, 0};  // slot 1's gradient went otherwise (the worker saw its copy land)
  EXPECT_EQ(released.take_landed(*engine_, holds), (std::vector<std::size_t>{2, 0}));
  EXPECT_TRUE(released.take_landed(*engine_, holds).empty());  // each slot once
  held = {2, 1, 0};  // slot 1, dropped when it was not held, is gone for good: never handed out later
  EXPECT_TRUE(released.take_landed(*engine_, holds).empty());
  const ReleasedGrads::Waited w = released.wait_all(*engine_);
  EXPECT_TRUE(w.stalled.empty());
  EXPECT_FALSE(w.stall);
}

TEST_P(StreamSlotsEngineTest, AStalledCopyIsNamedAndTheOthersAreStillWaitedFor) {
  build(buckets_of(1 << 20), {16, 16, 16, 16});  // one bucket, launched only when every slot is in
  script_copies(true);
  std::lock_guard<std::mutex> lock(engine_->mutex());
  engine_->backward_begins(now());
  ReleasedGrads released;
  for (std::size_t i : {3, 2, 1}) {  // slot 0 never comes: the worker never waits for these copies
    ASSERT_EQ(engine_->ledger().arrive(i), GradArrival::kStream);
    engine_->sync_buckets();
    const HostArray dst = engine_->stage_gradient(i, ScalarType::kFloat32, 64);
    ASSERT_TRUE(dst.defined());
    engine_->gradient_copied(i, wrap_copy_(copies_->copy(swap::Direction::kDeviceToHost, dst.data,
                                                         params_[i].grad.data(), 64, {},
                                                         swap::StreamRef::emulated_compute())));
    engine_->streamed(i, identity(i), true);
    released.add(*engine_, i);
  }
  copies_made_[0]->stalls = 1;    // slot 3's copy stalls once
  copies_made_[1]->failures = 1;  // slot 2's fails once: logged, its window is discarded
  copies_made_[2]->stalls = 1;    // slot 1's stalls too: the first stall is the one raised
  const ReleasedGrads::Waited w = released.wait_all(*engine_);
  EXPECT_EQ(w.stalled, (std::vector<std::size_t>{3, 1}));
  ASSERT_TRUE(w.stall);
  try {
    std::rethrow_exception(w.stall);
  } catch (const stall_error& e) {
    EXPECT_STREQ(e.what(), "a scripted copy stalled");
  }
  const std::function<bool(std::size_t)> all = [](std::size_t) { return true; };
  EXPECT_TRUE(released.take_landed(*engine_, all).empty());  // the list is empty
  engine_->end_window(false);
}

TEST_P(StreamSlotsEngineTest, TheClipWaitsPerDeviceForTheGradientCopySentLast) {
  build(buckets_of(1 << 20), {16, 16, 16, 16});
  backward(1.0f);  // copies sent from the last slot to the first: slot 0's is the last
  std::lock_guard<std::mutex> lock(engine_->mutex());
  const auto last = last_copied(*engine_, {{3, 1}, {2, 0}, {1, 1}, {0, 0}});
  ASSERT_EQ(last.size(), 2u);
  EXPECT_EQ(last[0], (std::pair<DeviceId, std::size_t>{1, 1}));  // devices in order of first appearance
  EXPECT_EQ(last[1], (std::pair<DeviceId, std::size_t>{0, 0}));
  EXPECT_EQ(last_copied(*engine_, {{3, 0}, {2, 0}}), (std::vector<std::pair<DeviceId, std::size_t>>{{0, 2}}));
  EXPECT_TRUE(last_copied(*engine_, {}).empty());
}

INSTANTIATE_TEST_SUITE_P(EmulatedDevice, StreamSlotsEngineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "adversarial" : "polite"; });

}  // namespace
