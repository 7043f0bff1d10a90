// A failed NVMe write of a parameter loses nothing (Note [Parameter moves]): its values stay in its staging, marked
// unwritten, every reader reads them from there with no NVMe read, and the next write that succeeds writes them and
// lets the staging go. The fake host and a real NvmeEngine with NvmeFaults (param_mover_fake_host.hpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "param_mover_fake_host.hpp"

using namespace tierflow;
using namespace tierflow::tiering;
using namespace tierflow::param_mover_test;

namespace {

// The unit whose use fetches `id` (the Fixture's: parameter 1 in unit 0, 2 in unit 1).
UnitId unit_of(ParamId id) { return static_cast<UnitId>(id - 1); }

// Points every parameter at the host, sets the first byte of each NVMe one's staging to 70 + its id (the
// optimizer's step), and points back with the first write failing; the parameter whose write failed.
ParamId step_with_a_failed_write(Fixture& f, swap::NvmeFaults& faults, unsigned char base = 70) {
  f.mover->point_at_host(true);
  for (ParamId id : {1, 2}) f.host.staged(id)[0] = static_cast<unsigned char>(base + id);
  faults.fail_writes = 1;
  try {
    f.mover->point_at_host(false);
  } catch (const io_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("they are kept in host memory"), std::string::npos) << what;
    return what.find("parameter 'blocks.0.w'") != std::string::npos ? 1 : 2;
  }
  ADD_FAILURE() << "a write failed";
  return 0;
}

}  // namespace

// A step's write-back that fails keeps its values in the staging: the next use fetches them from there (no read:
// a read would fail), load reads them, pointing at the host points at them; a second failure keeps them again;
// the next write that succeeds writes them, and a later fetch reads them from NVMe with the staging gone.
TEST(ParamMoverUnwritten, AFailedStepWriteKeepsTheValuesUntilTheNextWrite) {
  testing_nvme::NvmeTestDir dir("param-mover-unwritten-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);  // 1, 2 on NVMe; 3 a host copy
    const ParamId failed = step_with_a_failed_write(f, faults);
    ASSERT_NE(failed, 0u);
    const ParamId written = failed == 1 ? 2 : 1;
    EXPECT_EQ(f.host.staging.size(), 1u);
    EXPECT_EQ(f.host.staging.count(failed), 1u) << "its values, kept";
    faults.fail_reads = 1;  // an NVMe read would fail
    EXPECT_EQ(nvme_value(*f.mover, failed)[0], 70 + failed) << "load reads the staging";
    EXPECT_EQ(faults.fail_reads.load(), 1) << "no read";
    faults.fail_reads = 0;
    const int stages = f.host.stages[failed];  // a read of it needs a new staging
    f.mover->begin_forward(unit_of(failed), 0);
    EXPECT_EQ(f.host.first_device_byte(failed), 70 + failed) << "fetched from the staging";
    f.mover->end_forward(unit_of(failed), 0);
    f.mover->end_phase();
    EXPECT_FALSE(f.host.has_memory(failed)) << "released";
    EXPECT_EQ(f.host.staging.count(failed), 1u) << "the release keeps an unwritten staging";
    f.mover->point_at_host(true);
    EXPECT_EQ(f.host.view.at(failed), ParamView::kStaging);
    EXPECT_EQ(f.host.first_byte(f.host.staging, failed), 70 + failed) << "pointed at its values";
    EXPECT_EQ(f.host.stages[failed], stages) << "the fetch and pointing made no staging: no read";
    f.mover->point_at_host(false);  // writes both
    EXPECT_TRUE(f.host.staging.empty()) << "written: its staging goes";
    EXPECT_EQ(nvme_value(*f.mover, failed)[0], 70 + failed) << "from its block now";
    // A second failure keeps the new values (the same order: the same one's write fails first).
    EXPECT_EQ(step_with_a_failed_write(f, faults, 80), failed);
    EXPECT_EQ(nvme_value(*f.mover, failed)[0], 80 + failed);
    EXPECT_EQ(nvme_value(*f.mover, written)[0], 80 + written);
    f.mover->point_at_host(true);
    f.mover->point_at_host(false);
    EXPECT_TRUE(f.host.staging.empty());
    f.mover->begin_forward(unit_of(failed), 0);
    EXPECT_EQ(f.host.staging.count(failed), 1u) << "a fetch's staging, read from NVMe";
    EXPECT_EQ(f.host.first_device_byte(failed), 80 + failed);
    f.mover->end_forward(unit_of(failed), 0);
    f.mover->end_phase();
    EXPECT_TRUE(f.host.staging.empty()) << "let go at the release";
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}

// store: a failed write keeps the new value (load and materialize read it); the next store writes it and lets the
// staging go. The mover's teardown lets an unwritten staging go.
TEST(ParamMoverUnwritten, AFailedStoreKeepsTheValueAndTheTeardownLetsItGo) {
  testing_nvme::NvmeTestDir dir("param-mover-unwritten-store-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);
  faults.fail_writes = 1;
  if (const auto e = io_error_of([&] { f.mover->store(1, std::vector<unsigned char>(kBytes, 9).data()); },
                                 "the write failed")) {
    const std::string what = e->what();
    EXPECT_EQ(what.find("NvmeEngine: write"), 0u) << what;
    EXPECT_NE(what.find("parameter 'blocks.0.w': its new values were not written to NVMe; they are kept in host "
                        "memory"), std::string::npos) << what;
  }
  EXPECT_EQ(nvme_value(*f.mover, 1), std::vector<unsigned char>(kBytes, 9));
  f.mover->materialize(1, true);
  EXPECT_EQ(f.host.first_device_byte(1), 9) << "uploaded from the staging";
  f.mover->materialize(1, false);  // written home, dropped
  EXPECT_TRUE(f.host.staging.empty()) << "written: its staging goes";
  EXPECT_EQ(nvme_value(*f.mover, 1)[0], 9);
  faults.fail_writes = 1;
  EXPECT_THROW(f.mover->store(1, std::vector<unsigned char>(kBytes, 10).data()), io_error);
  EXPECT_EQ(nvme_value(*f.mover, 1)[0], 10);
  f.mover->store(1, std::vector<unsigned char>(kBytes, 11).data());
  EXPECT_TRUE(f.host.staging.empty()) << "stored: its staging goes";
  EXPECT_EQ(nvme_value(*f.mover, 1)[0], 11);
  faults.fail_writes = 1;
  EXPECT_THROW(f.mover->store(2, std::vector<unsigned char>(kBytes, 12).data()), io_error);
  EXPECT_EQ(f.host.staging.count(2), 1u);
  f.mover.reset();
  EXPECT_TRUE(f.host.staging.empty()) << "the teardown lets it go";
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}

// A failed store with no pinned memory left to keep the values in says so, naming the parameter: its block reads
// as failed (never as its old values) until a store succeeds.
TEST(ParamMoverUnwritten, AFailedStoreWithNoRoomToKeepTheValueSaysItIsLost) {
  testing_nvme::NvmeTestDir dir("param-mover-unwritten-lost-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);
  faults.fail_writes = 1;
  f.host.on_stage = at_stage(1, [] { throw out_of_memory("pinned host pool: no room (test)"); });
  if (const auto e = io_error_of([&] { f.mover->store(1, std::vector<unsigned char>(kBytes, 9).data()); },
                                 "the write failed")) {
    const std::string what = e->what();
    EXPECT_EQ(what.find("NvmeEngine: write"), 0u) << what;
    EXPECT_NE(what.find("parameter 'blocks.0.w': its new values were not written to NVMe and no host memory was "
                        "left to keep them"), std::string::npos) << what;
    EXPECT_EQ(e->error_number(), 5);
  }
  f.host.on_stage = nullptr;
  EXPECT_TRUE(f.host.staging.empty());
  std::vector<unsigned char> out(kBytes);
  EXPECT_THROW(f.mover->read_nvme(1, out.data()), io_error) << "no value: never the old one";
  f.mover->store(1, std::vector<unsigned char>(kBytes, 11).data());
  EXPECT_EQ(nvme_value(*f.mover, 1)[0], 11);
}

// tierflow.gathered's exit: a failed write keeps that parameter's device values in its staging and every hold is
// released all the same; make_resident uploads them and lets the staging go.
TEST(ParamMoverUnwritten, ScatterReleasesEveryHoldPastAFailedWrite) {
  testing_nvme::NvmeTestDir dir("param-mover-unwritten-scatter-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kNvme);
    f.mover->gather({1, 2, 3});
    for (ParamId id : {1, 2, 3}) f.host.device.at(id)[0] = static_cast<unsigned char>(60 + id);  // edits
    faults.fail_writes = 1;
    try {
      f.mover->scatter({1, 2, 3}, true);
      ADD_FAILURE() << "a write failed";
    } catch (const io_error& e) {
      EXPECT_NE(std::string(e.what()).find("its values on the device were not written to NVMe; they are kept in "
                                           "host memory"), std::string::npos) << e.what();
    }
    for (ParamId id : {1, 2, 3}) {
      EXPECT_FALSE(f.mover->on_device(id)) << "unheld: parameter " << id;
      EXPECT_FALSE(f.host.has_memory(id));
      EXPECT_EQ(nvme_value(*f.mover, id)[0], 60 + id) << "parameter " << id;
    }
    ASSERT_EQ(f.host.staging.size(), 1u) << "the failed one's values; the rest let go";
    const ParamId failed = f.host.staging.begin()->first;
    f.mover->gather({failed});
    faults.fail_writes = 1;  // a second failure keeps them again
    EXPECT_THROW(f.mover->scatter({failed}, true), io_error);
    EXPECT_FALSE(f.mover->on_device(failed));
    EXPECT_EQ(nvme_value(*f.mover, failed)[0], 60 + failed);
    const UnitId unit = failed == 3 ? 2 : unit_of(failed);
    EXPECT_EQ(f.mover->make_resident({unit}), std::vector<ParamId>{failed});
    EXPECT_EQ(f.host.first_device_byte(failed), 60 + failed) << "uploaded from the staging";
    EXPECT_TRUE(f.host.staging.empty()) << "resident: its staging goes";
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}
