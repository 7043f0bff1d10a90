// The GPU share of the optimizer (Deep Optimizer States, DeepSpeed's
// TwinFlow ratio): the same Adam/AdamW update as CpuAdam, as a CUDA kernel,
// for the parameters whose state is kept on the GPU. Same Note [Adam
// semantics]; compiled with -fmad=false and explicit fused multiply-adds
// where torch fuses, so its results equal the CPU path's.
#pragma once

#include <cstdint>
#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"

namespace tierflow::optimizer {

/// True when the CUDA kernel was compiled in (TIERFLOW_WITH_CUDA).
bool cuda_adam_compiled() noexcept;

/// Queues one step over `tensors` (all pointers in device memory, in place)
/// on `stream` (a cudaStream_t; nullptr is the legacy default stream).
/// Throws logic_error when built without CUDA, cuda_error when a launch fails.
void cuda_adam_step(const AdamOptions& options, std::int64_t step,
                    const std::vector<AdamTensor>& tensors, void* stream);

}  // namespace tierflow::optimizer
