// Note [Gradient content]: exact, order-free, one pass or slab by slab alike.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "tierflow/optimizer/grad_content.hpp"

namespace {

using tierflow::optimizer::combine_grad_content;
using tierflow::optimizer::grad_content;
using tierflow::optimizer::GradContent;
using tierflow::optimizer::kGradContentSlab;
using tierflow::optimizer::same_content;

template <typename T>
std::vector<T> random_bits(std::size_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(rng());  // negative patterns included (sign extension)
  return v;
}

// What a device computes: per slab, sum b and sum b * content_weight(i) (global i), modulo 2^64.
template <typename T>
GradContent by_slabs(const std::vector<T>& v) {
  std::vector<std::uint64_t> sums, weighted;
  for (std::size_t start = 0; start < v.size(); start += kGradContentSlab) {
    std::uint64_t s = 0, w = 0;
    for (std::size_t i = start; i < v.size() && i < start + kGradContentSlab; ++i) {
      const auto b = static_cast<std::uint64_t>(static_cast<std::int64_t>(v[i]));
      s += b;
      w += b * tierflow::optimizer::content_weight(i);
    }
    sums.push_back(s);
    weighted.push_back(w);
  }
  return combine_grad_content(sums.data(), weighted.data(), sums.size());
}

TEST(GradContent, SlabsGiveTheSinglePassResult) {
  for (std::size_t n : {std::size_t{1}, kGradContentSlab - 1, kGradContentSlab, 3 * kGradContentSlab + 17}) {
    const auto a = random_bits<std::int32_t>(n, 1);
    EXPECT_TRUE(same_content(grad_content(a.data(), 4, n), by_slabs(a))) << n;
    const auto b = random_bits<std::int16_t>(n, 2);
    EXPECT_TRUE(same_content(grad_content(b.data(), 2, n), by_slabs(b))) << n;
  }
}

TEST(GradContent, SeesOneChangedElementAndTwoSwapped) {
  auto a = random_bits<std::int32_t>(2 * kGradContentSlab + 5, 3);
  const GradContent before = grad_content(a.data(), 4, a.size());
  EXPECT_TRUE(same_content(before, grad_content(a.data(), 4, a.size())));
  a[kGradContentSlab + 3] ^= 1;  // the lowest mantissa bit of one float
  EXPECT_FALSE(same_content(before, grad_content(a.data(), 4, a.size())));
  a[kGradContentSlab + 3] ^= 1;
  a[0] = 7;
  a[a.size() - 1] = -7;
  const GradContent placed = grad_content(a.data(), 4, a.size());
  std::swap(a[0], a[a.size() - 1]);  // the same values elsewhere: the plain sum holds, the weighted one does not
  const GradContent swapped = grad_content(a.data(), 4, a.size());
  EXPECT_EQ(placed.sum, swapped.sum);
  EXPECT_FALSE(same_content(placed, swapped));
}

TEST(GradContent, SeesSignFlipsThatCancelUnderLinearWeights) {
  // p.grad.data.neg_() of values whose signs run +, -, -, +: each flip is +-2^31 in the bit pattern, and
  // positions 1 + 4 = 2 + 3, so sums weighted by i + 1 held. Pseudo-random weights do not cancel.
  const float values[] = {0.5F, -0.25F, -2.0F, 1.5F};
  std::vector<std::int32_t> a(4), b(4);
  for (int i = 0; i < 4; ++i) {
    const float neg = -values[i];
    std::memcpy(&a[static_cast<std::size_t>(i)], &values[i], 4);
    std::memcpy(&b[static_cast<std::size_t>(i)], &neg, 4);
  }
  EXPECT_FALSE(same_content(grad_content(a.data(), 4, 4), grad_content(b.data(), 4, 4)));
  // Every sign pattern of eight elements, negated: never the same pair.
  for (unsigned mask = 1; mask < 256; ++mask) {
    std::vector<std::int32_t> x(8), y(8);
    for (unsigned i = 0; i < 8; ++i) {
      const float f = (mask >> i & 1U) ? -1.0F - static_cast<float>(i) : 1.0F + static_cast<float>(i);
      const float g = -f;
      std::memcpy(&x[i], &f, 4);
      std::memcpy(&y[i], &g, 4);
    }
    EXPECT_FALSE(same_content(grad_content(x.data(), 4, 8), grad_content(y.data(), 4, 8))) << mask;
  }
}

TEST(GradContent, UnknownNeverMatchesAndOtherWidthsAreRefused) {
  GradContent known = grad_content(nullptr, 4, 0);
  EXPECT_TRUE(same_content(known, known));
  EXPECT_FALSE(same_content(known, GradContent{}));
  EXPECT_FALSE(same_content(GradContent{}, GradContent{}));
  const double x = 1.0;
  EXPECT_THROW(grad_content(&x, 8, 1), std::logic_error);
}

}  // namespace
