// See Note [Device memory meter] in device_memory_meter.hpp.
#include "tierflow/bindings/device_memory_meter.hpp"

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace tierflow::bindings {
namespace {

thread_local int t_open_meters = 0;  // meters open on this thread: its allocations are counted
std::atomic<std::int64_t> g_counted{0};  // live bytes of the counted allocations

// The counted blocks of every counter: each one's DataPtr from the allocator below it (freeing that frees the
// block there) and its size. One map: a block is counted once, by the counter that served it.
struct Counted {
  c10::DataPtr below;
  std::size_t bytes = 0;
};
std::mutex g_counted_mutex;
std::unordered_map<void*, Counted> g_live;

// A counter in front of the CPU allocator in force when it was installed. A later allocator may go in front of
// it (the adversarial device's, when a polite runtime's BlockOffload came first in the process): a new counter
// then goes in front of that one, so up to kCounters are stacked; each frees what it did not count through the
// allocator below it, hence one deleter per counter.
constexpr int kCounters = 4;
c10::Allocator* g_below[kCounters] = {};  // never freed: tensors they served may outlive everything
c10::Allocator* g_counter[kCounters] = {};
int g_counters = 0;

template <int I>
void free_block(void* data) {
  Counted block;
  bool counted = false;
  {
    std::lock_guard<std::mutex> lock(g_counted_mutex);
    const auto it = g_live.find(data);
    if (it != g_live.end()) {
      block = std::move(it->second);
      g_live.erase(it);
      counted = true;
    }
  }
  if (!counted) {
    // Not counted (raw_allocate passed the block below's own pointer through): it goes back below, outside the
    // lock (below may be another counter's allocator chain).
    if (auto del = g_below[I]->raw_deleter()) del(data);
    return;
  }
  g_counted.fetch_sub(static_cast<std::int64_t>(block.bytes), std::memory_order_relaxed);
  // block.below frees the memory below when it goes out of scope here.
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  CountingCpuAllocator(c10::Allocator* below, c10::DeleterFnPtr deleter) : below_(below), deleter_(deleter) {}

  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr below = below_->allocate(n);
    if (t_open_meters == 0 || n == 0) return below;
    void* data = below.get();
    {
      std::lock_guard<std::mutex> lock(g_counted_mutex);
      g_live[data] = Counted{std::move(below), n};
    }
    g_counted.fetch_add(static_cast<std::int64_t>(n), std::memory_order_relaxed);
    return c10::DataPtr(data, data, deleter_, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return deleter_; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* below_;
  c10::DeleterFnPtr deleter_;
};

constexpr c10::DeleterFnPtr kDeleters[kCounters] = {&free_block<0>, &free_block<1>, &free_block<2>, &free_block<3>};

std::mutex g_install_mutex;

std::int64_t device_allocated(const c10::Device& device) {
  if (device.is_cpu()) return g_counted.load(std::memory_order_relaxed);
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index() < 0 ? 0 : device.index());
  return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

}  // namespace

bool install_counting_cpu_allocator() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (g_counters > 0 && current == g_counter[g_counters - 1]) return true;
  if (g_counters == kCounters) return false;
  const int i = g_counters;
  g_below[i] = current;  // before torch can hand out a block that comes back to free_block<i>
  auto* a = new CountingCpuAllocator(current, kDeleters[i]);
  g_counter[i] = a;
  c10::SetCPUAllocator(a, /*priority=*/UINT8_MAX);
  if (c10::GetCPUAllocator() != a) {
    g_counter[i] = nullptr;
    delete a;
    return false;
  }
  g_counters += 1;
  return true;
}

DeviceMemoryMeter::DeviceMemoryMeter(const c10::Device& device) : device_(device) {
  if (device_.is_cpu()) ++t_open_meters;
  start_ = device_allocated(device_);
}

DeviceMemoryMeter::~DeviceMemoryMeter() {
  if (device_.is_cpu()) --t_open_meters;
}

std::uint64_t DeviceMemoryMeter::live_bytes() const {
  const std::int64_t d = device_allocated(device_) - start_;
  return d > 0 ? static_cast<std::uint64_t>(d) : 0;
}

}  // namespace tierflow::bindings
