// The profile file (Note [Profile file]): its text round-trips, and a bad file is refused with one line naming
// the field and showing the value as Python's json and repr show it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/profile_file.hpp"

using namespace tierflow::tiering;

namespace {

std::string refusal(const std::string& text) {
  try {
    profile_from_json(text);
  } catch (const tierflow::config_error& e) {
    return e.what();
  }
  return "accepted";
}

// A one-block file with `block` as its block's fields and `rest` after the blocks.
std::string file(const std::string& block, const std::string& rest = "") {
  return R"({"format": "tierflow-profile", "version": 1, "blocks": [{"input_bytes": 1)" +
         (block.empty() ? "" : ", " + block) + "}]" + rest + "}";
}

}  // namespace

TEST(ProfileFile, RoundTrips) {
  BlockProfile b;
  b.forward_seconds = 0.125;
  b.backward_seconds = 0.25;
  b.input_bytes = 1 << 20;
  b.cheap_bytes = (1ULL << 63) + 1;
  b.splittable = false;
  Links links;
  links.d2h = 2e10;
  links.h2d = 22e9;
  links.compute_share_during_copies = 0.875;
  const auto again = profile_from_json(profile_to_json({b, b}, links, 3ULL << 30));
  EXPECT_EQ(again.links.compute_share_during_copies, 0.875);
  EXPECT_EQ(again.links.copy_share_during_cpu_step, 1.0);
  ASSERT_EQ(again.blocks.size(), 2u);
  EXPECT_EQ(again.blocks[1].cheap_bytes, b.cheap_bytes);
  EXPECT_EQ(again.blocks[0].backward_seconds, 0.25);
  EXPECT_FALSE(again.blocks[0].splittable);
  EXPECT_EQ(again.links.h2d, 22e9);
  EXPECT_EQ(again.fixed_device_bytes, 3ULL << 30);
}

TEST(ProfileFile, MissingFieldsTakeTheirDefaults) {
  const auto p = profile_from_json(R"({"blocks": [{"input_bytes": 7}], "measured_peak_bytes": 5})");
  EXPECT_EQ(p.blocks[0].input_bytes, 7u);
  EXPECT_EQ(p.blocks[0].forward_seconds, 0);
  EXPECT_EQ(p.fixed_device_bytes, 0u);
  EXPECT_EQ(p.outside_saved_bytes, 0u);
  EXPECT_EQ(p.outside_largest_bytes, 0u) << "a file from before it was measured: not counted";
}

// auto's measurement of the tensors saved outside the blocks, the largest of them (their host staging on the way
// to NVMe, Budgets::outside_largest_bytes) too: read back, and checked as every byte count is.
TEST(ProfileFile, TheTensorsOutsideTheBlocksAndTheLargestOfThemAreReadBack) {
  const auto p = profile_from_json(file("", R"(, "outside_saved_bytes": 5000, "outside_largest_bytes": 4096)"));
  EXPECT_EQ(p.outside_saved_bytes, 5000u);
  EXPECT_EQ(p.outside_largest_bytes, 4096u);
  EXPECT_EQ(refusal(file("", R"(, "outside_largest_bytes": -1)")),
            "profile: outside_largest_bytes -1 is not valid; accepted: an integer from 0 to 2^64 - 1");
}

TEST(ProfileFile, ValuesAreShownAsPythonShowsThem) {
  const std::string bad = " is not valid; accepted: ";
  EXPECT_EQ(refusal(file(R"("forward_seconds": -1.0)")), "profile: block 0 forward_seconds -1.0" + bad +
                                                             "a finite number >= 0");
  EXPECT_EQ(refusal(file(R"("backward_seconds": NaN)")), "profile: block 0 backward_seconds nan" + bad +
                                                             "a finite number >= 0");
  EXPECT_EQ(refusal(file(R"("split_recompute_seconds": Infinity)")),
            "profile: block 0 split_recompute_seconds inf" + bad + "a finite number >= 0");
  EXPECT_EQ(refusal(file("", R"(, "links": {"h2d": -5.0})")), "profile: links h2d -5.0" + bad + "a finite number >= 0");
  EXPECT_EQ(refusal(file("", R"(, "links": {"d2h": -Infinity})")), "profile: links d2h -inf" + bad +
                                                                        "a finite number >= 0");
  // The measured shares are fractions of a speed: 0 would stop the device, above 1 is not a share.
  for (const char* v : {"0.0", "1.5"})
    EXPECT_EQ(refusal(file("", std::string(R"(, "links": {"compute_share_during_copies": )") + v + "}")),
              std::string("profile: links compute_share_during_copies ") + v + bad + "a fraction in (0, 1]");
  EXPECT_EQ(refusal(file("", R"(, "links": {"copy_share_during_cpu_step": -1.0})")),
            "profile: links copy_share_during_cpu_step -1.0" + bad + "a fraction in (0, 1]");
  const std::string integer = "an integer from 0 to 2^64 - 1";
  EXPECT_EQ(refusal(file("", R"(, "fixed_device_bytes": -5)")), "profile: fixed_device_bytes -5" + bad + integer);
  EXPECT_EQ(refusal(file("", R"(, "fixed_device_bytes": 1e30)")), "profile: fixed_device_bytes 1e+30" + bad + integer);
  EXPECT_EQ(refusal(file("", R"(, "fixed_device_bytes": 18446744073709551616)")),
            "profile: fixed_device_bytes 18446744073709551616" + bad + integer);
  EXPECT_EQ(refusal(file(R"("whole_bytes": 2.0)")), "profile: block 0 whole_bytes 2.0" + bad + integer);
  EXPECT_EQ(refusal(file(R"("whole_bytes": "12")")), "profile: block 0 whole_bytes '12'" + bad + integer);
  EXPECT_EQ(refusal(file(R"("whole_bytes": null)")), "profile: block 0 whole_bytes None" + bad + integer);
  EXPECT_EQ(refusal(file(R"("whole_bytes": [1, true])")), "profile: block 0 whole_bytes [1, True]" + bad + integer);
  EXPECT_EQ(refusal(file(R"("splittable": 1)")), "profile: block 0 splittable 1" + bad + "true or false");
  EXPECT_EQ(refusal(file(R"("forward_seconds": ")" + std::string(50, 'x') + "\"")),
            "profile: block 0 forward_seconds '" + std::string(36, 'x') + "..." + bad + "a finite number >= 0");
  // Integers of any size are numbers: a time of 10^30 seconds is finite.
  EXPECT_EQ(profile_from_json(file(R"("forward_seconds": 1000000000000000000000000000000)")).blocks[0].forward_seconds,
            1e30);
}

TEST(ProfileFile, ShapesAndCountsAreRefused) {
  const std::string fields = "['forward_seconds', 'backward_seconds', 'input_bytes', 'whole_bytes', 'split_bytes', "
                             "'split_recompute_seconds', 'cheap_bytes', 'cheap_recompute_seconds', 'splittable', "
                             "'transient_bytes', 'upload_bytes', 'download_bytes', 'parameter_bytes', 'replayable']";
  const std::string shape = "profile: expected an object with a non-empty \"blocks\" list";
  EXPECT_EQ(refusal("[]"), shape);
  EXPECT_EQ(refusal(R"({"blocks": []})"), shape);
  EXPECT_EQ(refusal(R"({"blocks": [1]})"), "profile: block 0 is not an object; accepted: an object of " + fields);
  EXPECT_EQ(refusal(R"({"blocks": [{"forward_secs": 1, "a": 2}]})"),
            "profile: block 0 has unknown fields ['a', 'forward_secs']; known: " + fields);
  EXPECT_EQ(refusal(R"({"blocks": [{}], "links": []})"),
            "profile: links is not an object; accepted: an object of ['d2h', 'h2d', 'duplex', 'nvme_write', 'nvme_read', "
            "'compute_share_during_copies', 'copy_share_during_cpu_step']");
  EXPECT_EQ(refusal(R"({"blocks": [{}], "version": 99})"),
            "profile: format None version 99 is not 'tierflow-profile' version 1");
  EXPECT_EQ(refusal(R"({"blocks": [{}], "version": 1.0, "format": "tierflow-profile"})"), "accepted");
  std::string many = R"({"blocks": [{})";
  for (int i = 0; i < 10000; ++i) many += ", {}";
  EXPECT_EQ(refusal(many + "]}"), "profile: 10001 blocks is not valid; accepted: 1 to 10000 blocks");
  EXPECT_EQ(refusal(R"({"blocks": [{}]]]])").rfind("profile: not JSON (", 0), 0u);
  EXPECT_EQ(refusal(std::string(100000, '[')).rfind("profile: not JSON (", 0), 0u);
  EXPECT_EQ(refusal(R"({"blocks": [{"input_bytes": NaNx}]})").rfind("profile: not JSON (", 0), 0u);
}

TEST(ProfileFile, AutoReadsBackAProfileOfItsModelOnly) {
  const std::string text = file("");
  EXPECT_EQ(profile_for_model("p.json", text, 1).blocks.size(), 1u);
  try {
    profile_for_model("p.json", text, 2);
    FAIL();
  } catch (const tierflow::config_error& e) {
    EXPECT_STREQ(e.what(), "TIERFLOW_PROFILE=p.json: profiles 1 blocks, the model has 2 (delete it to measure again)");
  }
  try {
    profile_for_model("p.json", R"({"version": 99})", 1);
    FAIL();
  } catch (const tierflow::config_error& e) {
    EXPECT_STREQ(e.what(), "TIERFLOW_PROFILE=p.json: not a tierflow profile (profile: expected an object with a "
                           "non-empty \"blocks\" list); delete it to measure again");
  }
}

TEST(ProfileFile, FloatsAreWrittenAsPythonsRepr) {
  EXPECT_EQ(python_float_repr(1.0), "1.0");
  EXPECT_EQ(python_float_repr(-0.5), "-0.5");
  EXPECT_EQ(python_float_repr(1e30), "1e+30");
  EXPECT_EQ(python_float_repr(1e16), "1e+16");
  EXPECT_EQ(python_float_repr(1234567890123456.0), "1234567890123456.0");
  EXPECT_EQ(python_float_repr(0.0001), "0.0001");
  EXPECT_EQ(python_float_repr(0.00001), "1e-05");
  EXPECT_EQ(python_float_repr(0.1), "0.1");
}
