// The AVX-512 Adam kernel: 16 lanes, masked tails, every input type converted
// in registers and the 16-bit copy-out written in the same pass.
//
// bf16 rounding uses integer round-to-nearest-even rather than VCVTNEPS2BF16:
// that instruction treats denormal inputs as zero, and torch's conversion
// (which the copy-out must equal) does not.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on masked intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "adam_kernel.hpp"

#define TIERFLOW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace tierflow::optimizer::detail {
namespace {

template <ScalarType G>
TIERFLOW_AVX512 inline __m512 load_grad(const AdamTensor& t, std::size_t i, __mmask16 k) {
  switch (G) {
    case ScalarType::kFloat32: return _mm512_maskz_loadu_ps(k, static_cast<const float*>(t.grad) + i);
    case ScalarType::kBFloat16: {
      __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(t.grad) + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case ScalarType::kFloat16: {
      __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(t.grad) + i);
      return _mm512_cvtph_ps(h);
    }
  }
  return _mm512_setzero_ps();
}

TIERFLOW_AVX512 inline __m256i to_bf16(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  // NaN stays a quiet NaN with its sign, as in float_to_bf16.
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  r = _mm512_mask_blend_epi32(nan, r, qnan);
  return _mm512_cvtepi32_epi16(r);
}

// P: 0 no copy-out, else 1 + the ScalarType of the copy.
template <int P>
TIERFLOW_AVX512 inline void store_param(const AdamTensor& t, std::size_t i, __mmask16 k, __m512 p) {
  if (P == 0) return;
  switch (static_cast<ScalarType>(P - 1)) {
    case ScalarType::kFloat32: _mm512_mask_storeu_ps(static_cast<float*>(t.param_out) + i, k, p); break;
    case ScalarType::kBFloat16:
      _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(t.param_out) + i, k, to_bf16(p));
      break;
    case ScalarType::kFloat16:
      _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(t.param_out) + i, k,
                               _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

// The same, with non-temporal stores (Note [Streaming stores]); `p` 32-byte
// aligned for 16-bit copies, 64-byte for fp32.
template <int P>
TIERFLOW_AVX512 inline void stream_param(const AdamTensor& t, std::size_t i, __m512 p) {
  if (P == 0) return;
  switch (static_cast<ScalarType>(P - 1)) {
    case ScalarType::kFloat32: _mm512_stream_ps(static_cast<float*>(t.param_out) + i, p); break;
    case ScalarType::kBFloat16:
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(t.param_out) + i), to_bf16(p));
      break;
    case ScalarType::kFloat16:
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(t.param_out) + i),
                          _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

template <ScalarType G, int P, bool kDecoupled, bool kWd, bool kAmsgrad>
TIERFLOW_AVX512 void run(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const __m512 decay = _mm512_set1_ps(s.decay), wd = _mm512_set1_ps(s.wd);
  const __m512 w = _mm512_set1_ps(s.one_minus_b1), b2 = _mm512_set1_ps(s.b2);
  const __m512 omb2 = _mm512_set1_ps(s.one_minus_b2), inv_bc2 = _mm512_set1_ps(s.inv_bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(s.eps), nss = _mm512_set1_ps(s.neg_step_size);
  const __m512i flip = _mm512_set1_epi32(s.maximize ? static_cast<int>(0x80000000u) : 0);
  const __m512 scale = _mm512_set1_ps(s.grad_scale);
  const AdamOutputs out(t);
  // Four vectors per iteration, each operation issued for all four before the
  // next: sqrt and div have long latencies, and independent work hides them
  // (one vector at a time ran ~20% below memory speed when bandwidth was high).
  // Then single vectors, then one masked tail.
  constexpr int U = 4;
  const __mmask16 all = static_cast<__mmask16>(0xffff);
  const Streaming nt = streaming_stores(t, out, begin, end, P == 0 ? 0 : (P == 1 ? 4 : 2));
  std::size_t i = begin;
  for (; i + 16 * U <= end; i += 16 * U) {
    __m512 g[U], p[U], m[U], v[U], vd[U];
    for (int u = 0; u < U; ++u) {
      g[u] = load_grad<G>(t, i + 16 * u, all);
      p[u] = _mm512_loadu_ps(t.master + i + 16 * u);
      m[u] = _mm512_loadu_ps(t.exp_avg + i + 16 * u);
      v[u] = _mm512_loadu_ps(t.exp_avg_sq + i + 16 * u);
    }
    for (int u = 0; u < U; ++u) {
      if (s.scale_grad) g[u] = _mm512_mul_ps(g[u], scale);
      g[u] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g[u]), flip));
      if (kWd) {
        if (kDecoupled) p[u] = _mm512_mul_ps(p[u], decay);
        else g[u] = _mm512_fmadd_ps(wd, p[u], g[u]);
      }
      m[u] = _mm512_fmadd_ps(w, _mm512_sub_ps(g[u], m[u]), m[u]);
      v[u] = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g[u]), g[u], _mm512_mul_ps(v[u], b2));
      vd[u] = v[u];
    }
    if (kAmsgrad) {
      for (int u = 0; u < U; ++u) {
        const __m512 vmax = _mm512_loadu_ps(t.max_exp_avg_sq + i + 16 * u);
        vd[u] = _mm512_max_ps(vmax, v[u]);
        vd[u] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q), vd[u], vmax);
        if (nt.state) _mm512_stream_ps(out.max_exp_avg_sq + i + 16 * u, vd[u]);
        else _mm512_storeu_ps(out.max_exp_avg_sq + i + 16 * u, vd[u]);
      }
    }
    __m512 denom[U];
    for (int u = 0; u < U; ++u) denom[u] = _mm512_sqrt_ps(vd[u]);
    for (int u = 0; u < U; ++u) denom[u] = _mm512_add_ps(_mm512_mul_ps(denom[u], inv_bc2), eps);
    for (int u = 0; u < U; ++u) p[u] = _mm512_add_ps(p[u], _mm512_div_ps(_mm512_mul_ps(nss, m[u]), denom[u]));
    for (int u = 0; u < U; ++u) {
      if (nt.state) {
        _mm512_stream_ps(out.master + i + 16 * u, p[u]);
        _mm512_stream_ps(out.exp_avg + i + 16 * u, m[u]);
        _mm512_stream_ps(out.exp_avg_sq + i + 16 * u, v[u]);
      } else {
        _mm512_storeu_ps(out.master + i + 16 * u, p[u]);
        _mm512_storeu_ps(out.exp_avg + i + 16 * u, m[u]);
        _mm512_storeu_ps(out.exp_avg_sq + i + 16 * u, v[u]);
      }
      if (nt.param) stream_param<P>(t, i + 16 * u, p[u]);
      else store_param<P>(t, i + 16 * u, all, p[u]);
    }
  }
  auto one = [&](std::size_t j, __mmask16 k) TIERFLOW_AVX512 {
      __m512 g = load_grad<G>(t, j, k);
      if (s.scale_grad) g = _mm512_mul_ps(g, scale);
      g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), flip));
      __m512 p = _mm512_maskz_loadu_ps(k, t.master + j);
      __m512 m = _mm512_maskz_loadu_ps(k, t.exp_avg + j);
      __m512 v = _mm512_maskz_loadu_ps(k, t.exp_avg_sq + j);
      if (kWd) {
        if (kDecoupled) p = _mm512_mul_ps(p, decay);
        else g = _mm512_fmadd_ps(wd, p, g);
      }
      m = _mm512_fmadd_ps(w, _mm512_sub_ps(g, m), m);
      v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(v, b2));
      __m512 vd = v;
      if (kAmsgrad) {
        const __m512 vmax = _mm512_maskz_loadu_ps(k, t.max_exp_avg_sq + j);
        vd = _mm512_max_ps(vmax, v);  // returns v when either is NaN
        vd = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q), vd, vmax);
        _mm512_mask_storeu_ps(out.max_exp_avg_sq + j, k, vd);
      }
      const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vd), inv_bc2), eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), denom));
      _mm512_mask_storeu_ps(out.master + j, k, p);
      _mm512_mask_storeu_ps(out.exp_avg + j, k, m);
      _mm512_mask_storeu_ps(out.exp_avg_sq + j, k, v);
      store_param<P>(t, j, k, p);
  };
  for (; i + 16 <= end; i += 16) one(i, all);
  if (i < end) one(i, static_cast<__mmask16>((1u << (end - i)) - 1u));
  if (nt.state || nt.param) _mm_sfence();  // the streamed stores before whatever the caller signals next
}
}  // namespace

namespace {

template <ScalarType G, int P>
void run_flags(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const int key = (s.decoupled ? 4 : 0) | (s.has_wd ? 2 : 0) | (s.amsgrad ? 1 : 0);
  switch (key) {
    case 0: run<G, P, false, false, false>(t, s, begin, end); break;
    case 1: run<G, P, false, false, true>(t, s, begin, end); break;
    case 2: run<G, P, false, true, false>(t, s, begin, end); break;
    case 3: run<G, P, false, true, true>(t, s, begin, end); break;
    case 4: run<G, P, true, false, false>(t, s, begin, end); break;
    case 5: run<G, P, true, false, true>(t, s, begin, end); break;
    case 6: run<G, P, true, true, false>(t, s, begin, end); break;
    case 7: run<G, P, true, true, true>(t, s, begin, end); break;
  }
}

template <ScalarType G>
void run_out(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  if (!t.param_out) return run_flags<G, 0>(t, s, begin, end);
  switch (t.param_type) {
    case ScalarType::kFloat32: return run_flags<G, 1>(t, s, begin, end);
    case ScalarType::kBFloat16: return run_flags<G, 2>(t, s, begin, end);
    case ScalarType::kFloat16: return run_flags<G, 3>(t, s, begin, end);
  }
}

}  // namespace

// ---- Packed moments (Note [Optimizer state formats]) -------------------------
namespace {

TIERFLOW_AVX512 inline __m512 load_bf16(const void* base, std::size_t i, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(base) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TIERFLOW_AVX512 inline __m512 decode_m8(const void* codes, std::size_t i, __mmask16 k, __m512 scale) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(k, static_cast<const std::uint8_t*>(codes) + i));
  // c << 7 puts q in bits 7..13 and the sign in bit 14; adding bit 14 to itself moves it to bit 15.
  const __m256i a = _mm256_slli_epi16(w, 7);
  const __m256i h = _mm256_add_epi16(a, _mm256_and_si256(a, _mm256_set1_epi16(0x4000)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), scale);
}

// `scale`: absmax * 2^-15, exact (kMinVScale), so one multiply rounds as decode_v8(c) * absmax does.
TIERFLOW_AVX512 inline __m512 decode_v8(const void* codes, std::size_t i, __mmask16 k, __m512 scale) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(k, static_cast<const std::uint8_t*>(codes) + i));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(w, 7)), scale);
}

// Non-negative halves rounded to 3 mantissa bits, as encode_m8/encode_v8 do.
TIERFLOW_AVX512 inline __m256i round_to_q(__m256i a) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(a, 7), _mm256_set1_epi16(1));
  return _mm256_srli_epi16(_mm256_add_epi16(a, _mm256_add_epi16(odd, _mm256_set1_epi16(0x3f))), 7);
}

// m's codes in 16-bit lanes. `qmax`: the largest q so far; above 120 only for a NaN (its half is a NaN:
// q >= 248; an infinite m never gets here, its block's scale is not finite).
TIERFLOW_AVX512 inline __m256i encode_m8(__m512 m, __m512 inv, __m256i& qmax) {
  const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(m, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i q = round_to_q(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)));
  qmax = _mm256_max_epu16(qmax, q);
  return _mm256_or_si256(q, _mm256_and_si256(_mm256_srli_epi16(h, 8), _mm256_set1_epi16(0x80)));
}

// `inv`: (1/absmax) * 2^15, exact (kMinVScale); (v * inv) rounds to what (v * (1/absmax)) * 2^15 does.
// v's codes in 16-bit lanes, at least 1 where m's (`mc`) are non-zero (floored_v8). `qmax` as for encode_m8:
// above 240 only for a NaN (an infinite v never gets here: its block goes through encode_block8).
TIERFLOW_AVX512 inline __m256i encode_v8(__m512 v, __m512 inv, __m256i mc, __m256i& qmax) {
  const __m512 y = _mm512_mul_ps(v, inv);
  const __m256i q = round_to_q(_mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  qmax = _mm256_max_epu16(qmax, q);
  const __m256i m_nonzero = _mm256_min_epu16(_mm256_and_si256(mc, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(1));
  return _mm256_max_epu16(q, m_nonzero);
}

TIERFLOW_AVX512 inline std::uint16_t hmax_epu16(__m256i x) {
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 2));
  return static_cast<std::uint16_t>(_mm_extract_epi16(m, 0));
}

// Whether any of the first n floats at x is NaN.
TIERFLOW_AVX512 inline bool any_nan(const float* x, std::size_t n) {
  __mmask16 nan = 0;
  for (std::size_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 a = _mm512_maskz_loadu_ps(k, x + j);
    nan |= _mm512_mask_cmp_ps_mask(k, a, a, _CMP_UNORD_Q);
  }
  return nan != 0;
}

TIERFLOW_AVX512 inline __mmask16 lanes(std::size_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// bf16 moments over [begin, end): 4 vectors at a time, then masked vectors of the tail, each through
// run_packed's `update` (the element update) and stored back rounded to bf16.
template <class Update>
TIERFLOW_AVX512 inline void run_bf16_moments(const AdamTensor& t, const PackedOutputs& q, std::size_t begin,
                                             std::size_t end, Update& update) {
  using One = std::integral_constant<int, 1>;
  using Four = std::integral_constant<int, 4>;
  constexpr __mmask16 all = static_cast<__mmask16>(0xffff);
  const __mmask16 full[4] = {all, all, all, all};
  auto* mo = static_cast<std::uint16_t*>(q.m.data);
  auto* vo = static_cast<std::uint16_t*>(q.v.data);
  std::size_t i = begin;
  for (; i + 64 <= end; i += 64) {
    __m512 m[4], v[4];
    for (int u = 0; u < 4; ++u) {
      m[u] = load_bf16(t.m.data, i + 16 * u, all);
      v[u] = load_bf16(t.v.data, i + 16 * u, all);
    }
    update(Four{}, i, full, m, v);
    for (int u = 0; u < 4; ++u) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mo + i + 16 * u), to_bf16(m[u]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vo + i + 16 * u), to_bf16(v[u]));
    }
  }
  for (; i < end; i += 16) {
    const __mmask16 k = lanes(end - i);
    __m512 m = load_bf16(t.m.data, i, k), v = load_bf16(t.v.data, i, k);
    update(One{}, i, &k, &m, &v);
    _mm256_mask_storeu_epi16(mo + i, k, to_bf16(m));
    _mm256_mask_storeu_epi16(vo + i, k, to_bf16(v));
  }
}

// One 8-bit block's updated moments (mb, vb: its n floats, 64-byte aligned; m_top, v_top: the largest |m| and
// v, NaN ignored) encoded into codes at mo, vo and their scales; an infinity or a NaN in it takes the scalar
// definition (encode_block8, rare).
TIERFLOW_AVX512 inline void encode_block_avx512(const float* mb, const float* vb, std::size_t n, float m_top,
                                                float v_top, std::uint8_t* mo, std::uint8_t* vo, float& m_absmax,
                                                float& v_absmax) {
  if (std::isinf(m_top) || std::isinf(v_top)) {  // an infinite moment (rare): the scalar definition
    encode_block8(mb, vb, n, mo, vo, m_absmax, v_absmax);
    return;
  }
  const BlockScale ms = block_scale(m_top, false, kMinMScale), vs = block_scale(v_top, false, kMinVScale);
  const __m512 m_inv = _mm512_set1_ps(ms.inv), v_inv = _mm512_set1_ps(vs.inv * kVCodeScale);
  const __m256i zero = _mm256_setzero_si256();
  __m256i m_q = zero, v_q = zero;
  for (std::size_t e = 0; e < n; e += 16) {
    const __mmask16 k = lanes(n - e);
    const __m256i mc = ms.inv == 0.f ? zero : encode_m8(_mm512_maskz_load_ps(k, mb + e), m_inv, m_q);
    const __m256i vc = vs.inv == 0.f ? zero : encode_v8(_mm512_maskz_load_ps(k, vb + e), v_inv, mc, v_q);
    _mm_mask_storeu_epi8(mo + e, k, _mm256_cvtepi16_epi8(mc));
    _mm_mask_storeu_epi8(vo + e, k, _mm256_cvtepi16_epi8(vc));
  }
  // A NaN (found in the codes, or by a scan where a block codes as zeros): the scalar definition (rare).
  if ((ms.inv == 0.f ? any_nan(mb, n) : hmax_epu16(m_q) > 120) ||
      (vs.inv == 0.f ? any_nan(vb, n) : hmax_epu16(v_q) > 240)) {
    encode_block8(mb, vb, n, mo, vo, m_absmax, v_absmax);
    return;
  }
  m_absmax = ms.stored;
  v_absmax = vs.stored;
}

template <ScalarType G, int P, StateFormat F, bool kDecoupled, bool kWd>
TIERFLOW_AVX512 void run_packed(const AdamTensor& tensor, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const AdamTensor t = tensor;  // a local copy: its pointers stay in registers across the stores below
  const __m512 decay = _mm512_set1_ps(s.decay), wd = _mm512_set1_ps(s.wd);
  const __m512 w = _mm512_set1_ps(s.one_minus_b1), b2 = _mm512_set1_ps(s.b2);
  const __m512 omb2 = _mm512_set1_ps(s.one_minus_b2), inv_bc2 = _mm512_set1_ps(s.inv_bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(s.eps), nss = _mm512_set1_ps(s.neg_step_size);
  const __m512i flip = _mm512_set1_epi32(s.maximize ? static_cast<int>(0x80000000u) : 0);
  const __m512 scale = _mm512_set1_ps(s.grad_scale);
  const AdamOutputs out(t);
  const PackedOutputs q(t);
  float* const master_out = out.master;
  // The element update of adam_element on U vectors of 16 lanes at i, i + 16, ...
  // (masks k[u]), each operation issued for all U before the next, as the fp32
  // kernel does (sqrt and div have long latencies); m and v in, new m and v out;
  // stores the master and the copy-out.
  auto update = [&](auto unroll, std::size_t i, const __mmask16* k, __m512* m, __m512* v) TIERFLOW_AVX512 {
    constexpr int U = decltype(unroll)::value;
    __m512 g[U], p[U], d[U];
    for (int u = 0; u < U; ++u) {
      g[u] = load_grad<G>(t, i + 16 * u, k[u]);
      p[u] = _mm512_maskz_loadu_ps(k[u], t.master + i + 16 * u);
    }
    for (int u = 0; u < U; ++u) {
      if (s.scale_grad) g[u] = _mm512_mul_ps(g[u], scale);
      g[u] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g[u]), flip));
      if (kWd) {
        if (kDecoupled) p[u] = _mm512_mul_ps(p[u], decay);
        else g[u] = _mm512_fmadd_ps(wd, p[u], g[u]);
      }
      m[u] = _mm512_fmadd_ps(w, _mm512_sub_ps(g[u], m[u]), m[u]);
      v[u] = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g[u]), g[u], _mm512_mul_ps(v[u], b2));
    }
    for (int u = 0; u < U; ++u) d[u] = _mm512_sqrt_ps(v[u]);
    for (int u = 0; u < U; ++u) d[u] = _mm512_add_ps(_mm512_mul_ps(d[u], inv_bc2), eps);
    for (int u = 0; u < U; ++u) p[u] = _mm512_add_ps(p[u], _mm512_div_ps(_mm512_mul_ps(nss, m[u]), d[u]));
    for (int u = 0; u < U; ++u) {
      _mm512_mask_storeu_ps(master_out + i + 16 * u, k[u], p[u]);
      store_param<P>(t, i + 16 * u, k[u], p[u]);
    }
  };
  using One = std::integral_constant<int, 1>;
  using Four = std::integral_constant<int, 4>;
  constexpr __mmask16 all = static_cast<__mmask16>(0xffff);
  const __mmask16 full[4] = {all, all, all, all};
  if (F == StateFormat::kBf16) return run_bf16_moments(t, q, begin, end, update);
  alignas(64) float mb[kQuantBlock], vb[kQuantBlock];
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
  for (std::size_t b = begin; b < end; b += kQuantBlock) {
    const std::size_t n = block_length(b, t.numel), block = b / kQuantBlock;
    const __m512 m_scale = _mm512_set1_ps(t.m.absmax[block]), v_scale = _mm512_set1_ps(t.v.absmax[block] * 0x1p-15f);
    // Largest |m| and v, NaN ignored (max returns its second operand when either is NaN): a NaN
    // shows in the codes below, or, when the block encodes as zeros, in a scan (any_nan); an
    // infinity shows here.
    __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
    // Decodes, updates and keeps U vectors of the block at j in mb and vb.
    auto part = [&](auto unroll, std::size_t j, const __mmask16* k) TIERFLOW_AVX512 {
      constexpr int U = decltype(unroll)::value;
      __m512 m[U], v[U];
      for (int u = 0; u < U; ++u) {
        m[u] = decode_m8(t.m.data, b + j + 16 * u, k[u], m_scale);
        v[u] = decode_v8(t.v.data, b + j + 16 * u, k[u], v_scale);
      }
      update(unroll, b + j, k, m, v);
      for (int u = 0; u < U; ++u) {
        _mm512_store_ps(mb + j + 16 * u, m[u]);
        _mm512_store_ps(vb + j + 16 * u, v[u]);
        const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m[u]), abs_bits));
        m_max = _mm512_mask_max_ps(m_max, k[u], am, m_max);
        v_max = _mm512_mask_max_ps(v_max, k[u], v[u], v_max);
      }
    };
    std::size_t j = 0;
    for (; j + 64 <= n; j += 64) part(Four{}, j, full);
    for (; j < n; j += 16) {
      const __mmask16 k = lanes(n - j);
      part(One{}, j, &k);
    }
    encode_block_avx512(mb, vb, n, _mm512_reduce_max_ps(m_max), _mm512_reduce_max_ps(v_max),
                        static_cast<std::uint8_t*>(q.m.data) + b, static_cast<std::uint8_t*>(q.v.data) + b,
                        q.m.absmax[block], q.v.absmax[block]);
  }
}

template <ScalarType G, int P, StateFormat F>
void packed_flags(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const int key = (s.decoupled ? 2 : 0) | (s.has_wd ? 1 : 0);
  switch (key) {
    case 0: return run_packed<G, P, F, false, false>(t, s, begin, end);
    case 1: return run_packed<G, P, F, false, true>(t, s, begin, end);
    case 2: return run_packed<G, P, F, true, false>(t, s, begin, end);
    case 3: return run_packed<G, P, F, true, true>(t, s, begin, end);
  }
}

template <ScalarType G, int P>
void packed_format(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  if (t.state_format == StateFormat::kBf16) return packed_flags<G, P, StateFormat::kBf16>(t, s, begin, end);
  return packed_flags<G, P, StateFormat::k8bit>(t, s, begin, end);
}

template <ScalarType G>
void packed_out(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  if (!t.param_out) return packed_format<G, 0>(t, s, begin, end);
  switch (t.param_type) {
    case ScalarType::kFloat32: return packed_format<G, 1>(t, s, begin, end);
    case ScalarType::kBFloat16: return packed_format<G, 2>(t, s, begin, end);
    case ScalarType::kFloat16: return packed_format<G, 3>(t, s, begin, end);
  }
}

}  // namespace

void adam_range_avx512_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return packed_out<ScalarType::kFloat32>(t, s, begin, end);
    case ScalarType::kBFloat16: return packed_out<ScalarType::kBFloat16>(t, s, begin, end);
    case ScalarType::kFloat16: return packed_out<ScalarType::kFloat16>(t, s, begin, end);
  }
}

void adam_range_avx512(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return run_out<ScalarType::kFloat32>(t, s, begin, end);
    case ScalarType::kBFloat16: return run_out<ScalarType::kBFloat16>(t, s, begin, end);
    case ScalarType::kFloat16: return run_out<ScalarType::kFloat16>(t, s, begin, end);
  }
}

}  // namespace tierflow::optimizer::detail
