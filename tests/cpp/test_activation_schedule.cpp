#include <gtest/gtest.h>

#include <algorithm>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/activation_schedule.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

ActivationScheduleOptions host_opts(std::uint64_t window) {
  ActivationScheduleOptions o;
  o.target = OffloadTarget::kHost;
  o.prefetch_bytes = window;
  return o;
}

// Simulates the executor: prefetched blocks arrive, read blocks get released.
void complete_offloads(ActivationSchedule& s) {
  auto& r = s.registry();
  for (BlockId i = 0; i < r.size(); ++i)
    if (r.residence(i) == Residence::kInFlightToHost) r.transition(i, Residence::kOnHost);
}
void fetch(ActivationSchedule& s, const std::vector<BlockId>& ids) {
  for (BlockId id : ids) s.registry().transition(id, Residence::kInFlightToDevice);
}
void release_all(ActivationSchedule& s) {
  auto& r = s.registry();
  for (BlockId i = 0; i < r.size(); ++i)
    if (r.residence(i) != Residence::kReleased) r.transition(i, Residence::kReleased);
}

}  // namespace

TEST(ActivationSchedule, FirstStepPrefetchesInReverseSaveOrderWithinTheWindow) {
  ActivationSchedule s(host_opts(300));
  s.begin_forward();
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(s.on_pack(100, true).offload);
  complete_offloads(s);
  auto first = s.begin_backward();
  EXPECT_EQ(first, (std::vector<BlockId>{4, 3, 2}));
  fetch(s, first);
  auto next = s.on_unpack(4);
  EXPECT_EQ(next, (std::vector<BlockId>{1}));
  fetch(s, next);
  EXPECT_EQ(s.on_unpack(3), (std::vector<BlockId>{0}));
  EXPECT_EQ(s.stats().order_misses, 0u);
}

TEST(ActivationSchedule, WindowAlwaysAdmitsTheNextBlock) {
  ActivationSchedule s(host_opts(10));
  s.begin_forward();
  s.on_pack(1000, true);
  s.on_pack(1000, true);
  EXPECT_EQ(s.begin_backward(), (std::vector<BlockId>{1}));
}

TEST(ActivationSchedule, APlansWindowTakesOverFromTheNextBackward) {
  // Note [Overlap window]: the same step prefetches three blocks ahead once the window holds three.
  ActivationSchedule s(host_opts(100));
  s.begin_forward();
  for (int i = 0; i < 5; ++i) s.on_pack(100, true);
  complete_offloads(s);
  EXPECT_EQ(s.begin_backward(), (std::vector<BlockId>{4}));
  release_all(s);
  s.set_prefetch_bytes(300);
  EXPECT_EQ(s.options().prefetch_bytes, 300u);
  s.begin_forward();
  for (int i = 0; i < 5; ++i) s.on_pack(100, true);
  complete_offloads(s);
  EXPECT_EQ(s.begin_backward(), (std::vector<BlockId>{4, 3, 2}));
  EXPECT_THROW(s.set_prefetch_bytes(0), tierflow::logic_error);
}

TEST(ActivationSchedule, NextStepReplaysTheRecordedOrder) {
  ActivationSchedule s(host_opts(100));
  // Step 1: backward reads in an order that is not reverse save order.
  s.begin_forward();
  for (int i = 0; i < 4; ++i) s.on_pack(100, true);
  complete_offloads(s);
  s.begin_backward();
  for (BlockId id : {2, 3, 0, 1}) s.on_unpack(id);
  EXPECT_GT(s.stats().order_misses, 0u);
  release_all(s);
  // Step 2: the schedule expects 2, 3, 0, 1 and prefetches in that order.
  const auto misses = s.stats().order_misses;
  s.begin_forward();
  for (int i = 0; i < 4; ++i) s.on_pack(100, true);
  complete_offloads(s);
  EXPECT_EQ(s.begin_backward(), (std::vector<BlockId>{2}));
  EXPECT_EQ(s.expected_order(), (std::vector<BlockId>{2, 3, 0, 1}));
  EXPECT_EQ(s.on_unpack(2), (std::vector<BlockId>{3}));
  EXPECT_EQ(s.on_unpack(3), (std::vector<BlockId>{0}));
  EXPECT_EQ(s.stats().order_misses, misses);
  EXPECT_EQ(s.stats().recorded_orders_used, 1u);
}

TEST(ActivationSchedule, ADifferentGraphFallsBackToReverseOrder) {
  ActivationSchedule s(host_opts(1 << 20));
  s.begin_forward();
  for (int i = 0; i < 3; ++i) s.on_pack(10, true);
  s.begin_backward();
  for (BlockId id : {0, 1, 2}) s.on_unpack(id);
  release_all(s);
  s.begin_forward();
  for (int i = 0; i < 5; ++i) s.on_pack(10, true);
  s.begin_backward();
  EXPECT_EQ(s.expected_order(), (std::vector<BlockId>{4, 3, 2, 1, 0}));
  EXPECT_EQ(s.stats().recorded_orders_used, 0u);
}

TEST(ActivationSchedule, IneligibleAndNoneKeepOnDevice) {
  ActivationSchedule s(host_opts(1 << 20));
  s.begin_forward();
  EXPECT_FALSE(s.on_pack(10, false).offload);
  EXPECT_TRUE(s.on_pack(10, true).offload);
  EXPECT_EQ(s.registry().residence(0), Residence::kResident);
  EXPECT_EQ(s.registry().residence(1), Residence::kInFlightToHost);
  // Kept blocks are never prefetched.
  EXPECT_EQ(s.begin_backward(), (std::vector<BlockId>{1}));

  ActivationScheduleOptions none;
  none.target = OffloadTarget::kNone;
  ActivationSchedule n(none);
  n.begin_forward();
  EXPECT_FALSE(n.on_pack(1 << 20, true).offload);
  EXPECT_EQ(n.stats().kept_blocks, 1u);
}

TEST(ActivationSchedule, DirectivesOverrideThePolicyExceptForIneligibleBlocks) {
  ActivationScheduleOptions o;
  o.target = OffloadTarget::kAuto;  // undirected blocks (outside the planned ones) are offloaded
  ActivationSchedule s(o);
  s.begin_forward();
  std::vector<bool> got;
  got.push_back(s.on_pack(100, true).offload);
  got.push_back(s.on_pack(100, true, PackDirective::kKeep).offload);
  got.push_back(s.on_pack(100, true, PackDirective::kOffload).offload);
  got.push_back(s.on_pack(100, false, PackDirective::kOffload).offload);  // too small / no-offload region
  EXPECT_EQ(got, (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(s.registry().device_bytes().values().current, 400);  // copies to the host are still in flight

  ActivationScheduleOptions none;
  none.target = OffloadTarget::kNone;
  ActivationSchedule n(none);
  n.begin_forward();
  EXPECT_TRUE(n.on_pack(100, true, PackDirective::kOffload).offload);
}

TEST(ActivationSchedule, TensorsSavedDuringBackwardStayResident) {
  ActivationSchedule s(host_opts(1 << 20));
  s.begin_forward();
  s.on_pack(10, true);
  s.begin_backward();
  EXPECT_FALSE(s.on_pack(10, true).offload);
}

TEST(ActivationSchedule, RepeatedReadsAndUnknownBlocks) {
  ActivationSchedule s(host_opts(1 << 20));
  s.begin_forward();
  s.on_pack(10, true);
  s.begin_backward();
  s.on_unpack(0);
  EXPECT_TRUE(s.consumed(0));
  EXPECT_TRUE(s.on_unpack(0).empty());
  EXPECT_THROW(s.on_unpack(7), logic_error);
}

TEST(ActivationSchedule, RefusesAZeroWindow) { EXPECT_THROW(ActivationSchedule{host_opts(0)}, logic_error); }

TEST(ActivationSchedule, NvmeKeepsTheLastSavedBlocksOfTheGraphResident) {
  ActivationScheduleOptions o;
  o.target = OffloadTarget::kNvme;
  o.keep_tail_bytes = 250;
  ActivationSchedule s(o);
  auto forward = [&] {
    s.begin_forward();
    std::vector<bool> out;
    for (int i = 0; i < 5; ++i) out.push_back(s.on_pack(100, true).offload);
    release_all(s);
    return out;
  };
  // First step: no previous graph, everything goes to SSD.
  EXPECT_EQ(forward(), (std::vector<bool>{true, true, true, true, true}));
  // Next steps: the last 200 bytes (two blocks) fit the 250-byte tail and stay.
  EXPECT_EQ(forward(), (std::vector<bool>{true, true, true, false, false}));
  EXPECT_EQ(forward(), (std::vector<bool>{true, true, true, false, false}));
}
