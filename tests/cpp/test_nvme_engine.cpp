#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/nvme_engine.hpp"

using namespace tierflow;
using namespace tierflow::swap;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test on a file system with O_DIRECT (not tmpfs).
class NvmeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* base = std::getenv("NVME_TEST_DIR");
    std::string root = base ? base : (fs::current_path() / "nvme-test").string();
    dir_ = root + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-" + std::to_string(getpid());
    fs::create_directories(dir_ + "/a");
    fs::create_directories(dir_ + "/b");
  }
  void TearDown() override { fs::remove_all(dir_); }
  NvmeEngineOptions opts(int paths = 1, std::uint64_t per_path = 64ULL << 20) {
    NvmeEngineOptions o;
    o.paths.push_back(dir_ + "/a");
    if (paths > 1) o.paths.push_back(dir_ + "/b");
    o.bytes_per_path = per_path;
    o.block_bytes = 256 << 10;
    o.queue_depth = 16;
    return o;
  }
  std::size_t files_in(const std::string& d) {
    std::size_t n = 0;
    for (auto& e : fs::directory_iterator(d)) n += e.is_regular_file();
    return n;
  }
  std::string dir_;
};

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
  std::vector<std::uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng());
  return v;
}

}  // namespace

TEST_F(NvmeTest, RoundTripsRandomSizesOnOneAndTwoPaths) {
  for (int paths : {1, 2}) {
    NvmeEngine e(opts(paths));
    std::mt19937 rng(1);
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{4096}, std::size_t{4097},
                          std::size_t{300000}, std::size_t{(256 << 10) * 3 + 17}, std::size_t{16 << 20}}) {
      auto data = random_bytes(n, static_cast<unsigned>(n));
      NvmeBlock b = e.allocate(n);
      e.write(b, data.data(), n).wait();
      EXPECT_TRUE(e.valid(b));
      std::vector<std::uint8_t> back(n, 0);
      e.read(b, back.data(), n).wait();
      ASSERT_EQ(back, data) << n << " bytes over " << paths << " paths";
      e.release(b);
    }
    // Aligned buffers go straight to the device (no staging); same result.
    allocator::AlignedBuffer src(1 << 20), dst(1 << 20);
    auto data = random_bytes(1 << 20, 9);
    std::memcpy(src.data(), data.data(), data.size());
    NvmeBlock b = e.allocate(1 << 20);
    e.write(b, src.data(), 1 << 20).wait();
    e.read(b, dst.data(), 1 << 20).wait();
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), 1 << 20), 0);
    e.release(b);
    EXPECT_EQ(e.stats().bytes_in_use, 0u);
  }
}

TEST_F(NvmeTest, TheLargestBlockFillsEveryFile) {
  auto o = opts(2, 32ULL << 20);
  NvmeEngine e(o);
  const std::size_t n = 2 * o.bytes_per_path - 12345;  // all of both files, with an unaligned tail
  auto data = random_bytes(n, 11);
  NvmeBlock b = e.allocate(n);
  EXPECT_THROW(e.allocate(4096), out_of_memory) << "nothing is left";
  e.write(b, data.data(), n).wait();
  std::vector<std::uint8_t> back(n);
  e.read(b, back.data(), n).wait();
  EXPECT_EQ(back, data);
}

TEST_F(NvmeTest, ManyOperationsInFlight) {
  NvmeEngine e(opts(2));
  const int n = 48;
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<NvmeBlock> blocks;
  std::vector<TransferHandle> hs;
  for (int i = 0; i < n; ++i) {
    data.push_back(random_bytes(100000 + i * 997, i));
    blocks.push_back(e.allocate(data.back().size()));
    hs.push_back(e.write(blocks.back(), data.back().data(), data.back().size()));
  }
  for (auto& h : hs) h.wait();
  std::vector<std::vector<std::uint8_t>> back(n);
  hs.clear();
  for (int i = 0; i < n; ++i) {
    back[i].resize(data[i].size());
    hs.push_back(e.read(blocks[i], back[i].data(), back[i].size()));
  }
  for (int i = 0; i < n; ++i) {
    hs[i].wait();
    ASSERT_EQ(back[i], data[i]) << i;
  }
  EXPECT_EQ(e.stats().write_ops, static_cast<std::uint64_t>(n));
}

TEST_F(NvmeTest, SpaceIsReusedAndFilesNeverGrow) {
  auto o = opts(2, 16ULL << 20);
  NvmeEngine e(o);
  const auto files = e.files();
  for (int step = 0; step < 100; ++step) {
    std::vector<NvmeBlock> live;
    for (int i = 0; i < 5; ++i) {
      auto data = random_bytes(1'000'000 + step * 13 + i, step * 7 + i);
      live.push_back(e.allocate(data.size()));
      e.write(live.back(), data.data(), data.size()).wait();
    }
    for (auto b : live) e.release(b);
  }
  EXPECT_EQ(e.stats().bytes_in_use, 0u);
  for (const auto& f : files) EXPECT_EQ(fs::file_size(f), o.bytes_per_path) << f;
  // After all that churn the free lists coalesced back: the whole capacity fits in one block.
  NvmeBlock all = e.allocate(2 * o.bytes_per_path);
  e.release(all);
}

TEST_F(NvmeTest, FullTierIsOutOfMemoryNamingTheSetting) {
  NvmeEngine e(opts(1, 4ULL << 20));
  NvmeBlock a = e.allocate(3 << 20);
  try {
    e.allocate(2 << 20);
    FAIL();
  } catch (const out_of_memory& err) {
    EXPECT_NE(std::string(err.what()).find("TIERFLOW_NVME_MEMORY"), std::string::npos) << err.what();
  }
  e.release(a);
  EXPECT_NO_THROW(e.release(e.allocate(4 << 20)));
}

TEST_F(NvmeTest, ChecksumCatchesACorruptBlock) {
  NvmeFaults faults;
  auto o = opts(1);
  o.faults = &faults;
  NvmeEngine e(o);
  auto data = random_bytes(700000, 3);
  NvmeBlock b = e.allocate(data.size());
  e.write(b, data.data(), data.size()).wait();
  faults.corrupt_reads = 1;
  std::vector<std::uint8_t> back(data.size());
  try {
    e.read(b, back.data(), back.size()).wait();
    FAIL() << "corruption went unnoticed";
  } catch (const io_error& err) {
    EXPECT_NE(std::string(err.what()).find("checksum mismatch"), std::string::npos) << err.what();
  }
  // The block on disk is fine: a clean read succeeds.
  e.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
}

TEST_F(NvmeTest, FailedWriteNeverLeavesTheBlockValid) {
  NvmeFaults faults;
  auto o = opts(2);
  o.faults = &faults;
  NvmeEngine e(o);
  auto data = random_bytes(1 << 20, 4);
  NvmeBlock b = e.allocate(data.size());
  faults.fail_writes = 1;
  try {
    e.write(b, data.data(), data.size()).wait();
    FAIL();
  } catch (const io_error& err) {
    std::string m = err.what();
    EXPECT_EQ(err.error_number(), 5);
    EXPECT_NE(m.find("write"), std::string::npos) << m;
    EXPECT_NE(m.find("tierflow-swap-"), std::string::npos) << "names the file: " << m;
  }
  EXPECT_FALSE(e.valid(b));
  std::vector<std::uint8_t> back(data.size());
  EXPECT_THROW(e.read(b, back.data(), back.size()), io_error) << "no read of a block whose write failed";
  e.write(b, data.data(), data.size()).wait();  // a retry works
  e.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
  EXPECT_EQ(e.stats().failures, 1u);
}

TEST_F(NvmeTest, ShortTransfersAndReadErrorsAreClearErrors) {
  NvmeFaults faults;
  auto o = opts(1);
  o.faults = &faults;
  NvmeEngine e(o);
  auto data = random_bytes(600000, 5);
  NvmeBlock b = e.allocate(data.size());
  faults.short_writes = 1;
  try {
    e.write(b, data.data(), data.size()).wait();
    FAIL();
  } catch (const io_error& err) {
    EXPECT_NE(std::string(err.what()).find("short write"), std::string::npos) << err.what();
  }
  e.write(b, data.data(), data.size()).wait();
  std::vector<std::uint8_t> back(data.size());
  faults.short_reads = 1;
  EXPECT_THROW(e.read(b, back.data(), back.size()).wait(), io_error);
  faults.fail_reads = 1;
  try {
    e.read(b, back.data(), back.size()).wait();
    FAIL();
  } catch (const io_error& err) {
    EXPECT_NE(std::string(err.what()).find("read of"), std::string::npos) << err.what();
  }
  e.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
}

TEST_F(NvmeTest, NoSpaceForTheSwapFileIsAClearErrorAndLeavesNothing) {
  auto o = opts(1, 1ULL << 60);  // 1 EiB: no file system here has that
  try {
    NvmeEngine e(o);
    FAIL();
  } catch (const io_error& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("fallocate"), std::string::npos) << m;
    EXPECT_NE(m.find(dir_ + "/a"), std::string::npos) << m;
  }
  EXPECT_EQ(files_in(dir_ + "/a"), 0u) << "a failed start leaves no swap file";
}

TEST_F(NvmeTest, FilesAreRemovedAtExitAndStaleOnesAtStart) {
  std::vector<std::string> files;
  {
    NvmeEngine e(opts(2));
    files = e.files();
    for (const auto& f : files) EXPECT_TRUE(fs::exists(f));
  }
  for (const auto& f : files) EXPECT_FALSE(fs::exists(f)) << f;
  // A process that dies without cleaning up (a crash) leaves its files behind...
  pid_t child = fork();
  if (child == 0) {
    NvmeEngine* leaked = new NvmeEngine(opts(2));
    (void)leaked;
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_EQ(files_in(dir_ + "/a"), 1u);
  // ...and the next engine on those paths removes them.
  NvmeEngine e(opts(2));
  EXPECT_EQ(files_in(dir_ + "/a"), 1u);  // only its own
  EXPECT_EQ(files_in(dir_ + "/b"), 1u);
  EXPECT_EQ(e.files()[0].find(std::to_string(child)), std::string::npos);
}

TEST_F(NvmeTest, AFileFromAnEarlierProcessWithOurPidIsStale) {
  // After a crash and restart in a container the PID is often the same.
  const std::string stale = dir_ + "/a/tierflow-swap-" + std::to_string(getpid()) + "-0.bin";
  { std::FILE* f = std::fopen(stale.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  NvmeEngine e(opts(1));
  EXPECT_EQ(files_in(dir_ + "/a"), 1u);
  for (const auto& f : e.files()) EXPECT_TRUE(fs::exists(f));
}

TEST_F(NvmeTest, BadArgumentsAreRefused) {
  auto o = opts(1);
  o.block_bytes = 1000;
  EXPECT_THROW(NvmeEngine{o}, logic_error);
  NvmeEngineOptions none;
  EXPECT_THROW(NvmeEngine{none}, logic_error);
  NvmeEngine e(opts(1));
  NvmeBlock b = e.allocate(4096);
  std::vector<std::uint8_t> big(8192);
  EXPECT_THROW(e.write(b, big.data(), big.size()), logic_error);
  EXPECT_THROW(e.read(999, big.data(), 10), logic_error);
}
