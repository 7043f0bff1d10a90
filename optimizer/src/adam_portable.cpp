// The portable Adam kernel: one element at a time, the reference for the SIMD paths.
#include "adam_kernel.hpp"

namespace tierflow::optimizer::detail {
namespace {

inline float load_grad(const AdamTensor& t, std::size_t i) noexcept {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return static_cast<const float*>(t.grad)[i];
    case ScalarType::kBFloat16: return bf16_to_float(static_cast<const std::uint16_t*>(t.grad)[i]);
    case ScalarType::kFloat16: return fp16_to_float(static_cast<const std::uint16_t*>(t.grad)[i]);
  }
  return 0.f;
}

inline void store_param(const AdamTensor& t, std::size_t i, float p) noexcept {
  if (!t.param_out) return;
  switch (t.param_type) {
    case ScalarType::kFloat32: static_cast<float*>(t.param_out)[i] = p; break;
    case ScalarType::kBFloat16: static_cast<std::uint16_t*>(t.param_out)[i] = float_to_bf16(p); break;
    case ScalarType::kFloat16: static_cast<std::uint16_t*>(t.param_out)[i] = float_to_fp16(p); break;
  }
}

}  // namespace

void adam_range_portable(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const AdamOutputs out(t);
  for (std::size_t i = begin; i < end; ++i) {
    float p = t.master[i], m = t.exp_avg[i], v = t.exp_avg_sq[i];
    float vmax = s.amsgrad ? t.max_exp_avg_sq[i] : 0.f;
    adam_element(load_grad(t, i), p, m, v, s.amsgrad ? &vmax : nullptr, s);
    out.master[i] = p;
    out.exp_avg[i] = m;
    out.exp_avg_sq[i] = v;
    if (s.amsgrad) out.max_exp_avg_sq[i] = (std::isnan(v) || std::isnan(vmax)) ? NAN : (v > vmax ? v : vmax);
    store_param(t, i, p);
  }
}

}  // namespace tierflow::optimizer::detail
