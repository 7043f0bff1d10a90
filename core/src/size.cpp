#include "tierflow/core/size.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tierflow {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// A plain decimal "12", "12.5", "12.", ".5" at the start of `s`: whole and fraction digits, and the
// rest. False when there is no digit at all.
bool split_decimal(std::string_view s, std::string_view* whole, std::string_view* fraction,
                   std::string_view* rest) {
  std::size_t i = 0;
  while (i < s.size() && is_digit(s[i])) ++i;
  *whole = s.substr(0, i);
  *fraction = {};
  if (i < s.size() && s[i] == '.') {
    std::size_t b = ++i;
    while (i < s.size() && is_digit(s[i])) ++i;
    *fraction = s.substr(b, i - b);
  }
  *rest = s.substr(i);
  return !whole->empty() || !fraction->empty();
}

// Digits to an integer; nullopt past 64 bits.
std::optional<std::uint64_t> digits_value(std::string_view digits) {
  std::uint64_t v = 0;
  for (char c : digits) {
    if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, static_cast<unsigned>(c - '0'), &v))
      return std::nullopt;
  }
  return v;
}

std::optional<std::uint64_t> unit_multiplier(std::string_view unit) {
  struct Unit { std::string_view name; std::uint64_t mult; };
  static constexpr Unit kUnits[] = {
      {"", 1},          {"B", 1},
      {"KiB", KiB},     {"MiB", MiB},           {"GiB", GiB},
      {"TiB", TiB},     {"KB", 1000ULL},        {"MB", 1000ULL * 1000},
      {"GB", 1000ULL * 1000 * 1000},            {"TB", 1000ULL * 1000 * 1000 * 1000},
  };
  for (const auto& u : kUnits) {
    if (u.name.size() != unit.size()) continue;
    bool same = true;
    for (std::size_t i = 0; i < unit.size() && same; ++i) {
      same = std::tolower(static_cast<unsigned char>(u.name[i])) ==
             std::tolower(static_cast<unsigned char>(unit[i]));
    }
    if (same) return u.mult;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::uint64_t> parse_size(std::string_view text) {
  std::string_view whole, fraction, rest;
  if (!split_decimal(trim(text), &whole, &fraction, &rest)) return std::nullopt;
  auto mult = unit_multiplier(trim(rest));
  if (!mult) return std::nullopt;
  while (!fraction.empty() && fraction.back() == '0') fraction.remove_suffix(1);
  // A fractional byte count ("1.5B") is a mistake, not something to round; past 19 digits the
  // fraction no longer fits the exact arithmetic below (and nobody means it).
  if (!fraction.empty() && (*mult == 1 || fraction.size() > 19)) return std::nullopt;
  auto w = digits_value(whole);
  std::uint64_t bytes = 0;
  if (!w || __builtin_mul_overflow(*w, *mult, &bytes)) return std::nullopt;
  if (!fraction.empty()) {
    // fraction * mult / 10^k, rounded to the nearest byte, in exact integer arithmetic (< 2^104).
    unsigned __int128 scale = 1;
    for (std::size_t i = 0; i < fraction.size(); ++i) scale *= 10;
    const unsigned __int128 part = static_cast<unsigned __int128>(*digits_value(fraction)) * *mult;
    std::uint64_t q = static_cast<std::uint64_t>(part / scale);
    if (2 * (part % scale) >= scale) ++q;
    if (__builtin_add_overflow(bytes, q, &bytes)) return std::nullopt;
  }
  return bytes;
}

std::optional<std::uint64_t> parse_uint(std::string_view text, std::uint64_t max) {
  std::string_view s = trim(text);
  if (s.empty()) return std::nullopt;
  for (char c : s)
    if (!is_digit(c)) return std::nullopt;
  auto v = digits_value(s);
  if (!v || *v > max) return std::nullopt;
  return v;
}

std::optional<double> parse_decimal(std::string_view text) {
  std::string_view s = trim(text);
  std::string_view sign = s;
  if (!s.empty() && (s.front() == '+' || s.front() == '-')) s.remove_prefix(1);
  std::string_view whole, fraction, rest;
  if (!split_decimal(s, &whole, &fraction, &rest)) return std::nullopt;
  if (!rest.empty()) {
    if (rest.front() != 'e' && rest.front() != 'E') return std::nullopt;
    rest.remove_prefix(1);
    if (!rest.empty() && (rest.front() == '+' || rest.front() == '-')) rest.remove_prefix(1);
    if (rest.empty()) return std::nullopt;
    for (char c : rest)
      if (!is_digit(c)) return std::nullopt;
  }
  // Only decimal digits, a point, a sign and an exponent are left: strtod reads exactly that (the
  // "C" locale's point: tierflow never changes LC_NUMERIC), and says ERANGE past a double's range.
  std::string num(sign.front() == '+' ? sign.substr(1) : sign);
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<Budget> parse_budget(std::string_view text) {
  std::string_view s = trim(text);
  if (!s.empty() && s.back() == '%') {
    std::string_view whole, fraction, rest;
    if (!split_decimal(trim(s.substr(0, s.size() - 1)), &whole, &fraction, &rest) || !rest.empty())
      return std::nullopt;
    const double value = *parse_decimal(trim(s.substr(0, s.size() - 1)));
    if (!(value > 0.0 && value <= 100.0)) return std::nullopt;
    Budget b;
    b.is_fraction = true;
    b.fraction = value / 100.0;
    return b;
  }
  auto bytes = parse_size(s);
  if (!bytes) return std::nullopt;
  Budget b;
  b.bytes = *bytes;
  return b;
}

std::uint64_t Budget::resolve(std::uint64_t capacity_bytes) const noexcept {
  if (!is_fraction) return bytes;
  const double share = static_cast<double>(capacity_bytes) * fraction;
  // A capacity near 2^64 rounds up to 2^64 as a double, which no uint64_t holds.
  if (share >= static_cast<double>(capacity_bytes)) return capacity_bytes;
  return static_cast<std::uint64_t>(share);
}

std::string Budget::to_string() const {
  if (!is_fraction) return std::to_string(bytes);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", fraction * 100.0);
  return buf;
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kNames[u]);
  }
  return buf;
}

}  // namespace tierflow
