#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;

TEST(GradBuckets, FollowArrivalOrderAndNeverExceedTheSizeUnlessOneTensorDoes) {
  // Backward completes gradients last layer first: order is the reverse of registration.
  const std::vector<std::size_t> bytes = {100, 300, 50, 1000, 20, 20};
  const std::vector<std::size_t> order = {5, 4, 3, 2, 1, 0};
  auto b = plan_grad_buckets(bytes, order, 400);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0].tensors, (std::vector<std::size_t>{5, 4}));
  EXPECT_EQ(b[1].tensors, (std::vector<std::size_t>{3}));  // larger than a bucket: alone
  EXPECT_EQ(b[1].bytes, 1000u);
  EXPECT_EQ(b[2].tensors, (std::vector<std::size_t>{2, 1}));
  EXPECT_EQ(b[3].tensors, (std::vector<std::size_t>{0}));
  std::size_t total = 0;
  for (const auto& x : b) total += x.bytes;
  EXPECT_EQ(total, 1490u);
}

TEST(GradBuckets, OneBucketWhenEverythingFits) {
  auto b = plan_grad_buckets({1, 2, 3}, {0, 1, 2}, 1 << 20);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].tensors.size(), 3u);
  EXPECT_TRUE(plan_grad_buckets({}, {}, 64).empty());
}

TEST(GradBuckets, RefuseAnOrderThatIsNotAPermutation) {
  EXPECT_THROW(plan_grad_buckets({1, 2}, {0, 0}, 64), logic_error);
  EXPECT_THROW(plan_grad_buckets({1, 2}, {0}, 64), logic_error);
  EXPECT_THROW(plan_grad_buckets({1, 2}, {0, 2}, 64), logic_error);
  EXPECT_THROW(plan_grad_buckets({1, 2}, {0, 1}, 0), logic_error);
}

TEST(GradBuckets, AutoSizeIsASixteenthClampedToTheLinkBounds) {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  EXPECT_EQ(auto_grad_bucket_bytes(1 * MiB), 4 * MiB);
  EXPECT_EQ(auto_grad_bucket_bytes(512 * MiB), 32 * MiB);
  EXPECT_EQ(auto_grad_bucket_bytes(2700 * MiB), 64 * MiB);  // the 1.34B GPT's bf16 gradients
}

TEST(GradBuckets, MeasuredSizeKeepsTheTailWithinTwoPercentOfBackward) {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  // The 1.34B GPT on the H100 node (GPU.md): backward 0.116 s, 55 GB/s, 5e9 bf16 params/s = 10 GB/s.
  BucketSizing h100{0.116, 55e9, 10e9, 2700 * MiB};
  const std::size_t b = measured_grad_bucket_bytes(h100);
  const double tail = static_cast<double>(b) / 55e9 + static_cast<double>(b) / 10e9;
  EXPECT_NEAR(tail, 0.02 * 0.116, 1e-6);
  EXPECT_GT(b, 18 * MiB);
  EXPECT_LT(b, 20 * MiB);
  // A longer backward (activations swapped back) allows larger buckets, up to 256 MiB.
  EXPECT_GT(measured_grad_bucket_bytes({0.28, 55e9, 10e9, 2700 * MiB}), b);
  EXPECT_EQ(measured_grad_bucket_bytes({100.0, 55e9, 10e9, 2700 * MiB}), 256 * MiB);
  // At least 4 buckets, and never under the 4 MiB floor.
  EXPECT_EQ(measured_grad_bucket_bytes({100.0, 55e9, 10e9, 64 * MiB}), 16 * MiB);
  EXPECT_EQ(measured_grad_bucket_bytes({1e-4, 55e9, 10e9, 2700 * MiB}), 4 * MiB);
  EXPECT_EQ(measured_grad_bucket_bytes({100.0, 55e9, 10e9, 1 * MiB}), 4 * MiB);
  // Without a measured speed: the unmeasured rule.
  EXPECT_EQ(measured_grad_bucket_bytes({0.1, 0.0, 10e9, 2700 * MiB}), auto_grad_bucket_bytes(2700 * MiB));
  EXPECT_EQ(measured_grad_bucket_bytes({0.0, 55e9, 10e9, 512 * MiB}), auto_grad_bucket_bytes(512 * MiB));
}

TEST(PartialNormsTest, SumOfSquaresMatchesADoubleReferenceInEveryType) {
  std::vector<float> f = {3.f, 4.f, -1.f, 0.5f, 2.f};  // 5 elements: the unrolled body and the tail
  double ref = 0;
  for (float x : f) ref += double(x) * double(x);
  EXPECT_DOUBLE_EQ(sum_of_squares(f.data(), ScalarType::kFloat32, f.size()), ref);
  std::vector<std::uint16_t> bf, h;
  for (float x : f) {
    bf.push_back(float_to_bf16(x));
    h.push_back(float_to_fp16(x));
  }
  // All these values are exact in both 16-bit types.
  EXPECT_DOUBLE_EQ(sum_of_squares(bf.data(), ScalarType::kBFloat16, bf.size()), ref);
  EXPECT_DOUBLE_EQ(sum_of_squares(h.data(), ScalarType::kFloat16, h.size()), ref);
  EXPECT_EQ(sum_of_squares(f.data(), ScalarType::kFloat32, 0), 0.0);
}

TEST(PartialNormsTest, ClipBindsOnlyOnceTheLandedNormAloneExceedsTheBound) {
  PartialNorms n;
  n.add(9.0);  // norm 3
  EXPECT_FALSE(n.clip_must_bind(3.0));   // equal is not enough: the margin
  EXPECT_FALSE(n.clip_must_bind(0.0));   // no clipping
  EXPECT_TRUE(n.clip_must_bind(2.0));
  n.add(16.0);  // norm 5
  EXPECT_DOUBLE_EQ(n.norm(), 5.0);
  EXPECT_TRUE(n.clip_must_bind(4.9));
  EXPECT_EQ(n.buckets(), 2u);
  n.reset();
  EXPECT_EQ(n.norm(), 0.0);
  n.add(std::numeric_limits<double>::infinity());
  EXPECT_TRUE(n.clip_must_bind(1e30));  // a non-finite gradient: speculation is pointless
}

TEST(SplitChooser, ZeroWhenTheCpuKeepsUpWithBackward) {
  SplitInputs in;
  in.cpu_elements_per_second = 5e9;
  in.backward_seconds = 0.5;
  in.elements = 1'340'000'000;  // 0.27 s of CPU
  EXPECT_EQ(choose_gpu_fraction(in), 0.0);
}

TEST(SplitChooser, ShareMakesTheCpuEndWithBackward) {
  SplitInputs in;
  in.cpu_elements_per_second = 1e9;
  in.backward_seconds = 0.6;
  in.elements = 1'000'000'000;  // 1 s of CPU against 0.6 s of backward
  EXPECT_NEAR(choose_gpu_fraction(in), 0.4, 1e-12);
  // With a GPU rate, both sides finish together: (1-f)/1e9 - 0.6 = f/1e10.
  in.gpu_elements_per_second = 1e10;
  const double f = choose_gpu_fraction(in);
  EXPECT_NEAR((1 - f) * 1.0 - 0.6, f * 0.1, 1e-12);
  // And never more than fits: 16 bytes per element, 1.6 GB free -> 10%.
  in.gpu_bytes_per_element = 16;
  in.gpu_free_bytes = 1'600'000'000;
  EXPECT_NEAR(choose_gpu_fraction(in), 0.1, 1e-12);
}

TEST(SplitChooser, DegenerateInputsGiveZero) {
  EXPECT_EQ(choose_gpu_fraction({}), 0.0);
  SplitInputs in;
  in.elements = 10;
  EXPECT_EQ(choose_gpu_fraction(in), 0.0);  // no measured rate yet
}

TEST(GpuShare, RoomIsTheBudgetLeftByThePeakAndAtMostHalfTheFreeMemory) {
  constexpr std::int64_t GiB = std::int64_t{1} << 30;
  EXPECT_EQ(gpu_share_room(60 * GiB, 16 * GiB, 15 * GiB), GiB);
  EXPECT_EQ(gpu_share_room(60 * GiB, 16 * GiB, 17 * GiB), 0);  // the peak passed the budget: no room
  EXPECT_EQ(gpu_share_room(4 * GiB, 80 * GiB, GiB), 2 * GiB);
  EXPECT_EQ(gpu_share_room(60 * GiB, 16 * GiB, 10 * GiB, 15 * GiB), GiB);  // the plan in force predicts more
  EXPECT_EQ(gpu_share_room(5, 80, 0), 2);
}

TEST(GpuShare, SixteenBitParametersNeedAMasterToo) {
  EXPECT_EQ(gpu_share_bytes_per_element(true), 12u);
  EXPECT_EQ(gpu_share_bytes_per_element(false), 8u);
}

TEST(GpuShare, AssignInterleavesAboutTheFraction) {
  EXPECT_EQ(assign_gpu_share({10, 10, 10, 10}, 0.0), (std::vector<bool>{false, false, false, false}));
  EXPECT_EQ(assign_gpu_share({10, 10, 10, 10}, 0.5), (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(assign_gpu_share({10, 10, 10, 10}, 1.0), (std::vector<bool>{true, true, true, true}));
  // A quarter of 8 equal parameters: every fourth, counting half of each as it is weighed.
  const auto q = assign_gpu_share(std::vector<std::size_t>(8, 100), 0.25);
  EXPECT_EQ(q, (std::vector<bool>{false, true, false, false, false, true, false, false}));
  // A large parameter does not go to the GPU when half of it passes the share.
  EXPECT_EQ(assign_gpu_share({1, 1000, 1}, 0.3), (std::vector<bool>{false, false, true}));
  EXPECT_TRUE(assign_gpu_share({}, 0.5).empty());
}

TEST(GradBuckets, LinkProbeIsASixteenthOfTheGradientsWithin1And16MiB) {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  EXPECT_EQ(grad_link_probe_bytes(0), MiB);
  EXPECT_EQ(grad_link_probe_bytes(32 * MiB), 2 * MiB);
  EXPECT_EQ(grad_link_probe_bytes(16 * MiB + 16), MiB + 1);
  EXPECT_EQ(grad_link_probe_bytes(1024 * MiB), 16 * MiB);
}

TEST(BucketSizingSchedule, SizesOnceAtTheFirstSteadyStep) {
  BucketSizingSchedule s(true);
  EXPECT_TRUE(s.pending());
  EXPECT_FALSE(s.due(false, true, 10.0, false));  // the stream carries nothing
  EXPECT_FALSE(s.due(true, false, 10.0, false));  // nothing streamed and stepped in this window: not counted
  EXPECT_FALSE(s.due(true, true, 0.0, false));    // no backward measured: not counted
  EXPECT_FALSE(s.due(true, true, 900.0, false));  // the first also created the states
  EXPECT_FALSE(s.due(true, true, 10.0, false));   // its backward is far from the one before
  EXPECT_FALSE(s.due(true, true, 10.5, true));    // close, but it grew the pinned pool
  EXPECT_TRUE(s.pending());
  EXPECT_TRUE(s.due(true, true, 11.0, false));    // close to the one before, nothing allocated
  EXPECT_FALSE(s.pending());
  EXPECT_FALSE(s.due(true, true, 11.0, false));   // once
  BucketSizingSchedule fixed(false);
  EXPECT_FALSE(fixed.pending());
  EXPECT_FALSE(fixed.due(true, true, 10.0, false));
  EXPECT_FALSE(fixed.due(true, true, 10.0, false));
}

TEST(SteadyStepWatch, WaitsForASettledBackwardWithoutNewPinnedMemoryButNotForever) {
  SteadyStepWatch w;
  EXPECT_FALSE(w.steady(100.0, false));  // the first streamed step created the optimizer states
  EXPECT_TRUE(w.steady(100.0 * (1 + kSteadyBackwardSpread), false));  // within the spread of the one before
  SteadyStepWatch growing;
  for (int n = 1; n < kSteadyStepLimit; ++n) EXPECT_FALSE(growing.steady(100.0, true)) << n;
  EXPECT_TRUE(growing.steady(100.0, true)) << "a pool that keeps growing still decides at the limit";
  SteadyStepWatch unsettled;  // 33 s, 2.1 s, 2.8 s, then 0.095 s: the 1.34B preset's first backwards on an H100
  const double backward_ms[] = {33000, 2100, 2800, 95, 96};
  int steady_at = 0;
  for (int n = 0; n < 5 && !steady_at; ++n)
    if (unsettled.steady(backward_ms[n], false)) steady_at = n + 1;
  EXPECT_EQ(steady_at, 5) << "decided from the first two ordinary backwards";
  EXPECT_EQ(unsettled.streamed_steps(), 5);
}

TEST(GpuShareChoice, AFixedFractionAssignsAtOnceAndNeverChooses) {
  GpuShareChoice c("0.5");
  EXPECT_FALSE(c.pending());
  EXPECT_EQ(c.fraction(), 0.5);
  EXPECT_EQ(c.assign({10, 10, 10, 10}), (std::vector<bool>{true, false, true, false}));
  EXPECT_FALSE(c.choose_now(true, 10.0, false));
  EXPECT_THROW(GpuShareChoice("1.5"), std::exception);
  EXPECT_THROW(GpuShareChoice("half"), std::exception);
}

TEST(GpuShareChoice, AutoChoosesOnceAndNothingWhenNothingWasMeasured) {
  GpuShareChoice c("auto");
  EXPECT_TRUE(c.pending());
  EXPECT_EQ(c.fraction(), 0.0);
  EXPECT_FALSE(c.choose_now(false, 10.0, false));  // nothing streamed yet: not counted
  EXPECT_FALSE(c.choose_now(true, 0.0, false));    // no backward measured: not counted
  EXPECT_FALSE(c.choose_now(true, 10.0, false));   // the first streamed step created the states (Note [Steady step])
  EXPECT_FALSE(c.choose_now(true, 10.0, true));    // the second grew the pinned pool
  EXPECT_TRUE(c.pending());
  EXPECT_TRUE(c.choose_now(true, 10.0, false));
  EXPECT_FALSE(c.choose_now(true, 10.0, false));  // decided once
  ShareMeasurements m;
  m.cpu_elements = 1e9;
  m.cpu_step_ms = 1000;
  m.backward_ms = 0;  // no backward measured
  m.free_bytes = m.budget_bytes = std::int64_t{1} << 40;
  EXPECT_EQ(c.choose({{100, true, false}, {100, true, false}}, m), (std::vector<bool>{false, false}));
  m.backward_ms = 600;
  EXPECT_EQ(c.choose({{100, false, false}}, m), (std::vector<bool>{false}));  // nothing streamed
}

TEST(GpuShareChoice, AutoTakesTheShareThatMakesTheCpuEndWithBackward) {
  // 1e9 elements/s on the CPU, 4e8 elements against 0.2 s of backward: 0.4 s of CPU, half must go.
  GpuShareChoice c("auto");
  ASSERT_FALSE(c.choose_now(true, 200.0, false));
  ASSERT_TRUE(c.choose_now(true, 200.0, false));
  ShareMeasurements m;
  m.cpu_elements = 1e9;
  m.cpu_step_ms = 1000;
  m.backward_ms = 200;
  m.free_bytes = m.budget_bytes = std::int64_t{1} << 40;
  const std::vector<ShareCandidate> four(4, ShareCandidate{100'000'000, true, false});
  EXPECT_EQ(c.choose(four, m), (std::vector<bool>{true, false, true, false}));
  EXPECT_NEAR(c.fraction(), 0.5, 1e-12);
  // The room caps it: 16-bit parameters need 12 bytes per element; 1.2e9 bytes hold 1e8 of 4e8 elements.
  GpuShareChoice small("auto");
  ASSERT_FALSE(small.choose_now(true, 200.0, false));
  ASSERT_TRUE(small.choose_now(true, 200.0, false));
  m.free_bytes = 2'400'000'000;
  m.budget_bytes = 1'200'000'000;
  m.first_step_peak_bytes = 0;
  std::vector<ShareCandidate> half16 = four;
  half16[3].is_16bit = true;
  small.choose(half16, m);
  EXPECT_NEAR(small.fraction(), 0.25, 1e-12);
  // An unstreamed parameter is assigned over but neither measured nor counted.
  GpuShareChoice mixed("auto");
  ASSERT_FALSE(mixed.choose_now(true, 200.0, false));
  ASSERT_TRUE(mixed.choose_now(true, 200.0, false));
  m.free_bytes = m.budget_bytes = std::int64_t{1} << 40;
  std::vector<ShareCandidate> with_cold = four;
  with_cold.push_back({100'000'000, false, true});
  mixed.choose(with_cold, m);
  EXPECT_NEAR(mixed.fraction(), 0.5, 1e-12);
}
