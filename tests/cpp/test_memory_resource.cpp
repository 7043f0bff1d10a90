#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/memory_resource.hpp"
#include "tierflow/allocator/small_alloc.hpp"
#include "tierflow/core/error.hpp"

using namespace tierflow;
using namespace tierflow::allocator;

TEST(EmulatedDeviceResource, AllocatesAlignedGpuTierMemory) {
  EmulatedDeviceResource r;
  EXPECT_EQ(r.tier(), Tier::kGpu);
  void* p = r.allocate(1000, 256);
  EXPECT_TRUE(is_aligned(p, 256));
  std::memset(p, 3, 1000);
  r.deallocate(p, 1000, 256);
}

TEST(LimitingAdaptor, EnforcesTheBudget) {
  EmulatedDeviceResource upstream;
  LimitingAdaptor limited(&upstream, 1 << 20);
  void* a = limited.allocate(700 << 10);
  EXPECT_EQ(limited.allocated_bytes(), 700u << 10);
  try {
    limited.allocate(400 << 10);
    FAIL();
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("gpu tier budget"), std::string::npos) << e.what();
  }
  EXPECT_EQ(limited.allocated_bytes(), 700u << 10) << "a refused request must not leak budget";
  limited.deallocate(a, 700 << 10);
  void* b = limited.allocate(1 << 20);
  limited.deallocate(b, 1 << 20);
  EXPECT_EQ(limited.allocated_bytes(), 0u);
}

TEST(StatisticsAdaptor, CountsCurrentAndPeak) {
  EmulatedDeviceResource upstream;
  StatisticsAdaptor stats(&upstream);
  LimitingAdaptor limited(&stats, 10 << 20);  // composes like RMM adaptors
  void* a = limited.allocate(1 << 20);
  void* b = limited.allocate(2 << 20);
  limited.deallocate(a, 1 << 20);
  auto v = stats.bytes();
  EXPECT_EQ(v.current, 2 << 20);
  EXPECT_EQ(v.peak, 3 << 20);
  EXPECT_EQ(v.freed, 1 << 20);
  limited.deallocate(b, 2 << 20);
  EXPECT_EQ(stats.bytes().current, 0);
}

TEST(DeviceCapacity, EmulatedDeviceHasTheMachinesMemory) {
  EXPECT_GT(device_capacity_bytes(DeviceKind::kEmulated), 0u);
  EXPECT_EQ(device_capacity_bytes(DeviceKind::kEmulated), host_capacity_bytes());
}

TEST(SmallAlloc, AlignedAllocationsFromMimallocWhenInstalled) {
  for (std::size_t align : {8u, 64u, 4096u}) {
    void* p = small_malloc(100, align);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(is_aligned(p, align));
    std::memset(p, 1, 100);
    small_free(p);
  }
  small_free(nullptr);
  const char* mode = std::getenv("TIERFLOW_MIMALLOC");
  if (built_with_sanitizer() || (mode && std::string(mode) == "off")) {
    // Note [mimalloc shim]: the C library serves them, as asked.
    EXPECT_FALSE(mimalloc_active()) << "mimalloc loaded in a sanitizer build or with TIERFLOW_MIMALLOC=off";
    return;
  }
  // Debian's libmimalloc2.0 is a declared dependency (scripts/setup.sh installs it).
  EXPECT_TRUE(mimalloc_active()) << "libmimalloc.so.2 could not be loaded";
}

TEST(PinnedHostResource, ResidentHugePageAlignedMemoryUnderABudget) {
  PinnedHostResource pinned(/*cuda_pinned=*/false);
  EXPECT_EQ(pinned.tier(), Tier::kHost);
  LimitingAdaptor budget(&pinned, 3 << 20);
  StatisticsAdaptor counted(&budget);
  void* p = counted.allocate(3 << 20, 4096);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % (2 << 20), 0u);  // on huge pages where the kernel allows
  std::memset(p, 0x5a, 3 << 20);
  EXPECT_THROW(counted.allocate(4096, 4096), out_of_memory);  // the budget, not the system, refuses
  EXPECT_EQ(counted.bytes().current, 3 << 20);
  counted.deallocate(p, 3 << 20, 4096);
  EXPECT_EQ(counted.bytes().current, 0);
  EXPECT_EQ(budget.allocated_bytes(), 0u);
}
