// Internal: the per-ISA Adam range kernels and what they share.
// See Note [Adam semantics] in cpu_adam.hpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierflow/optimizer/cpu_adam.hpp"

namespace tierflow::optimizer::detail {

/// Elements per parallel task: 4 MiB of each fp32 array keeps every stream long
/// enough for the hardware prefetchers (measured: 2^16 ran ~10% slower than
/// 2^20 at 1e8 elements with 2 threads) and still balances two threads.
/// The roofline kernel uses the same chunking.
inline constexpr std::size_t kChunkElements = std::size_t{1} << 20;
static_assert(kChunkElements % kQuantBlock == 0, "8-bit ranges must begin on a block boundary");

/// Per-step scalars, each rounded to fp32 exactly as torch rounds its Python scalars.
struct AdamScalars {
  float decay;          // 1 - lr*wd (AdamW)
  float wd;             // wd (Adam's L2 term)
  float one_minus_b1;   // lerp weight
  float b2;
  float one_minus_b2;
  float inv_bc2_sqrt;   // 1 / sqrt(1 - b2^t), rounded once
  float eps;
  float neg_step_size;  // -lr / (1 - b1^t)
  bool has_wd;
  bool decoupled;
  bool maximize;
  bool amsgrad;
  bool scale_grad;
  float grad_scale;
};

/// The scalars of step `step`, shared by the CPU and CUDA kernels: bias
/// corrections in double, as torch computes them in Python, then rounded once.
inline AdamScalars make_scalars(const AdamOptions& o, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  AdamScalars s{};
  s.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  s.wd = static_cast<float>(o.weight_decay);
  s.one_minus_b1 = static_cast<float>(1.0 - o.beta1);
  s.b2 = static_cast<float>(o.beta2);
  s.one_minus_b2 = static_cast<float>(1.0 - o.beta2);
  s.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(o.eps);
  s.neg_step_size = static_cast<float>(-(o.lr / bc1));
  s.has_wd = o.weight_decay != 0.0;
  s.decoupled = o.decoupled_weight_decay;
  s.maximize = o.maximize;
  s.amsgrad = o.amsgrad;
  s.grad_scale = static_cast<float>(o.grad_scale);
  s.scale_grad = o.grad_scale != 1.0;
  return s;
}

/// Output pointers of a tensor: the out-of-place ones, or the inputs.
struct AdamOutputs {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  explicit AdamOutputs(const AdamTensor& t)
      : master(t.master_out ? t.master_out : t.master),
        exp_avg(t.exp_avg_out ? t.exp_avg_out : t.exp_avg),
        exp_avg_sq(t.exp_avg_sq_out ? t.exp_avg_sq_out : t.exp_avg_sq),
        max_exp_avg_sq(t.max_exp_avg_sq_out ? t.max_exp_avg_sq_out : t.max_exp_avg_sq) {}
};

/// Note [Streaming stores]
/// ~~~~~~~~~~~~~~~~~~~~~~~
/// An out-of-place step (the gradient stream's, Note [Step during backward])
/// writes its new master, m and v into arrays it did not read, and every step
/// writes the 16-bit (or fp32) weights into staging that only a DMA to the
/// device or the next forward reads. Ordinary stores first read each of those
/// lines into the cache (read-for-ownership): 14 more bytes read per element
/// for the 30 the out-of-place step moves anyway, on the host memory bandwidth
/// the copies beside it share. Non-temporal stores skip that read. They are
/// used for a chunk of at least kStreamingStoreElements (smaller outputs are
/// likely read again from the cache) whose outputs are aligned for them; the
/// kernel ends with an sfence, so the stores are visible before the caller
/// (TBB's join, then the worker's handoff) signals the step done. In-place
/// outputs keep ordinary stores: their lines are in the cache already.
inline constexpr std::size_t kStreamingStoreElements = std::size_t{1} << 16;

/// Which outputs of a chunk take non-temporal stores (Note [Streaming stores]).
struct Streaming {
  bool state = false;  ///< master, m, v (and max v): out of place
  bool param = false;  ///< the weights' copy-out
};

inline bool aligned_to(const void* p, std::size_t a) noexcept { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

/// `param_bytes`: the copy-out's element size (0: none).
inline Streaming streaming_stores(const AdamTensor& t, const AdamOutputs& out, std::size_t begin, std::size_t end,
                                  std::size_t param_bytes) noexcept {
  Streaming s;
  if (end - begin < kStreamingStoreElements) return s;
  s.state = t.master_out != nullptr && aligned_to(out.master + begin, 64) && aligned_to(out.exp_avg + begin, 64) &&
            aligned_to(out.exp_avg_sq + begin, 64) &&
            (!t.max_exp_avg_sq_out || aligned_to(out.max_exp_avg_sq + begin, 64));
  s.param = param_bytes != 0 &&
            aligned_to(static_cast<const char*>(t.param_out) + begin * param_bytes, param_bytes == 4 ? 64 : 32);
  return s;
}

/// One element, in the exact operation order of torch's vectorized kernels
/// (lerp and add-with-alpha and addcmul are fused multiply-adds there).
inline void adam_element(float g, float& p, float& m, float& v, float* vmax, const AdamScalars& s) {
  if (s.scale_grad) g = g * s.grad_scale;
  if (s.maximize) g = -g;
  if (s.has_wd) {
    if (s.decoupled) p = p * s.decay;
    else g = std::fma(s.wd, p, g);
  }
  m = std::fma(s.one_minus_b1, g - m, m);
  v = std::fma(s.one_minus_b2 * g, g, v * s.b2);
  float vd = v;
  if (vmax) {
    vd = (std::isnan(v) || std::isnan(*vmax)) ? NAN : (v > *vmax ? v : *vmax);
  }
  const float denom = std::sqrt(vd) * s.inv_bc2_sqrt + s.eps;
  p = p + (s.neg_step_size * m) / denom;
}

// ---- Packed moments (Note [Optimizer state formats]) -------------------------

/// m's code of y = m * (1/absmax), |y| <= 1: sign in bit 7, q <= 120 below.
inline std::uint8_t encode_m8(float y) noexcept {
  const std::uint16_t h = float_to_fp16(y);
  const unsigned a = h & 0x7fffu;
  const unsigned q = (a + 0x3fu + ((a >> 7) & 1u)) >> 7;
  return static_cast<std::uint8_t>(q | ((h >> 8) & 0x80u));
}

/// m / absmax of code `c`.
inline float decode_m8(std::uint8_t c) noexcept {
  return fp16_to_float(static_cast<std::uint16_t>(((c & 0x7fu) << 7) | ((c & 0x80u) << 8)));
}

/// v's code of y = (v * (1/absmax)) * 2^15, 0 <= y <= 2^15: q <= 240.
inline std::uint8_t encode_v8(float y) noexcept {
  const unsigned h = float_to_fp16(y);
  return static_cast<std::uint8_t>((h + 0x3fu + ((h >> 7) & 1u)) >> 7);
}

/// v / absmax of code `c`.
inline float decode_v8(std::uint8_t c) noexcept {
  return fp16_to_float(static_cast<std::uint16_t>(c << 7)) * 0x1p-15f;
}

inline constexpr float kVCodeScale = 32768.f;  // 2^15

/// What a block stores as its scale, and the factor its moments are encoded with.
struct BlockScale {
  float stored;  ///< absmax; 0 below FLT_MIN; NaN for a non-finite block
  float inv;     ///< 1/absmax; 0 when the block's codes are all 0
};

/// Below these a block's moments encode as zeros with scale 0: m below the
/// smallest normal float; v below 2^-100, so that absmax * 2^-15 and
/// (1/absmax) * 2^15 are exact and a SIMD path may fold them into one factor.
inline constexpr float kMinMScale = 1.17549435e-38f, kMinVScale = 0x1p-100f;

/// The scale of a block whose largest |moment| (NaN ignored) is `absmax`, `nan`
/// if one was NaN; scales below `min` encode as zeros.
inline BlockScale block_scale(float absmax, bool nan, float min) noexcept {
  if (nan || !(absmax <= 3.4028234664e38f)) return {NAN, 0.f};
  if (absmax < min) return {0.f, 0.f};
  return {absmax, 1.f / absmax};
}

/// v's block scale (Note [Optimizer state formats]): `finite_max` the largest
/// finite v (NaN and +inf ignored), `nan` whether one was NaN, `inf` whether
/// one was +inf (a finite gradient's square can overflow: that element codes
/// as 248, the half +inf, so its step is 0 as in fp32, and the block keeps a
/// positive scale for it).
inline BlockScale v_block_scale(float finite_max, bool nan, bool inf) noexcept {
  if (nan) return {NAN, 0.f};
  const BlockScale s = block_scale(finite_max, false, kMinVScale);
  if (inf && s.inv == 0.f) return {1.f, 1.f};
  return s;
}

/// v's code where m's is `m_code`: at least 1 (v's smallest non-zero value,
/// 2^-32 of its scale) under a non-zero m, since a v coded 0 there would make
/// the next step's denominator eps; a larger v only shortens that step.
inline std::uint8_t floored_v8(std::uint8_t v_code, std::uint8_t m_code) noexcept {
  return v_code == 0 && (m_code & 0x7fu) != 0 ? std::uint8_t{1} : v_code;
}

/// Encodes one block of `n` new moments (m[j], v[j]) into codes and scales:
/// the scalar definition the SIMD paths match bit for bit.
inline void encode_block8(const float* m, const float* v, std::size_t n, std::uint8_t* mo, std::uint8_t* vo,
                          float& m_absmax, float& v_absmax) noexcept {
  float m_max = 0.f, v_max = 0.f;
  bool m_nan = false, v_nan = false, v_inf = false;
  for (std::size_t j = 0; j < n; ++j) {
    const float am = std::fabs(m[j]);
    m_max = am > m_max ? am : m_max;
    m_nan = m_nan || std::isnan(m[j]);
    v_nan = v_nan || std::isnan(v[j]);
    if (std::isinf(v[j])) v_inf = true;
    else if (v[j] > v_max) v_max = v[j];
  }
  const BlockScale ms = block_scale(m_max, m_nan, kMinMScale), vs = v_block_scale(v_max, v_nan, v_inf);
  for (std::size_t j = 0; j < n; ++j) {
    mo[j] = ms.inv == 0.f ? std::uint8_t{0} : encode_m8(m[j] * ms.inv);
    vo[j] = vs.inv == 0.f ? std::uint8_t{0} : floored_v8(encode_v8((v[j] * vs.inv) * kVCodeScale), mo[j]);
  }
  m_absmax = ms.stored;
  v_absmax = vs.stored;
}

/// Elements of a moment's block at `begin` (the tensor's last block may be short).
inline std::size_t block_length(std::size_t begin, std::size_t numel) noexcept {
  return numel - begin < kQuantBlock ? numel - begin : kQuantBlock;
}

/// Output moments of a packed step: the out-of-place ones, or the inputs.
struct PackedOutputs {
  PackedMoment m, v;
  explicit PackedOutputs(const AdamTensor& t) : m(t.m_out.data ? t.m_out : t.m), v(t.v_out.data ? t.v_out : t.v) {}
};

/// Scalar update of [begin, end) including the copy-out; exact reference for the SIMD paths.
void adam_range_portable(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end);
/// The same for bf16 or 8-bit moments; 8-bit ranges begin on a block boundary.
void adam_range_portable_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end);
/// AVX2 + FMA + F16C; tails go through adam_range_portable.
void adam_range_avx2(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end);
/// AVX-512 (F, BW, VL) + FMA + F16C, masked tails.
void adam_range_avx512(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end);
/// Packed moments on each SIMD path (block-aligned ranges for 8-bit).
void adam_range_avx2_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end);
void adam_range_avx512_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end);

}  // namespace tierflow::optimizer::detail
