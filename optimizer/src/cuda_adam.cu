// See cuda_adam.hpp. Built only with the CUDA backend; cuda_adam_stub.cpp otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>

#include "tierflow/allocator/detail/cuda_check.hpp"
#include "tierflow/core/error.hpp"
#include "adam_kernel.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"

namespace tierflow::optimizer {
namespace {

using DeviceScalars = detail::AdamScalars;

template <typename G>
__device__ __forceinline__ float to_float(G g);
template <>
__device__ __forceinline__ float to_float<float>(float g) { return g; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 g) { return __bfloat162float(g); }
template <>
__device__ __forceinline__ float to_float<__half>(__half g) { return __half2float(g); }

template <typename P>
__device__ __forceinline__ P from_float(float p);
template <>
__device__ __forceinline__ float from_float<float>(float p) { return p; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float p) { return __float2bfloat16_rn(p); }
template <>
__device__ __forceinline__ __half from_float<__half>(float p) { return __float2half_rn(p); }

// One element per thread, grid-stride; the operation order of Note [Adam semantics].
template <typename G, typename P>
__global__ void adam_kernel(float* __restrict__ master, float* __restrict__ m, float* __restrict__ v,
                            float* __restrict__ vmax, const G* __restrict__ grad, P* __restrict__ out,
                            std::size_t n, DeviceScalars s) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float g = to_float(grad[i]);
    if (s.scale_grad) g = __fmul_rn(g, s.grad_scale);
    if (s.maximize) g = -g;
    float p = master[i];
    if (s.has_wd) {
      if (s.decoupled) p = __fmul_rn(p, s.decay);
      else g = __fmaf_rn(s.wd, p, g);
    }
    const float mi = __fmaf_rn(s.one_minus_b1, __fsub_rn(g, m[i]), m[i]);
    const float vi = __fmaf_rn(__fmul_rn(s.one_minus_b2, g), g, __fmul_rn(v[i], s.b2));
    float vd = vi;
    if (s.amsgrad) {
      const float old = vmax[i];
      vd = (isnan(vi) || isnan(old)) ? __int_as_float(0x7fc00000) : fmaxf(old, vi);
      vmax[i] = vd;
    }
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vd), s.inv_bc2_sqrt), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, mi), denom));
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (out) out[i] = from_float<P>(p);
  }
}

template <typename G, typename P>
void launch(const AdamTensor& t, const DeviceScalars& s, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const std::size_t blocks = std::min<std::size_t>((t.numel + kThreads - 1) / kThreads, 65535ULL * 8);
  adam_kernel<G, P><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      t.master, t.exp_avg, t.exp_avg_sq, t.max_exp_avg_sq, static_cast<const G*>(t.grad),
      static_cast<P*>(t.param_out), t.numel, s);
  TIERFLOW_CUDA_TRY(cudaGetLastError());
}

template <typename G>
void launch_out(const AdamTensor& t, const DeviceScalars& s, cudaStream_t stream) {
  if (!t.param_out) return launch<G, float>(t, s, stream);
  switch (t.param_type) {
    case ScalarType::kFloat32: return launch<G, float>(t, s, stream);
    case ScalarType::kBFloat16: return launch<G, __nv_bfloat16>(t, s, stream);
    case ScalarType::kFloat16: return launch<G, __half>(t, s, stream);
  }
}

}  // namespace

bool cuda_adam_compiled() noexcept { return true; }

void cuda_adam_step(const AdamOptions& o, std::int64_t step, const std::vector<AdamTensor>& tensors,
                    void* stream) {
  TIERFLOW_EXPECTS(step >= 1, "cuda_adam_step: step must be >= 1");
  const DeviceScalars s = detail::make_scalars(o, step);
  auto st = static_cast<cudaStream_t>(stream);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const AdamTensor& t = tensors[i];
    if (t.numel == 0) continue;
    TIERFLOW_EXPECTS(t.master && t.exp_avg && t.exp_avg_sq && t.grad && (!o.amsgrad || t.max_exp_avg_sq),
                     "cuda_adam_step: tensor " + std::to_string(i) + " is missing a buffer");
    TIERFLOW_EXPECTS(!t.master_out, "cuda_adam_step: out-of-place outputs are CPU-only");
    switch (t.grad_type) {
      case ScalarType::kFloat32: launch_out<float>(t, s, st); break;
      case ScalarType::kBFloat16: launch_out<__nv_bfloat16>(t, s, st); break;
      case ScalarType::kFloat16: launch_out<__half>(t, s, st); break;
    }
  }
}

}  // namespace tierflow::optimizer
