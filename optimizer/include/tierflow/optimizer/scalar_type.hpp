// Element types the optimizer reads and writes, and exact conversions.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace tierflow::optimizer {

/// Element type of a gradient or of the parameter copy written back.
enum class ScalarType : std::uint8_t { kFloat32, kBFloat16, kFloat16 };

/// "float32", "bfloat16" or "float16".
constexpr std::string_view to_string(ScalarType t) noexcept {
  switch (t) {
    case ScalarType::kFloat32: return "float32";
    case ScalarType::kBFloat16: return "bfloat16";
    case ScalarType::kFloat16: return "float16";
  }
  return "?";
}

/// Bytes per element.
constexpr std::size_t element_size(ScalarType t) noexcept {
  return t == ScalarType::kFloat32 ? 4 : 2;
}

/// bfloat16 bits to float (exact).
inline float bf16_to_float(std::uint16_t b) noexcept {
  std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float to bfloat16 bits, round to nearest even; NaN stays NaN (as torch does).
inline std::uint16_t float_to_bf16(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// IEEE half bits to float (exact).
inline float fp16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float to IEEE half bits, round to nearest even, overflow to infinity.
inline std::uint16_t float_to_fp16(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t total = 126 - exp;  // half units are 2^-24; 14 <= total <= 24 here
    std::uint32_t half = mant >> total;
    const std::uint32_t rem = mant & ((1u << total) - 1u);
    const std::uint32_t mid = 1u << (total - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

}  // namespace tierflow::optimizer
