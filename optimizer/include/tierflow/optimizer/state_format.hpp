// How a CPU Adam keeps its moments: fp32, bf16, or 8-bit block-wise codes.
//
// Note [Optimizer state formats]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TIERFLOW_OPTIMIZER_STATES (keyword optimizer_states=) picks how exp_avg (m)
// and exp_avg_sq (v) are stored between steps. The fp32 master is always fp32,
// and every step computes in fp32 (Note [Adam semantics]): a step decodes m
// and v, updates them and the master exactly as the fp32 kernel does (the
// master's update uses the new m and v before they are stored), then encodes
// the new m and v, all in one pass with the 16-bit copy-out.
//
//   fp32  4 + 4 bytes a parameter; today's kernel, bit for bit.
//   bf16  2 + 2 bytes: each moment rounded to bfloat16, to nearest even.
//   8bit  1 + 1 bytes + two fp32 scales per block of kQuantBlock (256)
//         elements, counted from the tensor's (or shard's) first element
//         (Dettmers et al., ICLR'22: block-wise, dynamic, separate maps):
//     m: a signed code: bit 7 the sign, bits 0..6 q in [0, 120], where q/8
//        spans the exponents and 3 mantissa bits of |m|/absmax(m) as an
//        IEEE half whose exponents 0..15 cover [2^-17, 1] (E4M3, subnormals
//        below 2^-14): y = |m| * (1/absmax); q = the half of y, its 10
//        mantissa bits rounded to 3 (nearest even, in integers).
//     v: an unsigned code q in [0, 240]: the half of (v * (1/absmax)) * 2^15
//        rounded to 3 mantissa bits (E5M3, [2^-32, 1] of absmax). v needs
//        the wider range (v ~ m^2), and where m codes non-zero, v codes at
//        least 1 (2^-32 of its absmax): a v coded 0 under a non-zero m would
//        make the next step's denominator eps and the step lr * m / eps (a
//        review found a 360x lr jump before this floor). A v above its true
//        value only shortens that element's step.
//   Decoding: m = ±half(q << 7) * absmax; v = (half(q << 7) * 2^-15) * absmax.
//   Both use the hardware's fp32<->fp16 conversion (F16C), so encoding is two
//   multiplies, one conversion and four integer operations a moment.
// A block's largest element encodes as exactly 1 (m) or 2^15 (v) and
// decodes to absmax exactly, so decoding then encoding gives back the same
// codes and scales: a checkpoint may carry decoded fp32 moments and resume
// bit for bit (tested in test_state_format.cpp).
// Non-finite moments: a block with a NaN moment, or an infinite m (only an
// infinite gradient makes one, and it makes that element's master NaN in
// fp32 too), stores absmax NaN and codes 0: the whole block decodes to NaN.
// A finite gradient whose square overflows makes v +inf with m finite; fp32
// then steps that element by 0 and keeps it finite, and so does this format:
// v codes 248 (the half +inf), the block's scale is its largest finite v
// (1 if none), and its other elements step as before. A block whose absmax
// is below FLT_MIN (m) or 2^-100 (v) encodes as zeros with absmax 0. The SIMD
// paths encode such rare blocks (a NaN, an infinity) with encode_block8, the
// scalar definition. amsgrad is refused with bf16 and 8-bit moments.
// Buffers: a bf16 moment is a bfloat16 tensor shaped like its parameter (or
// shard); an 8-bit moment is one uint8 tensor of moment_bytes(k8bit, n): the
// n codes, padded to 16 bytes, then the fp32 scales (packed_8bit), so every
// place a moment goes (the gradient stream's out-of-place buffers, NVMe
// files, partitions) moves one tensor per moment, as with fp32. The format of
// a moment is its dtype: float32, bfloat16 or uint8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tierflow/core/state_format.hpp"

namespace tierflow::optimizer {

using tierflow::StateFormat;  // and to_string, parse_state_format: tierflow/core/state_format.hpp
using tierflow::kQuantBlock;
using tierflow::moments_bytes_per_param;
using tierflow::quant_blocks;

/// TIERFLOW_OPTIMIZER_STATES's value `name` as a format; a config_error naming what is accepted otherwise.
StateFormat state_format_named(const std::string& name);

/// One moment in a packed format: `data` holds numel uint16 (bf16 bits) or
/// uint8 codes; `absmax` one fp32 scale per block (8-bit only).
struct PackedMoment {
  void* data = nullptr;
  float* absmax = nullptr;
};

/// Where the scales of an 8-bit moment of `numel` elements begin in its
/// buffer: the codes, padded to 16 bytes, then quant_blocks(numel) fp32 scales.
constexpr std::size_t absmax_offset(std::size_t numel) noexcept { return (numel + 15) / 16 * 16; }

/// Bytes of one moment of `numel` elements in format `f`: 4n, 2n, or the
/// 8-bit buffer (codes, padding, scales; one tensor of uint8 in the bindings).
constexpr std::size_t moment_bytes(StateFormat f, std::size_t numel) noexcept {
  switch (f) {
    case StateFormat::kFp32: return 4 * numel;
    case StateFormat::kBf16: return 2 * numel;
    case StateFormat::k8bit: return absmax_offset(numel) + 4 * quant_blocks(numel);
  }
  return 4 * numel;
}

/// The codes and scales of an 8-bit moment buffer of `numel` elements at `base`.
inline PackedMoment packed_8bit(void* base, std::size_t numel) noexcept {
  return {base, reinterpret_cast<float*>(static_cast<char*>(base) + absmax_offset(numel))};
}

/// Encodes `n` fp32 moments (m, v) into format `f` (not kFp32): what a step
/// stores, block by block from element 0. Used to convert checkpoints.
void encode_moments(StateFormat f, const float* m, const float* v, std::size_t n, PackedMoment m_out,
                    PackedMoment v_out);

/// Decodes `n` moments of format `f` (not kFp32) into fp32.
void decode_moments(StateFormat f, PackedMoment m, PackedMoment v, std::size_t n, float* m_out, float* v_out);

}  // namespace tierflow::optimizer
