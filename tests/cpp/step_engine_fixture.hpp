// The fixture shared by the StepEngine tests (test_step_engine.cpp: the steps, windows and timeline;
// test_step_engine_copies.cpp: the copies the worker and the uploads wait for, and the kernel's arrays): a front
// end's host memory (FakeHost), the parameters, and an engine over the emulated copy engine, polite or adversarial,
// checked against a plain in-place CpuAdam step.
#pragma once

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

namespace tierflow::step_engine_test {


using namespace tierflow;
using namespace tierflow::optimizer;

inline std::uint64_t now() {
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

inline HostArray array_of(std::vector<float>& v) {
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

inline StepEngineOptions buckets_of(std::size_t bytes) {
  StepEngineOptions o;
  o.bucket_bytes = bytes;
  return o;
}

inline const std::vector<std::size_t> kSizes = {37, 64, 5, 128, 19};

}  // namespace tierflow::step_engine_test
