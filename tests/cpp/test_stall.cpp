// Note [Stall timeout]: a wait on a copy or an NVMe request that never completes raises, naming it and what
// else is in flight, within TIERFLOW_STALL_TIMEOUT.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"

using namespace tierflow;
using namespace tierflow::swap;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// The process-wide limit for one test, restored after it.
class StallTest : public ::testing::Test {
 protected:
  void SetUp() override { before_ = stall_timeout(); }
  void TearDown() override { set_stall_timeout(before_); }
  double before_ = 0;
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The stall error of `wait`, and how long it took to come; fails the test when it does not come.
std::pair<std::string, double> stall_of(const TransferHandle& h) {
  const auto t0 = Clock::now();
  try {
    h.wait();
  } catch (const stall_error& e) {
    return {e.what(), seconds_since(t0)};
  }
  ADD_FAILURE() << "the wait ended without a stall error";
  return {"", seconds_since(t0)};
}

TEST_F(StallTest, AStalledCopyRaisesWithinTheTimeoutNamingItAndWhatElseIsInFlight) {
  auto faults = std::make_shared<CopyFaults>();
  faults->d2h_delay_us = 1'200'000;  // each device -> host copy holds its stream this long
  auto engine = make_emulated_copy_engine(faults);
  std::vector<char> src(4096, 1), dst(4096), src2(8192, 2), dst2(8192);
  set_stall_timeout(0.15);
  const TransferHandle first = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size());
  const TransferHandle second = engine->copy(Direction::kDeviceToHost, dst2.data(), src2.data(), src2.size());
  const auto [what, took] = stall_of(first);
  EXPECT_LT(took, 0.9) << "raised within the timeout, not when the copy ended";
  EXPECT_GE(took, 0.14);
  EXPECT_NE(what.find("for a device -> host copy of 4.00 KiB"), std::string::npos) << what;
  EXPECT_NE(what.find("TIERFLOW_STALL_TIMEOUT=0.15 s"), std::string::npos) << what;
  // Both copies are in flight, oldest first, with their ages.
  const auto at = what.find("In flight, oldest first:");
  ASSERT_NE(at, std::string::npos) << what;
  const auto a = what.find("device -> host copy of 4.00 KiB", at), b = what.find("device -> host copy of 8.00 KiB", at);
  EXPECT_TRUE(a != std::string::npos && b != std::string::npos && a < b) << what;
  EXPECT_NE(what.find(" s old"), std::string::npos) << what;
  // The work itself goes on: with no limit the wait ends when the copy does, and what it moved is there.
  set_stall_timeout(0);
  first.wait();
  second.wait();
  EXPECT_EQ(dst, src);
  EXPECT_TRUE(PendingWork::in_flight(8).empty()) << "finished work leaves the list";
}

TEST_F(StallTest, AWaitWithinTheTimeoutIsUntouched) {
  auto faults = std::make_shared<CopyFaults>();
  faults->d2h_delay_us = 100'000;
  auto engine = make_emulated_copy_engine(faults);
  std::vector<char> src(4096, 3), dst(4096);
  set_stall_timeout(5.0);
  const TransferHandle h = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size());
  EXPECT_NO_THROW(h.wait());
  EXPECT_EQ(dst, src);
}

TEST_F(StallTest, AStuckNvmeWriteRaisesNamingItsBlock) {
  const char* base = std::getenv("NVME_TEST_DIR");
  const std::string dir = std::string(base ? base : (fs::current_path() / "nvme-test").string()) + "/stall-" +
                          std::to_string(getpid());
  fs::create_directories(dir);
  {
    NvmeFaults faults;
    NvmeEngineOptions o;
    o.paths = {dir};
    o.bytes_per_path = 16ULL << 20;
    o.block_bytes = 256 << 10;
    o.faults = &faults;
    NvmeEngine e(o);
    std::vector<char> data(1 << 20, 7);
    const NvmeBlock b = e.allocate(data.size());
    faults.write_delay_us = 1'000'000;  // the disk holds each write request this long
    set_stall_timeout(0.15);
    const TransferHandle w = e.write(b, data.data(), data.size());
    const auto [what, took] = stall_of(w);
    EXPECT_LT(took, 0.9);
    EXPECT_NE(what.find("for a NVMe write of 1.00 MiB (block " + std::to_string(b) + ")"), std::string::npos) << what;
    set_stall_timeout(0);
    faults.write_delay_us = 0;
    w.wait();  // it completes in the end, and the block reads back
    std::vector<char> back(data.size());
    e.read(b, back.data(), back.size()).wait();
    EXPECT_EQ(back, data);
  }
  fs::remove_all(dir);
}

TEST(StallConfig, TheTimeoutParsesSecondsMinutesAndNone) {
  auto parse = [](const std::string& v) { return Config::parse({}, {{"stall_timeout", v}}).stall_timeout_seconds; };
  EXPECT_EQ(Config::parse({}, {}).stall_timeout_seconds, 0.0);  // none, for now (kDefaultStallTimeout)
  EXPECT_EQ(parse("90"), 90.0);
  EXPECT_EQ(parse("90s"), 90.0);
  EXPECT_EQ(parse("10min"), 600.0);
  EXPECT_EQ(parse("0.5"), 0.5);
  EXPECT_EQ(parse("none"), 0.0);
  EXPECT_EQ(parse("0"), 0.0);
  for (const char* bad : {"", "-3", "ten", "5h", "nan"}) {
    try {
      parse(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find("TIERFLOW_STALL_TIMEOUT"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("seconds (e.g. 600, 90s, 10min), or none"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(Config::parse({}, {{"stall_timeout", "90s"}}).to_strings().at("TIERFLOW_STALL_TIMEOUT"), "90s");
}

}  // namespace
