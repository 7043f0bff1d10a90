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

void adam_range_avx2(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return run_out<ScalarType::kFloat32>(t, s, begin, end);
    case ScalarType::kBFloat16: return run_out<ScalarType::kBFloat16>(t, s, begin, end);
    case ScalarType::kFloat16: return run_out<ScalarType::kFloat16>(t, s, begin, end);
  }
}

}  // namespace tierflow::optimizer::detail
