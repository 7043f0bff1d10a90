// Waits that end: asynchronous work in flight, and the error of a wait past
// TIERFLOW_STALL_TIMEOUT (Note [Stall timeout]).
//
// Note [Stall timeout]
// ~~~~~~~~~~~~~~~~~~~~
// A copy, an NVMe request or a CPU optimizer step that never completes would
// hang training with no word. Every piece of such work registers itself as
// `PendingWork` while in flight (what it is, its bytes, since when), and every
// wait on it waits at most stall_timeout() seconds (TIERFLOW_STALL_TIMEOUT,
// e.g. 10 minutes, which no healthy step comes near; none, the default for
// now: see kDefaultStallTimeout). A wait
// past it throws `stall_error` naming what it waited for, how long, and up to
// kStallListed other pieces of work in flight, oldest first, with their ages:
// the copy stuck behind a hung driver, the NVMe request behind a dead disk.
// The work itself is not cancelled (neither a CUDA event nor a submitted
// libaio request can be); the error says so, and the run should end.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace tierflow {

/// A wait on asynchronous work lasted longer than TIERFLOW_STALL_TIMEOUT.
class stall_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Seconds a wait may last (TIERFLOW_STALL_TIMEOUT); 0 or less: no limit. Process-wide; stall_timeout() is 0
/// within an UnlimitedWaits scope.
void set_stall_timeout(double seconds) noexcept;
double stall_timeout() noexcept;
/// The default: no limit, for now. A review found waits that catch every error and go on (the pinned pool's
/// allocation, the step engine's and the NVMe optimizer's settling, parameter releases): a stall there would
/// be swallowed or free memory a copy still writes. Until each lets a stall through, the limit is asked for.
inline constexpr double kDefaultStallTimeout = 0.0;
/// At most this many other pieces of work are listed in a stall's error.
inline constexpr std::size_t kStallListed = 8;

/// One piece of asynchronous work while it is in flight: registered from construction until done() (or
/// destruction). `kind` must outlive it (a string literal: "device -> host copy", "NVMe read", ...).
class PendingWork {
 public:
  PendingWork(const char* kind, std::uint64_t bytes, std::int64_t id = -1) noexcept;
  ~PendingWork();
  PendingWork(const PendingWork&) = delete;
  PendingWork& operator=(const PendingWork&) = delete;

  /// No longer in flight (idempotent).
  void done() noexcept;
  /// "NVMe read of 4.00 MiB (block 12), 3.2 s old".
  std::string describe() const;
  /// Throws stall_error for a wait on this work that lasted `waited_seconds`.
  [[noreturn]] void stalled(double waited_seconds) const;

  /// What is in flight now, oldest first: descriptions with their ages (at most `max`).
  static std::vector<std::string> in_flight(std::size_t max);

 private:
  friend struct PendingRegistry;
  const char* kind_;
  std::uint64_t bytes_;
  std::int64_t id_;
  std::chrono::steady_clock::time_point since_;
  PendingWork* prev_ = nullptr;
  PendingWork* next_ = nullptr;
  bool listed_ = false;
};

/// Throws stall_error for a wait of `waited_seconds` on the work `description` names ("a host -> device copy of
/// 4.00 MiB, 601 s old"), listing the work in flight.
[[noreturn]] void throw_stall(const std::string& description, double waited_seconds);

/// Within its scope this thread's waits have no limit: teardown that must not free memory a copy may still
/// read or write waits for it, however long (the wait that first stalled has raised already).
class UnlimitedWaits {
 public:
  UnlimitedWaits() noexcept;
  ~UnlimitedWaits();
  UnlimitedWaits(const UnlimitedWaits&) = delete;
  UnlimitedWaits& operator=(const UnlimitedWaits&) = delete;

 private:
  bool before_;
};

/// The deadline of a wait that starts now (time_point::max() without a limit).
std::chrono::steady_clock::time_point stall_deadline() noexcept;

}  // namespace tierflow
