// Which device backs the GPU tier: a CUDA GPU, or the emulated device.
//
// Note [Emulated device]
// ~~~~~~~~~~~~~~~~~~~~~~
// With no GPU (CI, laptops) the GPU tier is ordinary host memory accounted
// against the GPU budget, and copies run on worker threads with the same
// handle semantics as CUDA streams and events. Everything above swap/ is the
// same code in both modes, so scheduling, budgets and the optimizer are tested
// without a GPU. The CUDA backend is compiled whenever the toolkit is found
// (TIERFLOW_WITH_CUDA) and chosen at run time when a GPU is present.
#pragma once

#include <cstdint>
#include <string_view>

namespace tierflow::allocator {

/// The backend of the GPU tier.
enum class DeviceKind : std::uint8_t { kEmulated, kCuda };

/// "emulated" or "cuda".
std::string_view to_string(DeviceKind k) noexcept;

/// True when tierflow was compiled with the CUDA backend.
bool cuda_compiled() noexcept;

/// True when the CUDA backend is compiled and at least one GPU is usable.
bool cuda_available() noexcept;

/// Total memory of the GPU tier: the current GPU's, or physical RAM when emulated.
std::uint64_t device_capacity_bytes(DeviceKind kind);

/// Physical RAM of this machine.
std::uint64_t host_capacity_bytes();

}  // namespace tierflow::allocator
