// tiering::SavedTensors: the decisions of Note [Saved-tensor decisions], without torch.
#include <gtest/gtest.h>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/saved_tensors.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

ActivationScheduleOptions target(OffloadTarget t) {
  ActivationScheduleOptions o;
  o.target = t;
  return o;
}

SavedTensorFacts tensor(std::uint64_t bytes) {
  SavedTensorFacts f;
  f.bytes = bytes;
  return f;
}

double field(const SavedTensorStats& s, const std::vector<StatField<SavedTensorStats>>& fields, const char* name) {
  for (const auto& f : fields)
    if (std::string(f.name) == name) return f.of(s);
  ADD_FAILURE() << "no field " << name;
  return -1;
}

}  // namespace

TEST(SavedTensors, PassesThroughUndefinedUnmanagedAndParametersAndCountsWhy) {
  SavedTensors saved(target(OffloadTarget::kHost), 0);
  SavedTensorFacts undefined;
  undefined.defined = false;
  SavedTensorFacts unmanaged = tensor(1 << 20);
  unmanaged.managed = false;
  SavedTensorFacts param = tensor(1 << 20);
  param.parameter = true;
  for (const auto& f : {undefined, unmanaged, param})
    EXPECT_EQ(saved.pack(f, PackTarget::kPolicy, false).verdict, PackVerdict::kPassThrough);
  const SavedTensorStats s = saved.stats({});
  EXPECT_EQ(s.packs, 3u);
  EXPECT_EQ(s.skipped_unmanaged, 1u);
  EXPECT_EQ(s.skipped_parameters, 1u);
  EXPECT_EQ(saved.schedule().registry().size(), 0u);  // no block for any of them
}

TEST(SavedTensors, AStorageSavedAgainIsTheSameBlock) {
  SavedTensors saved(target(OffloadTarget::kHost), 0);
  saved.schedule().begin_forward();
  SavedTensorFacts again = tensor(4096);
  again.saved_already = true;
  EXPECT_EQ(saved.pack(tensor(4096), PackTarget::kPolicy, false).verdict, PackVerdict::kNewBlock);
  EXPECT_EQ(saved.pack(again, PackTarget::kPolicy, false).verdict, PackVerdict::kSameBlock);
  EXPECT_EQ(saved.stats({}).dedup_hits, 1u);
  EXPECT_EQ(saved.schedule().registry().size(), 1u);
}

TEST(SavedTensors, SmallBlocksAndNoOffloadRegionsStayOnTheDevice) {
  SavedTensors saved(target(OffloadTarget::kHost), 1000);
  saved.schedule().begin_forward();
  const PackChoice small = saved.pack(tensor(999), PackTarget::kPolicy, false);
  EXPECT_EQ(small.verdict, PackVerdict::kNewBlock);
  EXPECT_FALSE(small.offload);
  SavedTensorFacts in_region = tensor(1000);
  in_region.in_no_offload_region = true;
  EXPECT_FALSE(saved.pack(in_region, PackTarget::kPolicy, false).offload);
  EXPECT_TRUE(saved.pack(tensor(1000), PackTarget::kPolicy, false).offload);  // the threshold itself goes
  const SavedTensorStats s = saved.stats({});
  EXPECT_EQ(s.kept_small, 1u);
  EXPECT_EQ(s.kept_region, 1u);
  EXPECT_EQ(s.policy_bytes, 1000u) << "what the policy's packs could offload: neither the small one nor the region's";
}

TEST(SavedTensors, PolicyBytesCountThePolicysPacksAlone) {
  // Under auto the blocks' runners pack with their own targets; the model-level hook's packs (kPolicy) are what is
  // saved outside the blocks (Note [Auto plan phases]), offloaded or not.
  SavedTensors saved(target(OffloadTarget::kNone), 0);
  saved.schedule().begin_forward();
  EXPECT_FALSE(saved.pack(tensor(100), PackTarget::kPolicy, false).offload);
  saved.pack(tensor(30), PackTarget::kHost, false);
  saved.pack(tensor(7), PackTarget::kKeep, false);
  SavedTensorFacts param = tensor(500);
  param.parameter = true;
  saved.pack(param, PackTarget::kPolicy, false);
  EXPECT_EQ(saved.stats({}).policy_bytes, 100u);
}

TEST(SavedTensors, OutsideNvmePacksDecideAndCountAsThePolicysAndGoToNvme) {
  // The model-level hook when the plan puts what is saved outside the blocks on NVMe (Note [Activation planner]):
  // the policy's decision (auto offloads), its policy_bytes (autoplan measures the outside bytes by them), NVMe
  // when there is a tier, else the host.
  SavedTensors saved(target(OffloadTarget::kAuto), 16);
  saved.schedule().begin_forward();
  const PackChoice big = saved.pack(tensor(100), PackTarget::kOutsideNvme, true);
  EXPECT_TRUE(big.offload);
  EXPECT_EQ(big.to, swap::StagedTarget::kNvme);
  EXPECT_EQ(saved.pack(tensor(50), PackTarget::kOutsideNvme, false).to, swap::StagedTarget::kHost);
  EXPECT_FALSE(saved.pack(tensor(8), PackTarget::kOutsideNvme, true).offload) << "small: kept, as kPolicy keeps it";
  EXPECT_EQ(saved.pack(tensor(64), PackTarget::kPolicy, true).to, swap::StagedTarget::kHost) << "auto's own: host";
  saved.pack(tensor(30), PackTarget::kNvme, true);  // a block plan's: not the policy's
  EXPECT_EQ(saved.stats({}).policy_bytes, 100u + 50u + 64u);

  SavedTensors none(target(OffloadTarget::kNone), 0);
  none.schedule().begin_forward();
  EXPECT_FALSE(none.pack(tensor(64), PackTarget::kOutsideNvme, true).offload) << "the policy decides, as kPolicy";
}

TEST(SavedTensors, TheTargetPicksTheTierAndNvmeFallsBackToTheHostWithoutATier) {
  SavedTensors host(target(OffloadTarget::kHost), 0);
  host.schedule().begin_forward();
  EXPECT_EQ(host.pack(tensor(64), PackTarget::kPolicy, true).to, swap::StagedTarget::kHost);
  EXPECT_EQ(host.pack(tensor(64), PackTarget::kNvme, true).to, swap::StagedTarget::kNvme);
  EXPECT_EQ(host.pack(tensor(64), PackTarget::kNvme, false).to, swap::StagedTarget::kHost);
  EXPECT_FALSE(host.pack(tensor(64), PackTarget::kKeep, true).offload);
  EXPECT_TRUE(host.pack(tensor(64), PackTarget::kHost, true).offload);

  SavedTensors nvme(target(OffloadTarget::kNvme), 0);
  nvme.schedule().begin_forward();
  EXPECT_EQ(nvme.pack(tensor(64), PackTarget::kPolicy, true).to, swap::StagedTarget::kNvme);
  EXPECT_EQ(nvme.pack(tensor(64), PackTarget::kHost, true).to, swap::StagedTarget::kHost);

  SavedTensors none(target(OffloadTarget::kNone), 0);
  none.schedule().begin_forward();
  EXPECT_FALSE(none.pack(tensor(64), PackTarget::kPolicy, true).offload);
  EXPECT_TRUE(none.pack(tensor(64), PackTarget::kHost, true).offload);  // a plan's decision wins
}

TEST(SavedTensors, AFullHostPoolKeepsTheBlockResidentAndWarnsOnce) {
  SavedTensors saved(target(OffloadTarget::kHost), 0);
  saved.schedule().begin_forward();
  const PackChoice a = saved.pack(tensor(64), PackTarget::kPolicy, false);
  const PackChoice b = saved.pack(tensor(64), PackTarget::kPolicy, false);
  ASSERT_TRUE(a.offload && b.offload);
  EXPECT_TRUE(saved.host_full(a.id));
  EXPECT_FALSE(saved.host_full(b.id));
  EXPECT_EQ(saved.schedule().registry().residence(a.id), Residence::kResident);
  EXPECT_EQ(saved.stats({}).host_fallbacks, 2u);
  saved.offloaded(64);
  EXPECT_EQ(saved.stats({}).offloaded_bytes, 64u);
}

TEST(SavedTensors, AReadIsServedByTheBlocksResidence) {
  SavedTensors saved(target(OffloadTarget::kHost), 0);
  saved.schedule().begin_forward();
  std::vector<BlockId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(saved.pack(tensor(64), PackTarget::kPolicy, false).id);
  auto& reg = saved.schedule().registry();
  // 0 stays in flight to the host, 1 on the host, 2 on NVMe, 3 coming back, 4 back and forwarded.
  for (BlockId id : {ids[1], ids[2], ids[3], ids[4]}) reg.transition(id, Residence::kOnHost);
  reg.transition(ids[2], Residence::kOnNvme);
  reg.transition(ids[3], Residence::kInFlightToDevice);
  reg.transition(ids[4], Residence::kInFlightToDevice);
  reg.transition(ids[4], Residence::kResident);
  EXPECT_EQ(saved.read(ids[0], false, true), ReadServe::kForward);
  EXPECT_EQ(saved.read(ids[1], false, true), ReadServe::kFetchNow);
  EXPECT_EQ(saved.read(ids[2], false, true), ReadServe::kFetchNow);
  EXPECT_EQ(saved.read(ids[3], false, true), ReadServe::kAsIs);  // not ready: a stall
  EXPECT_EQ(saved.read(ids[4], false, true), ReadServe::kAsIs);  // a prefetch brought it: a hit
  saved.stalled_for(2'000'000);
  const SavedTensorStats s = saved.stats({});
  EXPECT_EQ(s.unpacks, 5u);
  EXPECT_EQ(s.forwarded, 1u);
  EXPECT_EQ(s.unprefetched, 2u);
  EXPECT_EQ(s.stalls, 3u);
  EXPECT_EQ(s.prefetch_hits, 1u);
  EXPECT_DOUBLE_EQ(field(s, saved_tensor_prefetch_stat_fields(), "stall_ms"), 2.0);
}

TEST(SavedTensors, StatsCarryThePipelinesCountsAndTheBytesPerTier) {
  SavedTensors saved(target(OffloadTarget::kHost), 0);
  saved.schedule().begin_forward();
  const BlockId id = saved.pack(tensor(300), PackTarget::kPolicy, false).id;
  saved.schedule().registry().transition(id, Residence::kOnHost);
  swap::StagedPipelineStats p;
  p.nvme_writes = 7;
  p.offload_wait_ns = 3'000'000;
  const SavedTensorStats s = saved.stats(p);
  EXPECT_EQ(field(s, saved_tensor_nvme_stat_fields(), "writes"), 7.0);
  EXPECT_DOUBLE_EQ(field(s, saved_tensor_stat_fields(), "offload_wait_ms"), 3.0);
  EXPECT_EQ(s.host_bytes.current, 300u);
  EXPECT_EQ(s.device_bytes.current, 0u);
}

TEST(SavedTensors, PackTargetsParseAndTheErrorNamesTheAccepted) {
  EXPECT_EQ(parse_pack_target("policy"), PackTarget::kPolicy);
  EXPECT_EQ(parse_pack_target("keep"), PackTarget::kKeep);
  EXPECT_EQ(parse_pack_target("host"), PackTarget::kHost);
  EXPECT_EQ(parse_pack_target("nvme"), PackTarget::kNvme);
  EXPECT_EQ(parse_pack_target("outside_nvme"), PackTarget::kOutsideNvme);
  try {
    parse_pack_target("disk");
    FAIL() << "accepted 'disk'";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("'disk'; accepted: policy, keep, host, nvme, outside_nvme"),
              std::string::npos);
  }
}
