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
//   weighted = sum_i b_i * (i + 1)
//
// The pair is exact integer arithmetic: the same bytes give the same pair on
// any device, in any order of summation. It tells apart any two gradients that
// differ in one element, or by two elements swapped; a different pair is a
// certain change, an equal pair a change only of a kind no user code makes
// (values rearranged so that both sums hold, e.g. three or more elements
// permuted). Cost: one read of the gradient where it lives, when it streams and
// again in step(): on a GPU one kernel (cuda_grad_content_slabs) at memory
// speed, about 0.5 ms per GB at 2 TB/s; on the host, or the emulated device,
// one pass in C++.
//
// A device computes it in slabs of kGradContentSlab elements (no integer
// overflow inside a slab; a fixed, small weight vector) and the host combines
// the slabs' partial sums (combine_grad_content): the same pair as
// grad_content's single pass over host memory.
#pragma once

#include <cstddef>
#include <cstdint>

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

/// The content from per-slab partial sums: for slab r (elements r*kGradContentSlab on, the last one possibly
/// short) `slab_sum[r]` = sum_k b and `slab_weighted[r]` = sum_k b * (k + 1), k counted within the slab.
GradContent combine_grad_content(const std::int64_t* slab_sum, const std::int64_t* slab_weighted,
                                 std::size_t slabs);

/// Whether cuda_grad_content_slabs was compiled in (the CUDA backend).
bool cuda_grad_content_compiled() noexcept;

/// On a GPU: per-slab sums of `count` elements of `element_bytes` (2 or 4) at device address `data`, into
/// device arrays `slab_sum` and `slab_weighted` of ceil(count / kGradContentSlab) int64 each, queued on CUDA
/// stream `stream` (a cudaStream_t; nullptr: the legacy default stream). One read of the gradient.
void cuda_grad_content_slabs(const void* data, std::size_t element_bytes, std::size_t count,
                             std::int64_t* slab_sum, std::int64_t* slab_weighted, void* stream);

}  // namespace tierflow::optimizer
