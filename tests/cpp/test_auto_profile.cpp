// auto's profile to JSON and back (tiering::auto_profile_json, auto_profile_from_json; Note [Profile file]).
#include <gtest/gtest.h>

#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/plan_driver.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {
AutoProfile measured() {
  AutoProfile p;
  BlockProfile b;
  b.forward_seconds = 0.5;
  b.backward_seconds = 1.25;
  b.input_bytes = 1000;
  b.whole_bytes = 4000;
  p.file.blocks = {b, b};
  p.file.links.d2h = 10e9;
  p.file.links.h2d = 12e9;
  p.file.links.duplex = 15e9;
  p.file.fixed_device_bytes = 123;
  p.file.outside_saved_bytes = 77;
  p.file.outside_largest_bytes = 33;
  p.outside_measured = true;
  p.batch_tensor_elements = InputElements{{"z", 8}, {"a", 16}};
  p.batch_elements = 24;
  p.timed_step_seconds = 3.5;
  p.measured_peak_bytes = 999;
  p.calibrated = ProfileCalibration{1.5, 0.75, "the steps ran slower"};
  return p;
}
}  // namespace

TEST(AutoProfileJson, WhatIsWrittenReadsBackTheSame) {
  const AutoProfile p = measured();
  const AutoProfile back = auto_profile_from_json(auto_profile_json(p));
  ASSERT_EQ(back.file.blocks.size(), 2u);
  EXPECT_DOUBLE_EQ(back.file.blocks[1].backward_seconds, 1.25);
  EXPECT_EQ(back.file.blocks[1].whole_bytes, 4000u);
  EXPECT_DOUBLE_EQ(back.file.links.duplex, 15e9);
  EXPECT_EQ(back.file.fixed_device_bytes, 123u);
  EXPECT_TRUE(back.outside_measured);
  EXPECT_EQ(back.file.outside_saved_bytes, 77u);
  EXPECT_EQ(back.file.outside_largest_bytes, 33u);
  ASSERT_TRUE(back.batch_tensor_elements);
  EXPECT_EQ(*back.batch_tensor_elements, (InputElements{{"z", 8}, {"a", 16}}));  // call order, not sorted
  EXPECT_EQ(back.batch_elements, 24u);
  EXPECT_EQ(back.timed_step_seconds, 3.5);
  EXPECT_FALSE(back.host_gaps_seconds);
  EXPECT_EQ(back.measured_peak_bytes, 999u);
  ASSERT_TRUE(back.calibrated);
  EXPECT_DOUBLE_EQ(back.calibrated->link_factor, 1.5);
  EXPECT_DOUBLE_EQ(back.calibrated->compute_factor, 0.75);
  EXPECT_EQ(back.calibrated->why, "the steps ran slower");
  EXPECT_DOUBLE_EQ(back.batch_ratio, 1.0);  // never written
  EXPECT_EQ(auto_profile_json(back), auto_profile_json(p));
}

TEST(AutoProfileJson, AnOlderFileGetsTheEstimatesAndLeavesTheOutsideUnmeasured) {
  const AutoProfile p = auto_profile_from_json(
      R"({"blocks": [{"forward_seconds": 0.5, "input_bytes": 10}], "links": {"d2h": 1e9, "h2d": 3e9},
          "outside_largest_bytes": 5})");
  EXPECT_DOUBLE_EQ(p.file.blocks[0].backward_seconds, 0.5 * kBackwardPerForward);  // the planner's estimate
  EXPECT_DOUBLE_EQ(p.file.links.duplex, 4e9);                                       // both directions' sum
  EXPECT_FALSE(p.outside_measured);
  EXPECT_EQ(p.file.outside_largest_bytes, 0u);  // counted only where outside_saved_bytes is
  EXPECT_FALSE(p.batch_tensor_elements);
  EXPECT_FALSE(p.calibrated);
}

TEST(AutoProfileJson, ABadProfileIsRefusedSayingWhat) {
  try {
    auto_profile_from_json(R"({"blocks": [{"forward_seconds": 0.5, "colour": 1}]})");
    FAIL() << "a block with an unknown field was read";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("colour"), std::string::npos) << e.what();
  }
  EXPECT_THROW(auto_profile_from_json("{"), config_error);
}
