// See the header, Note [Adversarial emulated device] and Note [Quarantine adaptor].
#include "tierflow/bindings/emulated_device_memory.hpp"

#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include <mutex>
#include <unordered_map>

#include "tierflow/allocator/memory_resource.hpp"
#include "tierflow/allocator/quarantine_adaptor.hpp"
#include "tierflow/core/log.hpp"

namespace tierflow::bindings {
namespace {

class PoisoningCpuAllocator;
PoisoningCpuAllocator* g_allocator = nullptr;  // never freed: tensors it served may outlive everything

// torch's CPU allocator interface over allocator/'s resources. Torch's CPU
// kernels use raw_allocate()/raw_deleter(), which need a data pointer that is
// its own context: blocks are tracked by address, with the size the adaptor
// needs back on free.
class PoisoningCpuAllocator final : public c10::Allocator {
 public:
  explicit PoisoningCpuAllocator(c10::Allocator* upstream) : upstream_(upstream) {}

  c10::DataPtr allocate(std::size_t n) override {
    if (n == 0) return upstream_->allocate(0);  // torch's own empty block, as before installation
    void* data = quarantine_.allocate(n, c10::gAlignment);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, n);
    }
    return c10::DataPtr(data, data, &PoisoningCpuAllocator::free_block, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &PoisoningCpuAllocator::free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void check_all() noexcept { quarantine_.check_all(); }

  EmulatedDeviceMemoryStats stats() const {
    const auto q = quarantine_.stats();
    EmulatedDeviceMemoryStats s;
    s.installed = true;
    s.allocations = q.allocations;
    s.quarantined = q.quarantined;
    s.late_writes = q.late_writes;
    return s;
  }

 private:
  static void free_block(void* data) { g_allocator->free(data); }

  void free(void* data) {
    std::size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(data);
      if (it == live_.end()) {
        // Allocated by torch's allocator before this one was installed, and
        // freed through the current raw_deleter(): it goes back where it came from.
        if (auto del = upstream_->raw_deleter()) del(data);
        return;
      }
      bytes = it->second;
      live_.erase(it);
    }
    quarantine_.deallocate(data, bytes, c10::gAlignment);
  }

  c10::Allocator* upstream_;
  allocator::EmulatedDeviceResource device_;
  allocator::QuarantineAdaptor quarantine_{&device_, allocator::QuarantineLimits{}, "emulated device"};
  std::mutex mutex_;
  std::unordered_map<void*, std::size_t> live_;
};

std::mutex g_install_mutex;

}  // namespace

void install_poisoning_device_memory() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  if (g_allocator) return;
  auto* a = new PoisoningCpuAllocator(c10::GetCPUAllocator());
  g_allocator = a;  // before torch can hand out a block that comes back to free_block
  c10::SetCPUAllocator(a, /*priority=*/UINT8_MAX);
  if (c10::GetCPUAllocator() != a) {
    log(LogLevel::kWarn, "adversarial emulated device: torch's CPU allocator could not be replaced; "
                         "freed device memory is not poisoned");
    g_allocator = nullptr;
    delete a;
  }
}

void check_device_memory_quarantine() {
  PoisoningCpuAllocator* a;
  {
    std::lock_guard<std::mutex> lock(g_install_mutex);
    a = g_allocator;
  }
  if (a) a->check_all();
}

EmulatedDeviceMemoryStats emulated_device_memory_stats() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  return g_allocator ? g_allocator->stats() : EmulatedDeviceMemoryStats{};
}

}  // namespace tierflow::bindings
