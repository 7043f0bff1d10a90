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

void adam_range_portable_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const AdamOutputs out(t);
  const PackedOutputs q(t);
  if (t.state_format == StateFormat::kBf16) {
    const auto* m16 = static_cast<const std::uint16_t*>(t.m.data);
    const auto* v16 = static_cast<const std::uint16_t*>(t.v.data);
    for (std::size_t i = begin; i < end; ++i) {
      float p = t.master[i], m = bf16_to_float(m16[i]), v = bf16_to_float(v16[i]);
      adam_element(load_grad(t, i), p, m, v, nullptr, s);
      out.master[i] = p;
      static_cast<std::uint16_t*>(q.m.data)[i] = float_to_bf16(m);
      static_cast<std::uint16_t*>(q.v.data)[i] = float_to_bf16(v);
      store_param(t, i, p);
    }
    return;
  }
  const auto* mc = static_cast<const std::uint8_t*>(t.m.data);
  const auto* vc = static_cast<const std::uint8_t*>(t.v.data);
  float mb[kQuantBlock], vb[kQuantBlock];
  for (std::size_t b = begin; b < end; b += kQuantBlock) {
    const std::size_t n = block_length(b, t.numel), block = b / kQuantBlock;
    const float m_scale = t.m.absmax[block], v_scale = t.v.absmax[block];
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = b + j;
      float p = t.master[i], m = decode_m8(mc[i]) * m_scale, v = decode_v8(vc[i]) * v_scale;
      adam_element(load_grad(t, i), p, m, v, nullptr, s);
      out.master[i] = p;
      store_param(t, i, p);
      mb[j] = m;
      vb[j] = v;
    }
    encode_block8(mb, vb, n, static_cast<std::uint8_t*>(q.m.data) + b, static_cast<std::uint8_t*>(q.v.data) + b,
                  q.m.absmax[block], q.v.absmax[block]);
  }
}

}  // namespace tierflow::optimizer::detail
