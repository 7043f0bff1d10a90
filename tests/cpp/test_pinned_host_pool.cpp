#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/error.hpp"

using namespace tierflow;
using namespace tierflow::allocator;

namespace {
PinnedHostPoolOptions opts(std::uint64_t budget, std::uint64_t slab) {
  PinnedHostPoolOptions o;
  o.budget_bytes = budget;
  o.slab_bytes = slab;
  return o;
}
}  // namespace

TEST(PinnedHostPool, BlocksAreAlignedAndWritable) {
  PinnedHostPool pool(opts(8 << 20, 1 << 20));
  std::vector<void*> blocks;
  for (std::size_t n : {1u, 100u, 4096u, 4097u, 70000u}) {
    void* p = pool.allocate(n);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(is_aligned(p, PinnedHostPool::kBlockAlignment));
    std::memset(p, 0xab, n);
    blocks.push_back(p);
  }
  // Blocks do not overlap: each keeps its own fill.
  for (std::size_t i = 0; i < blocks.size(); ++i) std::memset(blocks[i], int(i), 1);
  for (std::size_t i = 0; i < blocks.size(); ++i) EXPECT_EQ(*static_cast<unsigned char*>(blocks[i]), i);
  for (void* p : blocks) pool.deallocate(p);
  EXPECT_EQ(pool.stats().in_use.current, 0);
}

TEST(PinnedHostPool, ReusesSlabsAcrossSteps) {
  PinnedHostPool pool(opts(64 << 20, 4 << 20));
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::size_t> size(1, 600 << 10);
  std::vector<std::size_t> sizes(20);
  for (auto& s : sizes) s = size(rng);
  std::uint64_t slabs_after_first = 0;
  for (int step = 0; step < 50; ++step) {
    std::vector<void*> live;
    for (auto s : sizes) live.push_back(pool.allocate(s));
    for (auto it = live.rbegin(); it != live.rend(); ++it) pool.deallocate(*it);
    if (step == 0) slabs_after_first = pool.stats().slab_allocations;
  }
  auto st = pool.stats();
  EXPECT_EQ(st.slab_allocations, slabs_after_first) << "a steady loop must not pin new slabs";
  EXPECT_EQ(st.block_allocations, 50u * sizes.size());
  EXPECT_EQ(st.in_use.current, 0);
  EXPECT_GT(st.in_use.peak, 0);
}

TEST(PinnedHostPool, FreedNeighboursCoalesce) {
  PinnedHostPool pool(opts(1 << 20, 1 << 20));
  void* a = pool.allocate(256 << 10);
  void* b = pool.allocate(256 << 10);
  void* c = pool.allocate(256 << 10);
  void* d = pool.allocate(256 << 10);
  pool.deallocate(b);
  pool.deallocate(c);
  // Only a coalesced b+c hole can hold 512 KiB inside the single 1 MiB slab.
  void* bc = pool.allocate(512 << 10);
  EXPECT_EQ(bc, b);
  EXPECT_EQ(pool.stats().slab_allocations, 1u);
  pool.deallocate(a);
  pool.deallocate(bc);
  pool.deallocate(d);
}

TEST(PinnedHostPool, BudgetIsNeverExceeded) {
  PinnedHostPool pool(opts(2 << 20, 1 << 20));
  void* a = pool.allocate(1 << 20);
  void* b = pool.allocate(1 << 20);
  EXPECT_EQ(pool.try_allocate(4096), nullptr);
  try {
    pool.allocate(4096);
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("TIERFLOW_HOST_MEMORY"), std::string::npos) << e.what();
  }
  EXPECT_LE(pool.stats().reserved.peak, 2 << 20);
  EXPECT_EQ(pool.stats().failed_allocations, 2u);
  pool.deallocate(a);
  EXPECT_NE(pool.try_allocate(4096), nullptr);
  pool.deallocate(b);
}

TEST(PinnedHostPool, OversizedRequestGetsItsOwnSlab) {
  PinnedHostPool pool(opts(16 << 20, 1 << 20));
  void* big = pool.allocate(5 << 20);
  ASSERT_NE(big, nullptr);
  std::memset(big, 1, 5 << 20);
  EXPECT_GE(pool.stats().reserved.current, 5 << 20);
  pool.deallocate(big);
  EXPECT_EQ(pool.release_unused(), pool.stats().reserved.peak);
  EXPECT_EQ(pool.stats().reserved.current, 0);
}

TEST(PinnedHostPool, EmptySlabsAreReleasedToFitADifferentSize) {
  PinnedHostPool pool(opts(4 << 20, 1 << 20));
  std::vector<void*> small;
  for (int i = 0; i < 4; ++i) small.push_back(pool.allocate(1 << 20));
  for (void* p : small) pool.deallocate(p);
  // Four empty 1 MiB slabs fill the budget; a 3 MiB block needs them released.
  void* big = pool.allocate(3 << 20);
  EXPECT_NE(big, nullptr);
  pool.deallocate(big);
}

TEST(PinnedHostPool, ThreadSafe) {
  PinnedHostPool pool(opts(64 << 20, 2 << 20));
  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    for (int i = 0; i < 2000; ++i) {
      std::size_t n = 1 + rng() % (64 << 10);
      auto* p = static_cast<unsigned char*>(pool.allocate(n));
      p[0] = static_cast<unsigned char>(seed);
      p[n - 1] = static_cast<unsigned char>(seed);
      EXPECT_EQ(p[0], static_cast<unsigned char>(seed));
      pool.deallocate(p);
    }
  };
  std::thread t1(worker, 1), t2(worker, 2);
  t1.join();
  t2.join();
  EXPECT_EQ(pool.stats().in_use.current, 0);
}

TEST(PinnedHostPool, RejectsTinySlabs) { EXPECT_THROW(PinnedHostPool(opts(1 << 20, 100)), logic_error); }

TEST(AlignedBuffer, AlignedZeroedAndMovable) {
  AlignedBuffer b(5000);
  EXPECT_TRUE(is_aligned(b.data(), kDirectIoAlignment));
  EXPECT_EQ(b.capacity(), 8192u);
  for (std::size_t i = 0; i < b.capacity(); ++i) ASSERT_EQ(b.data()[i], std::byte{0});
  AlignedBuffer c = std::move(b);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(c.capacity(), 8192u);
  EXPECT_THROW(AlignedBuffer(10, 3000), logic_error);
}

namespace {
// A completion the test finishes by hand.
struct ManualFence final : tierflow::Completion {
  std::atomic<bool> done{false};
  bool ready() const override { return done.load(); }
  void wait() const override {
    while (!done.load()) std::this_thread::yield();
  }
};
}  // namespace

TEST(PinnedHostPool, FencedBlockIsReusedOnlyAfterItsFence) {
  allocator::PinnedHostPoolOptions o;
  o.budget_bytes = 8192;
  o.slab_bytes = 8192;
  allocator::PinnedHostPool pool(o);
  void* a = pool.allocate(8192);
  auto fence = std::make_shared<ManualFence>();
  pool.deallocate(a, fence);
  EXPECT_EQ(pool.stats().fenced_frees, 1u);
  EXPECT_EQ(pool.stats().in_use.current, 8192) << "a copy still uses it";
  std::thread finisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    fence->done = true;
  });
  void* b = pool.try_allocate(8192);  // waits for the fence, then reuses the block
  finisher.join();
  EXPECT_EQ(b, a);
  EXPECT_EQ(pool.stats().fence_waits, 1u);
  pool.deallocate(b);
}

TEST(PinnedHostPool, PoisonedQuarantineFindsALateWrite) {
  allocator::PinnedHostPoolOptions o;
  o.budget_bytes = 1 << 20;
  o.slab_bytes = 1 << 20;
  o.poison_freed = true;
  o.quarantine_bytes = 1 << 20;
  allocator::PinnedHostPool pool(o);
  auto* p = static_cast<float*>(pool.allocate(4096));
  EXPECT_TRUE(std::isnan(p[0])) << "a fresh block holds poison, as a reused one could";
  p[0] = 1.0f;
  pool.deallocate(p);
  EXPECT_TRUE(std::isnan(p[0])) << "a freed block is poisoned";
  p[3] = 2.0f;  // a copy that still wrote into it after it was returned
  pool.release_unused();  // drains the quarantine, checking every byte
  EXPECT_EQ(pool.stats().late_writes, 1u);
  EXPECT_EQ(pool.stats().in_use.current, 0);
}

TEST(PinnedHostPool, SlabsComeThroughTheBudgetAndStatisticsAdaptors) {
  // Note [Pinned host pool]: the budget is the LimitingAdaptor's, the reserved
  // bytes the StatisticsAdaptor's; a slab released goes back through both.
  tierflow::allocator::PinnedHostPoolOptions o;
  o.budget_bytes = 3 * 4096;
  o.slab_bytes = 2 * 4096;
  tierflow::allocator::PinnedHostPool pool(o);
  void* a = pool.allocate(4096);
  EXPECT_EQ(pool.stats().reserved.current, 2 * 4096);
  void* b = pool.allocate(4096);
  void* c = pool.allocate(4096);  // a smaller slab: the rest of the budget
  EXPECT_EQ(pool.stats().reserved.current, 3 * 4096);
  EXPECT_EQ(pool.try_allocate(4096), nullptr);
  pool.deallocate(c);
  EXPECT_EQ(pool.release_unused(), 4096u);
  EXPECT_EQ(pool.stats().reserved.current, 2 * 4096);
  EXPECT_EQ(pool.stats().reserved.freed, 4096);
  void* d = pool.allocate(4096);  // the budget the released slab gave back
  EXPECT_NE(d, nullptr);
  for (void* p : {a, b, d}) pool.deallocate(p);
}

TEST(PinnedHostPool, StatFieldsNameEachCounterOnce) {
  // Note [Stat fields]: the report's host_pool dict comes from this table.
  PinnedHostPool pool(opts(4 << 20, 1 << 20));
  void* p = pool.allocate(4096);
  EXPECT_THROW(pool.allocate(64 << 20), out_of_memory);
  pool.deallocate(p);
  const auto s = pool.stats();
  std::vector<std::string> names;
  for (const auto& f : pinned_pool_stat_fields()) names.push_back(f.name);
  EXPECT_EQ(names, (std::vector<std::string>{"slab_allocations", "block_allocations", "failed_allocations",
                                             "fenced_frees", "fence_waits", "late_writes"}));
  EXPECT_EQ(pinned_pool_stat_fields()[1].of(s), static_cast<double>(s.block_allocations));
  EXPECT_EQ(pinned_pool_stat_fields()[1].of(s), 1.0);
  EXPECT_EQ(pinned_pool_stat_fields()[2].of(s), 1.0) << "the refused request";
}
