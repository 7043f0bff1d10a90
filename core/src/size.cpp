#include "tierflow/core/size.hpp"

#include <cctype>
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

// Splits "1.5GiB" into the number "1.5" and the unit "GiB".
bool split_number(std::string_view s, double* value, std::string_view* unit) {
  std::size_t i = 0;
  bool digits = false, dot = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits = true;
    } else if (c == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (!digits) return false;
  std::string num(s.substr(0, i));
  char* end = nullptr;
  *value = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size()) return false;
  *unit = trim(s.substr(i));
  return true;
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
  std::string_view s = trim(text);
  double value = 0;
  std::string_view unit;
  if (!split_number(s, &value, &unit)) return std::nullopt;
  auto mult = unit_multiplier(unit);
  if (!mult) return std::nullopt;
  double bytes = value * static_cast<double>(*mult);
  if (!std::isfinite(bytes) || bytes > 1.8e19) return std::nullopt;
  // A fractional byte count ("1.5B") is a mistake, not something to round.
  if (*mult == 1 && value != std::floor(value)) return std::nullopt;
  return static_cast<std::uint64_t>(std::llround(bytes));
}

std::optional<Budget> parse_budget(std::string_view text) {
  std::string_view s = trim(text);
  if (!s.empty() && s.back() == '%') {
    double value = 0;
    std::string_view unit;
    if (!split_number(trim(s.substr(0, s.size() - 1)), &value, &unit) || !unit.empty())
      return std::nullopt;
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
  return static_cast<std::uint64_t>(static_cast<double>(capacity_bytes) * fraction);
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
