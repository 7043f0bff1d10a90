// See Note [Optimizer state formats] in state_format.hpp.
#include "tierflow/optimizer/state_format.hpp"

#include <cmath>

#include "adam_kernel.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {

StateFormat state_format_named(const std::string& name) {
  const auto f = parse_state_format(name);
  if (!f) throw config_error("optimizer state format '" + name +
                             "'; accepted: fp32, bf16, 8bit (TIERFLOW_OPTIMIZER_STATES, keyword optimizer_states)");
  return *f;
}

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
    const std::size_t block = b / kQuantBlock;
    detail::encode_block8(m + b, v + b, detail::block_length(b, n), static_cast<std::uint8_t*>(m_out.data) + b,
                          static_cast<std::uint8_t*>(v_out.data) + b, m_out.absmax[block], v_out.absmax[block]);
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
