// The one clock of tierflow's timings: std::chrono::steady_clock in nanoseconds.
#pragma once

#include <chrono>
#include <cstdint>

namespace tierflow {

/// Nanoseconds on the steady clock (monotonic; for durations, not dates).
inline std::uint64_t now_ns() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

}  // namespace tierflow
