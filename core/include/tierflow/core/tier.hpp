// The three memory tiers and their names.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace tierflow {

/// Where a block of bytes lives. Order is fastest to slowest.
enum class Tier : std::uint8_t { kGpu = 0, kHost = 1, kNvme = 2 };

/// Number of tiers, for per-tier arrays.
inline constexpr std::size_t kNumTiers = 3;

/// All tiers, fastest first.
inline constexpr std::array<Tier, kNumTiers> kAllTiers{Tier::kGpu, Tier::kHost, Tier::kNvme};

/// Lower-case name used in reports and configuration ("gpu", "host", "nvme").
constexpr std::string_view to_string(Tier t) noexcept {
  switch (t) {
    case Tier::kGpu: return "gpu";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

/// Index of a tier in per-tier arrays.
constexpr std::size_t index(Tier t) noexcept { return static_cast<std::size_t>(t); }

}  // namespace tierflow
