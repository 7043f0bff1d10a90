// The fetches and releases of parameters (Note [Parameter residency]).
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/param_schedule.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

using Ids = std::vector<ParamId>;

// n blocks of one parameter each (ids 10+i, `bytes`), on `tier`, and a rest unit of parameter 1.
std::vector<ParamUnit> chain(std::size_t n, std::uint64_t bytes, Tier tier, Tier rest = Tier::kGpu) {
  std::vector<ParamUnit> units;
  for (std::size_t i = 0; i < n; ++i) units.push_back({tier, {{10 + i, bytes}}});
  units.push_back({rest, {{1, 5}}});
  return units;
}

// Carries out what the schedule asks: every fetch lands before the unit runs.
void land(ParamSchedule& s, const ParamActions& a) {
  for (ParamId id : a.fetch) s.arrived(id);
  for (ParamId id : a.prefetch) s.arrived(id);
}

void run_forward(ParamSchedule& s, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    land(s, s.begin_forward(i));
    land(s, s.end_forward(i));
  }
}

}  // namespace

TEST(ParamSchedule, FetchesAheadInOrderAndReleasesAfterEachUse) {
  ParamSchedule s(chain(4, 100, Tier::kHost), {100});
  EXPECT_EQ(s.stats().device_bytes, 5u);  // the resident rest unit
  EXPECT_EQ(s.stats().host_bytes, 400u);
  ParamActions a = s.begin_forward(0);
  EXPECT_EQ(a.fetch, Ids({10}));     // the first use stalls
  EXPECT_EQ(a.prefetch, Ids({11}));  // one block ahead within 100 bytes
  EXPECT_EQ(a.wait, Ids({10}));
  land(s, a);
  a = s.end_forward(0);
  EXPECT_EQ(a.release, Ids({10}));
  EXPECT_EQ(s.state(10), ParamState::kReleased);
  a = s.begin_forward(1);
  EXPECT_TRUE(a.fetch.empty());
  EXPECT_EQ(a.prefetch, Ids({12}));
  land(s, a);
  land(s, s.end_forward(1));
  for (std::size_t i = 2; i < 4; ++i) {
    land(s, s.begin_forward(i));
    land(s, s.end_forward(i));
  }
  EXPECT_EQ(s.stats().stalls, 1u);
  EXPECT_EQ(s.stats().prefetch_hits, 3u);
  EXPECT_EQ(s.stats().device_peak_bytes, 5u + 200u);  // the running block and the one prefetched
  // Backward: the reverse of this forward on the first step.
  a = s.begin_backward(3);
  EXPECT_EQ(a.fetch, Ids({13}));
  EXPECT_EQ(a.prefetch, Ids({12}));
  land(s, a);
  land(s, s.end_backward(3));
  for (std::size_t i = 3; i-- > 0;) {
    land(s, s.begin_backward(i));
    land(s, s.end_backward(i));
  }
  EXPECT_EQ(s.stats().fetches, 8u);
  EXPECT_EQ(s.stats().host_to_device_bytes, 800u);
  EXPECT_EQ(s.stats().nvme_to_host_bytes, 0u);
  EXPECT_EQ(s.stats().releases, 8u);
  EXPECT_EQ(s.stats().device_bytes, 5u);
  EXPECT_EQ(s.stats().order_misses, 0u);
}

TEST(ParamSchedule, AParameterTwoUnitsListIsFetchedForEachUseNotKeptBetweenThem) {
  std::vector<ParamUnit> units = chain(3, 100, Tier::kNvme);
  units[0].params.push_back({7, 50});  // tied: blocks 0 and 2 use parameter 7 (an embedding and its head)
  units[2].params.push_back({7, 50});
  ParamSchedule s(std::move(units), {0});  // no prefetch: every fetch is at its use
  EXPECT_EQ(s.stats().nvme_bytes, 350u);
  ParamActions a = s.begin_forward(0);
  EXPECT_EQ(a.fetch, Ids({10, 7}));
  land(s, a);
  EXPECT_EQ(s.end_forward(0).release, Ids({10, 7}));  // block 1 comes between: 7 does not wait on the device
  land(s, s.begin_forward(1));
  land(s, s.end_forward(1));
  a = s.begin_forward(2);
  EXPECT_EQ(a.fetch, Ids({12, 7}));
  land(s, a);
  EXPECT_EQ(s.end_forward(2).release, Ids({12, 7}));
  EXPECT_EQ(s.stats().fetches, 5u);
  EXPECT_EQ(s.stats().nvme_to_host_bytes, 400u);
  EXPECT_EQ(s.stats().device_peak_bytes, 155u);  // the rest unit's 5 bytes stay
}

TEST(ParamSchedule, OverlappingUsesKeepASharedParameterUntilTheLastOneEnds) {
  std::vector<ParamUnit> units = chain(3, 100, Tier::kHost);
  units[0].params.push_back({7, 50});
  units[2].params.push_back({7, 50});
  ParamSchedule s(std::move(units), {0});
  land(s, s.begin_forward(0));
  land(s, s.begin_forward(2));  // block 2's use begins before block 0's ends (a shared input, a nested call)
  EXPECT_EQ(s.end_forward(0).release, Ids({10}));  // 7: block 2 still uses it
  EXPECT_EQ(s.state(7), ParamState::kOnDevice);
  EXPECT_EQ(s.end_forward(2).release, Ids({12, 7}));
  // The same unit open twice (a block called twice before its first call's backward ended).
  land(s, s.begin_backward(1));
  land(s, s.begin_backward(1));
  EXPECT_TRUE(s.end_backward(1).release.empty());
  EXPECT_EQ(s.end_backward(1).release, Ids({11}));
  EXPECT_THROW(s.end_backward(1), std::logic_error);  // no use of block 1 is open
}

TEST(ParamSchedule, TheBudgetBoundsEveryFetchAndAUseThatCannotFitIsRefusedNamingTheOpenUses) {
  std::vector<ParamUnit> units = chain(4, 100, Tier::kHost);
  for (std::size_t i = 0; i < 4; ++i) units[i].name = "block " + std::to_string(i);
  ParamScheduleOptions o;
  o.prefetch_bytes = 100;
  o.device_budget_bytes = 250;
  ParamSchedule s(std::move(units), o);
  land(s, s.begin_forward(0));  // 0, and 1 prefetched: 205 with the rest unit's 5 resident bytes
  EXPECT_EQ(s.stats().device_bytes, 205u);
  ParamActions a = s.begin_forward(1);  // a hit; 2 would make 300: not prefetched
  EXPECT_TRUE(a.prefetch.empty() && a.refused.empty());
  land(s, a);
  a = s.begin_forward(2);  // three uses open at once do not fit 250
  EXPECT_TRUE(a.fetch.empty() && a.wait.empty());
  ASSERT_FALSE(a.refused.empty());
  for (const char* part : {"TIERFLOW_GPU_MEMORY", "block 0, block 1", "block 2", "250 bytes"})
    EXPECT_NE(a.refused.find(part), std::string::npos) << part << " in: " << a.refused;
  EXPECT_EQ(s.state(12), ParamState::kOnTier);  // nothing changed
  EXPECT_EQ(s.stats().device_bytes, 205u);
  a = s.end_forward(0);  // one use ended: 2 fits now, prefetched
  EXPECT_EQ(a.prefetch, Ids({12}));
  land(s, a);
  a = s.begin_forward(2);
  EXPECT_TRUE(a.refused.empty() && a.fetch.empty());
  land(s, a);
  EXPECT_LE(s.stats().device_peak_bytes, 250u);
}

TEST(ParamSchedule, AUsesExtraBytesCountInTheBudgetUntilItEnds) {
  ParamScheduleOptions o;
  o.device_budget_bytes = 260;
  ParamSchedule s(chain(2, 100, Tier::kHost, Tier::kHost), o);
  land(s, s.begin_forward(0, 50));  // block 0 and its casts (autocast's 16-bit copies of its fp32 weights)
  EXPECT_EQ(s.stats().device_bytes, 150u);
  ParamActions a = s.begin_forward(1, 50);  // 150 + 100 + 50 > 260
  EXPECT_FALSE(a.refused.empty());
  land(s, s.end_forward(0, 50));
  EXPECT_EQ(s.stats().device_bytes, 0u);
  land(s, s.begin_forward(1, 50));
  EXPECT_EQ(s.stats().device_peak_bytes, 150u);
  s.end_phase();  // an open use's extra bytes go with the phase
  EXPECT_EQ(s.stats().device_bytes, 0u);
}

TEST(ParamSchedule, ANeededFetchFirstReleasesPrefetchedParametersNoUseHolds) {
  std::vector<ParamUnit> units = chain(3, 100, Tier::kHost, Tier::kHost);
  ParamScheduleOptions o;
  o.prefetch_bytes = 100;
  o.device_budget_bytes = 200;
  ParamSchedule s(std::move(units), o);
  land(s, s.begin_forward(0));  // and 1 prefetched
  ParamActions a = s.hold(1);   // the rest unit's parameter read where its module does not run
  EXPECT_TRUE(a.refused.empty());
  EXPECT_EQ(a.release, Ids({11}));  // the prefetch made room
  EXPECT_EQ(a.fetch, Ids({1}));
  land(s, a);
  EXPECT_LE(s.stats().device_peak_bytes, 200u);
}

TEST(ParamSchedule, AHeldParameterStaysThroughPhaseEndsUntilUnheld) {
  ParamSchedule s(chain(2, 100, Tier::kHost, Tier::kHost), {0});
  land(s, s.begin_forward(0));
  land(s, s.hold(1));
  land(s, s.hold(1));  // held twice (a read inline, a gathered context)
  land(s, s.end_forward(0));
  EXPECT_EQ(s.end_phase().release, Ids());  // 10 went at the end of its use; 1 is held
  EXPECT_EQ(s.state(1), ParamState::kOnDevice);
  land(s, s.begin_backward(0));
  land(s, s.end_backward(0));
  s.end_phase();
  EXPECT_TRUE(s.unhold(1).release.empty());
  EXPECT_EQ(s.unhold(1).release, Ids({1}));
  EXPECT_THROW(s.unhold(1), std::logic_error);
}

TEST(ParamSchedule, AHeldParameterMadeResidentStaysWhereItIs) {
  ParamSchedule s(chain(2, 100, Tier::kHost, Tier::kHost), {0});
  land(s, s.hold(1));  // read inline in the forward the plan was made in (auto)
  EXPECT_EQ(s.make_resident({2}), Ids({1}));
  EXPECT_EQ(s.stats().device_bytes, 5u);  // counted once
  EXPECT_EQ(s.home(1), Tier::kGpu);
  EXPECT_TRUE(s.unhold(1).release.empty());  // the hold's end leaves it resident
}

TEST(ParamSchedule, AnAttachedParameterIsFetchedWithItsNewUnitFromNowOn) {
  ParamSchedule s(chain(2, 100, Tier::kHost, Tier::kHost), {0});
  land(s, s.begin_forward(1));
  ParamActions a = s.attach(1, 1);  // block 1 reads the rest unit's parameter
  EXPECT_EQ(a.fetch, Ids({1}));
  land(s, a);
  EXPECT_TRUE(s.attach(1, 1).fetch.empty());  // listed already
  EXPECT_EQ(s.end_forward(1).release, Ids({11, 1}));
  s.end_phase();
  a = s.begin_forward(1);
  EXPECT_EQ(a.fetch, Ids({11, 1}));
}


TEST(ParamSchedule, AParameterAResidentUnitListsStaysResident) {
  std::vector<ParamUnit> units = chain(2, 100, Tier::kHost);
  units[0].params.push_back({1, 5});  // the rest unit's (resident) parameter, used by block 0 too
  ParamSchedule s(std::move(units), {1000});
  EXPECT_EQ(s.home(1), Tier::kGpu);
  const ParamActions a = s.begin_forward(0);
  EXPECT_EQ(std::count(a.fetch.begin(), a.fetch.end(), ParamId{1}), 0);
  land(s, a);
  EXPECT_EQ(s.end_forward(0).release, Ids({10}));
  EXPECT_EQ(s.state(1), ParamState::kOnDevice);
}

TEST(ParamSchedule, TheRecordedBackwardOrderDrivesTheNextStepsPrefetch) {
  ParamSchedule s(chain(3, 100, Tier::kHost), {100});
  run_forward(s, 3);
  // This model's backward runs block 1 before block 2 (say, a skip connection).
  for (std::size_t i : {1, 2, 0}) {
    land(s, s.begin_backward(i));
    land(s, s.end_backward(i));
  }
  const auto misses = s.stats().order_misses;
  EXPECT_GT(misses, 0u);
  run_forward(s, 3);
  ParamActions a = s.begin_backward(1);
  EXPECT_EQ(s.expected_order(), std::vector<UnitId>({1, 2, 0}));
  EXPECT_EQ(a.prefetch, Ids({12}));
  land(s, a);
  land(s, s.end_backward(1));
  for (std::size_t i : {2, 0}) {
    land(s, s.begin_backward(i));
    land(s, s.end_backward(i));
  }
  EXPECT_EQ(s.stats().order_misses, misses);
}

TEST(ParamSchedule, EndingAPhaseReleasesEverythingLeftAndRecordsItsOrder) {
  ParamSchedule s(chain(4, 100, Tier::kHost, Tier::kHost), {100});
  EXPECT_TRUE(s.end_phase().release.empty());  // no phase yet
  land(s, s.begin_forward(4));
  land(s, s.end_forward(4));
  run_forward(s, 4);
  land(s, s.begin_forward(4));
  land(s, s.end_forward(4));
  // Backward uses only the rest unit and blocks 3 and 2 (frozen inputs below): 2's prefetch of 1 is left.
  land(s, s.begin_backward(4));
  land(s, s.end_backward(4));
  land(s, s.begin_backward(3));
  land(s, s.end_backward(3));
  const ParamActions b2 = s.begin_backward(2);
  ASSERT_EQ(b2.prefetch, Ids{11});  // in flight: the caller has not seen it land
  land(s, ParamActions{{}, b2.fetch, {}, {}});
  s.end_backward(2);
  const ParamActions end = s.end_phase();
  EXPECT_NE(std::find(end.release.begin(), end.release.end(), ParamId{11}), end.release.end());
  EXPECT_EQ(s.stats().device_bytes, 0u);
  EXPECT_EQ(s.state(11), ParamState::kReleased);
  EXPECT_TRUE(s.end_phase().release.empty());
  // The same forward again, ended by end_phase: the next backward expects the one recorded after it (rest, 3,
  // 2), not the reverse of the forward.
  land(s, s.begin_forward(4));
  land(s, s.end_forward(4));
  run_forward(s, 4);
  land(s, s.begin_forward(4));
  land(s, s.end_forward(4));
  EXPECT_TRUE(s.end_phase().release.empty());  // the rest unit's last use released it already
  const auto misses = s.stats().order_misses;
  for (UnitId u : {UnitId{4}, UnitId{3}, UnitId{2}}) {
    land(s, s.begin_backward(u));
    land(s, s.end_backward(u));
  }
  EXPECT_EQ(s.stats().order_misses, misses);
  s.end_phase();
  EXPECT_EQ(s.stats().device_bytes, 0u);
}

TEST(ParamSchedule, UnitsMadeResidentBetweenPhasesStayAndAreNeverFetchedAgain) {
  ParamSchedule s(chain(3, 100, Tier::kHost, Tier::kHost), {100});
  run_forward(s, 3);
  EXPECT_THROW(s.make_resident({1}), std::logic_error);  // in a phase
  s.end_phase();
  EXPECT_THROW(s.make_resident({7}), std::logic_error);
  EXPECT_EQ(s.make_resident({1, 3}), (Ids{11, 1}));
  EXPECT_EQ(s.home(11), Tier::kGpu);
  EXPECT_EQ(s.state(11), ParamState::kOnDevice);
  EXPECT_EQ(s.stats().device_bytes, 105u);
  EXPECT_EQ(s.stats().host_bytes, 200u);
  EXPECT_TRUE(s.make_resident({1}).empty());  // already resident
  const auto fetches = s.stats().fetches;
  run_forward(s, 3);
  s.end_phase();
  EXPECT_EQ(s.stats().fetches, fetches + 2);  // blocks 0 and 2 only
  EXPECT_EQ(s.state(11), ParamState::kOnDevice);
  EXPECT_EQ(s.stats().device_bytes, 105u);
}

TEST(ParamSchedule, AStepThatFailedLeavesTheNextOneASchedule) {
  ParamSchedule s(chain(2, 100, Tier::kHost), {0});
  // A fetch whose wait failed: the use ends all the same, releasing it (the caller waits for the copy first).
  s.begin_forward(0);
  EXPECT_EQ(s.end_forward(0).release, Ids{10});
  // A fetch the caller could not start goes back, and its next use fetches it again.
  const ParamActions a = s.begin_forward(1);
  ASSERT_EQ(a.fetch, Ids{11});
  s.fetch_failed(11);
  EXPECT_EQ(s.state(11), ParamState::kReleased);
  EXPECT_EQ(s.stats().device_bytes, 5u);  // the resident rest unit
  EXPECT_TRUE(s.end_forward(1).release.empty());
  s.end_phase();
  EXPECT_EQ(s.begin_forward(1).fetch, Ids{11});
}

TEST(ParamSchedule, IllegalMovesNameTheParameterAndBothStates) {
  ParamSchedule s(chain(2, 100, Tier::kHost), {0});
  s.begin_forward(0);  // fetch started
  try {
    s.fetch_failed(11);  // never fetched
    FAIL() << "put back a parameter that was not in flight";
  } catch (const std::logic_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("fetch_failed: parameter 11 is on-tier"), std::string::npos) << m;
  }
  s.arrived(10);
  EXPECT_THROW(s.arrived(10), std::logic_error);  // on-device -> on-device
  EXPECT_THROW(s.arrived(1), std::logic_error);   // resident
  EXPECT_THROW(s.state(99), std::logic_error);
  EXPECT_THROW(ParamSchedule({}, {}), std::logic_error);
  EXPECT_THROW(ParamSchedule({{Tier::kHost, {{3, 1}}}, {Tier::kHost, {{3, 2}}}}, {}), std::logic_error);
}

TEST(ParamSchedule, ResidencesComeFromThePlan) {
  Plan plan;
  plan.blocks.resize(2);
  plan.blocks[1].params = Tier::kNvme;
  plan.rest_params = Tier::kHost;
  EXPECT_EQ(residences_from_plan(plan), std::vector<Tier>({Tier::kGpu, Tier::kNvme, Tier::kHost}));
}

TEST(ParamSchedule, BeforeAnyRecordTheBlocksAreExpectedAndOtherUnitsFetchedAtTheirUse) {
  ParamSchedule s(chain(2, 100, Tier::kHost, Tier::kHost), {100});
  EXPECT_EQ(s.expected_order(), std::vector<UnitId>({0, 1}));
  ParamActions a = s.begin_forward(2);  // the embeddings: not expected yet, fetched at their use
  EXPECT_EQ(a.fetch, Ids({1}));
  land(s, a);
  EXPECT_EQ(s.end_forward(2).release, Ids({1}));
  run_forward(s, 2);
  EXPECT_EQ(s.stats().order_misses, 1u);
}

TEST(ParamBudget, ABudgetBelowTheLargestUnitWindowAndWorkingSetNamesTheBytes) {
  EXPECT_NO_THROW(check_param_budget(1000, {300, 500, 200}, 200, 300));
  try {
    check_param_budget(999, {300, 500, 200}, 200, 300);
    FAIL();
  } catch (const out_of_memory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("need at least 1000 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("TIERFLOW_GPU_MEMORY) is 999 bytes"), std::string::npos) << m;
  }
  EXPECT_THROW(check_param_budget(~0ULL, {~0ULL}, 1, 0), out_of_memory);
}
