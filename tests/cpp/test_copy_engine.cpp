#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>
#ifdef TIERFLOW_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "tierflow/allocator/device.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/copy_engine.hpp"

using namespace tierflow;
using namespace tierflow::swap;

namespace {
std::vector<allocator::DeviceKind> kinds() {
  std::vector<allocator::DeviceKind> k{allocator::DeviceKind::kEmulated};
  if (allocator::cuda_available()) k.push_back(allocator::DeviceKind::kCuda);
  return k;
}
}  // namespace

// With CUDA the "device" side needs device memory; the emulated engine treats
// host memory as the device. These tests use the emulated device and run the
// CUDA engine on the same assertions where a GPU exists.
TEST(CopyEngine, CopiesBytesBothWays) {
  for (auto kind : kinds()) {
    if (kind == allocator::DeviceKind::kCuda) continue;  // covered in CudaRoundTrip
    auto engine = make_copy_engine(kind);
    std::vector<std::uint8_t> dev(1 << 20), host(1 << 20), back(1 << 20);
    std::iota(dev.begin(), dev.end(), 0);
    TransferHandle d2h = engine->copy(Direction::kDeviceToHost, host.data(), dev.data(), dev.size());
    TransferHandle h2d = engine->copy(Direction::kHostToDevice, back.data(), host.data(), host.size(), {d2h});
    h2d.wait();
    EXPECT_TRUE(d2h.ready());
    EXPECT_EQ(back, dev);
    auto st = engine->stats();
    EXPECT_EQ(st.d2h_bytes, dev.size());
    EXPECT_EQ(st.h2d_bytes, dev.size());
    EXPECT_EQ(st.d2h_ops, 1u);
  }
}

// The Python suite's tiers (tests/README.md) trust this count: every queued
// copy moves it, whatever its size, and nothing else does.
TEST(CopyEngine, CountsEveryQueuedCopyInTheProcess) {
  auto engine = make_emulated_copy_engine();
  std::vector<std::uint8_t> a(64, 1), b(64, 0);
  const std::uint64_t before = queued_transfers_in_process();
  engine->synchronize();
  EXPECT_EQ(queued_transfers_in_process(), before);
  engine->copy(Direction::kDeviceToHost, b.data(), a.data(), a.size());
  engine->copy(Direction::kHostToDevice, a.data(), b.data(), 0);
  engine->synchronize();
  EXPECT_EQ(queued_transfers_in_process(), before + 2);
}

TEST(CopyEngine, StreamIsInOrder) {
  auto engine = make_emulated_copy_engine();
  // Each copy overwrites the same destination; the last submitted must win,
  // and every earlier handle must be complete once the last one is.
  std::vector<std::vector<std::uint8_t>> sources(64, std::vector<std::uint8_t>(64 << 10));
  for (std::size_t i = 0; i < sources.size(); ++i) std::fill(sources[i].begin(), sources[i].end(), i);
  std::vector<std::uint8_t> dst(64 << 10);
  std::vector<TransferHandle> handles;
  for (auto& s : sources) handles.push_back(engine->copy(Direction::kDeviceToHost, dst.data(), s.data(), s.size()));
  handles.back().wait();
  for (auto& h : handles) EXPECT_TRUE(h.ready());
  EXPECT_EQ(dst.front(), 63);
  EXPECT_EQ(dst.back(), 63);
}

TEST(CopyEngine, ChainedCopyWaitsForItsDependency) {
  auto engine = make_emulated_copy_engine();
  // A long D2H copy, then an H2D copy that reads its output: the H2D must see
  // the finished data even though it runs on the other stream.
  const std::size_t n = 64 << 20;
  std::vector<std::uint8_t> dev(n, 0x5a), host(n, 0), back(n, 0);
  auto d2h = engine->copy(Direction::kDeviceToHost, host.data(), dev.data(), n);
  auto h2d = engine->copy(Direction::kHostToDevice, back.data(), host.data(), n, {d2h});
  h2d.wait();
  EXPECT_EQ(back[0], 0x5a);
  EXPECT_EQ(back[n - 1], 0x5a);
}

TEST(CopyEngine, DirectionsOverlap) {
  auto engine = make_emulated_copy_engine();
  // A blocked D2H stream must not hold back the H2D stream.
  const std::size_t n = 256 << 20;
  std::vector<std::uint8_t> big_src(n, 1), big_dst(n);
  std::vector<std::uint8_t> small_src(4096, 2), small_dst(4096);
  auto slow = engine->copy(Direction::kDeviceToHost, big_dst.data(), big_src.data(), n);
  auto fast = engine->copy(Direction::kHostToDevice, small_dst.data(), small_src.data(), 4096);
  fast.wait();
  EXPECT_EQ(small_dst[4095], 2);
  slow.wait();
  EXPECT_EQ(big_dst[n - 1], 1);
}

TEST(CopyEngine, SynchronizeDrainsEverything) {
  auto engine = make_emulated_copy_engine();
  std::vector<std::uint8_t> a(1 << 20, 9), b(1 << 20);
  std::vector<TransferHandle> hs;
  for (int i = 0; i < 16; ++i) hs.push_back(engine->copy(Direction::kHostToDevice, b.data(), a.data(), a.size()));
  engine->synchronize();
  for (auto& h : hs) EXPECT_TRUE(h.ready());
  EXPECT_EQ(b[12345], 9);
}

TEST(CopyEngine, EmptyHandleIsComplete) {
  TransferHandle h;
  EXPECT_FALSE(h.valid());
  EXPECT_TRUE(h.ready());
  EXPECT_NO_THROW(h.wait());
  EXPECT_EQ(h.bytes(), 0u);
}

TEST(CopyEngine, ZeroByteCopyCompletes) {
  auto engine = make_emulated_copy_engine();
  auto h = engine->copy(Direction::kDeviceToHost, nullptr, nullptr, 0);
  h.wait();
  EXPECT_TRUE(h.ready());
}

TEST(CopyEngine, CudaEngineNeedsCuda) {
  if (allocator::cuda_available()) GTEST_SKIP() << "a GPU is present; see CudaRoundTrip";
  EXPECT_THROW(make_cuda_copy_engine(), logic_error);
}

TEST(CopyEngine, CudaRoundTrip) {
  if (!allocator::cuda_available())
    GTEST_SKIP() << "no CUDA GPU on this machine (CUDA backend compiled: "
                 << (allocator::cuda_compiled() ? "yes" : "no") << ")";
  auto engine = make_cuda_copy_engine();
  allocator::PinnedHostPoolOptions o;
  o.budget_bytes = 64 << 20;
  o.slab_bytes = 16 << 20;
  o.cuda_pinned = true;
  allocator::PinnedHostPool pool(o);
  const std::size_t n = 8 << 20;
  auto* src = static_cast<std::uint8_t*>(pool.allocate(n));
  auto* dst = static_cast<std::uint8_t*>(pool.allocate(n));
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<std::uint8_t>(i * 7);
  void* d = nullptr;
#ifdef TIERFLOW_WITH_CUDA
  ASSERT_EQ(cudaMalloc(&d, n), cudaSuccess);  // device memory as torch's allocator gets it
#endif
  auto up = engine->copy(Direction::kHostToDevice, d, src, n);
  auto down = engine->copy(Direction::kDeviceToHost, dst, d, n, {up});
  down.wait();
  EXPECT_EQ(std::memcmp(src, dst, n), 0);
#ifdef TIERFLOW_WITH_CUDA
  cudaFree(d);
#endif
  pool.deallocate(src);
  pool.deallocate(dst);
}

// Note [Adversarial emulated device]: rule 1 of Note [Copy ordering] is checked.
TEST(CopyEngine, AdversarialPoisonsCopiesThatNameNoStream) {
  EmulatedCopyOptions o;
  o.adversarial = true;
  auto engine = make_emulated_copy_engine(nullptr, o);
  std::vector<float> dev(4096, 1.5f), ordered(4096), unordered(4096);
  auto a = engine->copy(Direction::kDeviceToHost, ordered.data(), dev.data(), dev.size() * sizeof(float), {},
                        engine->compute_stream(nullptr));
  auto b = engine->copy(Direction::kHostToDevice, unordered.data(), dev.data(), dev.size() * sizeof(float));
  a.wait();
  b.wait();
  EXPECT_EQ(ordered, dev);
  for (float x : unordered) ASSERT_TRUE(std::isnan(x));
  auto st = emulated_copy_stats(*engine);
  EXPECT_EQ(st.unordered_copies, 1u);
}

TEST(CopyEngine, AdversarialCopiesAreLateButInOrderPerDirection) {
  EmulatedCopyOptions o;
  o.adversarial = true;
  o.seed = 7;
  auto engine = make_emulated_copy_engine(nullptr, o);
  std::vector<std::uint8_t> src(1 << 16, 3), dst(1 << 16, 0);
  const auto s = engine->compute_stream(nullptr);
  std::vector<TransferHandle> hs;
  for (int i = 0; i < 32; ++i) hs.push_back(engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size(), {}, s));
  // Whether a copy is still in flight when the host looks depends on the
  // scheduler (a timing assertion here was flaky), so "late" is read from the
  // engine's count of delayed copies below.
  hs.back().wait();
  for (auto& h : hs) EXPECT_TRUE(h.ready());  // a stream stays in order
  EXPECT_EQ(dst, src);
  EXPECT_GT(emulated_copy_stats(*engine).delayed_copies, 16u) << "most adversarial copies wait";
}

TEST(CopyEngine, PoliteEngineIgnoresTheStreamItWasNotGiven) {
  auto engine = make_emulated_copy_engine();
  std::vector<std::uint8_t> src(4096, 9), dst(4096, 0);
  engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size()).wait();
  EXPECT_EQ(dst, src);  // why the first round never saw issue 8
}

TEST(CopyEngine, InjectedDeviceToHostFailuresTravelThroughTheHandle) {
  auto faults = std::make_shared<CopyFaults>();
  faults->fail_d2h_copies = 1;
  auto engine = make_emulated_copy_engine(faults, EmulatedCopyOptions{});
  std::vector<std::uint8_t> src(4096, 3), dst(4096, 0), up(4096, 0);
  const auto s = engine->compute_stream(nullptr);
  auto up_copy = engine->copy(Direction::kHostToDevice, up.data(), src.data(), src.size(), {}, s);
  auto failed = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size(), {}, s);
  EXPECT_THROW(failed.wait(), io_error);
  EXPECT_EQ(dst, std::vector<std::uint8_t>(4096, 0)) << "a failed copy writes nothing";
  engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size(), {}, s).wait();  // only one fails
  up_copy.wait();  // host -> device copies are not affected
  EXPECT_EQ(dst, src);
  EXPECT_EQ(up, src);
  EXPECT_EQ(faults->fail_d2h_copies.load(), 0);
}

TEST(CopyEngine, StatFieldsAreTheReportsLinks) {
  // Note [Stat fields]: the report's "links" dict comes from this table.
  auto engine = swap::make_copy_engine(allocator::DeviceKind::kEmulated);
  std::vector<char> host(1000), dev(1000, 7);
  engine->copy(swap::Direction::kDeviceToHost, host.data(), dev.data(), dev.size(), {}, engine->compute_stream(nullptr))
      .wait();
  const auto s = engine->stats();
  std::vector<std::string> names;
  for (const auto& f : swap::copy_engine_stat_fields()) names.push_back(f.name);
  EXPECT_EQ(names, (std::vector<std::string>{"gpu_to_host_bytes", "host_to_gpu_bytes", "gpu_to_host_ops",
                                             "host_to_gpu_ops"}));
  EXPECT_EQ(swap::copy_engine_stat_fields()[0].of(s), 1000.0);
  EXPECT_EQ(swap::copy_engine_stat_fields()[2].of(s), 1.0);
  EXPECT_EQ(swap::emulated_copy_stat_fields().size(), 2u);
  EXPECT_STREQ(swap::emulated_copy_stat_fields()[0].name, "unordered_copies");
}
