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
