// The AVX2 Adam kernel: 8 lanes; the tail (fewer than 8 elements) goes
// through the portable kernel, which computes bit-identical results.
#include <immintrin.h>

#include "adam_kernel.hpp"

#define TIERFLOW_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace tierflow::optimizer::detail {
namespace {

template <ScalarType G>
TIERFLOW_AVX2 inline __m256 load_grad(const AdamTensor& t, std::size_t i) {
  switch (G) {
    case ScalarType::kFloat32: return _mm256_loadu_ps(static_cast<const float*>(t.grad) + i);
    case ScalarType::kBFloat16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(t.grad) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case ScalarType::kFloat16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(t.grad) + i));
      return _mm256_cvtph_ps(h);
    }
  }
  return _mm256_setzero_ps();
}

TIERFLOW_AVX2 inline __m128i to_bf16(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(nan));
  // Pack 8 x 32-bit (each < 65536) to 8 x 16-bit.
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

// P: 0 no copy-out, else 1 + the ScalarType of the copy.
template <int P>
TIERFLOW_AVX2 inline void store_param(const AdamTensor& t, std::size_t i, __m256 p) {
  if (P == 0) return;
  switch (static_cast<ScalarType>(P - 1)) {
    case ScalarType::kFloat32: _mm256_storeu_ps(static_cast<float*>(t.param_out) + i, p); break;
    case ScalarType::kBFloat16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(t.param_out) + i), to_bf16(p));
      break;
    case ScalarType::kFloat16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(t.param_out) + i),
                       _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

template <ScalarType G, int P, bool kDecoupled, bool kWd, bool kAmsgrad>
TIERFLOW_AVX2 void run(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const __m256 decay = _mm256_set1_ps(s.decay), wd = _mm256_set1_ps(s.wd);
  const __m256 w = _mm256_set1_ps(s.one_minus_b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 omb2 = _mm256_set1_ps(s.one_minus_b2), inv_bc2 = _mm256_set1_ps(s.inv_bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps), nss = _mm256_set1_ps(s.neg_step_size);
  const __m256 flip = _mm256_castsi256_ps(_mm256_set1_epi32(s.maximize ? static_cast<int>(0x80000000u) : 0));
  const __m256 scale = _mm256_set1_ps(s.grad_scale);
  const AdamOutputs out(t);
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = load_grad<G>(t, i);
    if (s.scale_grad) g = _mm256_mul_ps(g, scale);
    g = _mm256_xor_ps(g, flip);
    __m256 p = _mm256_loadu_ps(t.master + i);
    __m256 m = _mm256_loadu_ps(t.exp_avg + i);
    __m256 v = _mm256_loadu_ps(t.exp_avg_sq + i);
    if (kWd) {
      if (kDecoupled) p = _mm256_mul_ps(p, decay);
      else g = _mm256_fmadd_ps(wd, p, g);
    }
    m = _mm256_fmadd_ps(w, _mm256_sub_ps(g, m), m);
    v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(v, b2));
    __m256 vd = v;
    if (kAmsgrad) {
      const __m256 vmax = _mm256_loadu_ps(t.max_exp_avg_sq + i);
      vd = _mm256_max_ps(vmax, v);  // returns v when either is NaN
      vd = _mm256_blendv_ps(vd, vmax, _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q));
      _mm256_storeu_ps(out.max_exp_avg_sq + i, vd);
    }
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vd), inv_bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), denom));
    _mm256_storeu_ps(out.master + i, p);
    _mm256_storeu_ps(out.exp_avg + i, m);
    _mm256_storeu_ps(out.exp_avg_sq + i, v);
    store_param<P>(t, i, p);
  }
  if (i < end) adam_range_portable(t, s, i, end);
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

TIERFLOW_AVX2 inline __m256 load_bf16(const void* base, std::size_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(base) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TIERFLOW_AVX2 inline __m128i load8(const void* codes, std::size_t i) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const std::uint8_t*>(codes) + i)));
}

TIERFLOW_AVX2 inline __m256 decode_m8(const void* codes, std::size_t i, __m256 scale) {
  const __m128i w = load8(codes, i);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), scale);
}

TIERFLOW_AVX2 inline __m256 decode_v8(const void* codes, std::size_t i, __m256 scale) {
  const __m256 y = _mm256_cvtph_ps(_mm_slli_epi16(load8(codes, i), 7));
  return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_set1_ps(0x1p-15f)), scale);
}

// Non-negative halves rounded to 3 mantissa bits, as encode_m8/encode_v8 do.
TIERFLOW_AVX2 inline __m128i round_to_q(__m128i a) {
  const __m128i odd = _mm_and_si128(_mm_srli_epi16(a, 7), _mm_set1_epi16(1));
  return _mm_srli_epi16(_mm_add_epi16(a, _mm_add_epi16(odd, _mm_set1_epi16(0x3f))), 7);
}

TIERFLOW_AVX2 inline void store8(void* codes, std::size_t i, __m128i q) {
  _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<std::uint8_t*>(codes) + i), _mm_packus_epi16(q, q));
}

TIERFLOW_AVX2 inline __m128i encode_m8(__m256 m, __m256 inv) {
  const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(m, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i q = round_to_q(_mm_and_si128(h, _mm_set1_epi16(0x7fff)));
  return _mm_or_si128(q, _mm_and_si128(_mm_srli_epi16(h, 8), _mm_set1_epi16(0x80)));
}

TIERFLOW_AVX2 inline __m128i encode_v8(__m256 v, __m256 inv) {
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(v, inv), _mm256_set1_ps(kVCodeScale));
  return round_to_q(_mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

TIERFLOW_AVX2 inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

template <ScalarType G, int P, StateFormat F, bool kDecoupled, bool kWd>
TIERFLOW_AVX2 void run_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  const __m256 decay = _mm256_set1_ps(s.decay), wd = _mm256_set1_ps(s.wd);
  const __m256 w = _mm256_set1_ps(s.one_minus_b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 omb2 = _mm256_set1_ps(s.one_minus_b2), inv_bc2 = _mm256_set1_ps(s.inv_bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps), nss = _mm256_set1_ps(s.neg_step_size);
  const __m256 flip = _mm256_castsi256_ps(_mm256_set1_epi32(s.maximize ? static_cast<int>(0x80000000u) : 0));
  const __m256 scale = _mm256_set1_ps(s.grad_scale);
  const AdamOutputs out(t);
  const PackedOutputs q(t);
  auto update = [&](std::size_t i, __m256& m, __m256& v) TIERFLOW_AVX2 {
    __m256 g = load_grad<G>(t, i);
    if (s.scale_grad) g = _mm256_mul_ps(g, scale);
    g = _mm256_xor_ps(g, flip);
    __m256 p = _mm256_loadu_ps(t.master + i);
    if (kWd) {
      if (kDecoupled) p = _mm256_mul_ps(p, decay);
      else g = _mm256_fmadd_ps(wd, p, g);
    }
    m = _mm256_fmadd_ps(w, _mm256_sub_ps(g, m), m);
    v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(v, b2));
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), inv_bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), denom));
    _mm256_storeu_ps(out.master + i, p);
    store_param<P>(t, i, p);
  };
  if (F == StateFormat::kBf16) {
    std::size_t i = begin;
    for (; i + 8 <= end; i += 8) {
      __m256 m = load_bf16(t.m.data, i), v = load_bf16(t.v.data, i);
      update(i, m, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(q.m.data) + i), to_bf16(m));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(q.v.data) + i), to_bf16(v));
    }
    if (i < end) adam_range_portable_packed(t, s, i, end);
    return;
  }
  alignas(32) float mb[kQuantBlock], vb[kQuantBlock];
  const __m256 abs_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (std::size_t b = begin; b < end; b += kQuantBlock) {
    const std::size_t n = block_length(b, t.numel), block = b / kQuantBlock;
    if (n % 8 != 0) {  // the tensor's last block, short: the portable kernel (bit-identical)
      adam_range_portable_packed(t, s, b, end);
      return;
    }
    const __m256 m_scale = _mm256_set1_ps(t.m.absmax[block]), v_scale = _mm256_set1_ps(t.v.absmax[block]);
    __m256 m_max = _mm256_setzero_ps(), v_max = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (std::size_t j = 0; j < n; j += 8) {
      __m256 m = decode_m8(t.m.data, b + j, m_scale), v = decode_v8(t.v.data, b + j, v_scale);
      update(b + j, m, v);
      _mm256_store_ps(mb + j, m);
      _mm256_store_ps(vb + j, v);
      m_max = _mm256_max_ps(_mm256_and_ps(m, abs_bits), m_max);  // keeps m_max where |m| is NaN
      v_max = _mm256_max_ps(v, v_max);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(m, v, _CMP_UNORD_Q));
    }
    auto* mo = static_cast<std::uint8_t*>(q.m.data) + b;
    auto* vo = static_cast<std::uint8_t*>(q.v.data) + b;
    const float m_top = hmax(m_max), v_top = hmax(v_max);
    if (_mm256_movemask_ps(nan) != 0 || std::isinf(m_top) || std::isinf(v_top)) {
      // a NaN or an infinite moment (rare): the scalar definition
      encode_block8(mb, vb, n, mo, vo, q.m.absmax[block], q.v.absmax[block]);
      continue;
    }
    const BlockScale ms = block_scale(m_top, false, kMinMScale), vs = block_scale(v_top, false, kMinVScale);
    const __m256 m_inv = _mm256_set1_ps(ms.inv), v_inv = _mm256_set1_ps(vs.inv);
    const __m128i zero = _mm_setzero_si128(), mag = _mm_set1_epi16(0x7f), one = _mm_set1_epi16(1);
    for (std::size_t j = 0; j < n; j += 8) {
      const __m128i mc = ms.inv == 0.f ? zero : encode_m8(_mm256_load_ps(mb + j), m_inv);
      __m128i vc = vs.inv == 0.f ? zero : encode_v8(_mm256_load_ps(vb + j), v_inv);
      if (vs.inv != 0.f) vc = _mm_max_epu16(vc, _mm_min_epu16(_mm_and_si128(mc, mag), one));  // floored_v8
      store8(mo, j, mc);
      store8(vo, j, vc);
    }
    q.m.absmax[block] = ms.stored;
    q.v.absmax[block] = vs.stored;
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

void adam_range_avx2_packed(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return packed_out<ScalarType::kFloat32>(t, s, begin, end);
    case ScalarType::kBFloat16: return packed_out<ScalarType::kBFloat16>(t, s, begin, end);
    case ScalarType::kFloat16: return packed_out<ScalarType::kFloat16>(t, s, begin, end);
  }
}

void adam_range_avx2(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return run_out<ScalarType::kFloat32>(t, s, begin, end);
    case ScalarType::kBFloat16: return run_out<ScalarType::kBFloat16>(t, s, begin, end);
    case ScalarType::kFloat16: return run_out<ScalarType::kFloat16>(t, s, begin, end);
  }
}

}  // namespace tierflow::optimizer::detail
