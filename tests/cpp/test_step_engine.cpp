// optimizer::StepEngine (issue 40 item 2) without torch, on the emulated copy engine (polite and adversarial):
// the paths the Python streaming suites drive through GradStream -- buckets stepped during backward and
// committed, redone with a clip coefficient, taken back, accumulated over a window, a held parameter stepped in
// step(), a changed gradient left to the caller, released gradients, the timeline's order, size_buckets, a
// frugal step (every early step redone in place) -- each checked element-wise, bit for bit, against a plain
// in-place CpuAdam step over copies of the same arrays; and the weights' uploads: which copy each device's
// compute stream and each module waits for, and the staging kept until its copy is done.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/adam_args.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/grad_content.hpp"
#include "tierflow/optimizer/step_engine.hpp"
#include "tierflow/swap/copy_engine.hpp"

namespace {

using namespace tierflow;
using namespace tierflow::optimizer;

std::uint64_t now() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// Host memory as a front end would hand it out: a block kept by the array; `refuse` bytes fail (a full pool).
struct FakeHost final : StepEngineHost {
  CpuAdam adam{1};
  std::vector<std::int64_t> steps;
  std::set<std::size_t> landed, failed;
  std::size_t refuse = 0;  // allocations of exactly these bytes throw out_of_memory (0: none)
  std::size_t calls = 0;
  std::vector<std::weak_ptr<void>> blocks;  // every allocation, to see which are still held

  std::size_t alive() const {
    std::size_t n = 0;
    for (const auto& b : blocks) n += b.expired() ? 0 : 1;
    return n;
  }

  HostArray allocate(std::size_t bytes) override {
    if (refuse != 0 && bytes == refuse) throw out_of_memory("FakeHost: refused " + std::to_string(bytes));
    auto block = std::make_shared<std::vector<float>>((bytes + 3) / 4 + 1, std::nanf(""));  // garbage until written
    blocks.push_back(block);
    return {block->data(), bytes, block};
  }
  void adam_step(const AdamOptions& options, std::int64_t step, const std::vector<KernelArrays>& arrays) override {
    adam.step(options, step, adam_tensors(arrays));
    ++calls;
  }
  std::int64_t steps_taken(std::size_t slot) override { return steps.at(slot); }
  void count_step(std::size_t slot) override { steps.at(slot) += 1; }
  void gradient_landed(std::size_t slot) override { landed.insert(slot); }
  void gradient_copy_failed(std::size_t slot) override { failed.insert(slot); }
  // Devices as the front end names them: each its own compute stream (`stream_of`, else emulated compute).
  swap::CopyEngine* copies = nullptr;
  std::vector<void*> stream_of;
  struct Wait {
    DeviceId device;
    void* stream;
    swap::TransferHandle copy;
  };
  std::vector<Wait> waits;  // every stream wait the engine asked for
  swap::StreamRef compute_stream(DeviceId device) override {
    if (device < stream_of.size() && stream_of[device]) return swap::StreamRef::cuda(stream_of[device]);
    return swap::StreamRef::emulated_compute();
  }
  void make_stream_wait(swap::StreamRef stream, const swap::TransferHandle& copy) override {
    DeviceId device = stream_of.size();
    for (DeviceId d = 0; d < stream_of.size(); ++d)
      if (stream_of[d] == stream.native()) device = d;
    waits.push_back({device, stream.native(), copy});
    if (!stream.is_cuda()) copies->make_stream_wait(stream, copy);
  }
};

HostArray array_of(std::vector<float>& v) {
  return {v.data(), v.size() * 4, std::shared_ptr<void>(&v, [](void*) {})};
}

// One parameter as the front end holds it: its device weight and gradient, its state, and the reference's copy.
struct Param {
  std::vector<float> weight, grad, master, m, v;      // the engine's state arrays are master, m, v
  std::vector<float> ref_master, ref_m, ref_v, ref_w;  // a plain in-place step over copies
  std::int64_t version = 0;
};

class StepEngineTest : public ::testing::TestWithParam<bool> {
 protected:
  void build(StepEngineOptions o, std::vector<std::size_t> sizes) {
    swap::EmulatedCopyOptions co;
    co.adversarial = GetParam();
    copies_ = swap::make_emulated_copy_engine(nullptr, co);
    host_.copies = copies_.get();
    engine_ = std::make_unique<StepEngine>(o, host_);
    opts_.lr = 1e-2;
    opts_.weight_decay = 0.01;
    std::lock_guard<std::mutex> lock(engine_->mutex());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Param p;
      const std::size_t n = sizes[i];
      for (std::size_t k = 0; k < n; ++k) p.weight.push_back(0.1f * static_cast<float>((k * 7 + i * 3) % 11) - 0.5f);
      p.master = p.ref_master = p.weight;
      p.m = p.v = p.ref_m = p.ref_v = std::vector<float>(n, 0.0f);
      p.ref_w = p.weight;
      p.grad.assign(n, 0.0f);
      params_.push_back(std::move(p));
      EXPECT_EQ(engine_->add(n, 4 * n, ScalarType::kFloat32, 0, true), i);
      host_.steps.push_back(0);
    }
    engine_->ledger().set_group(0, opts_);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Param& p = params_[i];
      engine_->set_state(i, array_of(p.master), array_of(p.m), array_of(p.v), {}, StateFormat::kFp32);
    }
  }

  GradIdentity identity(std::size_t i) {
    const Param& p = params_[i];
    return {100 + i, p.version, grad_content(p.grad.data(), 4, p.grad.size())};
  }

  // A backward: fresh gradients (scaled by `size`), delivered last registered first; each streams as
  // GradStream's hook would stream it (accumulated onto the last ones within a window).
  // `end`: its end callback runs (else the test runs end_backward itself).
  void backward(float size, bool released = false, bool fresh = true, bool end = true) {
    ++backwards_;
    for (std::size_t i = params_.size(); i-- > 0;) {
      Param& p = params_[i];
      for (std::size_t k = 0; k < p.grad.size(); ++k) {
        const float g = size * std::sin(static_cast<float>(k + 1) * 0.37f + static_cast<float>(i + backwards_));
        p.grad[k] = fresh ? g : p.grad[k] + g;
      }
      p.version += 1;
      std::lock_guard<std::mutex> lock(engine_->mutex());
      engine_->backward_begins(now());
      const GradArrival what = engine_->ledger().arrive(i);
      engine_->sync_buckets();
      if (what != GradArrival::kStream || !engine_->ledger().may_stream(i)) continue;
      const HostArray dst = engine_->stage_gradient(i, ScalarType::kFloat32, p.grad.size() * 4);
      if (!dst.defined()) continue;
      swap::TransferHandle copy = copies_->copy(swap::Direction::kDeviceToHost, dst.data, p.grad.data(), dst.bytes,
                                                {}, swap::StreamRef::emulated_compute());
      engine_->gradient_copied(i, wrap_copy_ ? wrap_copy_(std::move(copy)) : std::move(copy));
      engine_->streamed(i, identity(i), released);
    }
    if (end) end_backward(now());
  }

  // The backward's end callback, as GradStream's, at `at` (read before it takes the lock).
  void end_backward(std::uint64_t at) {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    engine_->backward_ends(at);
    engine_->launch_unlaunched();
  }

  // step(): what GradStream's prepare_finish and commit_finish do, the caller's own steps for the slots left
  // to it; `scale` is the clip coefficient.
  StepEngine::Finish step(double scale = 1.0) {
    engine_->wait_worker_unlocked(false);  // as the Python path's step() does first (Note [Stream timeline])
    {
      std::lock_guard<std::mutex> lock(engine_->mutex());
      engine_->launch_unlaunched();
    }
    engine_->wait_worker_unlocked(true);
    std::lock_guard<std::mutex> lock(engine_->mutex());
    engine_->wait_uploads();  // the last step's weights are in (as GradStream's prepare_finish)
    std::vector<GradIdentity> now_ids;
    for (std::size_t i = 0; i < params_.size(); ++i) now_ids.push_back(identity(i));
    const std::vector<std::size_t> unhandled = engine_->prepare(now_ids, scale, false);
    engine_->prepare_staging(frugal_);
    StepEngine::Finish f = engine_->commit_prepared();
    EXPECT_EQ(f.unhandled, unhandled);
    // The new weights go back to the device: queued in forward order, each device's (slot % devices_)
    // compute stream ordered after the copy sent last to it.
    std::vector<std::size_t> sent;
    for (std::size_t i : engine_->ledger().forward_order(f.committed)) {
      const HostArray& staging = engine_->staging_of(i);
      engine_->upload_sent(i, i % devices_,
                           copies_->copy(swap::Direction::kHostToDevice, params_[i].weight.data(), staging.data,
                                         staging.bytes, {}, swap::StreamRef::emulated_compute()));
      sent.push_back(i);
    }
    if (weights_in_forward_) return end_step(f, scale);
    engine_->wait_for_step_uploads(sent);
    return end_step(f, scale);
  }

  StepEngine::Finish end_step(const StepEngine::Finish& f, double scale) {
    for (std::size_t i : f.unhandled) own_step(i, scale);
    engine_->end_window(false);
    return f;
  }

  // The caller's own step of slot i (the Python path), in place on the engine's state from its device gradient.
  void own_step(std::size_t i, double scale) {
    Param& p = params_[i];
    const std::vector<HostArray> state = engine_->state_of(i);
    AdamOptions o = opts_;
    o.grad_scale = scale;
    AdamTensor t;
    t.numel = p.grad.size();
    t.master = static_cast<float*>(state[0].data);
    t.exp_avg = static_cast<float*>(state[1].data);
    t.exp_avg_sq = static_cast<float*>(state[2].data);
    t.grad = p.grad.data();
    t.param_out = p.weight.data();
    host_.adam.step(o, ++host_.steps[i], {t});
  }

  // The reference: a plain in-place step of every parameter with its current gradient.
  void reference_step(double scale = 1.0) {
    ++ref_steps_;
    for (Param& p : params_) {
      AdamOptions o = opts_;
      o.grad_scale = scale;
      AdamTensor t;
      t.numel = p.grad.size();
      t.master = p.ref_master.data();
      t.exp_avg = p.ref_m.data();
      t.exp_avg_sq = p.ref_v.data();
      t.grad = p.grad.data();
      t.param_out = p.ref_w.data();
      reference_.step(o, ref_steps_, {t});
    }
  }

  // The weights and the engine's state now (bit for bit) against the reference's.
  void expect_matches_reference() {
    {
      std::lock_guard<std::mutex> lock(engine_->mutex());
      engine_->synchronize();  // the weights on their way are in
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      std::vector<HostArray> state;
      {
        std::lock_guard<std::mutex> lock(engine_->mutex());
        state = engine_->state_of(i);
      }
      const float* master = static_cast<const float*>(state[0].data);
      const float* m = static_cast<const float*>(state[1].data);
      const float* v = static_cast<const float*>(state[2].data);
      for (std::size_t k = 0; k < p.grad.size(); ++k) {
        ASSERT_EQ(p.weight[k], p.ref_w[k]) << "param " << i << " element " << k;
        ASSERT_EQ(master[k], p.ref_master[k]) << "master " << i << " element " << k;
        ASSERT_EQ(m[k], p.ref_m[k]) << "exp_avg " << i << " element " << k;
        ASSERT_EQ(v[k], p.ref_v[k]) << "exp_avg_sq " << i << " element " << k;
      }
      EXPECT_EQ(host_.steps[i], ref_steps_) << "param " << i;
    }
  }

  double grad_norm() const {
    double sq = 0;
    for (const Param& p : params_)
      for (float g : p.grad) sq += static_cast<double>(g) * g;
    return std::sqrt(sq);
  }

  StepEngineStats stats() {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    return engine_->stats();
  }

  FakeHost host_;
  std::unique_ptr<swap::CopyEngine> copies_;
  std::vector<Param> params_;  // before the engine: it may hold arrays of theirs to its end
  std::unique_ptr<StepEngine> engine_;
  CpuAdam reference_{1};
  AdamOptions opts_;
  std::int64_t ref_steps_ = 0;
  int backwards_ = 0;
  bool frugal_ = false;             // step()'s prepare_staging lets the early results go
  bool weights_in_forward_ = false; // step() leaves the uploads pending (TIERFLOW_WEIGHTS_RETURN=forward)
  std::size_t devices_ = 1;         // step() sends slot i's weights to device i % devices_
  std::function<swap::TransferHandle(swap::TransferHandle)> wrap_copy_;  // what backward hands the engine
};

StepEngineOptions buckets_of(std::size_t bytes) {
  StepEngineOptions o;
  o.bucket_bytes = bytes;
  return o;
}

const std::vector<std::size_t> kSizes = {37, 64, 5, 128, 19};

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

// Gradient copies held back until the test opens the gate: the worker waits for them as long as the test says.
struct CopyGate {
  std::mutex m;
  std::condition_variable cv;
  bool opened = false;
  int entered = 0;  // waits begun
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    ++entered;
    cv.notify_all();
    cv.wait(lock, [&] { return opened; });
  }
  // Whether a wait began within 10 s; if not the gate opens (no worker is left waiting on it for good).
  bool wait_entered() {
    std::unique_lock<std::mutex> lock(m);
    if (cv.wait_for(lock, std::chrono::seconds(10), [&] { return entered > 0; })) return true;
    opened = true;
    cv.notify_all();
    return false;
  }
  void open() {
    std::lock_guard<std::mutex> lock(m);
    opened = true;
    cv.notify_all();
  }
  bool is_open() {
    std::lock_guard<std::mutex> lock(m);
    return opened;
  }
};

struct GatedCopy final : swap::detail::TransferState {
  std::shared_ptr<CopyGate> gate;
  swap::TransferHandle inner;
  GatedCopy(std::shared_ptr<CopyGate> g, swap::TransferHandle h) : gate(std::move(g)), inner(std::move(h)) {}
  bool ready() const override { return gate->is_open() && inner.ready(); }
  void wait() const override {
    gate->wait();
    inner.wait();
  }
  std::size_t bytes() const noexcept override { return inner.bytes(); }
};

// Note [Stream timeline]: grad_copy_wait_ns is the part of every bucket's [picked, landed] past backward_end, as
// the timeline shows them: the wait before the end (during backward) left out, a bucket that landed before the
// end callback took the lock counted by it; step_wait_ns holds step()'s first wait (where the worker still waits).
TEST_P(StepEngineTest, CountsTheWorkersWaitForGradientCopiesPastTheBackwardsEnd) {
  using std::chrono::milliseconds;
  build(buckets_of(256), kSizes);
  std::shared_ptr<CopyGate> gate;
  wrap_copy_ = [&gate](swap::TransferHandle h) {
    return swap::TransferHandle(std::make_shared<GatedCopy>(gate, std::move(h)));
  };
  auto past_end_ms = [&](double* whole_ms) {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    const WindowTimeline& w = engine_->last_window();
    EXPECT_GE(w.backward_end_ms, 0.0);
    double past = 0;
    *whole_ms = 0;
    for (const BucketTimes& b : w.buckets) {
      past += std::max(0.0, b.landed_ms - std::max(b.picked_ms, w.backward_end_ms));
      *whole_ms += b.landed_ms - b.picked_ms;
    }
    return past;
  };
  // The worker picks a bucket during backward and waits for its copies past the backward's end, into step().
  gate = std::make_shared<CopyGate>();
  backward(1.0f, false, true, false);
  ASSERT_TRUE(gate->wait_entered()) << "no bucket went to the worker during backward";
  std::this_thread::sleep_for(milliseconds(30));  // waiting during backward: hidden by it
  const std::uint64_t ended = now();
  end_backward(ended);
  std::uint64_t opened = 0;
  std::thread opener([&] {
    std::this_thread::sleep_for(milliseconds(30));
    opened = now();
    gate->open();
  });
  const std::uint64_t stepping = now();
  step();
  opener.join();
  reference_step();
  expect_matches_reference();
  StepEngineStats st = stats();
  double whole = 0;
  double past = past_end_ms(&whole);
  EXPECT_NEAR(static_cast<double>(st.grad_copy_wait_ns) / 1e6, past, 1e-3);
  EXPECT_GE(st.grad_copy_wait_ns, opened - ended);  // it waited until the gate opened
  EXPECT_GE(whole - past, 25.0);                     // ... and 30 ms before the end, left out
  // step()'s first wait counted (10 ms of slack for a thread descheduled before it began; uncounted it reads ~0)
  EXPECT_GE(st.step_wait_ns + 10'000'000, opened - stepping);
  // The end callback's time read before the copies landed, its lock taken after: counted by the callback.
  const std::uint64_t before = st.grad_copy_wait_ns;
  gate = std::make_shared<CopyGate>();
  backward(1.0f, false, true, false);
  ASSERT_TRUE(gate->wait_entered()) << "no bucket went to the worker during backward";
  const std::uint64_t late = now();
  std::this_thread::sleep_for(milliseconds(20));
  const std::uint64_t opened_late = now();
  gate->open();
  engine_->wait_worker_unlocked(false);  // landed and stepped: the worker saw no end
  end_backward(late);
  step();
  reference_step();
  expect_matches_reference();
  st = stats();
  past = past_end_ms(&whole);
  EXPECT_NEAR(static_cast<double>(st.grad_copy_wait_ns - before) / 1e6, past, 1e-3);
  EXPECT_GE(st.grad_copy_wait_ns - before, opened_late - late);
}

// A copy that completes when the host waits for it: the uploads' bookkeeping without a copy engine's timing.
struct Gate final : swap::detail::TransferState {
  mutable bool open = false;
  bool ready() const override { return open; }
  void wait() const override { open = true; }
  std::size_t bytes() const noexcept override { return 0; }
};

TEST_P(StepEngineTest, UploadsWaitForTheCopySentLastPerDeviceAndModule) {
  build(buckets_of(256), kSizes);
  backward(1.0f);
  step();
  int a = 0, b = 0, c = 0;  // three compute streams: device 0's, device 1's, another of device 0's
  host_.stream_of = {&a, &b};
  std::vector<std::shared_ptr<Gate>> g(kSizes.size());
  std::lock_guard<std::mutex> lock(engine_->mutex());
  engine_->synchronize();  // the step's own uploads are done
  auto send = [&](const std::vector<std::size_t>& order) {
    for (std::size_t i : order) {
      engine_->ensure_staging(i);
      g[i] = std::make_shared<Gate>();
      engine_->upload_sent(i, i % 2, swap::TransferHandle(g[i]));
    }
    host_.waits.clear();
  };
  auto waited = [&](std::size_t k, void* stream, std::size_t slot) {
    ASSERT_LT(k, host_.waits.size());
    EXPECT_EQ(host_.waits[k].stream, stream) << "wait " << k;
    EXPECT_EQ(host_.waits[k].copy.state().get(), static_cast<swap::detail::TransferState*>(g[slot].get()))
        << "wait " << k << " is not slot " << slot;
  };
  // TIERFLOW_WEIGHTS_RETURN=step: one wait per device, for the copy sent to it last.
  send({2, 0, 4, 1, 3});
  engine_->wait_for_step_uploads({2, 0, 4, 1, 3});
  ASSERT_EQ(host_.waits.size(), 2u);
  waited(0, &a, 4);
  waited(1, &b, 3);
  // A forward on another stream of device 0 waits too, once; device 1's stream waits already.
  host_.stream_of[0] = &c;
  engine_->wait_step_uploads();
  engine_->wait_step_uploads();
  ASSERT_EQ(host_.waits.size(), 3u);
  waited(2, &c, 4);
  // The staging stays until its copy is done (rule 3), even once the slots let go of it.
  const std::size_t alive = host_.alive();
  for (std::size_t i = 0; i < kSizes.size(); ++i) engine_->drop_outputs(i, true);
  EXPECT_EQ(host_.alive(), alive);
  engine_->wait_uploads();
  EXPECT_EQ(host_.alive(), alive - kSizes.size());
  for (const auto& gi : g) EXPECT_TRUE(gi->open);
  // =forward: each module's forward waits for its own parameters' last copy only.
  host_.stream_of[0] = &a;
  const std::size_t even = engine_->add_module({0, 2, 4}), odd = engine_->add_module({1, 3});
  send({4, 0, 2, 3, 1});
  engine_->wait_module(even);
  engine_->wait_module(even);  // nothing pending any more
  ASSERT_EQ(host_.waits.size(), 1u);
  waited(0, &a, 2);
  EXPECT_FALSE(engine_->upload_pending(0));
  EXPECT_TRUE(engine_->upload_pending(1));
  engine_->wait_upload(1);  // one parameter's probe: its copy waited for, the module's still pending
  ASSERT_EQ(host_.waits.size(), 2u);
  waited(1, &b, 1);
  EXPECT_TRUE(engine_->upload_pending(3));
  engine_->synchronize();  // the pending ones (1 and 3), then the host waits for all
  ASSERT_EQ(host_.waits.size(), 4u);
  EXPECT_FALSE(engine_->upload_pending(1));
  EXPECT_FALSE(engine_->upload_pending(3));
  for (const auto& gi : g) EXPECT_TRUE(gi->open);
  EXPECT_THROW(engine_->wait_module(odd + 1), std::logic_error);
  engine_->end_window(false);
}

TEST_P(StepEngineTest, RefusesAStateOfTheWrongSize) {
  build(buckets_of(256), kSizes);
  std::vector<float> short_master(3);
  std::lock_guard<std::mutex> lock(engine_->mutex());
  EXPECT_THROW(engine_->set_state(0, array_of(short_master), array_of(params_[0].m), array_of(params_[0].v), {},
                                  StateFormat::kFp32),
               std::logic_error);
}

INSTANTIATE_TEST_SUITE_P(EmulatedDevice, StepEngineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "adversarial" : "polite"; });

// The engine's arrays reach the kernel through adam_tensors, the checks every front end's tensors pass: each
// array where the kernel reads it (packed moments for bf16 and 8bit), and a wrong one refused by name.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

HostArray block(std::size_t bytes) {
  auto keep = std::make_shared<std::vector<char>>(bytes + 1);
  return {keep->data(), bytes, keep};
}

TEST(KernelArraysTest, EveryArrayReachesTheKernelWhereItIsRead) {
  constexpr std::size_t n = 5;
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::k8bit}) {
    KernelArrays a;
    a.numel = n;
    a.format = f;
    a.grad_type = ScalarType::kBFloat16;
    a.param_type = ScalarType::kFloat16;
    a.master = block(4 * n);
    a.exp_avg = block(moment_bytes(f, n));
    a.exp_avg_sq = block(moment_bytes(f, n));
    a.max_exp_avg_sq = block(4 * n);
    a.grad = block(2 * n);
    a.param_out = block(2 * n);
    a.master_out = block(4 * n);
    a.exp_avg_out = block(moment_bytes(f, n));
    a.exp_avg_sq_out = block(moment_bytes(f, n));
    a.max_exp_avg_sq_out = block(4 * n);
    KernelArrays in_place = a;
    in_place.master_out = in_place.exp_avg_out = in_place.exp_avg_sq_out = in_place.max_exp_avg_sq_out = {};
    in_place.max_exp_avg_sq = in_place.param_out = {};
    std::uint64_t elements = 0;
    const std::vector<AdamTensor> ts = adam_tensors({a, in_place}, &elements);
    ASSERT_EQ(ts.size(), 2u);
    EXPECT_EQ(elements, 2 * n);
    const AdamTensor& t = ts[0];
    EXPECT_EQ(t.numel, n);
    EXPECT_EQ(t.state_format, f);
    EXPECT_EQ(t.master, a.master.data);
    EXPECT_EQ(t.max_exp_avg_sq, a.max_exp_avg_sq.data);
    EXPECT_EQ(t.grad, a.grad.data);
    EXPECT_EQ(t.grad_type, ScalarType::kBFloat16);
    EXPECT_EQ(t.param_out, a.param_out.data);
    EXPECT_EQ(t.param_type, ScalarType::kFloat16);
    EXPECT_EQ(t.master_out, a.master_out.data);
    EXPECT_EQ(t.max_exp_avg_sq_out, a.max_exp_avg_sq_out.data);
    if (f == StateFormat::kFp32) {
      EXPECT_EQ(t.exp_avg, a.exp_avg.data);
      EXPECT_EQ(t.exp_avg_sq, a.exp_avg_sq.data);
      EXPECT_EQ(t.exp_avg_out, a.exp_avg_out.data);
      EXPECT_EQ(t.exp_avg_sq_out, a.exp_avg_sq_out.data);
    } else {
      const PackedMoment m = f == StateFormat::k8bit ? packed_8bit(a.exp_avg.data, n) : PackedMoment{a.exp_avg.data, nullptr};
      const PackedMoment v_out =
          f == StateFormat::k8bit ? packed_8bit(a.exp_avg_sq_out.data, n) : PackedMoment{a.exp_avg_sq_out.data, nullptr};
      EXPECT_EQ(t.m.data, m.data);
      EXPECT_EQ(t.m.absmax, m.absmax);
      EXPECT_EQ(t.v.data, a.exp_avg_sq.data);
      EXPECT_EQ(t.m_out.data, a.exp_avg_out.data);
      EXPECT_EQ(t.v_out.data, v_out.data);
      EXPECT_EQ(t.v_out.absmax, v_out.absmax);
    }
    const AdamTensor& p = ts[1];  // in place: no outputs, no max_exp_avg_sq
    EXPECT_EQ(p.master, a.master.data);
    EXPECT_EQ(p.master_out, nullptr);
    EXPECT_EQ(p.param_out, nullptr);
    EXPECT_EQ(p.max_exp_avg_sq, nullptr);
  }
}

TEST(KernelArraysTest, AWrongArrayIsRefusedByName) {
  constexpr std::size_t n = 4;
  KernelArrays a;
  a.numel = n;
  a.master = block(4 * n);
  a.exp_avg = block(4 * n);
  a.exp_avg_sq = block(4 * (n - 1));
  a.grad = block(4 * n);
  EXPECT_NE(error_of([&] { adam_tensors({a}); }).find("tierflow CPU Adam: exp_avg_sq 0 has 3 elements, expected 4"),
            std::string::npos)
      << error_of([&] { adam_tensors({a}); });
  a.exp_avg_sq = block(4 * n);
  a.format = StateFormat::k8bit;  // fp32-sized moments where 8bit ones are expected
  EXPECT_NE(error_of([&] { adam_tensors({a}); }).find("exp_avg 0 (8bit moment) has 16 bytes, expected"),
            std::string::npos)
      << error_of([&] { adam_tensors({a}); });
}

}  // namespace
