// torch's tensors as optimizer/ names them: dtypes for the CPU and CUDA Adam
// kernels, and a gradient's identity for the step ledger and retry marks.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/scalar_type.hpp"
#include "tierflow/optimizer/step_ledger.hpp"

namespace tierflow::bindings {

/// The kernels' element type of dtype `t`, or nullopt for a dtype they do not take.
inline std::optional<optimizer::ScalarType> kernel_type(at::ScalarType t) noexcept {
  switch (t) {
    case at::kFloat: return optimizer::ScalarType::kFloat32;
    case at::kBFloat16: return optimizer::ScalarType::kBFloat16;
    case at::kHalf: return optimizer::ScalarType::kFloat16;
    default: return std::nullopt;
  }
}

/// kernel_type, where any other dtype is a config_error that names `what` (and
/// `index`, when given) and the accepted dtypes. Nothing is allocated unless it throws.
inline optimizer::ScalarType optimizer_type(at::ScalarType t, std::string_view what,
                                            std::size_t index = static_cast<std::size_t>(-1)) {
  if (const auto k = kernel_type(t)) return *k;
  std::string who(what);
  if (index != static_cast<std::size_t>(-1)) who += " " + std::to_string(index);
  throw config_error(who + ": dtype " + std::string(c10::toString(t)) + "; accepted: float32, bfloat16, float16");
}

/// A gradient as optimizer::StepLedger and StepRetryMarks see it: its TensorImpl and version (Note [Step
/// ledger]); an undefined tensor is the empty identity.
inline optimizer::GradIdentity grad_identity(const at::Tensor& grad) {
  if (!grad.defined()) return {};
  return {reinterpret_cast<std::uintptr_t>(grad.unsafeGetTensorImpl()), static_cast<std::int64_t>(grad._version())};
}

}  // namespace tierflow::bindings
