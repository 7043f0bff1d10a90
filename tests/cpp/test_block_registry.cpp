#include <gtest/gtest.h>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/block_registry.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

TEST(BlockRegistry, FullOffloadCycleAccountsBothTiers) {
  BlockRegistry r;
  BlockId a = r.add(100, Residence::kInFlightToHost);
  EXPECT_EQ(r.device_bytes().values().current, 100);
  EXPECT_EQ(r.host_bytes().values().current, 100);
  r.transition(a, Residence::kOnHost);
  EXPECT_EQ(r.device_bytes().values().current, 0);
  r.transition(a, Residence::kInFlightToDevice);
  EXPECT_EQ(r.device_bytes().values().current, 100);
  r.transition(a, Residence::kResident);
  EXPECT_EQ(r.host_bytes().values().current, 0);
  r.transition(a, Residence::kReleased);
  EXPECT_EQ(r.device_bytes().values().current, 0);
  EXPECT_EQ(r.device_bytes().values().peak, 100);
  EXPECT_TRUE(r.all_released());
  r.clear();
  EXPECT_EQ(r.size(), 0u);
}

TEST(BlockRegistry, ForwardingKeepsTheDeviceCopy) {
  BlockRegistry r;
  BlockId a = r.add(64, Residence::kInFlightToHost);
  r.transition(a, Residence::kResident);
  EXPECT_EQ(r.device_bytes().values().current, 64);
  EXPECT_EQ(r.host_bytes().values().current, 0);
}

TEST(BlockRegistry, IllegalMovesAreRejectedAndNameBothStates) {
  BlockRegistry r;
  BlockId a = r.add(8, Residence::kResident);
  try {
    r.transition(a, Residence::kOnHost);
    FAIL();
  } catch (const logic_error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("resident"), std::string::npos);
    EXPECT_NE(m.find("on-host"), std::string::npos);
  }
  EXPECT_EQ(r.residence(a), Residence::kResident) << "a refused move changes nothing";
  r.transition(a, Residence::kReleased);
  EXPECT_THROW(r.transition(a, Residence::kResident), logic_error);
  EXPECT_THROW(r.add(8, Residence::kOnHost), logic_error);
  EXPECT_THROW(r.residence(99), logic_error);
}

TEST(BlockRegistry, ClearRefusesLiveBlocks) {
  BlockRegistry r;
  r.add(8, Residence::kResident);
  EXPECT_THROW(r.clear(), logic_error);
}

TEST(BlockRegistry, NvmeCycleCountsEachTier) {
  // Note [Block residences]: written behind, the block leaves the host tier
  // for NVMe; read ahead, it holds host staging and device memory again.
  BlockRegistry r;
  BlockId a = r.add(100, Residence::kInFlightToHost);
  r.transition(a, Residence::kOnHost);
  EXPECT_EQ(r.host_bytes().values().current, 100);
  EXPECT_EQ(r.nvme_bytes().values().current, 0);
  r.transition(a, Residence::kOnNvme);
  EXPECT_EQ(r.device_bytes().values().current, 0);
  EXPECT_EQ(r.host_bytes().values().current, 0) << "its staging went back to the pool";
  EXPECT_EQ(r.nvme_bytes().values().current, 100);
  r.transition(a, Residence::kInFlightToDevice);
  EXPECT_EQ(r.nvme_bytes().values().current, 0);
  EXPECT_EQ(r.host_bytes().values().current, 100);
  EXPECT_EQ(r.device_bytes().values().current, 100);
  r.transition(a, Residence::kResident);
  r.transition(a, Residence::kReleased);
  EXPECT_EQ(r.nvme_bytes().values().peak, 100);
  EXPECT_EQ(r.host_bytes().values().current, 0);
  EXPECT_TRUE(r.all_released());
  r.reset_peaks();
  EXPECT_EQ(r.nvme_bytes().values().peak, 0);
}

TEST(BlockRegistry, NvmeMovesThePipelineNeverMakesAreRefused) {
  BlockRegistry r;
  BlockId a = r.add(8, Residence::kResident);
  EXPECT_THROW(r.transition(a, Residence::kOnNvme), logic_error) << "the device never writes to NVMe directly";
  BlockId b = r.add(8, Residence::kInFlightToHost);
  EXPECT_THROW(r.transition(b, Residence::kOnNvme), logic_error) << "written behind only once on the host";
  r.transition(b, Residence::kOnHost);
  r.transition(b, Residence::kOnNvme);
  try {
    r.transition(b, Residence::kResident);
    ADD_FAILURE() << "a block on NVMe comes back through a read";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("on-nvme"), std::string::npos) << e.what();
  }
  EXPECT_EQ(r.residence(b), Residence::kOnNvme) << "a refused move changes nothing";
  EXPECT_EQ(r.nvme_bytes().values().current, 8);
  r.transition(b, Residence::kReleased);
  EXPECT_EQ(r.nvme_bytes().values().current, 0) << "a block released from NVMe frees its count";
  r.transition(a, Residence::kReleased);
}

TEST(BlockRegistry, FollowsEveryStagedPipelineState) {
  // residence_of maps each state of Note [Staged pipeline] to one residence,
  // and every move the pipeline makes is a legal one.
  EXPECT_EQ(residence_of(swap::StagedState::kOnDevice), Residence::kResident);
  EXPECT_EQ(residence_of(swap::StagedState::kToHost), Residence::kInFlightToHost);
  EXPECT_EQ(residence_of(swap::StagedState::kOnHost), Residence::kOnHost);
  EXPECT_EQ(residence_of(swap::StagedState::kOnNvme), Residence::kOnNvme);
  EXPECT_EQ(residence_of(swap::StagedState::kToDevice), Residence::kInFlightToDevice);
  EXPECT_EQ(residence_of(swap::StagedState::kReleased), Residence::kReleased);
  using S = swap::StagedState;
  const std::vector<std::vector<S>> paths = {
      {S::kToHost, S::kOnDevice, S::kReleased},                              // forwarded
      {S::kToHost, S::kOnHost, S::kToDevice, S::kOnDevice, S::kReleased},   // host target
      {S::kToHost, S::kOnHost, S::kOnNvme, S::kToDevice, S::kOnDevice, S::kReleased},  // NVMe target
      {S::kToHost, S::kOnHost, S::kToDevice, S::kOnDevice, S::kReleased},   // read from staging, write pending
      {S::kToHost, S::kOnHost, S::kOnNvme, S::kReleased},                   // never read back
  };
  BlockRegistry r;
  for (const auto& path : paths) {
    BlockId id = r.add(16, residence_of(path.front()));
    for (std::size_t i = 1; i < path.size(); ++i) EXPECT_NO_THROW(r.transition(id, residence_of(path[i])));
  }
  EXPECT_TRUE(r.all_released());
  EXPECT_EQ(r.nvme_bytes().values().current, 0);
}

TEST(BlockRegistry, OffDeviceMeansAReadMustFetch) {
  EXPECT_TRUE(off_device(Residence::kOnHost));
  EXPECT_TRUE(off_device(Residence::kOnNvme));
  for (Residence r : {Residence::kResident, Residence::kInFlightToHost, Residence::kInFlightToDevice,
                      Residence::kReleased})
    EXPECT_FALSE(off_device(r)) << to_string(r);
}
