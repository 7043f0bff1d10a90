// The staged pipeline (Note [Staged pipeline]) on the emulated device, in its
// polite and its adversarial mode (Note [Adversarial emulated device]).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nvme_test_dir.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/staged_pipeline.hpp"

using namespace tierflow;
using namespace tierflow::swap;

namespace {

constexpr std::size_t kMiB = 1 << 20;
constexpr unsigned char kFreshDeviceByte = 0xAB;  // what new device memory holds before a copy fills it

// Emulated device memory: host bytes, held by the DeviceBuffer's owner.
DeviceBuffer device_bytes(const std::vector<unsigned char>& contents) {
  auto mem = std::make_shared<std::vector<unsigned char>>(contents);
  return DeviceBuffer{mem->data(), mem};
}

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

std::vector<unsigned char> read_device(const DeviceBuffer& b, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(b.data);
  return std::vector<unsigned char>(p, p + n);
}

// The current test's name, a parameterized one's '/' made '-', and a '-': its NVMe directory's prefix.
std::string test_dir_prefix() {
  std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  for (char& c : name)
    if (c == '/') c = '-';
  return name + "-";
}

// One pipeline over an emulated engine, a pinned pool and (optionally) NVMe.
// The parameter: true runs the adversarial emulated device.
class StagedPipelineTest : public ::testing::TestWithParam<bool> {
 protected:
  void TearDown() override {
    pipeline_.reset();
    nvme_.reset();
  }

  bool adversarial() const { return GetParam(); }

  // Builds the pipeline; `pool_bytes` is TIERFLOW_HOST_MEMORY.
  void make(std::uint64_t pool_bytes, bool with_nvme, std::uint64_t max_to_host_bytes = 256 * kMiB) {
    allocator::PinnedHostPoolOptions po;
    po.budget_bytes = pool_bytes;
    po.slab_bytes = kMiB;
    po.poison_freed = adversarial();
    pool_ = std::make_shared<allocator::PinnedHostPool>(po);
    EmulatedCopyOptions eo;
    eo.adversarial = adversarial();
    eo.seed = 7;
    engine_ = make_emulated_copy_engine(copy_faults_, eo);
    if (with_nvme) {
      NvmeEngineOptions no;
      no.paths = {dir_};
      no.bytes_per_path = 64 * kMiB;
      no.block_bytes = 256 << 10;
      no.queue_depth = 8;
      no.faults = &nvme_faults_;
      nvme_ = std::make_shared<NvmeEngine>(no);
    }
    StagedPipelineOptions o;
    o.max_to_host_bytes = max_to_host_bytes;
    o.allocate_device = [](std::size_t bytes, int) {
      return device_bytes(std::vector<unsigned char>(bytes, kFreshDeviceByte));
    };
    o.compute_stream = [this](int) { return engine_->compute_stream(nullptr); };
    o.on_state = [this](std::uint64_t id, StagedState to) { events_.emplace_back(id, to); };
    pipeline_ = std::make_unique<StagedPipeline>(o, pool_, engine_, nvme_);
  }

  // Offloads `contents` as block `id`; returns whether it left the device.
  bool offload(std::uint64_t id, const std::vector<unsigned char>& contents, StagedTarget target) {
    return pipeline_->offload(id, device_bytes(contents), contents.size(), 0, target,
                              engine_->compute_stream(nullptr));
  }

  // Polls until `done` holds (NVMe writes complete on their own thread).
  void settle(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      pipeline_->synchronize();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(done()) << "the pipeline did not settle";
  }

  // Brings block `id` back and returns its bytes on the device.
  std::vector<unsigned char> round_trip(std::uint64_t id, std::size_t bytes) {
    EXPECT_EQ(pipeline_->fetch(id), FetchResult::kStarted);
    pipeline_->complete_fetch(id);
    EXPECT_EQ(pipeline_->state(id), StagedState::kOnDevice);
    return read_device(pipeline_->device_copy(id), bytes);
  }

  // The order in which blocks reached `state`.
  std::vector<std::uint64_t> reached(StagedState state) const {
    std::vector<std::uint64_t> ids;
    for (const auto& [id, to] : events_)
      if (to == state) ids.push_back(id);
    return ids;
  }

  // This test's directory (nvme_test_dir.hpp), named after it ('/' made '-'); removed after everything below.
  const testing_nvme::NvmeTestDir test_dir_{test_dir_prefix()};
  const std::string dir_ = test_dir_.path();
  std::shared_ptr<CopyFaults> copy_faults_ = std::make_shared<CopyFaults>();
  NvmeFaults nvme_faults_;
  std::shared_ptr<allocator::PinnedHostPool> pool_;
  std::shared_ptr<CopyEngine> engine_;
  std::shared_ptr<NvmeEngine> nvme_;
  std::unique_ptr<StagedPipeline> pipeline_;
  std::vector<std::pair<std::uint64_t, StagedState>> events_;
};

TEST_P(StagedPipelineTest, HostRoundTripIsBitExact) {
  make(16 * kMiB, /*with_nvme=*/false);
  const auto a = random_bytes(kMiB + 123, 1);
  const auto b = random_bytes(3 * kMiB, 2);
  ASSERT_TRUE(offload(1, a, StagedTarget::kHost));
  ASSERT_TRUE(offload(2, b, StagedTarget::kHost));
  std::weak_ptr<void> source = pipeline_->device_copy(1).owner;
  pipeline_->synchronize();
  EXPECT_EQ(pipeline_->state(1), StagedState::kOnHost);
  EXPECT_TRUE(source.expired()) << "the device copy is dropped once the host holds the block";
  EXPECT_EQ(round_trip(2, b.size()), b);
  EXPECT_EQ(round_trip(1, a.size()), a);
  EXPECT_EQ(pool_->stats().in_use.current, 0u) << "the staging returns to the pool after the copy back";
  EXPECT_EQ(reached(StagedState::kOnHost), (std::vector<std::uint64_t>{1, 2}));
  pipeline_->release(1);
  pipeline_->release(2);
  EXPECT_FALSE(pipeline_->contains(1));
  EXPECT_EQ(reached(StagedState::kReleased), (std::vector<std::uint64_t>{1, 2}));
  EXPECT_EQ(engine_->stats().d2h_bytes, a.size() + b.size());
}

TEST_P(StagedPipelineTest, NvmeRoundTripWritesBehindAndReadsAheadBitExact) {
  make(16 * kMiB, /*with_nvme=*/true);
  const auto a = random_bytes(2 * kMiB + 4096 + 17, 3);
  ASSERT_TRUE(offload(7, a, StagedTarget::kNvme));
  settle([&] { return pipeline_->state(7) == StagedState::kOnNvme; });
  EXPECT_EQ(pool_->stats().in_use.current, 0u) << "staging returns to the pool once the write completes";
  EXPECT_EQ(pipeline_->stats().nvme_writes, 1u);
  EXPECT_EQ(pipeline_->stats().nvme_write_bytes, a.size());
  EXPECT_EQ(pipeline_->device_copy(7).owner, nullptr);
  EXPECT_EQ(pipeline_->fetch(7), FetchResult::kStarted);
  EXPECT_GT(pool_->stats().in_use.current, 0u) << "the read-ahead lands in staging";
  pipeline_->complete_fetch(7);
  EXPECT_EQ(read_device(pipeline_->device_copy(7), a.size()), a);
  EXPECT_EQ(pipeline_->stats().nvme_reads, 1u);
  EXPECT_EQ(pipeline_->stats().nvme_forwarded, 0u);
  EXPECT_EQ(reached(StagedState::kToDevice), (std::vector<std::uint64_t>{7}));
  pipeline_->release(7);
  EXPECT_EQ(nvme_->stats().bytes_in_use, 0u) << "release returns the block's NVMe space";
}

TEST_P(StagedPipelineTest, ReadWhileTheWriteIsPendingIsServedFromStaging) {
  make(16 * kMiB, /*with_nvme=*/true);
  nvme_faults_.write_delay_us = 100'000;  // every write request (four of them) is held this long
  const auto a = random_bytes(kMiB, 4);
  ASSERT_TRUE(offload(1, a, StagedTarget::kNvme));
  settle([&] { return pipeline_->state(1) == StagedState::kOnHost; });  // copied to the host, write started
  EXPECT_EQ(pipeline_->fetch(1), FetchResult::kStarted);
  pipeline_->complete_fetch(1);
  EXPECT_EQ(read_device(pipeline_->device_copy(1), a.size()), a);
  EXPECT_EQ(pipeline_->stats().nvme_forwarded, 1u);
  EXPECT_EQ(pipeline_->stats().nvme_reads, 0u) << "no NVMe read: the staging still held the block";
  EXPECT_GT(pool_->stats().in_use.current, 0u) << "the pending write still reads the staging";
  settle([&] { return pipeline_->stats().nvme_writes == 1; });
  EXPECT_EQ(pool_->stats().in_use.current, 0u) << "the staging is freed once the write is done";
  EXPECT_EQ(pipeline_->state(1), StagedState::kOnDevice);
  EXPECT_TRUE(reached(StagedState::kOnNvme).empty());
}

TEST_P(StagedPipelineTest, ReadWhileTheCopyToTheHostIsInFlightKeepsTheDeviceCopy) {
  make(16 * kMiB, /*with_nvme=*/true);
  copy_faults_->d2h_delay_us = 200'000;
  const auto a = random_bytes(kMiB, 5);
  ASSERT_TRUE(offload(3, a, StagedTarget::kNvme));
  const void* original = pipeline_->device_copy(3).data;
  EXPECT_EQ(pipeline_->state(3), StagedState::kToHost);
  EXPECT_EQ(pipeline_->fetch(3), FetchResult::kForwarded);
  ASSERT_EQ(pipeline_->state(3), StagedState::kOnDevice);
  EXPECT_EQ(pipeline_->device_copy(3).data, original) << "served from the device copy, no round trip";
  pipeline_->synchronize();
  EXPECT_EQ(read_device(pipeline_->device_copy(3), a.size()), a);
  EXPECT_EQ(pool_->stats().in_use.current, 0u) << "the host copy is dropped when it lands";
  EXPECT_EQ(pipeline_->stats().nvme_writes, 0u) << "nothing is written for a forwarded block";
  EXPECT_EQ(engine_->stats().h2d_ops, 0u);
}

TEST_P(StagedPipelineTest, BoundedStagingWaitsOldestFirstWithinTheBudget) {
  const std::uint64_t budget = 2 * kMiB;  // staging for two blocks; five go through it
  make(budget, /*with_nvme=*/true);
  std::vector<std::vector<unsigned char>> blocks;
  for (unsigned i = 0; i < 5; ++i) {
    blocks.push_back(random_bytes(kMiB, 10 + i));
    ASSERT_TRUE(offload(i, blocks.back(), StagedTarget::kNvme)) << "block " << i << " waits instead of failing";
    if (i >= 2) {  // its staging came from the oldest block, which is on NVMe now
      const auto on_nvme = reached(StagedState::kOnNvme);
      EXPECT_NE(std::find(on_nvme.begin(), on_nvme.end(), i - 2), on_nvme.end()) << "block " << i - 2;
    }
  }
  settle([&] { return reached(StagedState::kOnNvme).size() == 5; });
  EXPECT_GT(pipeline_->stats().staging_waits, 0u);
  EXPECT_EQ(reached(StagedState::kOnNvme), (std::vector<std::uint64_t>{0, 1, 2, 3, 4})) << "oldest first";
  for (std::uint64_t i = 0; i < 5; ++i) EXPECT_EQ(pipeline_->fetch(i), FetchResult::kStarted) << i;
  for (std::uint64_t i = 0; i < 5; ++i) {
    pipeline_->complete_fetch(i);
    EXPECT_EQ(read_device(pipeline_->device_copy(i), kMiB), blocks[i]) << "block " << i;
  }
  const auto st = pool_->stats();
  EXPECT_LE(st.reserved.peak, budget) << "never allocates past TIERFLOW_HOST_MEMORY";
  EXPECT_LE(st.in_use.peak, budget);
  EXPECT_EQ(st.in_use.current, 0u);
}

TEST_P(StagedPipelineTest, NoRoomWithNothingInFlightKeepsTheBlockOnTheDevice) {
  make(2 * kMiB, /*with_nvme=*/true);
  EXPECT_FALSE(offload(1, random_bytes(3 * kMiB, 6), StagedTarget::kNvme)) << "larger than the whole budget";
  const auto held = random_bytes(2 * kMiB, 7);
  ASSERT_TRUE(offload(2, held, StagedTarget::kHost));  // fills the pool and stays on the host
  pipeline_->synchronize();
  const std::uint64_t waits = pipeline_->stats().staging_waits;
  EXPECT_FALSE(offload(3, random_bytes(kMiB, 8), StagedTarget::kNvme)) << "nothing in flight frees staging";
  EXPECT_FALSE(offload(4, random_bytes(kMiB, 9), StagedTarget::kHost)) << "the host target never waits";
  EXPECT_GT(pipeline_->stats().staging_waits, waits);
  EXPECT_FALSE(pipeline_->contains(1));
  EXPECT_FALSE(pipeline_->contains(3));
  EXPECT_LE(pool_->stats().reserved.peak, 2 * kMiB);
  EXPECT_EQ(round_trip(2, held.size()), held);
}

TEST_P(StagedPipelineTest, NoStagingToReadBackRaisesOutOfMemory) {
  make(2 * kMiB, /*with_nvme=*/true);
  const auto a = random_bytes(kMiB, 11);
  ASSERT_TRUE(offload(1, a, StagedTarget::kNvme));
  settle([&] { return pipeline_->state(1) == StagedState::kOnNvme; });
  void* hog = pool_->try_allocate(2 * kMiB);  // another user of the pool takes it all
  ASSERT_NE(hog, nullptr);
  EXPECT_EQ(pipeline_->fetch(1), FetchResult::kNoStaging);
  EXPECT_THROW(pipeline_->fetch_or_throw(1), out_of_memory);
  EXPECT_EQ(pipeline_->state(1), StagedState::kOnNvme) << "left as it was";
  pool_->deallocate(hog);
  pipeline_->fetch_or_throw(1);
  pipeline_->complete_fetch(1);
  EXPECT_EQ(read_device(pipeline_->device_copy(1), a.size()), a);
}

TEST_P(StagedPipelineTest, FailedWriteKeepsTheBlockOnTheHostAndCountsIt) {
  make(16 * kMiB, /*with_nvme=*/true);
  nvme_faults_.fail_writes = 1;
  const auto a = random_bytes(kMiB, 12);
  ASSERT_TRUE(offload(1, a, StagedTarget::kNvme));
  settle([&] { return pipeline_->stats().nvme_write_failures == 1; });
  EXPECT_EQ(pipeline_->state(1), StagedState::kOnHost);
  EXPECT_EQ(pipeline_->stats().nvme_writes, 0u);
  EXPECT_GE(pool_->stats().in_use.current, a.size()) << "the staging holds the only copy";
  EXPECT_EQ(nvme_->stats().bytes_in_use, 0u) << "the failed write's NVMe space is released";
  EXPECT_EQ(round_trip(1, a.size()), a);
  EXPECT_EQ(pipeline_->stats().nvme_reads, 0u);
}

TEST_P(StagedPipelineTest, FailedReadRaisesAndLeaksNothing) {
  make(16 * kMiB, /*with_nvme=*/true);
  const auto a = random_bytes(kMiB, 13);
  ASSERT_TRUE(offload(1, a, StagedTarget::kNvme));
  settle([&] { return pipeline_->state(1) == StagedState::kOnNvme; });
  nvme_faults_.fail_reads = 1;
  ASSERT_EQ(pipeline_->fetch(1), FetchResult::kStarted);
  std::weak_ptr<void> destination = pipeline_->device_copy(1).owner;
  EXPECT_THROW(pipeline_->complete_fetch(1), io_error);
  EXPECT_EQ(engine_->stats().h2d_ops, 0u) << "nothing is copied from a failed read";
  pipeline_->poll();
  EXPECT_EQ(pool_->stats().in_use.current, 0u) << "the failed read's staging is back in the pool";
  pipeline_->release(1);
  EXPECT_EQ(pool_->stats().in_use.current, 0u);
  EXPECT_EQ(nvme_->stats().bytes_in_use, 0u);
  EXPECT_TRUE(destination.expired()) << "the device memory for the read is freed";
  EXPECT_EQ(reached(StagedState::kReleased), (std::vector<std::uint64_t>{1}));
}

TEST_P(StagedPipelineTest, CopiesNameTheComputeStream) {
  // Rule 1 of Note [Copy ordering]: in the adversarial mode a copy that names
  // no stream delivers poison; the pipeline names the block's compute stream.
  make(16 * kMiB, /*with_nvme=*/true);
  const auto a = random_bytes(kMiB, 14);
  ASSERT_TRUE(offload(1, a, StagedTarget::kNvme));
  settle([&] { return pipeline_->state(1) == StagedState::kOnNvme; });
  EXPECT_EQ(round_trip(1, a.size()), a);
  EXPECT_EQ(emulated_copy_stats(*engine_).unordered_copies, 0u);
}

INSTANTIATE_TEST_SUITE_P(EmulatedDevice, StagedPipelineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "adversarial" : "polite";
                         });

}  // namespace
