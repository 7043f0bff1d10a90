// Window peaks (Note [Window peak] in core/stats.hpp): the most a meter held since the previous take, what the step
// recorder reads at each step's boundary (Note [Step stats]); in Stat, the pinned pool, the saved activations'
// registry and the NVMe engine's bytes in use.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "nvme_test_dir.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/stats.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/tiering/block_registry.hpp"

using namespace tierflow;

TEST(StatWindowPeak, TheMostSinceThePreviousTakeBelowTheAllTimePeak) {
  Stat s;
  EXPECT_EQ(s.take_window_peak(), 0);
  s.increase(500);
  s.decrease(500);
  EXPECT_EQ(s.take_window_peak(), 500);
  s.increase(100);
  s.increase(20);  // 120: below the all-time 500
  s.decrease(90);
  EXPECT_EQ(s.take_window_peak(), 120) << "the window's own peak, not the all-time one";
  EXPECT_EQ(s.values().peak, 500);
  EXPECT_EQ(s.take_window_peak(), 30) << "a window with no increase: what is held at its start";
  s.decrease(30);
  EXPECT_EQ(s.take_window_peak(), 30) << "held at the window's start (the previous take), then freed";
  EXPECT_EQ(s.take_window_peak(), 0);
  s.reset_peak();
  s.increase(7);
  EXPECT_EQ(s.take_window_peak(), 7);
}

TEST(StatWindowPeak, ConcurrentIncreasesLandInSomeWindow) {
  Stat s;
  constexpr int kThreads = 2, kRounds = 20000;
  std::atomic<bool> go{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&] {
      while (!go.load()) {
      }
      for (int i = 0; i < kRounds; ++i) {
        s.increase(10);
        s.decrease(10);
      }
    });
  }
  go.store(true);
  std::int64_t most = 0;
  for (int i = 0; i < 1000; ++i) most = std::max(most, s.take_window_peak());
  for (auto& w : workers) w.join();
  most = std::max(most, s.take_window_peak());
  EXPECT_EQ(most, s.values().peak) << "the all-time peak fell in one of the windows";
  EXPECT_EQ(s.take_window_peak(), 0) << "all freed: the next window starts at zero";
}

TEST(PinnedHostPoolWindowPeak, InUseSinceThePreviousTake) {
  allocator::PinnedHostPoolOptions o;
  o.budget_bytes = 8 << 20;
  o.slab_bytes = 1 << 20;
  allocator::PinnedHostPool pool(o);
  void* a = pool.allocate(256 << 10);
  void* b = pool.allocate(256 << 10);
  pool.deallocate(a);
  pool.deallocate(b);
  EXPECT_EQ(pool.take_in_use_window_peak(), 512 << 10);
  void* c = pool.allocate(64 << 10);
  pool.deallocate(c);
  EXPECT_EQ(pool.take_in_use_window_peak(), 64 << 10) << "below the earlier window's";
  EXPECT_EQ(pool.stats().in_use.peak, 512 << 10);
  EXPECT_EQ(pool.take_in_use_window_peak(), 0);
}

TEST(BlockRegistryWindowPeak, EachTierSinceThePreviousTake) {
  using tiering::Residence;
  tiering::BlockRegistry r;
  const auto a = r.add(1000, Residence::kResident);
  const auto b = r.add(300, Residence::kResident);
  r.transition(a, Residence::kInFlightToHost);  // device and host both hold it
  r.transition(a, Residence::kOnHost);
  r.transition(b, Residence::kReleased);
  auto w = r.take_window_peaks();
  EXPECT_EQ(w.device, 1300);
  EXPECT_EQ(w.host, 1000);
  r.transition(a, Residence::kOnNvme);
  w = r.take_window_peaks();
  EXPECT_EQ(w.device, 0);
  EXPECT_EQ(w.host, 1000) << "held at the window's start";
  EXPECT_EQ(w.nvme, 1000);
  r.transition(a, Residence::kInFlightToDevice);
  r.transition(a, Residence::kResident);
  w = r.take_window_peaks();
  EXPECT_EQ(w.device, 1000) << "below the earlier window's 1300";
  EXPECT_EQ(r.device_bytes().values().peak, 1300);
  r.transition(a, Residence::kReleased);
}

TEST(NvmeEngineWindowPeak, BytesInUseSinceThePreviousTake) {
  const testing_nvme::NvmeTestDir dir("window-peak-");  // removed after the engine
  swap::NvmeEngineOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = 16 << 20;
  o.block_bytes = 256 << 10;
  o.queue_depth = 4;
  swap::NvmeEngine e(o);
  const auto a = e.allocate(1 << 20);
  const auto b = e.allocate(1 << 20);
  e.release(a);
  e.release(b);
  EXPECT_EQ(e.take_in_use_window_peak(), 2u << 20);
  const auto c = e.allocate(1 << 20);
  EXPECT_EQ(e.take_in_use_window_peak(), 1u << 20) << "below the earlier window's";
  e.release(c);
  EXPECT_EQ(e.take_in_use_window_peak(), 1u << 20) << "held at the window's start";
  EXPECT_EQ(e.take_in_use_window_peak(), 0u);
}
