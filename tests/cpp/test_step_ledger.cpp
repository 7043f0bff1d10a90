// optimizer::StepLedger (Note [Step ledger]): every path of the step during
// backward that the Python suites exercise through torch, decided without
// torch: commit, redo under a binding clip, the inf/NaN stop, accumulation, a
// forward before step(), hyperparameters changed between steps, the user's
// clip picked up, late buckets of an ended window, bucket plans and sizing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
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

// A gradient tensor as the ledger sees it: slot i's is id 100 + i at `version`, with bytes `bytes` (the same
// unless a test changes them; Note [Gradient content]).
GradIdentity grad_of(std::size_t slot, std::int64_t version = 0, std::uint64_t bytes = 0) {
  return {100 + slot, version, {slot + 1, bytes, true}};
}

// n slots of kBytes in group 0, with state, buckets of `per_bucket` slots.
StepLedger make(std::size_t n, StepLedgerOptions o = {}, std::size_t per_bucket = 2) {
  if (o.bucket_bytes == 0) o.bucket_bytes = per_bucket * kBytes;
  StepLedger l(o);
  for (std::size_t i = 0; i < n; ++i) l.add(kBytes, 0, true);
  l.set_group(0, {});
  for (std::size_t i = 0; i < n; ++i) l.state_set(i);
  return l;
}

// Backward delivers every slot's gradient, last registered first; each streams.
// Returns the buckets that completed, in order.
std::vector<std::size_t> backward(StepLedger& l, bool released = false) {
  std::vector<std::size_t> full;
  l.backward_begins(1000);
  for (std::size_t i = l.size(); i-- > 0;) {
    if (l.arrive(i) != GradArrival::kStream || !l.may_stream(i)) continue;
    if (l.streamed(i, grad_of(i), released)) full.push_back(l.bucket_of(i));
  }
  return full;
}

// The worker: launches, lands and steps every completed bucket; returns what landed said.
std::vector<Landed> work(StepLedger& l, const std::vector<std::size_t>& buckets, double sum_sq_each = 0.0) {
  std::vector<Landed> out;
  for (std::size_t b : buckets) {
    const std::uint64_t gen = l.generation();
    const auto slots = l.launch(b);
    const Landed next = l.landed(gen, slots, sum_sq_each);
    if (next == Landed::kStep) l.stepped_early(gen, slots, std::vector<bool>(slots.size(), false));
    out.push_back(next);
  }
  return out;
}

TEST(StepLedger, BucketsFollowReverseRegistrationThenTheObservedOrder) {
  StepLedger l = make(4);
  l.backward_begins(0);
  EXPECT_EQ(l.arrive(3), GradArrival::kStream);  // plans at the first gradient
  EXPECT_EQ(l.bucket_count(), 2u);
  EXPECT_EQ(l.bucket_of(3), 0u);
  EXPECT_EQ(l.bucket_of(2), 0u);
  EXPECT_EQ(l.bucket_of(1), 1u);
  EXPECT_EQ(l.offset_of(3), 0u);
  EXPECT_EQ(l.offset_of(2), kBytes);
  // This backward delivers the others in registration order: 3, 0, 1, 2.
  for (std::size_t i : {0u, 1u, 2u}) l.arrive(i);
  l.backward_ends(10);
  const auto plan = l.plan_id();
  l.end_window(true);
  EXPECT_NE(l.plan_id(), plan);  // re-cut once, in the order observed
  EXPECT_EQ(l.bucket_of(3), 0u);
  EXPECT_EQ(l.bucket_of(0), 0u);
  EXPECT_EQ(l.bucket_of(1), 1u);
  EXPECT_EQ(l.offset_of(0), kBytes);
  // Weights go back in forward order: the bucket filled last first, back to front.
  EXPECT_EQ(l.forward_order({0, 1, 2, 3}), (std::vector<std::size_t>{2, 1, 0, 3}));
  const auto again = l.plan_id();
  l.arrive(0);
  l.end_window(true);
  EXPECT_EQ(l.plan_id(), again);  // only the first observed order re-cuts
}

TEST(StepLedger, CommitsEarlyStepsWhoseGradientsAreUnchanged) {
  StepLedger l = make(4);
  const auto full = backward(l);
  EXPECT_EQ(full, (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(work(l, full), (std::vector<Landed>{Landed::kStep, Landed::kStep}));
  l.backward_ends(2000);
  EXPECT_TRUE(l.has_unconfirmed());
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(l.confirm(i, grad_of(i), 1.0, false).kind, Confirmation::kCommit);
  l.end_window(false);
  const auto s = l.stats();
  EXPECT_EQ(s.early_steps, 4u);
  EXPECT_EQ(s.committed, 4u);
  EXPECT_EQ(s.redone, 0u);
  EXPECT_EQ(s.taken_back, 0u);
  EXPECT_EQ(s.buckets, 2u);
  EXPECT_EQ(s.last_backward_ns, 1000u);
  EXPECT_FALSE(l.has_unconfirmed());
}

TEST(StepLedger, ABindingClipStopsSpeculationAndRedoesWithTheCoefficient) {
  StepLedgerOptions o;
  o.max_grad_norm = 1.0;
  StepLedger l = make(4, o);
  const auto full = backward(l);
  ASSERT_EQ(full.size(), 2u);
  // The first bucket's norm (0.5) stays under the bound; the second crosses it.
  EXPECT_EQ(work(l, {full[0]}, 0.25), (std::vector<Landed>{Landed::kStep}));
  EXPECT_EQ(work(l, {full[1]}, 100.0), (std::vector<Landed>{Landed::kWait}));
  EXPECT_EQ(l.stats().speculation_stops, 1u);
  EXPECT_NEAR(l.stats().last_partial_norm, std::sqrt(100.25), 1e-12);
  for (std::size_t i = 0; i < 4; ++i) {
    const Confirmation c = l.confirm(i, grad_of(i), 0.1, false);
    EXPECT_EQ(c.kind, Confirmation::kRedo) << i;
    EXPECT_EQ(c.scale, 0.1);
  }
  const auto s = l.stats();
  EXPECT_EQ(s.early_steps, 2u);  // only the bucket before the bound
  EXPECT_EQ(s.redone, 2u);
  EXPECT_EQ(s.taken_back, 2u);
  EXPECT_EQ(s.committed, 0u);
}

TEST(StepLedger, ANonfiniteGradientStopsSpeculationUnderSkipNonfinite) {
  StepLedgerOptions o;
  o.skip_nonfinite = true;
  StepLedger l = make(2, o);
  EXPECT_TRUE(l.needs_norm());
  const auto full = backward(l);
  EXPECT_EQ(work(l, full, std::numeric_limits<double>::infinity()), (std::vector<Landed>{Landed::kWait}));
  EXPECT_EQ(l.stats().speculation_stops, 1u);
  EXPECT_EQ(l.stats().early_steps, 0u);
  // Without the option, nothing is summed and nothing stops.
  StepLedger plain = make(2);
  EXPECT_FALSE(plain.needs_norm());
  EXPECT_EQ(work(plain, backward(plain), std::numeric_limits<double>::quiet_NaN()),
            (std::vector<Landed>{Landed::kStep}));
}

TEST(StepLedger, AccumulationStreamsTheLastGradientAndTakesBackALaterOne) {
  StepLedgerOptions o;
  o.accumulation_steps = 2;
  StepLedger l = make(2, o);
  l.backward_begins(0);
  EXPECT_EQ(l.arrive(1), GradArrival::kIgnore);  // 1 of 2
  EXPECT_EQ(l.arrive(1), GradArrival::kStream);  // 2 of 2
  ASSERT_TRUE(l.may_stream(1));
  EXPECT_FALSE(l.streamed(1, grad_of(1), false));  // its bucket waits for slot 0
  EXPECT_EQ(l.arrive(1), GradArrival::kTakeBack);  // a third: the gradient changed again
  EXPECT_EQ(l.stats().taken_back, 1u);
  EXPECT_EQ(l.confirm(1, grad_of(1, 1), 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.stats().taken_back, 1u);  // counted once
  l.end_window(true);
  EXPECT_EQ(l.arrive(1), GradArrival::kIgnore);  // counts start again
}

TEST(StepLedger, AForwardBeforeStepTakesEveryEarlyStepBack) {
  StepLedger l = make(4);
  work(l, backward(l));
  l.discard_all();
  EXPECT_FALSE(l.has_unconfirmed());
  EXPECT_EQ(l.stats().taken_back, 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(l.confirm(i, grad_of(i), 1.0, false).kind, Confirmation::kUnhandled);
  l.end_window(false);
  EXPECT_EQ(l.stats().taken_back, 4u);
  EXPECT_EQ(l.stats().committed, 0u);
  // A slot that had not streamed yet still streams after the discard.
  StepLedger m = make(2);
  m.backward_begins(0);
  m.discard_all();
  EXPECT_EQ(m.arrive(0), GradArrival::kStream);
}

TEST(StepLedger, HyperparametersChangedBeforeStepRedoWithTheNewOnes) {
  StepLedger l = make(2);
  work(l, backward(l));
  tierflow::optimizer::AdamOptions changed;
  changed.lr = 2e-3;
  l.set_group(0, changed);
  const Confirmation c = l.confirm(0, grad_of(0), 1.0, false);
  EXPECT_EQ(c.kind, Confirmation::kRedo);
  EXPECT_EQ(c.scale, 1.0);
  EXPECT_EQ(l.group_options(l.group_of(0)).lr, 2e-3);
  EXPECT_EQ(l.options_used(0).lr, tierflow::optimizer::AdamOptions{}.lr);
  EXPECT_EQ(l.stats().redone, 1u);
}

TEST(StepLedger, AChangedGradientIsSteppedByTheCaller) {
  StepLedger l = make(2);
  work(l, backward(l));
  EXPECT_EQ(l.confirm(0, grad_of(0, 3), 1.0, false).kind, Confirmation::kUnhandled);  // scaled in place
  EXPECT_EQ(l.confirm(1, grad_of(7), 1.0, false).kind, Confirmation::kUnhandled);     // another tensor
  EXPECT_EQ(l.stats().taken_back, 2u);
  // Stale masters: nothing that streamed is usable.
  StepLedger m = make(2);
  work(m, backward(m));
  EXPECT_EQ(m.confirm(0, grad_of(0), 1.0, true).kind, Confirmation::kUnhandled);
}

TEST(StepLedger, AGradientWhoseBytesChangedUnderTheSameVersionIsSteppedByTheCaller) {
  // dist.all_reduce(p.grad), p.grad.data.clamp_(): the tensor and its version as streamed, other bytes (Note
  // [Gradient content]). Neither committed nor redone from the landed copy.
  StepLedgerOptions o;
  o.max_grad_norm = 1.0;
  StepLedger l = make(3, o);
  work(l, backward(l), 0.0);
  EXPECT_EQ(l.confirm(0, grad_of(0, 0, /*bytes=*/9), 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.confirm(1, grad_of(1, 0, 9), 0.5, false).kind, Confirmation::kUnhandled);  // not a redo either
  GradIdentity unknown = grad_of(2);
  unknown.content.known = false;  // not computed: counts as changed
  EXPECT_EQ(l.confirm(2, unknown, 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.stats().committed, 0u);
  EXPECT_EQ(l.stats().taken_back, 3u);
}

TEST(StepLedger, TheStreamedBytesCanBeKnownAfterTheStream) {
  // A device's content is read later (streamed_content); until then nothing is committed.
  StepLedger l = make(2);
  l.backward_begins(1000);
  std::vector<std::size_t> full;
  for (std::size_t i = l.size(); i-- > 0;) {
    ASSERT_EQ(l.arrive(i), GradArrival::kStream);
    GradIdentity g = grad_of(i);
    g.content = {};
    if (l.streamed(i, g, false)) full.push_back(l.bucket_of(i));
  }
  work(l, full);
  EXPECT_TRUE(l.compares_content(0));
  l.streamed_content(0, grad_of(0).content);
  EXPECT_EQ(l.confirm(0, grad_of(0), 1.0, false).kind, Confirmation::kCommit);
  EXPECT_EQ(l.confirm(1, grad_of(1), 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_FALSE(l.compares_content(0));  // consumed
}

TEST(StepLedger, AClipOfChangedBytesIsNotPickedUp) {
  StepLedger l = make(2);
  work(l, backward(l));
  EXPECT_FALSE(l.clip_candidate(0, grad_of(0, 0, 9)));  // changed before the clip
  ASSERT_TRUE(l.clip_candidate(1, grad_of(1)));
  ASSERT_TRUE(l.learn_clip(1.0));
  l.clipped(0, grad_of(0, 1, 10), 0.5, true);
  // The clip's bytes are the gradient from now on: a later change is one more.
  l.clipped(1, grad_of(1, 1, 11), 0.5, true);
  EXPECT_EQ(l.stats().clips_picked_up, 1u);
  EXPECT_EQ(l.confirm(0, grad_of(0, 1, 10), 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.confirm(1, grad_of(1, 1, 12), 1.0, false).kind, Confirmation::kUnhandled);
  // A multiply by exactly 1 whose bytes changed all the same is not the streamed gradient.
  StepLedger m = make(1);
  work(m, backward(m));
  ASSERT_TRUE(m.clip_candidate(0, grad_of(0)));
  ASSERT_TRUE(m.learn_clip(1.0));
  m.clipped(0, grad_of(0, 1, 9), 1.0, true);
  EXPECT_EQ(m.confirm(0, grad_of(0, 1, 9), 1.0, false).kind, Confirmation::kUnhandled);
}

TEST(StepLedger, AReleasedGradientCountsAsUnchangedWhilePGradIsNone) {
  StepLedger l = make(2);
  work(l, backward(l, /*released=*/true));
  EXPECT_TRUE(l.released(0));
  EXPECT_EQ(l.confirm(0, GradIdentity{}, 1.0, false).kind, Confirmation::kCommit);
  // Put back on the device, then set to None: that gradient is gone.
  l.restored(1);
  EXPECT_EQ(l.confirm(1, GradIdentity{}, 1.0, false).kind, Confirmation::kNone);
  EXPECT_EQ(l.stats().taken_back, 1u);
}

TEST(StepLedger, HeldSlotsAreNotSteppedEarlyButRedone) {
  StepLedger l = make(2);
  const auto full = backward(l);
  const std::uint64_t gen = l.generation();
  const auto slots = l.launch(full.at(0));
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_TRUE(l.launch(full.at(0)).empty());  // once
  ASSERT_EQ(l.landed(gen, slots, 0.0), Landed::kStep);
  l.held();
  l.stepped_early(gen, slots, {true, false});
  EXPECT_EQ(l.stats().early_steps, 1u);
  EXPECT_EQ(l.stats().held, 1u);
  EXPECT_EQ(l.confirm(slots[0], grad_of(slots[0]), 1.0, false).kind, Confirmation::kRedo);
  EXPECT_EQ(l.confirm(slots[1], grad_of(slots[1]), 1.0, false).kind, Confirmation::kCommit);
}

TEST(StepLedger, ABucketLandingAfterItsWindowEndedChangesNothing) {
  StepLedger l = make(2);
  const auto full = backward(l);
  const std::uint64_t gen = l.generation();
  const auto slots = l.launch(full.at(0));
  l.end_window(true);  // zero_grad while the worker still runs
  EXPECT_EQ(l.stats().taken_back, 2u);
  EXPECT_EQ(l.landed(gen, slots, 0.0), Landed::kGone);
  l.stepped_early(gen, slots, {false, false});
  EXPECT_EQ(l.stats().early_steps, 0u);
  EXPECT_FALSE(l.has_unconfirmed());
  // A failed copy: the slot's step cannot run and step() takes it from p.grad.
  StepLedger m = make(2);
  const auto mf = backward(m, true);
  const std::uint64_t mg = m.generation();
  m.launch(mf.at(0));
  m.copy_landed(mg, 0);
  m.copy_failed(1);
  EXPECT_FALSE(m.released(1));
  EXPECT_EQ(m.confirm(1, grad_of(1), 1.0, false).kind, Confirmation::kUnhandled);
}

TEST(StepLedger, TheUsersClipIsPickedUpAndTeachesSpeculationItsNorm) {
  StepLedger l = make(2);
  work(l, backward(l));
  ASSERT_TRUE(l.clip_candidate(0, grad_of(0)));
  ASSERT_TRUE(l.clip_candidate(1, grad_of(1)));
  ASSERT_TRUE(l.learn_clip(1.0));
  EXPECT_FALSE(l.needs_norm());  // not in the window it was seen in: buckets may still land
  l.clipped(0, grad_of(0, 1), 0.5, /*exact=*/true);   // fp32: the kernel's multiply rounds as torch's
  l.clipped(1, grad_of(1, 1), 0.5, /*exact=*/false);  // bf16: it would not
  EXPECT_EQ(l.stats().clips_picked_up, 1u);
  const Confirmation c = l.confirm(0, grad_of(0, 1), 1.0, false);
  EXPECT_EQ(c.kind, Confirmation::kRedo);
  EXPECT_EQ(c.scale, 0.5);
  EXPECT_EQ(l.confirm(1, grad_of(1, 1), 1.0, false).kind, Confirmation::kUnhandled);
  l.end_window(false);
  // The next backward knows max_norm = 1: a landed norm of 10 stops speculation.
  EXPECT_TRUE(l.needs_norm());
  EXPECT_EQ(work(l, backward(l), 100.0), (std::vector<Landed>{Landed::kWait}));
  // Not a candidate: changed since its copy.
  EXPECT_FALSE(l.clip_candidate(0, grad_of(0, 5)));
  // tierflow clips itself: nothing is picked up.
  StepLedgerOptions o;
  o.max_grad_norm = 2.0;
  StepLedger m = make(2, o);
  work(m, backward(m), 0.0);
  ASSERT_TRUE(m.clip_candidate(0, grad_of(0)));
  EXPECT_FALSE(m.learn_clip(1.0));
  m.clipped(0, grad_of(0, 1), 0.5, true);
  EXPECT_EQ(m.stats().clips_picked_up, 0u);
}

TEST(StepLedger, AUserClipByExactlyOneKeepsTheStreamedStepsUnderTierflowsOwnClip) {
  // transformers 5's Trainer reads the norm at every step with clip_grad_norm_(max_norm=inf): a multiply by 1.
  StepLedgerOptions o;
  o.max_grad_norm = 2.0;
  StepLedger l = make(2, o);
  ASSERT_TRUE(l.clips_itself());
  work(l, backward(l), 0.0);
  ASSERT_TRUE(l.clip_candidate(0, grad_of(0)));
  ASSERT_TRUE(l.clip_candidate(1, grad_of(1)));
  // GradStream::end_clip asks learn_clip only for a coefficient other than 1 (it would refuse: tierflow clips).
  l.clipped(0, grad_of(0, 1), 1.0, /*exact=*/false);  // any dtype: a multiply by 1 rounds nothing
  l.clipped(1, grad_of(1, 2), 1.0, false);             // changed twice since its copy: not the clip alone
  EXPECT_EQ(l.stats().clips_picked_up, 1u);
  // tierflow's own clip still decides the scale: committed when it does not bind, redone with it when it does.
  EXPECT_EQ(l.confirm(0, grad_of(0, 1), 1.0, false).kind, Confirmation::kCommit);
  EXPECT_EQ(l.confirm(1, grad_of(1, 2), 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.stats().taken_back, 1u);
  l.end_window(false);
  work(l, backward(l), 0.0);
  ASSERT_TRUE(l.clip_candidate(0, grad_of(0)));
  l.clipped(0, grad_of(0, 1), 1.0, false);
  const Confirmation c = l.confirm(0, grad_of(0, 1), 0.25, false);
  EXPECT_EQ(c.kind, Confirmation::kRedo);
  EXPECT_EQ(c.scale, 0.25);
}

TEST(StepLedger, ReplacedStateTakesTheEarlyStepBack) {
  StepLedger l = make(2);
  work(l, backward(l));
  l.state_set(0);  // load_state_dict between backward and step()
  EXPECT_EQ(l.stats().taken_back, 1u);
  EXPECT_EQ(l.confirm(0, grad_of(0), 1.0, false).kind, Confirmation::kUnhandled);
  EXPECT_EQ(l.confirm(1, grad_of(1), 1.0, false).kind, Confirmation::kCommit);
  // A slot without state asks for it first.
  StepLedger m({});
  m.add(kBytes, 0, true);
  m.backward_begins(0);
  EXPECT_EQ(m.arrive(0), GradArrival::kNeedState);
  EXPECT_FALSE(m.may_stream(0));
  m.state_set(0);
  EXPECT_TRUE(m.may_stream(0));
}

TEST(StepLedger, AnExcludedSlotLeavesThePlan) {
  StepLedger l = make(4);
  work(l, backward(l));
  l.exclude(3);
  EXPECT_EQ(l.stats().taken_back, 1u);
  EXPECT_EQ(l.confirm(3, grad_of(3), 1.0, false).kind, Confirmation::kNone);
  l.end_window(false);
  const auto plan = l.plan_id();
  l.backward_begins(0);
  EXPECT_EQ(l.arrive(3), GradArrival::kIgnore);
  EXPECT_EQ(l.arrive(2), GradArrival::kStream);
  EXPECT_NE(l.plan_id(), plan);
  EXPECT_EQ(l.stats().bucket_count, 2u);  // 3 slots in buckets of 2
  EXPECT_THROW(l.add(kBytes, 0, true), std::logic_error);  // after the first plan
}

TEST(StepLedger, SizeBucketsFromTheMeasuredStep) {
  StepLedgerOptions o;  // bucket size on auto
  StepLedger l(o);
  const std::size_t n = 64, bytes = 4 << 20;
  for (std::size_t i = 0; i < n; ++i) l.add(bytes, 0, true);
  l.set_group(0, {});
  for (std::size_t i = 0; i < n; ++i) l.state_set(i);
  EXPECT_EQ(l.size_buckets(1e10), 0u);  // nothing planned yet: nothing to size
  l.backward_begins(0);
  for (std::size_t i = n; i-- > 0;) l.arrive(i);
  EXPECT_EQ(l.stats().bucket_bytes, tierflow::optimizer::auto_grad_bucket_bytes(n * bytes));
  EXPECT_EQ(l.size_buckets(1e10), l.stats().bucket_bytes);  // inside backward: unchanged
  l.backward_ends(2'000'000'000);  // 2 s
  l.kernel_time(1'000'000'000, 8ull << 30);  // 8 GiB/s
  l.end_window(true);
  tierflow::optimizer::BucketSizing in;
  in.backward_seconds = 2.0;
  in.link_bytes_per_second = 1e10;
  in.cpu_grad_bytes_per_second = static_cast<double>(8ull << 30);
  in.total_grad_bytes = n * bytes;
  const std::size_t want = tierflow::optimizer::measured_grad_bucket_bytes(in);
  EXPECT_EQ(l.size_buckets(1e10), want);
  EXPECT_EQ(l.stats().sized_backward_s, 2.0);
  EXPECT_EQ(l.stats().sized_link_bytes_per_s, 1e10);
  EXPECT_EQ(l.stats().bucket_count, (n * bytes + want - 1) / want);
}

TEST(StepLedger, RefusesWhatItCannotDo) {
  StepLedgerOptions o;
  o.accumulation_steps = 0;
  EXPECT_THROW(StepLedger{o}, std::logic_error);
  StepLedger l = make(2);
  EXPECT_THROW(l.streamed(0, grad_of(0), false), std::logic_error);  // not planned: may not stream
  EXPECT_THROW(l.arrive(5), std::logic_error);
  EXPECT_THROW(l.add(kBytes, -1, true), std::logic_error);
}

}  // namespace
