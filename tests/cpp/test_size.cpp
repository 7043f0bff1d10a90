#include <gtest/gtest.h>

#include "tierflow/core/size.hpp"

using namespace tierflow;

TEST(ParseSize, AcceptsBareBytesAndUnits) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("512MiB"), 512 * MiB);
  EXPECT_EQ(parse_size("1.5GiB"), 3 * GiB / 2);
  EXPECT_EQ(parse_size("2KB"), 2000u);
  EXPECT_EQ(parse_size("3 MB"), 3000000u);
  EXPECT_EQ(parse_size("1TiB"), TiB);
  EXPECT_EQ(parse_size("64kib"), 64 * KiB);  // units are case-insensitive
  EXPECT_EQ(parse_size("  7B "), 7u);
}

TEST(ParseSize, RejectsMalformed) {
  for (const char* bad : {"", "MiB", "-1", "1.5", "1.5B", "12XB", "1..2GiB", "1e3", "nan", "GiB1",
                          "1 2", "99999999999TiB"}) {
    EXPECT_FALSE(parse_size(bad).has_value()) << bad;
  }
}

TEST(ParseBudget, PercentAndSize) {
  auto b = parse_budget("80%");
  ASSERT_TRUE(b);
  EXPECT_TRUE(b->is_fraction);
  EXPECT_EQ(b->resolve(1000), 800u);
  auto s = parse_budget("1GiB");
  ASSERT_TRUE(s);
  EXPECT_FALSE(s->is_fraction);
  EXPECT_EQ(s->resolve(12345), GiB);
  EXPECT_EQ(parse_budget("100%")->resolve(77), 77u);
  EXPECT_EQ(parse_budget("12.5%")->resolve(800), 100u);
}

TEST(ParseBudget, RejectsOutOfRangePercent) {
  for (const char* bad : {"0%", "101%", "-5%", "%", "5MiB%", "abc%"}) {
    EXPECT_FALSE(parse_budget(bad).has_value()) << bad;
  }
}

TEST(ParseBudget, TextRoundTrips) {
  for (const char* text : {"80%", "12.5%", "4096", "1GiB"}) {
    auto b = parse_budget(text);
    ASSERT_TRUE(b) << text;
    auto again = parse_budget(b->to_string());
    ASSERT_TRUE(again) << b->to_string();
    EXPECT_EQ(again->resolve(1 << 30), b->resolve(1 << 30)) << text;
  }
}

TEST(FormatBytes, Readable) {
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3 * GiB / 2), "1.50 GiB");
}
