// Note [Quarantine adaptor]: poison on allocate and on free, late writes
// counted once, eviction by bytes and by blocks, check_all, threads.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/device.hpp"
#include "tierflow/allocator/memory_resource.hpp"
#include "tierflow/allocator/quarantine_adaptor.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/log.hpp"

using namespace tierflow;
using namespace tierflow::allocator;

namespace {

// An upstream whose fresh memory holds zeros (not poison) and that knows which
// blocks it has out, so a test sees what came back and with which size.
class TrackingResource final : public MemoryResource {
 public:
  Tier tier() const noexcept override { return Tier::kGpu; }
  bool holds(void* p) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(p) == 1;
  }
  std::size_t live_blocks() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.size();
  }
  std::size_t returned() const { return returned_.load(); }
  std::size_t mismatched() const { return mismatched_.load(); }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    void* p = inner_.allocate(bytes, alignment);
    std::memset(p, 0, bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    live_[p] = {bytes, alignment};
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(p);
      if (it == live_.end() || it->second.first != bytes || it->second.second != alignment) ++mismatched_;
      if (it != live_.end()) live_.erase(it);
    }
    ++returned_;
    inner_.deallocate(p, bytes, alignment);
  }

  EmulatedDeviceResource inner_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, std::pair<std::size_t, std::size_t>> live_;
  std::atomic<std::size_t> returned_{0}, mismatched_{0};
};

bool all_poison(const void* p, std::size_t bytes) { return first_unpoisoned(p, bytes) == bytes; }

QuarantineLimits limits(std::size_t bytes, std::size_t blocks) {
  QuarantineLimits l;
  l.max_bytes = bytes;
  l.max_blocks = blocks;
  return l;
}

}  // namespace

TEST(QuarantineAdaptor, DefaultsHoldSixtyFourMiBOrFourThousandBlocks) {
  TrackingResource up;
  QuarantineAdaptor q(&up);
  EXPECT_EQ(q.limits().max_bytes, std::size_t{64} << 20);
  EXPECT_EQ(q.limits().max_blocks, 4096u);
  EXPECT_EQ(q.tier(), Tier::kGpu);
}

TEST(QuarantineAdaptor, EveryAllocationStartsAsPoison) {
  TrackingResource up;
  QuarantineAdaptor q(&up);
  void* p = q.allocate(1000, 4096);
  EXPECT_TRUE(is_aligned(p, 4096));
  EXPECT_TRUE(all_poison(p, 1000)) << "the upstream handed out zeros; the adaptor must poison them";
  EXPECT_EQ(q.stats().allocations, 1u);
  q.deallocate(p, 1000, 4096);
}

TEST(QuarantineAdaptor, AFreedBlockIsPoisonedAndHeldBack) {
  TrackingResource up;
  QuarantineAdaptor q(&up);
  auto* p = static_cast<unsigned char*>(q.allocate(4096));
  std::memset(p, 0x42, 4096);
  q.deallocate(p, 4096);
  EXPECT_TRUE(all_poison(p, 4096)) << "a read of freed memory must see poison";
  EXPECT_TRUE(up.holds(p)) << "a freed block must not go upstream at once";
  EXPECT_EQ(up.returned(), 0u);
  const auto s = q.stats();
  EXPECT_EQ(s.quarantined, 1u);
  EXPECT_EQ(s.held_bytes, 4096u);
  EXPECT_EQ(s.held_blocks, 1u);
  EXPECT_EQ(s.late_writes, 0u);
}

TEST(QuarantineAdaptor, CheckAllCountsALateWriteOnceWithoutEvicting) {
  TrackingResource up;
  QuarantineAdaptor q(&up);
  auto* p = static_cast<unsigned char*>(q.allocate(1 << 16));
  q.deallocate(p, 1 << 16);
  p[1234] = 7;  // a copy that still wrote into the block after its free
  testing::internal::CaptureStderr();
  const LogLevel before = log_level();
  set_log_level(LogLevel::kError);
  q.check_all();
  set_log_level(before);
  const std::string logged = testing::internal::GetCapturedStderr();
  EXPECT_EQ(q.stats().late_writes, 1u);
  EXPECT_NE(logged.find("emulated device: a freed block of 64.00 KiB was written after it was freed (byte 1234)"),
            std::string::npos)
      << logged;
  EXPECT_EQ(q.stats().held_blocks, 1u) << "check_all must not evict";
  EXPECT_TRUE(up.holds(p));
  q.check_all();
  q.release();  // checked again on its way out
  EXPECT_EQ(q.stats().late_writes, 1u) << "one late write is counted once";
  EXPECT_FALSE(up.holds(p));
}

TEST(QuarantineAdaptor, ALateWriteIsFoundOnEviction) {
  TrackingResource up;
  QuarantineAdaptor q(&up, limits(1 << 20, 1));
  auto* a = static_cast<unsigned char*>(q.allocate(512));
  void* b = q.allocate(512);
  q.deallocate(a, 512);
  a[511] = 0;
  EXPECT_EQ(q.stats().late_writes, 0u) << "nothing checked it yet";
  q.deallocate(b, 512);  // two blocks held, one allowed: `a` leaves, checked
  EXPECT_EQ(q.stats().late_writes, 1u);
  EXPECT_FALSE(up.holds(a));
  EXPECT_TRUE(up.holds(b));
}

TEST(QuarantineAdaptor, EvictsOldestFirstPastTheByteLimit) {
  TrackingResource up;
  QuarantineAdaptor q(&up, limits(3000, 100));
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(q.allocate(1000));
  for (int i = 0; i < 3; ++i) q.deallocate(blocks[i], 1000);
  EXPECT_EQ(up.returned(), 0u) << "3000 bytes fit the limit";
  q.deallocate(blocks[3], 1000);
  EXPECT_EQ(up.returned(), 1u);
  EXPECT_FALSE(up.holds(blocks[0])) << "the oldest freed block goes upstream first";
  EXPECT_TRUE(up.holds(blocks[1]));
  EXPECT_EQ(q.stats().held_bytes, 3000u);
  EXPECT_EQ(q.stats().held_blocks, 3u);
  EXPECT_EQ(q.stats().late_writes, 0u);
}

TEST(QuarantineAdaptor, EvictsPastTheBlockLimit) {
  TrackingResource up;
  QuarantineAdaptor q(&up, limits(std::size_t{1} << 30, 2));
  void* a = q.allocate(64);
  void* b = q.allocate(64);
  void* c = q.allocate(64);
  q.deallocate(a, 64);
  q.deallocate(b, 64);
  EXPECT_EQ(up.returned(), 0u);
  q.deallocate(c, 64);
  EXPECT_EQ(up.returned(), 1u);
  EXPECT_FALSE(up.holds(a));
  EXPECT_EQ(q.stats().held_blocks, 2u);
  EXPECT_EQ(q.stats().held_bytes, 128u);
}

TEST(QuarantineAdaptor, GivesEverythingBackWithItsSizeAndAlignment) {
  TrackingResource up;
  {
    QuarantineAdaptor q(&up);
    void* a = q.allocate(100, 64);
    void* b = q.allocate(5000, 4096);
    q.deallocate(a, 100, 64);
    q.deallocate(b, 5000, 4096);
    EXPECT_EQ(up.live_blocks(), 2u);
  }  // the destructor empties the quarantine
  EXPECT_EQ(up.live_blocks(), 0u);
  EXPECT_EQ(up.returned(), 2u);
  EXPECT_EQ(up.mismatched(), 0u);
}

TEST(QuarantineAdaptor, ComposesUnderAStatisticsAdaptor) {
  EmulatedDeviceResource device;
  QuarantineAdaptor q(&device, limits(1 << 20, 1));
  StatisticsAdaptor counted(&q);
  void* a = counted.allocate(4096);
  void* b = counted.allocate(4096);
  counted.deallocate(a, 4096);
  counted.deallocate(b, 4096);
  EXPECT_EQ(counted.bytes().current, 0);
  EXPECT_EQ(q.stats().held_blocks, 1u);
  EXPECT_EQ(q.stats().allocations, 2u);
}

TEST(QuarantineAdaptor, ThreadsAllocatingAndFreeingAreClean) {
  TrackingResource up;
  QuarantineAdaptor q(&up, limits(256 << 10, 64));
  constexpr int kThreads = 6, kRounds = 1500;
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        const std::size_t n = 64 + static_cast<std::size_t>((t * 131 + i * 17) % 8192);
        auto* p = static_cast<unsigned char*>(q.allocate(n));
        if (!all_poison(p, n)) ++corrupted;
        std::memset(p, t + 1, n);
        for (std::size_t k = 0; k < n; k += 97)
          if (p[k] != static_cast<unsigned char>(t + 1)) ++corrupted;
        q.deallocate(p, n);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupted.load(), 0) << "a block was handed to two owners, or not poisoned";
  auto s = q.stats();
  EXPECT_EQ(s.allocations, static_cast<std::uint64_t>(kThreads * kRounds));
  EXPECT_EQ(s.quarantined, static_cast<std::uint64_t>(kThreads * kRounds));
  EXPECT_EQ(s.late_writes, 0u);
  EXPECT_LE(s.held_blocks, 64u);
  EXPECT_LE(s.held_bytes, std::size_t{256} << 10);
  q.release();
  EXPECT_EQ(up.live_blocks(), 0u);
  EXPECT_EQ(up.mismatched(), 0u);
}
