// Offloaded parameters moved as the schedule says (tiering/param_mover.hpp, Note [Parameter moves]) without torch:
// a host of byte buffers stands for ParamResidency's tensors, a real NvmeEngine for the NVMe tier
// (param_mover_fake_host.hpp).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "param_mover_fake_host.hpp"

using namespace tierflow;
using namespace tierflow::tiering;
using namespace tierflow::param_mover_test;

TEST(ParamMover, ConstructionCopiesEachFetchedParameterHomeAndDropsItsDeviceMemory) {
  Fixture f(Tier::kHost, 1ULL << 30, {}, Tier::kGpu);
  EXPECT_EQ(f.host.first_byte(f.host.host, 1), 1);
  EXPECT_EQ(f.host.first_byte(f.host.host, 2), 2);
  EXPECT_FALSE(f.host.has_memory(1));
  EXPECT_NE(f.host.why.at(1).find("parameter 'blocks.0.w' lives on the host between its uses"), std::string::npos);
  EXPECT_TRUE(f.host.has_memory(3)) << "the rest unit is resident: never copied nor dropped";
  EXPECT_EQ(f.host.host.count(3), 0u);
  EXPECT_TRUE(f.mover->offloaded(1));
  EXPECT_FALSE(f.mover->offloaded(3));
}

TEST(ParamMover, RefusesAParameterThatCannotBeOffloadedOrSharesAStorageBeforeAnythingMoves) {
  FakeHost host;
  ParamSpec bad = spec(1, "blocks.0.w");
  bad.cannot_offload = "is not a leaf tensor";
  try {
    ParamMover m({{bad}, {spec(3, "head.w")}}, {Tier::kHost, Tier::kHost}, 1, {}, 1ULL << 30, {}, host);
    FAIL() << "accepted a parameter that cannot be offloaded";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'blocks.0.w' is not a leaf tensor"), std::string::npos);
  }
  ParamSpec twin = spec(2, "blocks.0.w2");
  twin.storage = spec(1, "").storage;
  EXPECT_THROW(ParamMover({{spec(1, "blocks.0.w"), twin}, {spec(3, "head.w")}}, {Tier::kHost, Tier::kHost}, 1, {}, 1ULL << 30,
                          {}, host),
               config_error);
  EXPECT_THROW(ParamMover({{spec(1, "blocks.0.w")}, {spec(3, "head.w")}}, {Tier::kNvme, Tier::kHost}, 1, {}, 1ULL << 30, {}, host),
               config_error)
      << "the NVMe tier without an NVMe engine";
  EXPECT_TRUE(host.calls.empty());
  EXPECT_TRUE(host.host.empty());
}

TEST(ParamMover, AUseFetchesItsParametersWaitsForThemAndItsEndReleasesThem) {
  Fixture f;
  const std::uint64_t waited_before = param_wait_total(&f);  // (an address an earlier test used goes on)
  f.mover->begin_forward(0, 0);
  EXPECT_TRUE(f.host.has_memory(1));
  EXPECT_EQ(f.host.first_device_byte(1), 1) << "the host copy's values";
  EXPECT_TRUE(f.mover->on_device(1));
  const auto await = std::find(f.host.calls.begin(), f.host.calls.end(), "await 1");
  ASSERT_NE(await, f.host.calls.end());
  EXPECT_LT(std::find(f.host.calls.begin(), f.host.calls.end(), "fetch 1"), await);
  EXPECT_EQ(param_wait_total(&f) - waited_before, f.mover->stats().stall_ns)
      << "the runtime's total (param_wait_ns) counts it";
  EXPECT_EQ(param_wait_total(f.mover.get()), 0u) << "another runtime's";
  f.mover->end_forward(0, 0);
  f.mover->end_phase();
  EXPECT_FALSE(f.host.has_memory(1));
  EXPECT_FALSE(f.mover->on_device(1));
  EXPECT_THROW(f.mover->begin_forward(3, 0), std::logic_error) << "unit 3 of 3";
}

TEST(ParamMover, AFetchThatFailsIsPutBackAndTheNextUseFetchesItAgain) {
  Fixture f;
  f.host.fail_fetch = {1};
  EXPECT_THROW(f.mover->begin_forward(0, 0), out_of_memory);
  EXPECT_FALSE(f.host.has_memory(1));
  EXPECT_FALSE(f.host.has_memory(2)) << "the prefetch after it did not start either";
  EXPECT_FALSE(f.mover->on_device(1));
  f.host.fail_fetch.clear();
  f.mover->end_forward(0, 0);
  f.mover->end_phase();  // the step that raised ends
  f.mover->begin_forward(0, 0);
  EXPECT_EQ(f.host.first_device_byte(1), 1);
}

TEST(ParamMover, AReleaseAfterAStalledFetchKeepsItsMemoryForGoodAndRaisesTheStall) {
  Fixture f;
  f.host.stall_fetch = {1};
  EXPECT_THROW(f.mover->begin_forward(0, 0), stall_error) << "the wait for it";
  EXPECT_THROW(f.mover->end_phase(), stall_error) << "the release waits for the fetch first";
  EXPECT_EQ(f.host.kept.count(1), 1u);
}

TEST(ParamMover, AHoldOverTheBudgetNamesTheParameterAndGatherIsAllOrNone) {
  Fixture f(Tier::kHost, 2 * kBytes);
  try {
    f.mover->hold(1);
    f.mover->hold(2);
    f.mover->hold(3);
    FAIL() << "held three parameters in a budget of two";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'head.w'"), std::string::npos) << e.what();
  }
  f.mover->unhold(1, "");
  f.mover->unhold(2, "held until the end of backward");
  EXPECT_EQ(f.host.why.at(2), "held until the end of backward") << "the unhold's text, not the usual";
  EXPECT_THROW(f.mover->gather({1, 2, 3}), out_of_memory);
  EXPECT_FALSE(f.mover->on_device(1));
  EXPECT_FALSE(f.mover->on_device(2));
  f.mover->gather({1, 1, 4});  // duplicates and a parameter that is not offloaded pass
  EXPECT_TRUE(f.mover->on_device(1));
}

TEST(ParamMover, ScatterWritesTheDeviceValuesHomeOnlyWhenAsked) {
  Fixture f;
  f.mover->gather({1, 2});
  f.host.device.at(1)[0] = 42;
  f.host.device.at(2)[0] = 43;
  f.mover->scatter({1}, true);
  f.mover->scatter({2}, false);
  EXPECT_EQ(f.host.first_byte(f.host.host, 1), 42);
  EXPECT_EQ(f.host.first_byte(f.host.host, 2), 2);
  EXPECT_FALSE(f.host.has_memory(1));
  EXPECT_FALSE(f.host.has_memory(2));
}

TEST(ParamMover, MakeResidentUploadsReleasedParametersAndForgetsThem) {
  Fixture f;
  f.mover->hold(2);
  f.host.device.at(2)[0] = 7;  // held: its device values are the ones kept
  const std::vector<ParamId> resident = f.mover->make_resident({0, 1});
  EXPECT_EQ(std::set<ParamId>(resident.begin(), resident.end()), (std::set<ParamId>{1, 2}));
  EXPECT_EQ(f.host.first_device_byte(1), 1);
  EXPECT_EQ(f.host.first_device_byte(2), 7);
  EXPECT_FALSE(f.mover->offloaded(1));
  EXPECT_TRUE(f.mover->offloaded(3));
}

TEST(ParamMover, MaterializeFetchesOrWritesBackAndDrops) {
  Fixture f;
  f.mover->materialize(1, true);
  EXPECT_EQ(f.host.first_device_byte(1), 1);
  f.host.device.at(1)[0] = 9;  // load_state_dict wrote it
  f.mover->materialize(1, false);
  EXPECT_EQ(f.host.first_byte(f.host.host, 1), 9);
  EXPECT_FALSE(f.host.has_memory(1));
  f.mover->store(1, std::vector<unsigned char>(kBytes, 5).data());
  f.mover->begin_forward(0, 0);
  EXPECT_EQ(f.host.first_device_byte(1), 5) << "a stored value is what the next fetch copies";
}

TEST(ParamMover, PointAtHostPointsBackAtTheNextEventAfterAStepThatRaised) {
  Fixture f;
  f.mover->point_at_host(true);
  EXPECT_EQ(f.host.view.at(1), ParamView::kHostCopy);
  f.mover->begin_forward(0, 0);  // no point_at_host(false) came
  EXPECT_EQ(f.host.view.at(1), ParamView::kDevice);
  EXPECT_THROW(f.mover->point_at_host(true), std::logic_error) << "a parameter is being fetched";
}

TEST(ParamMover, OnNvmeTheBlockIsTheOnlyCopyAndStepsGoThroughTheStaging) {
  testing_nvme::NvmeTestDir dir("param-mover-");
  auto nvme = nvme_engine(dir, 16ULL << 20);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kNvme);
    EXPECT_TRUE(f.host.host.empty()) << "the host copies go once written";
    EXPECT_TRUE(f.mover->on_nvme(1));
    EXPECT_NE(f.host.why.at(1).find("lives on the NVMe tier"), std::string::npos);
    f.mover->begin_forward(0, 0);
    EXPECT_EQ(f.host.first_device_byte(1), 1) << "read through the staging";
    f.mover->end_forward(0, 0);
    f.mover->end_phase();
    EXPECT_TRUE(f.host.staging.empty()) << "the staging goes with the release";
    f.mover->point_at_host(true);
    EXPECT_EQ(f.host.view.at(2), ParamView::kStaging);
    EXPECT_EQ(f.host.first_byte(f.host.staging, 2), 2);
    reinterpret_cast<unsigned char*>(f.host.staging.at(2).data())[0] = 77;  // the optimizer's step
    f.mover->point_at_host(false);
    std::vector<unsigned char> value(kBytes);
    f.mover->read_nvme(2, value.data());
    EXPECT_EQ(value[0], 77);
    f.mover->make_resident({2});
    EXPECT_EQ(f.host.first_device_byte(3), 3);
    EXPECT_THROW(f.mover->read_nvme(3, value.data()), std::logic_error);
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u) << "every block released";
}

// A step that raised left an NVMe parameter pointed at its staging; a load_state_dict then (materialize, which uses
// the one staging a parameter has) points it back first, and the next step's pointing works and writes its values.
TEST(ParamMover, MaterializeAfterAStepThatRaisedPointsBackFirst) {
  testing_nvme::NvmeTestDir dir("param-mover-raised-");
  auto nvme = nvme_engine(dir, 16ULL << 20);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kNvme);
    f.mover->point_at_host(true);  // the step's pre-hook; the step raises, no point_at_host(false)
    f.mover->materialize(2, true);
    EXPECT_EQ(f.host.view.at(2), ParamView::kDevice);
    f.host.device.at(2)[0] = 55;  // load_state_dict's value
    f.mover->materialize(2, false);
    f.mover->point_at_host(true);  // the next step
    EXPECT_EQ(f.host.first_byte(f.host.staging, 2), 55);
    reinterpret_cast<unsigned char*>(f.host.staging.at(2).data())[0] = 56;
    f.mover->point_at_host(false);
    std::vector<unsigned char> value(kBytes);
    f.mover->read_nvme(2, value.data());
    EXPECT_EQ(value[0], 56);
    // A held parameter released by unhold after a step that raised: pointed back first, and the next
    // point_at_host(false) (unwrap's) finds nothing to write.
    f.mover->hold(2);
    f.mover->point_at_host(true);
    f.mover->unhold(2, "");
    EXPECT_EQ(f.host.view.at(2), ParamView::kDevice);
    f.mover->point_at_host(false);
    f.mover->read_nvme(2, value.data());
    EXPECT_EQ(value[0], 56) << "the raised step's staging is not written home";
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}

TEST(ParamMover, RefusesParametersBeyondNvmeSpaceBeforeAnyWrite) {
  testing_nvme::NvmeTestDir dir("param-mover-full-");
  auto nvme = nvme_engine(dir, 2 * kBytes);
  EXPECT_THROW(Fixture(Tier::kNvme, 1ULL << 30, nvme, Tier::kNvme), out_of_memory);
  EXPECT_EQ(nvme->stats().bytes_written, 0u);
}

// Pointing at the host is all or none: a staging out of memory or a failed read of the second NVMe parameter
// leaves every parameter at its device storage with no staging, and a retry points them all (Note [Parameter
// moves]; the step's pre-hook raises, the step does not run).
TEST(ParamMover, PointAtHostIsAllOrNoneWhenAStagingOrAReadFails) {
  testing_nvme::NvmeTestDir dir("param-mover-point-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);  // 1, 2 on NVMe; 3 a host copy
    const auto nothing_pointed = [&f](const std::string& after) {
      for (ParamId id : {1, 2, 3}) EXPECT_TRUE(f.host.at_device(id)) << "parameter " << id << " after " << after;
      EXPECT_TRUE(f.host.staging.empty()) << "every staging let go after " << after;
    };
    f.host.on_stage = at_stage(2, [] { throw out_of_memory("no pinned memory for a staging"); });
    EXPECT_THROW(f.mover->point_at_host(true), out_of_memory);
    nothing_pointed("a staging out of memory");
    f.host.on_stage = at_stage(2, [&faults] { faults.fail_reads = 1; });
    try {
      f.mover->point_at_host(true);
      FAIL() << "the second NVMe read failed";
    } catch (const io_error& e) {
      EXPECT_NE(std::string(e.what()).find("NvmeEngine: read"), std::string::npos) << e.what();
    }
    nothing_pointed("a failed read");
    f.host.on_stage = {};
    f.mover->begin_forward(0, 0);  // parameter 2 prefetched: in flight
    EXPECT_THROW(f.mover->point_at_host(true), std::logic_error);
    for (ParamId id : {1, 2, 3}) EXPECT_TRUE(f.host.at_device(id)) << "checked before any is pointed: " << id;
    f.mover->end_forward(0, 0);
    f.mover->end_phase();
    f.mover->point_at_host(true);  // the retry
    EXPECT_EQ(f.host.view.at(1), ParamView::kStaging);
    EXPECT_EQ(f.host.view.at(2), ParamView::kStaging);
    EXPECT_EQ(f.host.view.at(3), ParamView::kHostCopy);
    EXPECT_EQ(f.host.first_byte(f.host.staging, 1), 1);
    EXPECT_EQ(f.host.first_byte(f.host.staging, 2), 2);
    reinterpret_cast<unsigned char*>(f.host.staging.at(1).data())[0] = 81;  // the optimizer's step
    f.mover->point_at_host(false);
    EXPECT_EQ(nvme_value(*f.mover, 1)[0], 81);
    nothing_pointed("the step");
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}

// Pointing back goes on past a failed write (it cannot be undone): every parameter points at its device storage,
// every staging goes (none is written from later), the mover is off the host, and the error names the parameter.
TEST(ParamMover, PointingBackGoesOnPastAFailedWriteAndNamesItsParameter) {
  testing_nvme::NvmeTestDir dir("param-mover-back-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);  // 1, 2 on NVMe; 3 a host copy
    f.mover->point_at_host(true);
    reinterpret_cast<unsigned char*>(f.host.staging.at(1).data())[0] = 71;  // the optimizer's step
    reinterpret_cast<unsigned char*>(f.host.staging.at(2).data())[0] = 72;
    faults.fail_writes = 1;  // the first written (either, in the mover's order)
    ParamId failed = 0;
    try {
      f.mover->point_at_host(false);
      FAIL() << "a write failed";
    } catch (const io_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("NvmeEngine: write"), std::string::npos) << "the engine's words: " << what;
      EXPECT_EQ(e.error_number(), faults.error);
      failed = what.find("parameter 'blocks.0.w'") != std::string::npos ? 1 : 2;
      EXPECT_NE(what.find(failed == 1 ? "parameter 'blocks.0.w': its values from the optimizer's step were not "
                                        "written to NVMe"
                                      : "parameter 'blocks.1.w': its values from the optimizer's step were not "
                                        "written to NVMe"),
                std::string::npos)
          << what;
    }
    const ParamId written = failed == 1 ? 2 : 1;
    for (ParamId id : {1, 2, 3}) EXPECT_TRUE(f.host.at_device(id)) << "parameter " << id;
    EXPECT_EQ(f.host.staging.size(), 1u) << "the written one's staging goes";
    EXPECT_EQ(f.host.staging.count(failed), 1u) << "the failed one's stays as its value (unwritten)";
    EXPECT_EQ(nvme_value(*f.mover, written)[0], 70 + written) << "written past the failure";
    EXPECT_EQ(nvme_value(*f.mover, failed)[0], 70 + failed) << "its step's values, kept in its staging";
    f.mover->point_at_host(false);  // off the host already: nothing to write (a staging freed would crash)
    f.mover->store(failed, std::vector<unsigned char>(kBytes, 9).data());  // stored again
    f.mover->point_at_host(true);
    EXPECT_EQ(f.host.first_byte(f.host.staging, failed), 9);
    EXPECT_EQ(f.host.first_byte(f.host.staging, written), 70 + written);
    f.mover->point_at_host(false);
    EXPECT_TRUE(f.host.staging.empty());
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}

// tierflow.gathered's exit: scatter writes every parameter home before unholding any; a staging out of memory
// leaves all three held, and the retry writes and releases them. A write that fails (the third's, on NVMe) keeps
// its values in its staging and releases all three (Note [Parameter moves]).
TEST(ParamMover, ScatterWritesEveryParameterBackBeforeUnholdingAny) {
  testing_nvme::NvmeTestDir dir("param-mover-scatter-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  {
    Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kNvme);
    f.mover->gather({1, 2, 3});
    for (ParamId id : {1, 2, 3}) f.host.device.at(id)[0] = static_cast<unsigned char>(60 + id);
    f.host.on_stage = at_stage(2, [] { throw out_of_memory("no pinned memory for a staging"); });
    EXPECT_THROW(f.mover->scatter({1, 2, 3}, true), out_of_memory);
    for (ParamId id : {1, 2, 3}) {
      EXPECT_TRUE(f.mover->on_device(id)) << "parameter " << id << " after a staging out of memory";
      EXPECT_TRUE(f.host.has_memory(id)) << "parameter " << id << " after a staging out of memory";
    }
    EXPECT_EQ(f.host.staging.size(), 2u) << "the fetches' stagings of the two not written (let go at their "
                                            "release); the one written let its go";
    ParamId third = 0;  // the third staged: its write fails
    f.host.on_stage = [&faults, &third, n = 0](ParamId id) mutable {
      if (++n == 3) third = id, faults.fail_writes = 1;
    };
    EXPECT_THROW(f.mover->scatter({1, 2, 3}, true), io_error);
    f.host.on_stage = {};
    for (ParamId id : {1, 2, 3}) {
      EXPECT_FALSE(f.mover->on_device(id)) << "released past the failed write: parameter " << id;
      EXPECT_FALSE(f.host.has_memory(id));
      EXPECT_EQ(nvme_value(*f.mover, id)[0], 60 + id) << "parameter " << id;
    }
    EXPECT_EQ(f.host.staging.size(), 1u);
    EXPECT_EQ(f.host.staging.count(third), 1u) << "the failed one's values, kept";
    f.mover->gather({1, 2, 3});
    for (ParamId id : {1, 2, 3}) EXPECT_EQ(f.host.first_device_byte(id), 60 + id) << "parameter " << id;
    f.mover->scatter({1, 2, 3}, true);
    EXPECT_TRUE(f.host.staging.empty()) << "written: its staging goes";
    f.mover->gather({1});  // the holds balance: one more of each
    f.mover->scatter({1}, false);
    EXPECT_FALSE(f.mover->on_device(1));
  }
  EXPECT_EQ(nvme->stats().bytes_in_use, 0u);
}

// Note [Stall timeout]: a read that stalls while pointing at the host may still land in its staging, which is kept
// for good (not let go with the others'); every parameter still points at its device storage.
TEST(ParamMover, PointAtHostKeepsTheStagingOfAStalledReadForGood) {
  testing_nvme::NvmeTestDir dir("param-mover-stalled-read-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);  // 1, 2 on NVMe; 3 a host copy
  f.host.stage_offset = 8;  // the read lands in the staging as it completes
  ParamId stalled = 0;      // the last staged: its read stalls, nothing is staged after it
  f.host.on_stage = [&stalled](ParamId id) { stalled = id; };
  faults.read_delay_us = kStuckUs;
  {
    const StallLimit limit(kStallLimit);
    EXPECT_THROW(f.mover->point_at_host(true), stall_error);
  }
  faults.read_delay_us = 0;
  ASSERT_NE(stalled, 0u);
  EXPECT_EQ(f.host.kept, std::set<ParamId>{stalled});
  EXPECT_EQ(f.host.staging.count(stalled), 1u) << "the staging the read may still land in is kept";
  for (ParamId id : {1, 2, 3}) EXPECT_TRUE(f.host.at_device(id)) << "parameter " << id;
  f.mover.reset();  // waits for the read (its block's release)
  if (f.host.staging.count(stalled))
    EXPECT_EQ(f.host.staged(stalled)[0], static_cast<unsigned char>(stalled)) << "the read landed in the kept staging";
  EXPECT_TRUE(f.host.let_go_untouched()) << "the read landed in a staging let go";
}

// A write that stalls while pointing back may still read its staging: kept for good; no further write goes to the
// hung disk, the rest are pointed back and their stagings go (nothing reads them), and the stall is raised.
TEST(ParamMover, PointingBackKeepsTheStagingOfAStalledWriteAndWritesNoMore) {
  testing_nvme::NvmeTestDir dir("param-mover-stalled-write-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);  // 1, 2 on NVMe; 3 a host copy
  f.mover->point_at_host(true);
  f.host.staged(1)[0] = 71;  // the optimizer's step
  f.host.staged(2)[0] = 72;
  const std::uint64_t writes_before = nvme->stats().write_ops;
  faults.write_delay_us = kStuckUs;
  {
    const StallLimit limit(kStallLimit);
    EXPECT_THROW(f.mover->point_at_host(false), stall_error);
  }
  faults.write_delay_us = 0;
  for (ParamId id : {1, 2, 3}) EXPECT_TRUE(f.host.at_device(id)) << "parameter " << id;
  f.mover->point_at_host(false);  // off the host already: nothing to write
  f.mover.reset();  // waits for the stalled write (its block's release)
  EXPECT_EQ(nvme->stats().write_ops - writes_before, 1u) << "no write went to the hung disk after the stall";
  ASSERT_EQ(f.host.kept.size(), 1u) << "the first written (either, in the mover's order)";
  const ParamId stalled = *f.host.kept.begin();
  const ParamId other = stalled == 1 ? 2 : 1;
  ASSERT_EQ(f.host.staging.count(stalled), 1u) << "the staging its write may still read is kept";
  EXPECT_EQ(f.host.staged(stalled)[0], 70 + stalled);
  EXPECT_EQ(f.host.staging.count(other), 0u) << "not written: let go";
}

// scatter (tierflow.gathered's exit) whose first NVMe write stalls: its staging is kept for good, none is let go
// while a write may read it, and every hold stays.
TEST(ParamMover, ScatterKeepsTheStagingOfAStalledWriteForGood) {
  testing_nvme::NvmeTestDir dir("param-mover-stalled-scatter-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kNvme);
  f.mover->gather({1, 2, 3});
  const std::size_t let_go_before = f.host.let_go.size();
  faults.write_delay_us = kStuckUs;
  {
    const StallLimit limit(kStallLimit);
    EXPECT_THROW(f.mover->scatter({1, 2, 3}, true), stall_error);
  }
  faults.write_delay_us = 0;
  EXPECT_EQ(f.host.kept, std::set<ParamId>{1}) << "the first written";
  EXPECT_EQ(f.host.staging.count(1), 1u) << "the staging its write may still read is kept";
  EXPECT_EQ(f.host.let_go.size(), let_go_before) << "a staging went while its write was in flight";
  for (ParamId id : {1, 2, 3}) EXPECT_TRUE(f.mover->on_device(id)) << "parameter " << id << " still held";
  f.mover.reset();  // waits for the stalled write
}

// materialize (a state_dict's read) whose device-to-host copy stalls: the copy may still write the staging (and
// read the device memory): both kept for good, the staging not let go.
TEST(ParamMover, MaterializeKeepsTheStagingOfAStalledDownloadForGood) {
  Fixture f;
  f.mover->materialize(1, true);
  f.host.stall_download = {1};
  EXPECT_THROW(f.mover->materialize(1, false), stall_error);
  EXPECT_EQ(f.host.kept, std::set<ParamId>{1});
  EXPECT_EQ(f.host.staging.count(1), 1u) << "the staging the copy may still write is kept";
  EXPECT_TRUE(f.host.let_go.empty());
}

// A failed NVMe read while pointing at the host, and a failed write home (scatter, materialize), keep the engine's
// words and errno and name their parameter.
TEST(ParamMover, AFailedReadOrWriteHomeNamesItsParameter) {
  testing_nvme::NvmeTestDir dir("param-mover-named-");
  swap::NvmeFaults faults;
  auto nvme = nvme_engine(dir, 16ULL << 20, &faults);
  Fixture f(Tier::kNvme, 1ULL << 30, nvme, Tier::kHost);  // 1, 2 on NVMe; 3 a host copy
  const std::map<ParamId, std::string> names{{1, "blocks.0.w"}, {2, "blocks.1.w"}};
  ParamId staged = 0;  // the first staged: its read fails (known once it is made)
  f.host.on_stage = [&staged, &faults](ParamId id) {
    if (staged != 0) return;
    staged = id;
    faults.fail_reads = 1;
  };
  const auto expect_named = [&](const std::function<void()>& call, const std::string& engine, const ParamId& id,
                                const std::string& then) {
    try {
      call();
      ADD_FAILURE() << "no error: " << engine;
    } catch (const io_error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find(engine), 0u) << "the engine's words first: " << what;
      EXPECT_NE(what.find("; parameter '" + names.at(id) + "': " + then), std::string::npos) << what;
      EXPECT_EQ(e.error_number(), faults.error);
    }
  };
  expect_named([&f] { f.mover->point_at_host(true); }, "NvmeEngine: read", staged,
               "its values were not read from NVMe for the optimizer's step");
  f.host.on_stage = {};
  f.mover->gather({1, 2});
  faults.fail_writes = 1;
  expect_named([&f] { f.mover->scatter({1, 2}, true); }, "NvmeEngine: write", 1,
               "its values on the device were not written to NVMe");
  f.mover->gather({1, 2});  // (the failed write released them, its values kept)
  faults.fail_writes = 1;
  expect_named([&f] { f.mover->materialize(2, false); }, "NvmeEngine: write", 2,
               "its values on the device were not written to NVMe");
  f.mover->scatter({1, 2}, true);  // writes both again
  EXPECT_FALSE(f.mover->on_device(1));
  EXPECT_TRUE(f.host.staging.empty());
}
