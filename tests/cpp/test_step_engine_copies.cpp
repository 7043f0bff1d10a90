// optimizer::StepEngine's waits (issue 40 item 2, issue 41): the worker's wait for gradient copies held back past
// the backward's end, which copy each device's compute stream and each module waits for before the weights'
// uploads, a state of the wrong size refused; and the kernel's arrays (KernelArrays) as every front end's reach it.
#include <gtest/gtest.h>

#include "step_engine_fixture.hpp"

namespace {

using namespace tierflow;
using namespace tierflow::optimizer;
using namespace tierflow::step_engine_test;

// The same fixture under its own name: a suite is one fixture class in one file.
class StepEngineCopiesTest : public StepEngineTest {};

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
TEST_P(StepEngineCopiesTest, CountsTheWorkersWaitForGradientCopiesPastTheBackwardsEnd) {
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

TEST_P(StepEngineCopiesTest, UploadsWaitForTheCopySentLastPerDeviceAndModule) {
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

TEST_P(StepEngineCopiesTest, RefusesAStateOfTheWrongSize) {
  build(buckets_of(256), kSizes);
  std::vector<float> short_master(3);
  std::lock_guard<std::mutex> lock(engine_->mutex());
  EXPECT_THROW(engine_->set_state(0, array_of(short_master), array_of(params_[0].m), array_of(params_[0].v), {},
                                  StateFormat::kFp32),
               std::logic_error);
}

INSTANTIATE_TEST_SUITE_P(EmulatedDevice, StepEngineCopiesTest, ::testing::Values(false, true),
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
