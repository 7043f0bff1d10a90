#include "tierflow/allocator/device.hpp"

#include <unistd.h>

#include "tierflow/core/error.hpp"

#ifdef TIERFLOW_WITH_CUDA
#include <cuda_runtime_api.h>

#include "tierflow/allocator/detail/cuda_check.hpp"
#endif

namespace tierflow::allocator {

std::string_view to_string(DeviceKind k) noexcept {
  return k == DeviceKind::kCuda ? "cuda" : "emulated";
}

bool cuda_compiled() noexcept {
#ifdef TIERFLOW_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() noexcept {
#ifdef TIERFLOW_WITH_CUDA
  static const bool available = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky "no device" status
      return false;
    }
    return count > 0;
  }();
  return available;
#else
  return false;
#endif
}

std::uint64_t host_capacity_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page = sysconf(_SC_PAGESIZE);
  TIERFLOW_EXPECTS(pages > 0 && page > 0, "sysconf could not report physical memory");
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
}

std::uint64_t device_capacity_bytes(DeviceKind kind) {
  if (kind == DeviceKind::kEmulated) return host_capacity_bytes();
#ifdef TIERFLOW_WITH_CUDA
  std::size_t free_bytes = 0, total_bytes = 0;
  TIERFLOW_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes;
#else
  throw logic_error("device_capacity_bytes(cuda): tierflow was built without CUDA");
#endif
}

}  // namespace tierflow::allocator
