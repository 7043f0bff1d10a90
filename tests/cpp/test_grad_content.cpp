// Note [Gradient content]: exact, order-free, one pass or slab by slab alike.
#include <gtest/gtest.h>

#include <cstdint>
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

// What a device computes: per slab, sum b and sum b (k + 1), in int64 (no overflow inside a slab).
template <typename T>
GradContent by_slabs(const std::vector<T>& v) {
  std::vector<std::int64_t> sums, weighted;
  for (std::size_t start = 0; start < v.size(); start += kGradContentSlab) {
    std::int64_t s = 0, w = 0;
    for (std::size_t k = 0; start + k < v.size() && k < kGradContentSlab; ++k) {
      s += v[start + k];
      w += static_cast<std::int64_t>(v[start + k]) * static_cast<std::int64_t>(k + 1);
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

TEST(GradContent, UnknownNeverMatchesAndOtherWidthsAreRefused) {
  GradContent known = grad_content(nullptr, 4, 0);
  EXPECT_TRUE(same_content(known, known));
  EXPECT_FALSE(same_content(known, GradContent{}));
  EXPECT_FALSE(same_content(GradContent{}, GradContent{}));
  const double x = 1.0;
  EXPECT_THROW(grad_content(&x, 8, 1), std::logic_error);
}

}  // namespace
