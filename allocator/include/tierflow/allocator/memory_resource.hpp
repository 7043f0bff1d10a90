// Memory resources per tier, composable through an upstream like RMM's.
//
// A resource hands out raw bytes of one tier. Adaptors wrap an upstream
// resource they do not own: LimitingAdaptor enforces a budget and throws
// out_of_memory past it; StatisticsAdaptor counts current/peak bytes;
// QuarantineAdaptor (quarantine_adaptor.hpp) poisons and delays reuse.
// deallocate() is noexcept and must receive the size given to allocate().
//
// Which resources serve which tier:
//  - pinned host memory (the pinned host pool's slabs, Note [Pinned host
//    pool]): PinnedHostResource -> LimitingAdaptor (TIERFLOW_HOST_MEMORY)
//    -> StatisticsAdaptor (the reserved bytes);
//  - emulated device memory in adversarial mode (Note [Adversarial emulated
//    device]): EmulatedDeviceResource -> QuarantineAdaptor, behind the
//    c10::Allocator that bindings/ installs as torch's CPU allocator; in
//    polite mode the emulated device's memory is torch's CPU allocator's;
//  - CUDA device memory: torch's caching allocator, not a resource here;
//    its budget (TIERFLOW_GPU_MEMORY) is enforced by the planner, which
//    compares it with the memory torch measures.
#pragma once

#include <atomic>
#include <cstddef>

#include "tierflow/allocator/device.hpp"
#include "tierflow/core/stats.hpp"
#include "tierflow/core/tier.hpp"

namespace tierflow::allocator {

/// Default alignment of every resource: enough for any vector load and for DMA.
inline constexpr std::size_t kDefaultAlignment = 256;

/// Base class of all memory resources.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  /// Returns `bytes` bytes aligned to `alignment`; throws out_of_memory when exhausted.
  void* allocate(std::size_t bytes, std::size_t alignment = kDefaultAlignment) {
    return do_allocate(bytes, alignment);
  }
  /// Returns memory obtained from allocate() with the same size and alignment.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = kDefaultAlignment) noexcept {
    do_deallocate(p, bytes, alignment);
  }
  /// The tier this resource's memory belongs to.
  virtual Tier tier() const noexcept = 0;

 private:
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept = 0;
};

/// GPU-tier memory of the emulated device: host memory from small_malloc (Note
/// [mimalloc shim]); the QuarantineAdaptor's upstream in adversarial mode.
class EmulatedDeviceResource final : public MemoryResource {
 public:
  Tier tier() const noexcept override { return Tier::kGpu; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
};

/// Page-locked host memory, resident before its first use: cudaHostAlloc with
/// `cuda_pinned` (needs a GPU), otherwise a 2 MiB-aligned anonymous mapping
/// on transparent huge pages, faulted in at once. The pinned host pool's
/// upstream for its slabs (Note [Pinned host pool]).
class PinnedHostResource final : public MemoryResource {
 public:
  explicit PinnedHostResource(bool cuda_pinned) : cuda_pinned_(cuda_pinned) {}
  Tier tier() const noexcept override { return Tier::kHost; }
  bool cuda_pinned() const noexcept { return cuda_pinned_; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  bool cuda_pinned_;
};

/// Enforces a byte budget over an upstream resource.
class LimitingAdaptor final : public MemoryResource {
 public:
  /// `upstream` must outlive the adaptor.
  LimitingAdaptor(MemoryResource* upstream, std::size_t limit_bytes);
  Tier tier() const noexcept override { return upstream_->tier(); }
  /// Bytes currently allocated through this adaptor.
  std::size_t allocated_bytes() const noexcept { return used_.load(); }
  /// The budget.
  std::size_t limit_bytes() const noexcept { return limit_; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  MemoryResource* upstream_;
  std::size_t limit_;
  std::atomic<std::size_t> used_{0};
};

/// Counts bytes through it (current, peak, allocated, freed).
class StatisticsAdaptor final : public MemoryResource {
 public:
  /// `upstream` must outlive the adaptor.
  explicit StatisticsAdaptor(MemoryResource* upstream) : upstream_(upstream) {}
  Tier tier() const noexcept override { return upstream_->tier(); }
  /// Byte statistics since construction.
  StatValues bytes() const noexcept { return bytes_.values(); }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  MemoryResource* upstream_;
  Stat bytes_;
};

}  // namespace tierflow::allocator
