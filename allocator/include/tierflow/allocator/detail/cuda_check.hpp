// CUDA error checking for tierflow's CUDA backend sources only.
#pragma once

#ifdef TIERFLOW_WITH_CUDA
#include <cuda_runtime_api.h>

#include <string>

#include "tierflow/core/error.hpp"

/// Throws tierflow::cuda_error with the call, the CUDA message and file:line.
#define TIERFLOW_CUDA_TRY(call)                                                            \
  do {                                                                                     \
    cudaError_t tierflow_status_ = (call);                                                 \
    if (tierflow_status_ != cudaSuccess) {                                                 \
      throw ::tierflow::cuda_error(                                                        \
          static_cast<int>(tierflow_status_),                                              \
          ::tierflow::detail::where(__FILE__, __LINE__,                                    \
                                    std::string(#call) + " failed: " +                     \
                                        cudaGetErrorString(tierflow_status_)));            \
    }                                                                                      \
  } while (0)

/// For destructors and noexcept paths: reports, never throws.
#define TIERFLOW_CUDA_ASSERT_OK(call)                                                      \
  do {                                                                                     \
    cudaError_t tierflow_status_ = (call);                                                 \
    if (tierflow_status_ != cudaSuccess) {                                                 \
      ::tierflow::log(::tierflow::LogLevel::kError,                                        \
                      ::tierflow::detail::where(__FILE__, __LINE__,                        \
                                                std::string(#call) + " failed: " +         \
                                                    cudaGetErrorString(tierflow_status_))); \
    }                                                                                      \
  } while (0)
#endif
