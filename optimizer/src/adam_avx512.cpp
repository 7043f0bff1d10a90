// The AVX-512 Adam kernel: 16 lanes, masked tails, every input type converted
// in registers and the 16-bit copy-out written in the same pass.
//
// bf16 rounding uses integer round-to-nearest-even rather than VCVTNEPS2BF16:
// that instruction treats denormal inputs as zero, and torch's conversion
// (which the copy-out must equal) does not.
#include <immintrin.h>

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

void adam_range_avx512(const AdamTensor& t, const AdamScalars& s, std::size_t begin, std::size_t end) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: return run_out<ScalarType::kFloat32>(t, s, begin, end);
    case ScalarType::kBFloat16: return run_out<ScalarType::kBFloat16>(t, s, begin, end);
    case ScalarType::kFloat16: return run_out<ScalarType::kFloat16>(t, s, begin, end);
  }
}

}  // namespace tierflow::optimizer::detail
