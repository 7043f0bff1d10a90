#include "tierflow/allocator/memory_resource.hpp"
#include "tierflow/allocator/small_alloc.hpp"

#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"

#ifdef TIERFLOW_WITH_CUDA
#include "tierflow/allocator/detail/cuda_check.hpp"
#endif

namespace tierflow::allocator {

void* EmulatedDeviceResource::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = small_malloc(bytes == 0 ? 1 : bytes, alignment);
  if (!p) throw out_of_memory("emulated device: could not allocate " + format_bytes(bytes));
  return p;
}

void EmulatedDeviceResource::do_deallocate(void* p, std::size_t, std::size_t) noexcept {
  small_free(p);
}

CudaDeviceResource::CudaDeviceResource() {
  TIERFLOW_EXPECTS(cuda_compiled(), "CudaDeviceResource: tierflow was built without CUDA "
                                    "(configure with TIERFLOW_WITH_CUDA=ON and a CUDA toolkit)");
}

void* CudaDeviceResource::do_allocate(std::size_t bytes, std::size_t) {
#ifdef TIERFLOW_WITH_CUDA
  void* p = nullptr;
  cudaError_t st = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
  if (st == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw out_of_memory("GPU: cudaMalloc of " + format_bytes(bytes) + " failed: out of memory");
  }
  TIERFLOW_CUDA_TRY(st);
  return p;  // cudaMalloc alignment (256 B) satisfies kDefaultAlignment
#else
  (void)bytes;
  throw logic_error("CudaDeviceResource: built without CUDA");
#endif
}

void CudaDeviceResource::do_deallocate(void* p, std::size_t, std::size_t) noexcept {
#ifdef TIERFLOW_WITH_CUDA
  TIERFLOW_CUDA_ASSERT_OK(cudaFree(p));
#else
  (void)p;
#endif
}

LimitingAdaptor::LimitingAdaptor(MemoryResource* upstream, std::size_t limit_bytes)
    : upstream_(upstream), limit_(limit_bytes) {
  TIERFLOW_EXPECTS(upstream != nullptr, "LimitingAdaptor: upstream must not be null");
}

void* LimitingAdaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  std::size_t before = used_.fetch_add(bytes);
  if (before + bytes > limit_) {
    used_.fetch_sub(bytes);
    throw out_of_memory(std::string(to_string(tier())) + " tier budget exhausted: " +
                        format_bytes(bytes) + " requested, " + format_bytes(before) + " of " +
                        format_bytes(limit_) + " in use");
  }
  try {
    return upstream_->allocate(bytes, alignment);
  } catch (...) {
    used_.fetch_sub(bytes);
    throw;
  }
}

void LimitingAdaptor::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  upstream_->deallocate(p, bytes, alignment);
  used_.fetch_sub(bytes);
}

void* StatisticsAdaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = upstream_->allocate(bytes, alignment);
  bytes_.increase(static_cast<std::int64_t>(bytes));
  return p;
}

void StatisticsAdaptor::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  upstream_->deallocate(p, bytes, alignment);
  bytes_.decrease(static_cast<std::int64_t>(bytes));
}

std::unique_ptr<MemoryResource> make_device_resource(DeviceKind kind) {
  if (kind == DeviceKind::kCuda) return std::make_unique<CudaDeviceResource>();
  return std::make_unique<EmulatedDeviceResource>();
}

}  // namespace tierflow::allocator
