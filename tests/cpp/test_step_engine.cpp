// optimizer::StepEngine (issue 40 item 2) without torch, on the emulated copy engine (polite and adversarial):
// the paths the Python streaming suites drive through GradStream -- buckets stepped during backward and
// committed, redone with a clip coefficient, taken back, accumulated over a window, a held parameter stepped in
// step(), a changed gradient left to the caller, released gradients, the timeline's order, size_buckets, a
// frugal step (every early step redone in place) -- each checked element-wise, bit for bit, against a plain
// in-place CpuAdam step over copies of the same arrays; and the weights' uploads: which copy each device's
// compute stream and each module waits for, and the staging kept until its copy is done.
#include <gtest/gtest.h>

#include "step_engine_fixture.hpp"

namespace {

using namespace tierflow;
using namespace tierflow::optimizer;
using namespace tierflow::step_engine_test;


TEST_P(StepEngineTest, StepsBucketsDuringBackwardAndCommitsThem) {
  build(buckets_of(256), kSizes);
  for (int s = 0; s < 3; ++s) {
    backward(1.0f);
    const StepEngine::Finish f = step();
    reference_step();
    EXPECT_EQ(f.committed.size(), kSizes.size());
    EXPECT_TRUE(f.unhandled.empty());
    expect_matches_reference();
  }
  const StepEngineStats st = stats();
  EXPECT_EQ(st.early_steps, 3 * kSizes.size());
  EXPECT_EQ(st.committed, 3 * kSizes.size());
  EXPECT_EQ(st.redone, 0u);
  EXPECT_GE(st.buckets, 3u * 3u);  // 1,036 bytes in 256-byte buckets: at least three a step
  EXPECT_EQ(st.grad_bytes_to_host, 3u * 4u * (37 + 64 + 5 + 128 + 19));
}

TEST_P(StepEngineTest, RedoesWithTheClipCoefficientWhenTheClipBinds) {
  StepEngineOptions o = buckets_of(256);
  o.max_grad_norm = 0.5;
  build(o, kSizes);
  for (int s = 0; s < 2; ++s) {
    backward(1.0f);
    const double norm = grad_norm();
    ASSERT_GT(norm, 0.5);
    const double coef = 0.5 / (norm + 1e-6);
    const StepEngine::Finish f = step(coef);
    reference_step(coef);
    EXPECT_EQ(f.committed.size(), kSizes.size());
    expect_matches_reference();
  }
  // The running norm passed max_grad_norm: speculation stopped, and nothing stepped early was committed.
  EXPECT_EQ(stats().speculation_stops, 2u);
  EXPECT_EQ(stats().committed, 0u);
}

TEST_P(StepEngineTest, CommitsWhenTheClipDoesNotBind) {
  StepEngineOptions o = buckets_of(256);
  o.max_grad_norm = 1e6;
  build(o, kSizes);
  backward(1.0f);
  step(1.0);
  reference_step(1.0);
  expect_matches_reference();
  EXPECT_EQ(stats().committed, kSizes.size());
  EXPECT_GT(stats().last_partial_norm, 0.0);
}

TEST_P(StepEngineTest, TakesBackEveryEarlyStepOfADiscardedWindow) {
  build(buckets_of(256), kSizes);
  backward(1.0f);
  engine_->wait_worker_unlocked(false);
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    EXPECT_TRUE(engine_->ledger().has_unconfirmed());
    engine_->ledger().discard_all();
    engine_->end_window(true);
  }
  expect_matches_reference();  // nothing stepped: the state is the initial one, bit for bit
  EXPECT_EQ(stats().taken_back, kSizes.size());
  backward(1.0f);  // the next window steps from the old state
  step();
  reference_step();
  expect_matches_reference();
}

TEST_P(StepEngineTest, AccumulatesOverAWindowAndStreamsOnlyTheLastBackward) {
  StepEngineOptions o = buckets_of(256);
  o.accumulation_steps = 3;
  build(o, kSizes);
  for (int s = 0; s < 2; ++s) {
    backward(1.0f, false, true);
    backward(0.5f, false, false);
    backward(0.25f, false, false);
    step();
    reference_step();
    expect_matches_reference();
  }
  EXPECT_EQ(stats().early_steps, 2 * kSizes.size());
  EXPECT_EQ(stats().grad_bytes_to_host, 2u * 4u * (37 + 64 + 5 + 128 + 19));  // one copy per window
}

TEST_P(StepEngineTest, AHeldParameterStepsInStep) {
  build(buckets_of(256), kSizes);
  host_.refuse = 4 * 5;  // parameter 2's out-of-place outputs find no room
  backward(1.0f);
  engine_->wait_worker_unlocked(false);
  host_.refuse = 0;
  const StepEngine::Finish f = step();
  reference_step();
  expect_matches_reference();
  EXPECT_EQ(f.committed.size(), kSizes.size());
  const StepEngineStats st = stats();
  EXPECT_GE(st.held, 1u);
  EXPECT_EQ(st.early_steps, kSizes.size() - 1);
}

TEST_P(StepEngineTest, LeavesAChangedGradientToTheCaller) {
  build(buckets_of(256), kSizes);
  backward(1.0f);
  engine_->wait_worker_unlocked(false);
  params_[3].grad[7] += 1.0f;  // an in-place write after it streamed
  params_[3].version += 1;
  const StepEngine::Finish f = step();
  reference_step();
  ASSERT_EQ(f.unhandled, std::vector<std::size_t>{3});
  expect_matches_reference();
}

TEST_P(StepEngineTest, ReleasedGradientsAreLetGoOnceTheirCopyLanded) {
  build(buckets_of(256), kSizes);
  backward(1.0f, true);
  engine_->wait_worker_unlocked(false);
  EXPECT_EQ(host_.landed.size(), kSizes.size());
  EXPECT_TRUE(host_.failed.empty());
  step();
  reference_step();
  expect_matches_reference();
}

TEST_P(StepEngineTest, TimelineOrdersEveryBucket) {
  build(buckets_of(256), kSizes);
  backward(1.0f);
  step();
  std::lock_guard<std::mutex> lock(engine_->mutex());
  const WindowTimeline& w = engine_->last_window();
  ASSERT_GE(w.buckets.size(), 3u);
  std::uint64_t bytes = 0;
  for (const BucketTimes& b : w.buckets) {
    EXPECT_GE(b.launched_ms, 0.0);
    EXPECT_LE(b.launched_ms, b.picked_ms);
    EXPECT_LE(b.picked_ms, b.landed_ms);
    EXPECT_LE(b.landed_ms, b.stepped_ms);
    EXPECT_LE(b.stepped_ms, w.worker_done_ms);
    bytes += b.grad_bytes;
  }
  EXPECT_EQ(bytes, 4u * (37 + 64 + 5 + 128 + 19));
  EXPECT_GE(w.backward_end_ms, 0.0);
  EXPECT_GE(w.step_ms, 0.0);
  EXPECT_LE(w.step_ms, w.worker_done_ms);
}

TEST_P(StepEngineTest, SizeBucketsReCutsThemFromTheMeasuredStep) {
  build(StepEngineOptions{}, kSizes);  // bucket size on auto
  backward(1.0f);
  step();
  reference_step();
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    bytes = engine_->size_buckets(1e3);  // a slow link: the smallest buckets
    EXPECT_EQ(engine_->stats().bucket_bytes, bytes);
    EXPECT_EQ(engine_->stats().sized_link_bytes_per_s, 1e3);
  }
  EXPECT_GT(bytes, 0u);
  for (int s = 0; s < 2; ++s) {  // the new cut steps the same values
    backward(1.0f);
    step();
    reference_step();
    expect_matches_reference();
  }
}

TEST_P(StepEngineTest, EndsAWindowHoldingOnlyTheCommittedState) {
  build(buckets_of(256), kSizes);
  backward(1.0f);
  step();
  // The buckets' buffers and the old outputs went with the window, the staging is kept by the uploads until
  // their copies are done (rule 3); the committed outputs are the state now (master and both moments).
  EXPECT_EQ(host_.alive(), 4 * kSizes.size());
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    engine_->wait_uploads();
  }
  EXPECT_EQ(host_.alive(), 3 * kSizes.size());
  backward(1.0f);
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    engine_->ledger().discard_all();
  }
  engine_->wait_worker_unlocked(false);
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    engine_->end_window(true);
  }
  EXPECT_EQ(host_.alive(), 3 * kSizes.size());  // a discarded window's outputs go too
}

TEST_P(StepEngineTest, AFrugalStepRedoesEveryEarlyStepInPlace) {
  build(buckets_of(256), kSizes);
  frugal_ = true;  // a tight host budget: the early steps' out-of-place results go, their steps are redone
  devices_ = 2;
  weights_in_forward_ = true;
  for (int s = 0; s < 2; ++s) {
    backward(1.0f);
    const StepEngine::Finish f = step();
    reference_step();
    EXPECT_EQ(f.committed.size(), kSizes.size());
    expect_matches_reference();  // the same kernel on the same values: the same bits
  }
  const StepEngineStats st = stats();
  EXPECT_EQ(st.early_steps, 2 * kSizes.size());
  EXPECT_EQ(st.committed, 0u);  // none by a pointer swap: each forgotten and stepped again in place
  EXPECT_EQ(st.weight_bytes_to_device, 2u * 4u * (37 + 64 + 5 + 128 + 19));
}

TEST_P(StepEngineTest, CommitsOnlyWhatWasPrepared) {
  build(buckets_of(256), kSizes);
  backward(1.0f);
  engine_->wait_worker_unlocked(true);
  std::lock_guard<std::mutex> lock(engine_->mutex());
  EXPECT_THROW(engine_->commit_prepared(), std::logic_error);  // no prepare
  std::vector<GradIdentity> now_ids;
  for (std::size_t i = 0; i < params_.size(); ++i) now_ids.push_back(identity(i));
  EXPECT_THROW(engine_->prepare({now_ids[0]}, 1.0, false), std::logic_error);  // one identity per slot
  EXPECT_TRUE(engine_->prepare(now_ids, 1.0, false).empty());
  EXPECT_THROW(engine_->commit_prepared(), std::logic_error);  // no prepare_staging
  engine_->prepare_staging(false);
  EXPECT_EQ(engine_->commit_prepared().committed.size(), kSizes.size());
  EXPECT_THROW(engine_->commit_prepared(), std::logic_error);  // once
  engine_->end_window(false);
}

INSTANTIATE_TEST_SUITE_P(EmulatedDevice, StepEngineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "adversarial" : "polite"; });

}  // namespace
