// The formats of a CPU Adam's moments, as TIERFLOW_OPTIMIZER_STATES names them
// (the layouts and kernels: Note [Optimizer state formats] in
// optimizer/state_format.hpp).
#pragma once

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

}  // namespace tierflow
