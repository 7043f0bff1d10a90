// cuda_grad_content_slabs: Note [Gradient content] on a GPU, one block per slab. Built only with the CUDA
// backend (grad_content_stub.cpp otherwise).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "tierflow/allocator/detail/cuda_check.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/grad_content.hpp"

namespace tierflow::optimizer {
namespace {

constexpr int kThreads = 256;

// Block r sums slab r: sum b and sum b * content_weight(i) over its elements, modulo 2^64 (unsigned
// arithmetic wraps by definition), as the host's combine_grad_content adds them.
template <typename Bits>
__global__ void content_slabs(const Bits* __restrict__ bits, std::size_t count,
                              unsigned long long* __restrict__ sums, unsigned long long* __restrict__ weighted) {
  __shared__ unsigned long long s_sum[kThreads];
  __shared__ unsigned long long s_weighted[kThreads];
  const std::size_t start = static_cast<std::size_t>(blockIdx.x) * kGradContentSlab;
  unsigned long long sum = 0, w = 0;
  for (std::size_t k = threadIdx.x; k < kGradContentSlab && start + k < count; k += kThreads) {
    const auto b = static_cast<unsigned long long>(static_cast<long long>(bits[start + k]));
    sum += b;
    w += b * content_weight(start + k);
  }
  s_sum[threadIdx.x] = sum;
  s_weighted[threadIdx.x] = w;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      s_sum[threadIdx.x] += s_sum[threadIdx.x + half];
      s_weighted[threadIdx.x] += s_weighted[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = s_sum[0];
    weighted[blockIdx.x] = s_weighted[0];
  }
}

}  // namespace

bool cuda_grad_content_compiled() noexcept { return true; }

void cuda_grad_content_slabs(const void* data, std::size_t element_bytes, std::size_t count,
                             std::uint64_t* slab_sum, std::uint64_t* slab_weighted, void* stream) {
  const std::size_t slabs = (count + kGradContentSlab - 1) / kGradContentSlab;
  if (slabs == 0) return;
  TIERFLOW_EXPECTS(slabs <= 0x7fffffffu, "cuda_grad_content_slabs: " + std::to_string(count) + " elements");
  const auto s = static_cast<cudaStream_t>(stream);
  auto* sums = reinterpret_cast<unsigned long long*>(slab_sum);
  auto* weighted = reinterpret_cast<unsigned long long*>(slab_weighted);
  const auto grid = static_cast<unsigned>(slabs);
  switch (element_bytes) {
    case 2:
      content_slabs<<<grid, kThreads, 0, s>>>(static_cast<const std::int16_t*>(data), count, sums, weighted);
      break;
    case 4:
      content_slabs<<<grid, kThreads, 0, s>>>(static_cast<const std::int32_t*>(data), count, sums, weighted);
      break;
    default:
      throw logic_error("cuda_grad_content_slabs: elements of " + std::to_string(element_bytes) +
                        " bytes; accepted: 2 or 4");
  }
  TIERFLOW_CUDA_TRY(cudaGetLastError());
}

}  // namespace tierflow::optimizer
