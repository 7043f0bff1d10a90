// See Note [Optimizer state formats] in state_format.hpp.
#include "tierflow/optimizer/state_format.hpp"

#include <cmath>

#include "adam_kernel.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {

void encode_moments(StateFormat f, const float* m, const float* v, std::size_t n, PackedMoment m_out,
                    PackedMoment v_out) {
  TIERFLOW_EXPECTS(f != StateFormat::kFp32, "encode_moments: fp32 moments are not packed");
  if (f == StateFormat::kBf16) {
    for (std::size_t i = 0; i < n; ++i) {
      static_cast<std::uint16_t*>(m_out.data)[i] = float_to_bf16(m[i]);
      static_cast<std::uint16_t*>(v_out.data)[i] = float_to_bf16(v[i]);
    }
    return;
  }
  for (std::size_t b = 0; b < n; b += kQuantBlock) {
    const std::size_t len = detail::block_length(b, n), block = b / kQuantBlock;
    float m_max = 0.f, v_max = 0.f;
    bool m_nan = false, v_nan = false;
    for (std::size_t i = b; i < b + len; ++i) {
      const float am = std::fabs(m[i]);
      m_max = am > m_max ? am : m_max;
      v_max = v[i] > v_max ? v[i] : v_max;
      m_nan = m_nan || std::isnan(m[i]);
      v_nan = v_nan || std::isnan(v[i]);
    }
    const detail::BlockScale ms = detail::block_scale(m_max, m_nan, detail::kMinMScale), vs = detail::block_scale(v_max, v_nan, detail::kMinVScale);
    for (std::size_t i = b; i < b + len; ++i) {
      static_cast<std::uint8_t*>(m_out.data)[i] = ms.inv == 0.f ? 0 : detail::encode_m8(m[i] * ms.inv);
      static_cast<std::uint8_t*>(v_out.data)[i] =
          vs.inv == 0.f ? 0 : detail::encode_v8((v[i] * vs.inv) * detail::kVCodeScale);
    }
    m_out.absmax[block] = ms.stored;
    v_out.absmax[block] = vs.stored;
  }
}

void decode_moments(StateFormat f, PackedMoment m, PackedMoment v, std::size_t n, float* m_out, float* v_out) {
  TIERFLOW_EXPECTS(f != StateFormat::kFp32, "decode_moments: fp32 moments are not packed");
  for (std::size_t i = 0; i < n; ++i) {
    if (f == StateFormat::kBf16) {
      m_out[i] = bf16_to_float(static_cast<const std::uint16_t*>(m.data)[i]);
      v_out[i] = bf16_to_float(static_cast<const std::uint16_t*>(v.data)[i]);
    } else {
      m_out[i] = detail::decode_m8(static_cast<const std::uint8_t*>(m.data)[i]) * m.absmax[i / kQuantBlock];
      v_out[i] = detail::decode_v8(static_cast<const std::uint8_t*>(v.data)[i]) * v.absmax[i / kQuantBlock];
    }
  }
}

}  // namespace tierflow::optimizer
