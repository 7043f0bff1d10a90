// See the header and Note [Adversarial emulated device].
#include "tierflow/bindings/emulated_device_memory.hpp"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/allocator/device.hpp"

namespace tierflow::bindings {
namespace {

constexpr std::size_t kQuarantineBytes = 64ULL << 20;  // delays reuse by this much freed memory
constexpr std::size_t kQuarantineBlocks = 4096;

class PoisoningCpuAllocator;
PoisoningCpuAllocator* g_allocator = nullptr;  // never freed: tensors it served may outlive everything

// Torch's CPU kernels use raw_allocate()/raw_deleter(), which need a data
// pointer that is its own context: blocks are tracked by address.
class PoisoningCpuAllocator final : public c10::Allocator {
 public:
  explicit PoisoningCpuAllocator(c10::Allocator* upstream) : upstream_(upstream) {}

  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr inner = upstream_->allocate(n);
    void* data = inner.get();
    if (!data) return inner;
    if (n) std::memset(data, allocator::kPoisonByte, n);  // reused device memory, at worst
    allocations_.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, Record{std::move(inner), n, false});
    }
    return c10::DataPtr(data, data, &PoisoningCpuAllocator::free_block, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &PoisoningCpuAllocator::free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void check_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& r : quarantine_) check(r);
  }

  EmulatedDeviceMemoryStats stats() const {
    EmulatedDeviceMemoryStats s;
    s.installed = true;
    s.allocations = allocations_.load(std::memory_order_relaxed);
    s.quarantined = quarantined_.load(std::memory_order_relaxed);
    s.late_writes = late_writes_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  struct Record {
    c10::DataPtr inner;
    std::size_t bytes;
    bool reported;
  };

  static void free_block(void* data) { g_allocator->quarantine(data); }

  void quarantine(void* data) {
    std::deque<Record> out;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(data);
      if (it == live_.end()) {
        // Allocated by torch's allocator before this one was installed, and
        // freed through the current raw_deleter(): it goes back where it came from.
        if (auto del = upstream_->raw_deleter()) del(data);
        return;
      }
      Record r = std::move(it->second);
      live_.erase(it);
      if (r.bytes) std::memset(data, allocator::kPoisonByte, r.bytes);
      quarantined_.fetch_add(1, std::memory_order_relaxed);
      held_bytes_ += r.bytes;
      quarantine_.push_back(std::move(r));
      while (!quarantine_.empty() && (held_bytes_ > kQuarantineBytes || quarantine_.size() > kQuarantineBlocks)) {
        check(quarantine_.front());
        held_bytes_ -= quarantine_.front().bytes;
        out.push_back(std::move(quarantine_.front()));
        quarantine_.pop_front();
      }
    }
    out.clear();  // frees through torch's allocator, outside the lock
  }

  void check(Record& r) {
    if (r.reported) return;
    const std::size_t i = allocator::first_unpoisoned(r.inner.get(), r.bytes);
    if (i == r.bytes) return;
    r.reported = true;
    late_writes_.fetch_add(1, std::memory_order_relaxed);
    log(LogLevel::kError, "emulated device: a freed block of " + format_bytes(r.bytes) +
                              " was written after it was freed (byte " + std::to_string(i) +
                              "): a copy still used device memory that had been returned");
  }

  c10::Allocator* upstream_;
  std::mutex mutex_;
  std::unordered_map<void*, Record> live_;
  std::deque<Record> quarantine_;
  std::size_t held_bytes_ = 0;
  std::atomic<std::uint64_t> allocations_{0}, quarantined_{0}, late_writes_{0};
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
