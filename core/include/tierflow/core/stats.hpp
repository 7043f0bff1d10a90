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

/// current / peak / allocated / freed, updated lock-free from any thread, and a window peak (Note [Window
/// peak]).
//
// Note [Window peak]
// ~~~~~~~~~~~~~~~~~~
// peak is the highest `current` since the last reset_peak(), which a report
// keeps for the whole run. A reader that wants the highest `current` of an
// interval (a training step: Note [Step stats]) takes the window peak at each
// of its boundaries: take_window_peak() returns the highest `current` since
// the previous take (or since construction), the value at that take
// included, and starts the next window at `current`. increase() raises it
// as it raises peak (one relaxed load when it is not beaten); decrease() does
// not touch it. One reader per Stat: two readers would each see the part of
// the interval since the other's take.
class Stat {
 public:
  /// Adds `amount` to current and allocated, raising peak and the window peak if needed.
  void increase(std::int64_t amount) noexcept {
    std::int64_t now = current_.fetch_add(amount, std::memory_order_relaxed) + amount;
    allocated_.fetch_add(amount, std::memory_order_relaxed);
    raise(peak_, now);
    raise(window_peak_, now);
  }
  /// Removes `amount` from current and adds it to freed.
  void decrease(std::int64_t amount) noexcept {
    current_.fetch_sub(amount, std::memory_order_relaxed);
    freed_.fetch_add(amount, std::memory_order_relaxed);
  }
  /// Sets peak to current (the window peak is not affected).
  void reset_peak() noexcept { peak_.store(current_.load(std::memory_order_relaxed)); }
  /// The highest `current` since the previous take_window_peak() (or construction), `current` now included; the
  /// next window starts at `current` (Note [Window peak]).
  std::int64_t take_window_peak() noexcept {
    const std::int64_t at_start = current_.load(std::memory_order_acquire);
    const std::int64_t w = window_peak_.exchange(at_start, std::memory_order_acq_rel);
    // An increase between the two lines raised the old window (it is counted there) and may have been overwritten
    // by at_start: the next window starts at current as read now, not lower.
    raise(window_peak_, current_.load(std::memory_order_acquire));
    return w > at_start ? w : at_start;
  }
  /// Consistent-enough snapshot for reporting.
  StatValues values() const noexcept {
    return {current_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocated_.load(std::memory_order_relaxed), freed_.load(std::memory_order_relaxed)};
  }

 private:
  static void raise(std::atomic<std::int64_t>& to, std::int64_t now) noexcept {
    std::int64_t p = to.load(std::memory_order_relaxed);
    while (now > p && !to.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
    }
  }

  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> window_peak_{0};
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
