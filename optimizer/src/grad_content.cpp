// Note [Gradient content] in grad_content.hpp.
#include "tierflow/optimizer/grad_content.hpp"

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {
namespace {

template <typename Bits>
GradContent content_of(const Bits* b, std::size_t count) {
  // Unsigned arithmetic: wraps modulo 2^64 by definition; the sign extension is the int64 conversion's.
  std::uint64_t sum = 0, weighted = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const auto v = static_cast<std::uint64_t>(static_cast<std::int64_t>(b[i]));
    sum += v;
    weighted += v * content_weight(i);
  }
  return {sum, weighted, true};
}

}  // namespace

GradContent grad_content(const void* data, std::size_t element_bytes, std::size_t count) {
  switch (element_bytes) {
    case 2: return content_of(static_cast<const std::int16_t*>(data), count);
    case 4: return content_of(static_cast<const std::int32_t*>(data), count);
    default:
      throw logic_error("grad_content: elements of " + std::to_string(element_bytes) +
                             " bytes; accepted: 2 (bfloat16, float16) or 4 (float32)");
  }
}

GradContent combine_grad_content(const std::uint64_t* slab_sum, const std::uint64_t* slab_weighted,
                                 std::size_t slabs) {
  std::uint64_t sum = 0, weighted = 0;
  for (std::size_t r = 0; r < slabs; ++r) {
    sum += slab_sum[r];
    weighted += slab_weighted[r];
  }
  return {sum, weighted, true};
}

}  // namespace tierflow::optimizer
