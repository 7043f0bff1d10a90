#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "loop_fs.hpp"
#include "nvme_test_dir.hpp"
#include "sanitizers.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/nvme_probe.hpp"

using namespace tierflow;
using namespace tierflow::swap;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test on a file system with O_DIRECT (not tmpfs; nvme_test_dir.hpp), named after the test.
class NvmeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(dir_ + "/a");
    fs::create_directories(dir_ + "/b");
  }
  NvmeEngineOptions opts(int paths = 1, std::uint64_t per_path = 64ULL << 20) {
    NvmeEngineOptions o;
    o.paths.push_back(dir_ + "/a");
    if (paths > 1) o.paths.push_back(dir_ + "/b");
    o.bytes_per_path = per_path;
    o.block_bytes = 256 << 10;
    o.queue_depth = 16;
    return o;
  }
  // TIERFLOW_NVME_MEMORY=auto on one path of a small file system.
  static NvmeEngineOptions auto_opts(const tierflow::testing::LoopFs& disk) {
    NvmeEngineOptions o;
    o.paths = {disk.path()};
    o.bytes_per_path = kNvmeAutoBytes;
    o.block_bytes = 256 << 10;
    o.grow_bytes = 1 << 20;
    return o;
  }
  std::size_t files_in(const std::string& d) {
    std::size_t n = 0;
    for (auto& e : fs::directory_iterator(d)) n += e.is_regular_file();
    return n;
  }
  const testing_nvme::NvmeTestDir test_dir_{
      std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-"};
  const std::string dir_ = test_dir_.path();
};

using tierflow::testing::LoopFs;

// A pid that no process has: a child's, after it was reaped.
pid_t dead_pid() {
  pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

void touch(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs("left behind", f);
  std::fclose(f);
}

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

// The Python suite's tiers (tests/README.md) count NVMe requests as queued
// transfers: a write and a read move the process's count by two.
TEST_F(NvmeTest, CountsEveryRequestInTheProcess) {
  NvmeEngine e(opts());
  std::vector<std::uint8_t> data(4096, 7), back(4096, 0);
  NvmeBlock b = e.allocate(data.size());
  const std::uint64_t before = queued_transfers_in_process();
  e.write(b, data.data(), data.size()).wait();
  e.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(queued_transfers_in_process(), before + 2);
  EXPECT_EQ(back, data);
  e.release(b);
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

TEST_F(NvmeTest, SpaceIsReusedAndFilesStopGrowing) {
  auto o = opts(2, 16ULL << 20);
  o.grow_bytes = 1 << 20;
  NvmeEngine e(o);
  const auto files = e.files();
  std::vector<std::uintmax_t> after_first;
  for (int step = 0; step < 100; ++step) {
    std::vector<NvmeBlock> live;
    for (int i = 0; i < 5; ++i) {
      auto data = random_bytes(1'000'000 + step * 13 + i, step * 7 + i);
      live.push_back(e.allocate(data.size()));
      e.write(live.back(), data.data(), data.size()).wait();
    }
    for (auto b : live) e.release(b);
    if (step == 0)
      for (const auto& f : files) after_first.push_back(fs::file_size(f));
  }
  EXPECT_EQ(e.stats().bytes_in_use, 0u);
  for (std::size_t i = 0; i < files.size(); ++i) {
    EXPECT_EQ(fs::file_size(files[i]), after_first[i]) << "the space of the first step is reused: " << files[i];
    EXPECT_LT(fs::file_size(files[i]), o.bytes_per_path) << "a file holds what its blocks need, not its cap";
  }
  // After all that churn the free lists coalesced back: the whole capacity fits in one block.
  NvmeBlock all = e.allocate(2 * o.bytes_per_path);
  e.release(all);
}

TEST_F(NvmeTest, FilesGrowOnDemandNotUpFront) {
  auto o = opts(1, 1ULL << 30);
  o.grow_bytes = 2 << 20;
  NvmeEngine e(o);
  const std::string file = e.files()[0];
  EXPECT_EQ(fs::file_size(file), o.block_bytes) << "a new file holds one request, not its 1 GiB cap";
  auto data = random_bytes(5 << 20, 2);
  NvmeBlock b = e.allocate(data.size());
  EXPECT_GE(fs::file_size(file), data.size()) << "grown before the write";
  EXPECT_LE(fs::file_size(file), data.size() + o.grow_bytes);
  e.write(b, data.data(), data.size()).wait();
  std::vector<std::uint8_t> back(data.size());
  e.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
  EXPECT_EQ(e.stats().bytes_on_disk, fs::file_size(file));
  EXPECT_GE(e.stats().grows, 1u);
}

TEST_F(NvmeTest, ReserveGrowsUpFrontOrRefusesAndGrowsNothing) {
  auto o = opts(2, 64ULL << 20);
  o.grow_bytes = 1 << 20;
  NvmeEngine e(o);
  e.reserve({10 << 20, 3 << 20});
  const auto on_disk = e.stats().bytes_on_disk;
  EXPECT_GE(on_disk, 13u << 20);
  const auto grows = e.stats().grows;
  NvmeBlock a = e.allocate(10 << 20), b = e.allocate(3 << 20);
  EXPECT_EQ(e.stats().grows, grows) << "reserved blocks need no grow";
  try {
    e.reserve({200 << 20});  // 100 MiB on each path, over the 64 MiB cap
    FAIL() << "a reservation past the cap went through";
  } catch (const io_error& err) {
    std::string m = err.what();
    EXPECT_EQ(err.error_number(), ENOSPC);
    EXPECT_NE(m.find("TIERFLOW_NVME_MEMORY"), std::string::npos) << m;
    EXPECT_NE(m.find("tierflow-swap-"), std::string::npos) << "names the file: " << m;
  }
  EXPECT_EQ(e.stats().bytes_on_disk, on_disk) << "a refused reservation grows nothing";
  e.release(a);
  e.release(b);
}

TEST_F(NvmeTest, AFailedGrowIsOutOfMemoryNamingTheSpaceAndChangesNothing) {
  NvmeFaults faults;
  auto o = opts(2, 256ULL << 20);
  o.grow_bytes = 1 << 20;
  o.faults = &faults;
  NvmeEngine e(o);
  NvmeBlock kept = e.allocate(1 << 20);
  const auto before = e.stats();
  faults.fail_grows = 1;  // the disk is full
  try {
    e.allocate(16 << 20);
    FAIL() << "a grow that failed went unnoticed";
  } catch (const out_of_memory& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("No space left"), std::string::npos) << m;
    EXPECT_NE(m.find("free on " + dir_), std::string::npos) << "names the free space: " << m;
    EXPECT_NE(m.find("TIERFLOW_NVME_MEMORY"), std::string::npos) << m;
    EXPECT_NE(m.find("16.00 MiB"), std::string::npos) << "names the need: " << m;
  }
  EXPECT_EQ(e.stats().bytes_in_use, before.bytes_in_use) << "nothing allocated";
  EXPECT_EQ(e.stats().bytes_on_disk, before.bytes_on_disk) << "nothing grown";
  auto data = random_bytes(16 << 20, 8);  // space came back: it works
  NvmeBlock b = e.allocate(data.size());
  e.write(b, data.data(), data.size()).wait();
  std::vector<std::uint8_t> back(data.size());
  e.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
  e.release(b);
  e.release(kept);
}

TEST_F(NvmeTest, ARealFullDiskIsAClearErrorBeforeAnyWrite) {
  LoopFs disk(dir_, 32);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  NvmeEngineOptions o;
  o.paths = {disk.path()};
  o.bytes_per_path = 1ULL << 30;  // a cap past the disk: the disk decides
  o.block_bytes = 256 << 10;
  o.grow_bytes = 4 << 20;
  {
    NvmeEngine e(o);
    std::vector<NvmeBlock> blocks;
    auto data = random_bytes(2 << 20, 3);
    try {
      for (;;) {
        blocks.push_back(e.allocate(data.size()));
        e.write(blocks.back(), data.data(), data.size()).wait();  // never ENOSPC: the space is there
      }
    } catch (const out_of_memory& err) {
      std::string m = err.what();
      EXPECT_NE(m.find("No space left"), std::string::npos) << m;
      EXPECT_NE(m.find(disk.path()), std::string::npos) << m;
      EXPECT_NE(m.find("free"), std::string::npos) << m;
    }
    ASSERT_GE(blocks.size(), 5u);
    std::vector<std::uint8_t> back(data.size());
    e.read(blocks[0], back.data(), back.size()).wait();
    EXPECT_EQ(back, data) << "what was written before the disk filled is intact";
    e.release(blocks.back());
    NvmeBlock again = e.allocate(data.size());  // the file's own space is reused on a full disk
    e.write(again, data.data(), data.size()).wait();
    EXPECT_THROW(e.reserve({64 << 20}), io_error);
  }
  // A file system with no room for even a first request: an error at start, and no file left.
  {
    const std::string ballast = disk.path() + "/ballast";
    int fd = ::open(ballast.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    std::uint64_t left = disk.free_bytes();
    while (left >= 4096 && posix_fallocate(fd, 0, static_cast<off_t>(fs::file_size(ballast) + left)) != 0) left /= 2;
    while (posix_fallocate(fd, static_cast<off_t>(fs::file_size(ballast)), 4096) == 0) {
    }
    ::close(fd);
    try {
      NvmeEngine e(o);
      FAIL() << "an engine started on a full disk";
    } catch (const io_error& err) {
      std::string m = err.what();
      EXPECT_EQ(err.error_number(), ENOSPC) << m;
      EXPECT_NE(m.find(disk.path()), std::string::npos) << m;
    }
    std::size_t swap = 0;
    for (auto& f : fs::directory_iterator(disk.path())) swap += f.path().filename().string().rfind("tierflow-swap-", 0) == 0;
    EXPECT_EQ(swap, 0u) << "a failed start leaves no swap file";
    fs::remove(ballast);
  }
}

TEST_F(NvmeTest, AutoLeavesATenthOfTheFileSystemFree) {
  LoopFs disk(dir_, 48);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  NvmeEngine e(auto_opts(disk));
  std::vector<NvmeBlock> blocks;
  try {
    for (;;) blocks.push_back(e.allocate(1 << 20));
  } catch (const out_of_memory& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("TIERFLOW_NVME_MEMORY=auto"), std::string::npos) << m;
    EXPECT_NE(m.find("10%"), std::string::npos) << m;
  }
  EXPECT_GE(blocks.size(), 10u) << "auto takes what the run needs";
  EXPECT_GE(disk.free_bytes() + (1 << 20), disk.size_bytes() / 10) << "and leaves the file system usable";
  for (auto b : blocks) e.release(b);
}

TEST_F(NvmeTest, AvailableBytesIsWhatAllocateCanStillPlace) {
  // Under a cap: both files' cap, less the blocks in use, whatever the files hold on disk so far.
  {
    NvmeEngine e(opts(2, 8 << 20));
    EXPECT_EQ(e.available_bytes(), 16u << 20);
    NvmeBlock a = e.allocate(4 << 20);
    EXPECT_EQ(e.available_bytes(), 12u << 20);
    NvmeBlock b = e.allocate(e.available_bytes());  // exactly what it said fits
    EXPECT_EQ(e.available_bytes(), 0u);
    EXPECT_THROW(e.allocate(4096 * 2), out_of_memory);
    e.release(a);
    e.release(b);
    EXPECT_EQ(e.available_bytes(), 16u << 20);
  }
  // Under auto on a small file system: its free space less the tenth that auto keeps free.
  LoopFs disk(dir_, 48);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  NvmeEngine e(auto_opts(disk));
  const std::uint64_t said = e.available_bytes();
  EXPECT_GT(said, 0u);
  EXPECT_LT(said, disk.size_bytes() * 9 / 10) << "auto keeps a tenth of the file system free";
  NvmeBlock all = e.allocate(said);  // it fits, growing the file as it goes
  EXPECT_LT(e.available_bytes(), 1u << 20);
  e.release(all);
}

TEST_F(NvmeTest, TheProbeMeasuresThroughTheEngineAndGivesItsSpaceBack) {
  // Note [NVMe probe]: the planner's NVMe bandwidth, through the engine on every path.
  NvmeEngine e(opts(2, 8 << 20));
  tierflow::allocator::AlignedBuffer buffer(4 << 20);
  const NvmeBandwidth bw = tierflow::swap::measure_bandwidth(e, buffer.data(), 4 << 20, 2);
  EXPECT_EQ(bw.bytes, 4u << 20);
  EXPECT_GT(bw.write_bytes_per_second, 0.0);
  EXPECT_GT(bw.read_bytes_per_second, 0.0);
  EXPECT_EQ(e.stats().bytes_written, 2u * (4 << 20)) << "two rounds, each way";
  EXPECT_EQ(e.stats().bytes_read, 2u * (4 << 20));
  EXPECT_EQ(e.available_bytes(), 16u << 20) << "the probe's block went back";
  // More than the tier holds: out_of_memory, and nothing held.
  tierflow::allocator::AlignedBuffer big(20 << 20);
  EXPECT_THROW(tierflow::swap::measure_bandwidth(e, big.data(), 20 << 20), out_of_memory);
  EXPECT_EQ(e.available_bytes(), 16u << 20);
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
  // A cap of 1 EiB grows nothing up front: the engine starts with one request's worth...
  auto o = opts(1, 1ULL << 60);
  {
    NvmeEngine e(o);
    const auto on_disk = e.stats().bytes_on_disk;
    EXPECT_EQ(on_disk, o.block_bytes);
    // ...and a reservation no file system here can hold is a clear error that grows nothing.
    try {
      e.reserve({1ULL << 59});
      FAIL();
    } catch (const io_error& err) {
      std::string m = err.what();
      EXPECT_EQ(err.error_number(), ENOSPC) << m;
      EXPECT_NE(m.find("cannot reserve"), std::string::npos) << m;
      EXPECT_NE(m.find(dir_ + "/a"), std::string::npos) << m;
      EXPECT_NE(m.find("free on"), std::string::npos) << "names the free space: " << m;
      EXPECT_NE(m.find("TIERFLOW_NVME_MEMORY"), std::string::npos) << m;
    }
    EXPECT_EQ(e.stats().bytes_on_disk, on_disk);
    EXPECT_EQ(fs::file_size(e.files()[0]), on_disk);
  }
  // A cap below one 4 KiB request leaves nothing to use: an error at start naming the path.
  o.bytes_per_path = 1000;
  try {
    NvmeEngine e(o);
    FAIL();
  } catch (const io_error& err) {
    std::string m = err.what();
    EXPECT_NE(m.find(dir_ + "/a"), std::string::npos) << m;
    EXPECT_NE(m.find("TIERFLOW_NVME_MEMORY"), std::string::npos) << m;
  }
  EXPECT_EQ(files_in(dir_ + "/a"), 0u) << "a failed start leaves no swap file";
}

TEST_F(NvmeTest, FilesAreRemovedAtExitAndStaleOnesAtStart) {
  if (tierflow::testing::kThreadSanitizer)
    GTEST_SKIP() << "its children start the engine's thread after fork(), which TSan does not support "
                    "(it hangs); the ASan and plain builds run it";
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
  // ...and so does one killed with SIGKILL in the middle of its work.
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t killed = fork();
  if (killed == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives a test that failed before killing it
    NvmeEngine* leaked = new NvmeEngine(opts(2));
    auto data = random_bytes(1 << 20, 1);
    NvmeBlock b = leaked->allocate(data.size());
    leaked->write(b, data.data(), data.size()).wait();
    char c = 1;
    (void)!write(ready[1], &c, 1);
    for (;;) pause();
  }
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  // Its start removed the exited child's files; its own are live while it runs.
  ASSERT_EQ(files_in(dir_ + "/a"), 1u);
  EXPECT_EQ(NvmeEngine::remove_stale_files({dir_ + "/a", dir_ + "/b"}), 0u);
  ASSERT_EQ(files_in(dir_ + "/a"), 1u) << "the live child's file is kept";
  kill(killed, SIGKILL);
  waitpid(killed, &status, 0);
  close(ready[0]);
  close(ready[1]);
  // ...and the next engine on those paths removes them.
  NvmeEngine e(opts(2));
  EXPECT_EQ(files_in(dir_ + "/a"), 1u);  // only its own
  EXPECT_EQ(files_in(dir_ + "/b"), 1u);
  EXPECT_EQ(e.files()[0].find(std::to_string(child)), std::string::npos);
  EXPECT_EQ(e.files()[0].find(std::to_string(killed)), std::string::npos);
}

TEST_F(NvmeTest, AFileNoEngineHoldsIsStaleWhateverPidItsNameCarries) {
  // Pid 1 always runs (in a container too): judged by pid, its file would stay forever.
  const std::string live_pid = dir_ + "/a/tierflow-swap-1-0-0000abcd.bin";
  const std::string dead = dir_ + "/a/tierflow-swap-" + std::to_string(dead_pid()) + "-0.bin";
  touch(live_pid);
  touch(dead);
  NvmeEngine e(opts(1));
  EXPECT_FALSE(fs::exists(live_pid)) << "no lock held: stale, although pid 1 runs";
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_EQ(files_in(dir_ + "/a"), 1u);
}

TEST_F(NvmeTest, ALockedFileIsLiveWhateverPidItsNameCarries) {
  // Another container's trainer: its file names a pid that does not exist here.
  const std::string theirs = dir_ + "/a/tierflow-swap-" + std::to_string(dead_pid()) + "-7-12345678.bin";
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  pid_t child = fork();
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = ::open(theirs.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) _exit(1);
    char c = 1;
    (void)!write(ready[1], &c, 1);
    (void)!read(go[0], &c, 1);  // holds the lock until told
    _exit(0);
  }
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  {
    NvmeEngine e(opts(1));
    EXPECT_TRUE(fs::exists(theirs)) << "a locked file is live: never removed";
    EXPECT_EQ(NvmeEngine::remove_stale_files({dir_ + "/a"}), 0u);
  }
  (void)!write(go[1], &c, 1);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(NvmeEngine::remove_stale_files({dir_ + "/a"}), 1u) << "its process is gone: stale";
  EXPECT_FALSE(fs::exists(theirs));
  for (int fd : {ready[0], ready[1], go[0], go[1]}) close(fd);
}

TEST_F(NvmeTest, TwoEnginesOnOnePathKeepEachOthersFiles) {
  NvmeEngine first(opts(1));
  auto data = random_bytes(300000, 4);
  NvmeBlock b = first.allocate(data.size());
  first.write(b, data.data(), data.size()).wait();
  NvmeEngine second(opts(1));  // its start judges the first one's file
  for (const auto& f : first.files()) EXPECT_TRUE(fs::exists(f)) << f;
  EXPECT_EQ(files_in(dir_ + "/a"), 2u);
  std::vector<std::uint8_t> back(data.size());
  first.read(b, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
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

TEST_F(NvmeTest, TheNameTagGoesIntoTheSwapFilesNames) {
  auto o = opts(2, 64ULL << 20);
  o.name_tag = "rank3-";
  NvmeEngine e(o);
  for (const auto& f : e.files())
    EXPECT_EQ(fs::path(f).filename().string().rfind("tierflow-swap-rank3-" + std::to_string(getpid()) + "-", 0), 0u)
        << f;
}
