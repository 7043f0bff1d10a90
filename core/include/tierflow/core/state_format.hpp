// The formats of a CPU Adam's moments, as TIERFLOW_OPTIMIZER_STATES names them,
// and their sizes, for the planner and the optimizer alike (the layouts and
// kernels: Note [Optimizer state formats] in optimizer/state_format.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tierflow {

/// How exp_avg and exp_avg_sq are stored between steps.
enum class StateFormat : std::uint8_t { kFp32, kBf16, k8bit };

/// "fp32", "bf16" or "8bit".
constexpr const char* to_string(StateFormat f) noexcept {
  switch (f) {
    case StateFormat::kFp32: return "fp32";
    case StateFormat::kBf16: return "bf16";
    case StateFormat::k8bit: return "8bit";
  }
  return "?";
}

/// The format named `name`; nullopt otherwise.
constexpr std::optional<StateFormat> parse_state_format(std::string_view name) noexcept {
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::k8bit})
    if (name == to_string(f)) return f;
  return std::nullopt;
}

/// Elements sharing one scale in the 8-bit format.
inline constexpr std::size_t kQuantBlock = 256;

/// Scales (per moment) of `numel` elements in the 8-bit format.
constexpr std::size_t quant_blocks(std::size_t numel) noexcept { return (numel + kQuantBlock - 1) / kQuantBlock; }

/// Bytes a parameter of both moments in format `f` (scales amortised): 8, 4
/// or 2 + 8/256. Add 4 for an fp32 master.
constexpr double moments_bytes_per_param(StateFormat f) noexcept {
  switch (f) {
    case StateFormat::kFp32: return 8.0;
    case StateFormat::kBf16: return 4.0;
    case StateFormat::k8bit: return 2.0 + 8.0 / static_cast<double>(kQuantBlock);
  }
  return 8.0;
}

}  // namespace tierflow
