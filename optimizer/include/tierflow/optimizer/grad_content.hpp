// A gradient known by its bytes, torch-free.
//
// Note [Gradient content]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The step ledger (Note [Step ledger]) commits a step taken during backward
// only if the gradient step() would step is the one that streamed. A tensor's
// version counter does not promise that: dist.all_reduce(p.grad), an edit
// through p.grad.data (p.grad.data.clamp_()), a DTensor's foreach op and
// set_() all change the values without moving it. So a gradient is known by its
// content as well: two 64-bit sums over its elements' bit patterns b_i (read as
// signed 16- or 32-bit integers, sign-extended), modulo 2^64,
//
//   sum      = sum_i b_i
//   weighted = sum_i b_i * w(i),   w(i) = splitmix64(i) | 1
//
// exact unsigned integer arithmetic: the same bytes give the same pair on any
// device, in any order of summation. The weights are pseudo-random odd 64-bit
// numbers, one per position, so no structured edit cancels out: a change of
// the bytes keeps `weighted` only if sum_i delta_i * w(i) = 0 modulo 2^64,
// about a 2^-64 chance for any one edit. Linear weights (i + 1) did not hold:
// p.grad.data.neg_() of four elements whose signs ran +, -, -, + kept both
// sums (each sign flip is +-2^31, and positions 1 + 4 = 2 + 3). Cost: one read
// of the gradient where it lives, when it streams and again in step(): on a
// GPU one kernel (cuda_grad_content_slabs) at memory speed, about 0.5 ms per
// GB at 2 TB/s; on the host, or the emulated device, one pass in C++.
//
// A device sums slabs of kGradContentSlab elements, one block each, and the
// host adds the slabs' sums (combine_grad_content): the same pair as
// grad_content's single pass over host memory.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TIERFLOW_CONTENT_HOST_DEVICE __host__ __device__
#else
#define TIERFLOW_CONTENT_HOST_DEVICE
#endif

namespace tierflow::optimizer {

/// The content of a gradient (Note [Gradient content]); `known` false: not computed (compares unequal).
struct GradContent {
  std::uint64_t sum = 0;
  std::uint64_t weighted = 0;
  bool known = false;
};

/// True when both are known and equal: the same gradient bytes (Note [Gradient content]).
inline bool same_content(const GradContent& a, const GradContent& b) noexcept {
  return a.known && b.known && a.sum == b.sum && a.weighted == b.weighted;
}

/// Elements per slab of a device's computation (combine_grad_content).
inline constexpr std::size_t kGradContentSlab = 4096;

/// The content of `count` elements of `element_bytes` each (2 or 4) at `data`, in one pass.
GradContent grad_content(const void* data, std::size_t element_bytes, std::size_t count);

/// The weight of position `i` (Note [Gradient content]): splitmix64's finalizer of i, made odd.
TIERFLOW_CONTENT_HOST_DEVICE inline constexpr std::uint64_t content_weight(std::uint64_t i) noexcept {
  std::uint64_t z = i + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) | 1ULL;
}

/// The content from per-slab partial sums (modulo 2^64), each over its slab's elements with their global
/// positions' weights: `slab_sum[r]` = sum b, `slab_weighted[r]` = sum b * content_weight(i).
GradContent combine_grad_content(const std::uint64_t* slab_sum, const std::uint64_t* slab_weighted,
                                 std::size_t slabs);

/// Whether cuda_grad_content_slabs was compiled in (the CUDA backend).
bool cuda_grad_content_compiled() noexcept;

/// On a GPU: per-slab sums of `count` elements of `element_bytes` (2 or 4) at device address `data`, into
/// device arrays `slab_sum` and `slab_weighted` of ceil(count / kGradContentSlab) each, queued on CUDA
/// stream `stream` (a cudaStream_t; nullptr: the legacy default stream). One read of the gradient.
void cuda_grad_content_slabs(const void* data, std::size_t element_bytes, std::size_t count,
                             std::uint64_t* slab_sum, std::uint64_t* slab_weighted, void* stream);

}  // namespace tierflow::optimizer
