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

// Issue 16: sizes parse exactly, up to the last byte a uint64_t holds, or are refused; never rounded
// through a double (llround past 2^63 made "10000000TB" 2^63 bytes).
TEST(ParseSize, ExactUpToTheLargestUint64) {
  EXPECT_EQ(parse_size("10000000TB"), 10000000000000000000ULL);
  EXPECT_EQ(parse_size("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(parse_size("18446744073709551615B"), UINT64_MAX);
  EXPECT_EQ(parse_size("16777215TiB"), 16777215ULL * TiB);
  EXPECT_EQ(parse_size("9007199254740993"), 9007199254740993ULL);  // 2^53 + 1: no double holds it
  EXPECT_EQ(parse_size("1.000000000000000001TB"), 1000000000000ULL);
  EXPECT_EQ(parse_size("0.1KiB"), 102u);   // 102.4 rounds to the nearest byte
  EXPECT_EQ(parse_size("0.5B0"), std::nullopt);
  EXPECT_EQ(parse_size("1.50000000000000000000000GiB"), 3 * GiB / 2);  // trailing zeros are exact
  EXPECT_EQ(parse_size("2.5KB"), 2500u);
  EXPECT_EQ(parse_size(".5KiB"), 512u);
  EXPECT_EQ(parse_size("5."), 5u);
}

TEST(ParseSize, RefusesWhatDoesNotFit) {
  for (const char* bad : {"18446744073709551616", "18446744073709551616B", "20000000TB", "16777216TiB",
                          "18446744073709551615.5KiB", "99999999999999999999999999999", "17179869184GiB",
                          "1.0000000000000000000001KiB"}) {
    EXPECT_FALSE(parse_size(bad).has_value()) << bad;
  }
}

TEST(ParseSize, RefusesHexSignsExponentsAndSpecials) {
  for (const char* bad : {"0x100", "0x1p10", "0X10MiB", "inf", "infinity", "-0", "+5", "1e3KiB", "1E3",
                          "nan", ".", ".KiB", "1.5.5", "1_000", "１２", "5MiB\x01"}) {
    EXPECT_FALSE(parse_size(bad).has_value()) << bad;
  }
}

TEST(ParseBudget, PercentagesAreDecimalOnly) {
  for (const char* bad : {"0x10%", "1e1%", "inf%", "nan%", "+5%", "0.0000%", "100.0001%", "5%%", "%5"}) {
    EXPECT_FALSE(parse_budget(bad).has_value()) << bad;
  }
  EXPECT_EQ(parse_budget("100.000%")->resolve(1000), 1000u);
  EXPECT_EQ(parse_budget(".5%")->resolve(1000), 5u);
}

TEST(ParseBudget, ShareOfTheLargestCapacityFits) {
  // capacity * 1.0 as a double is 2^64, which no uint64_t holds: the budget is the capacity.
  EXPECT_EQ(parse_budget("100%")->resolve(UINT64_MAX), UINT64_MAX);
  EXPECT_LE(parse_budget("99.9999%")->resolve(UINT64_MAX), UINT64_MAX);
  EXPECT_EQ(parse_budget("18446744073709551615")->resolve(0), UINT64_MAX);
}

TEST(ParseUint, DigitsOnlyWithinTheBound) {
  EXPECT_EQ(parse_uint("0"), 0u);
  EXPECT_EQ(parse_uint(" 1024 ", 1024), 1024u);
  EXPECT_EQ(parse_uint("18446744073709551615"), UINT64_MAX);
  for (const char* bad : {"", " ", "1025", "-1", "+1", "0x10", "1e3", "1.0", "18446744073709551616", "1 0"}) {
    EXPECT_FALSE(parse_uint(bad, bad == std::string("1025") ? 1024 : UINT64_MAX).has_value()) << bad;
  }
}

TEST(ParseDecimal, DecimalOnly) {
  EXPECT_EQ(parse_decimal("1.0"), 1.0);
  EXPECT_EQ(parse_decimal(" -0.5 "), -0.5);
  EXPECT_EQ(parse_decimal("+2e-3"), 2e-3);
  EXPECT_EQ(parse_decimal(".5"), 0.5);
  EXPECT_EQ(parse_decimal("5."), 5.0);
  EXPECT_EQ(parse_decimal("1E2"), 100.0);
  // strtod alone takes every one of these: 0x100 is 256 and 0x0.8p0 is 0.5.
  for (const char* bad : {"0x100", "0x0.8p0", "0X1P-2", "inf", "-inf", "infinity", "nan", "NAN(1)", "1e999",
                          "1e-999", "", ".", "e5", "1e", "1e+", "1.2.3", "1,5", "1_0", "--1", "1 e5", "١"}) {
    EXPECT_FALSE(parse_decimal(bad).has_value()) << bad;
  }
}
