// Thread-safe statistics counters, in the c10 allocator's shape.
#pragma once

#include <atomic>
#include <cstdint>

namespace tierflow {

/// Snapshot of a Stat.
struct StatValues {
  std::int64_t current = 0;    ///< bytes (or items) held now
  std::int64_t peak = 0;       ///< highest `current` since the last reset_peak()
  std::int64_t allocated = 0;  ///< total ever added
  std::int64_t freed = 0;      ///< total ever removed
};

/// current / peak / allocated / freed, updated lock-free from any thread.
class Stat {
 public:
  /// Adds `amount` to current and allocated, raising peak if needed.
  void increase(std::int64_t amount) noexcept {
    std::int64_t now = current_.fetch_add(amount, std::memory_order_relaxed) + amount;
    allocated_.fetch_add(amount, std::memory_order_relaxed);
    std::int64_t p = peak_.load(std::memory_order_relaxed);
    while (now > p && !peak_.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
    }
  }
  /// Removes `amount` from current and adds it to freed.
  void decrease(std::int64_t amount) noexcept {
    current_.fetch_sub(amount, std::memory_order_relaxed);
    freed_.fetch_add(amount, std::memory_order_relaxed);
  }
  /// Sets peak to current.
  void reset_peak() noexcept { peak_.store(current_.load(std::memory_order_relaxed)); }
  /// Consistent-enough snapshot for reporting.
  StatValues values() const noexcept {
    return {current_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocated_.load(std::memory_order_relaxed), freed_.load(std::memory_order_relaxed)};
  }

 private:
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocated_{0};
  std::atomic<std::int64_t> freed_{0};
};

/// A monotonically increasing count (operations, bytes moved, nanoseconds).
class Counter {
 public:
  /// Adds `n`.
  void add(std::uint64_t n = 1) noexcept { v_.fetch_add(n, std::memory_order_relaxed); }
  /// Current total.
  std::uint64_t value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> v_{0};
};

}  // namespace tierflow

namespace tierflow {

/// One exported field of a statistics struct T (Note [Stat fields]): its name
/// in reports and tierflow's stats dicts, the member it reads, and a unit
/// change (0: the member's value as it is; otherwise a double, the member
/// times `scale`, e.g. 1e-6 for a nanosecond count reported in milliseconds).
//
// Note [Stat fields]
// ~~~~~~~~~~~~~~~~~~
// Each statistics struct has one table of its exported fields beside it
// (e.g. grad_stream_stat_fields()); the Python dicts, the report and the
// tests read the table, so a counter added to the struct and its table shows
// up everywhere, and a name is written once.
template <class T>
struct StatField {
  const char* name;
  std::uint64_t T::*count = nullptr;  ///< a count, or
  double T::*value = nullptr;         ///< ... a measured value
  double scale = 0.0;
  /// The field of `s` as a double (for the tests and the report).
  double of(const T& s) const noexcept {
    const double v = count ? static_cast<double>(s.*count) : s.*value;
    return scale != 0.0 ? v * scale : v;
  }
};

}  // namespace tierflow
