// Byte sizes with units, and memory budgets that may be a share of capacity.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tierflow {

inline constexpr std::uint64_t KiB = 1024ULL;
inline constexpr std::uint64_t MiB = 1024ULL * KiB;
inline constexpr std::uint64_t GiB = 1024ULL * MiB;
inline constexpr std::uint64_t TiB = 1024ULL * GiB;

/// Accepted size forms, quoted in every parse error.
inline constexpr std::string_view kSizeForms =
    "a byte count with an optional unit B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB "
    "(powers of 1000), e.g. 4096, 512MiB, 1.5GiB";

/// Parses "4096", "512MiB", "1.5GiB", "2GB" exactly (decimal digits only: no sign, exponent or hex; a
/// fraction times its unit is rounded to the nearest byte, a fraction of a byte is refused); nullopt when
/// malformed or when the bytes do not fit in 64 bits (at most 18446744073709551615).
std::optional<std::uint64_t> parse_size(std::string_view text);

/// Parses a decimal integer (digits only, surrounding spaces allowed: no sign, exponent or hex) of at most
/// `max`; nullopt when malformed or larger.
std::optional<std::uint64_t> parse_uint(std::string_view text, std::uint64_t max = UINT64_MAX);

/// Parses a finite decimal number: an optional sign, digits with an optional point, an optional exponent
/// (1, -0.5, .5, 2e-3). No hex, inf or nan; nullopt when malformed or out of the range of a double.
std::optional<double> parse_decimal(std::string_view text);

/// A memory budget: an absolute byte count or a percentage of the tier's capacity.
struct Budget {
  std::uint64_t bytes = 0;        ///< absolute size when !is_fraction
  double fraction = 0.0;          ///< in (0, 1] when is_fraction
  bool is_fraction = false;       ///< true for "80%"

  /// Bytes this budget grants on a tier of the given capacity (a percentage rounds down, never past it).
  std::uint64_t resolve(std::uint64_t capacity_bytes) const noexcept;
  /// Text form that parses back to the same budget.
  std::string to_string() const;
};

/// Parses a size or a percentage in (0, 100]; nullopt when malformed.
std::optional<Budget> parse_budget(std::string_view text);

/// Human-readable size ("1.50 GiB", "512.00 KiB", "17 B").
std::string format_bytes(std::uint64_t bytes);

}  // namespace tierflow
