#include "tierflow/optimizer/roofline.hpp"

#include "adam_kernel.hpp"

#include <immintrin.h>

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on masked intrinsics (as in adam_avx512.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace tierflow::optimizer {
namespace {

using detail::kChunkElements;  // as CpuAdam

#define TIERFLOW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// Trivial arithmetic, same bytes: p += g, m += g, v += g, out = p (truncated to 16 bits).
TIERFLOW_AVX512 void traffic_avx512(const AdamTensor& t, std::size_t b, std::size_t e) {
  const bool g16 = t.grad_type != ScalarType::kFloat32;
  const bool o16 = t.param_out && t.param_type != ScalarType::kFloat32;
  for (std::size_t i = b; i < e; i += 16) {
    const std::size_t left = e - i;
    const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    __m512 g;
    if (g16) {
      __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(t.grad) + i);
      g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      g = _mm512_maskz_loadu_ps(k, static_cast<const float*>(t.grad) + i);
    }
    __m512 p = _mm512_add_ps(_mm512_maskz_loadu_ps(k, t.master + i), g);
    _mm512_mask_storeu_ps(t.exp_avg + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, t.exp_avg + i), g));
    _mm512_mask_storeu_ps(t.exp_avg_sq + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, t.exp_avg_sq + i), g));
    _mm512_mask_storeu_ps(t.master + i, k, p);
    if (o16) {
      _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(t.param_out) + i, k,
                               _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    } else if (t.param_out) {
      _mm512_mask_storeu_ps(static_cast<float*>(t.param_out) + i, k, p);
    }
  }
}

// Packed moments (Note [Optimizer state formats]): the same master, gradient
// and copy-out traffic, and the moments' own bytes: 16-bit m and v, or 8-bit
// codes and a scale per block read and written.
TIERFLOW_AVX512 void traffic_packed_avx512(const AdamTensor& t, std::size_t b, std::size_t e) {
  const bool g16 = t.grad_type != ScalarType::kFloat32;
  const bool o16 = t.param_out && t.param_type != ScalarType::kFloat32;
  const bool q8 = t.state_format == StateFormat::k8bit;
  for (std::size_t i = b; i < e; i += 16) {
    const std::size_t left = e - i;
    const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    __m512 g;
    __m256i gbits;
    if (g16) {
      gbits = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(t.grad) + i);
      g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(gbits), 16));
    } else {
      g = _mm512_maskz_loadu_ps(k, static_cast<const float*>(t.grad) + i);
      gbits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(g), 16));
    }
    const __m512 p = _mm512_add_ps(_mm512_maskz_loadu_ps(k, t.master + i), g);
    if (q8) {
      const __m128i g8 = _mm256_cvtepi16_epi8(gbits);
      for (void* d : {t.m.data, t.v.data}) {
        auto* c = static_cast<std::uint8_t*>(d) + i;
        _mm_mask_storeu_epi8(c, k, _mm_add_epi8(_mm_maskz_loadu_epi8(k, c), g8));
      }
      if (i % kQuantBlock == 0) {
        t.m.absmax[i / kQuantBlock] += 1.f;
        t.v.absmax[i / kQuantBlock] += 1.f;
      }
    } else {
      for (void* d : {t.m.data, t.v.data}) {
        auto* h = static_cast<std::uint16_t*>(d) + i;
        _mm256_mask_storeu_epi16(h, k, _mm256_add_epi16(_mm256_maskz_loadu_epi16(k, h), gbits));
      }
    }
    _mm512_mask_storeu_ps(t.master + i, k, p);
    if (o16) {
      _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(t.param_out) + i, k,
                               _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    } else if (t.param_out) {
      _mm512_mask_storeu_ps(static_cast<float*>(t.param_out) + i, k, p);
    }
  }
}

void traffic_portable(const AdamTensor& t, std::size_t b, std::size_t e) {
  for (std::size_t i = b; i < e; ++i) {
    float g = t.grad_type == ScalarType::kFloat32 ? static_cast<const float*>(t.grad)[i]
                                                  : bf16_to_float(static_cast<const std::uint16_t*>(t.grad)[i]);
    float p = t.master[i] + g;
    if (t.state_format == StateFormat::kFp32) {
      t.exp_avg[i] += g;
      t.exp_avg_sq[i] += g;
    } else if (t.state_format == StateFormat::kBf16) {
      static_cast<std::uint16_t*>(t.m.data)[i] = static_cast<std::uint16_t>(static_cast<std::uint16_t*>(t.m.data)[i] + 1);
      static_cast<std::uint16_t*>(t.v.data)[i] = static_cast<std::uint16_t>(static_cast<std::uint16_t*>(t.v.data)[i] + 1);
    } else {
      static_cast<std::uint8_t*>(t.m.data)[i] = static_cast<std::uint8_t>(static_cast<std::uint8_t*>(t.m.data)[i] + 1);
      static_cast<std::uint8_t*>(t.v.data)[i] = static_cast<std::uint8_t>(static_cast<std::uint8_t*>(t.v.data)[i] + 1);
      if (i % kQuantBlock == 0) {
        t.m.absmax[i / kQuantBlock] += 1.f;
        t.v.absmax[i / kQuantBlock] += 1.f;
      }
    }
    t.master[i] = p;
    if (!t.param_out) continue;
    if (t.param_type == ScalarType::kFloat32) static_cast<float*>(t.param_out)[i] = p;
    else static_cast<std::uint16_t*>(t.param_out)[i] = static_cast<std::uint16_t>(
        [&] { std::uint32_t u; std::memcpy(&u, &p, 4); return u >> 16; }());
  }
}

}  // namespace

struct AdamTrafficKernel::Impl {
  explicit Impl(int threads) : arena(threads > 0 ? threads : tbb::task_arena::automatic) { arena.initialize(); }
  tbb::task_arena arena;
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> chunks;
};

AdamTrafficKernel::AdamTrafficKernel(int threads) : impl_(std::make_unique<Impl>(threads)) {}
AdamTrafficKernel::~AdamTrafficKernel() = default;

void AdamTrafficKernel::run(const std::vector<AdamTensor>& tensors) {
  auto& chunks = impl_->chunks;
  chunks.clear();
  for (std::size_t i = 0; i < tensors.size(); ++i)
    for (std::size_t b = 0; b < tensors[i].numel; b += kChunkElements)
      chunks.emplace_back(i, b, std::min(tensors[i].numel, b + kChunkElements));
  const bool wide = best_cpu_isa() == CpuIsa::kAvx512;
  impl_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, chunks.size(), 1),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        for (std::size_t c = r.begin(); c != r.end(); ++c) {
                          auto [ti, b, e] = chunks[c];
                          const bool packed = tensors[ti].state_format != StateFormat::kFp32;
                          if (wide && packed) traffic_packed_avx512(tensors[ti], b, e);
                          else if (wide) traffic_avx512(tensors[ti], b, e);
                          else traffic_portable(tensors[ti], b, e);
                        }
                      },
                      tbb::static_partitioner());
  });
}

CpuAdamRate measure_cpu_adam_rate(StateFormat states, double seconds, std::size_t parameters, int threads) {
  const std::size_t n = std::max<std::size_t>(parameters, 1);
  std::vector<float> master(n, 0.5f), m32, v32;
  std::vector<std::uint16_t> grad(n, 0x3c00), weight(n);  // bf16 0.0078125
  std::vector<std::uint8_t> m_bytes, v_bytes;
  AdamTensor t;
  t.master = master.data();
  t.grad = grad.data();
  t.grad_type = ScalarType::kBFloat16;
  t.param_out = weight.data();
  t.param_type = ScalarType::kBFloat16;
  t.numel = n;
  t.state_format = states;
  if (states == StateFormat::kFp32) {
    m32.assign(n, 0.f);
    v32.assign(n, 0.f);
    t.exp_avg = m32.data();
    t.exp_avg_sq = v32.data();
  } else {
    m_bytes.assign(moment_bytes(states, n), 0);
    v_bytes.assign(moment_bytes(states, n), 0);
    t.m = states == StateFormat::k8bit ? packed_8bit(m_bytes.data(), n) : PackedMoment{m_bytes.data(), nullptr};
    t.v = states == StateFormat::k8bit ? packed_8bit(v_bytes.data(), n) : PackedMoment{v_bytes.data(), nullptr};
  }
  CpuAdam adam(threads);
  const AdamOptions options;
  std::int64_t step = 1;
  adam.step(options, step++, {t});  // untimed: the pages touched, the arena's threads started
  using Clock = std::chrono::steady_clock;
  CpuAdamRate out;
  out.parameters = n;
  const auto start = Clock::now();
  do {
    adam.step(options, step++, {t});
    ++out.passes;
    out.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  } while (out.passes < 2 || out.seconds < seconds);
  out.params_per_second = static_cast<double>(n) * out.passes / out.seconds;
  return out;
}

}  // namespace tierflow::optimizer
