// Waits that end: asynchronous work in flight, and the error of a wait past
// TIERFLOW_STALL_TIMEOUT (Note [Stall timeout]).
//
// Note [Stall timeout]
// ~~~~~~~~~~~~~~~~~~~~
// A copy, an NVMe request or a CPU optimizer step that never completes would
// hang training with no word. Every piece of such work registers itself as
// `PendingWork` while in flight (what it is, its bytes, since when): the
// emulated device's copies, CUDA copies (their events), NVMe requests and the
// CPU optimizer's buckets on its worker. Every wait on it ends at most
// stall_timeout() seconds after the WORK started (its PendingWork's since(),
// not the wait's start: a copy already 9 minutes old gets one more minute,
// and a second wait on a copy that stalled raises at once).
// TIERFLOW_STALL_TIMEOUT, default 10min (kDefaultStallTimeout), which no
// healthy step comes near; `none` (or 0) for no limit; under a second is
// refused (a loaded machine's copy can take that long). A wait past it throws
// `stall_error` (tierflow._C.StallError, a TimeoutError) naming what it
// waited for, how long, and up to kStallListed other pieces of work in
// flight, oldest first, with their ages: the copy stuck behind a hung driver,
// the NVMe request behind a dead disk. The work itself is not cancelled
// (neither a CUDA event nor a submitted libaio request can be); the error
// says so, and the run should end.
//
// Rules for a wait on such work:
// - A wait that catches errors lets stall_error through (catch it first and
//   rethrow): a stall is never taken for a failed copy (whose memory may be
//   reused) nor for a lack of memory (the pinned pool's allocation, the
//   staged pipeline's staging), and the NVMe optimizer never releases or
//   reuses the block or buffer of a stalled request.
// - Where it cannot raise (a release, a destructor), the memory the work may
//   still read or write is kept: parked (freed by a later poll once the work
//   ends) or, at teardown, kept for good (keep_forever, one warning naming
//   it); the stall is raised by the next call that can. After any stall
//   (stall_seen()) the pinned pool's destructor keeps the slabs that still
//   hold blocks instead of freeing them.
// - Teardown waits with the limit too (from the work's start, so what
//   stalled already is given up at once): a truly hung device does not hang
//   the exit. UnlimitedWaits is for a wait that must end before memory goes
//   and has nowhere to keep it.
// - The limit is process-wide (a wait deep in an engine, the pool or the
//   optimizer's worker has no runtime to ask). A Runtime claims it with a
//   StallTimeoutClaim while it lives: a second Runtime with a different
//   TIERFLOW_STALL_TIMEOUT / stall_timeout= while the first lives is refused
//   with a config_error naming both values, rather than silently changing the
//   first one's limit; the same value, or any once the first is gone, is fine.
//   bindings/src/runtime.cpp holds the claim (Runtime::stall_claim_); the plan
//   command's runtime, made only to measure the links, takes the limit of a
//   wrapped model alive in the process (cli/plan.py measure_links).
// - A stall ends training at the limit of the OLDEST work in flight, not of
//   whatever is waited on next: a wait ends at the oldest work's deadline too
//   (oldest_deadline()), and the calls that can raise (the staged pipeline's
//   offload, fetch and complete_fetch) first check it (raise_if_stalled()).
//   Otherwise a stall that a release only logged would let training submit
//   more copies and raise one limit later, on one of those. The error names
//   the oldest stalled work first. A CUDA copy is seen complete only when its
//   event is queried, so one completed but never queried would still be
//   listed: it is marked seen_only_when_polled(), and only a wait on it
//   raises its stall, never the check of the oldest work (no false stall of
//   a copy that ended long ago while its handle sat unpolled).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tierflow/core/keep_forever.hpp"  // what teardown keeps after a stall

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
/// The default: 10 minutes, which no healthy step comes near.
inline constexpr double kDefaultStallTimeout = 600.0;
/// The shortest limit accepted (TIERFLOW_STALL_TIMEOUT refuses less than this, other than none/0).
inline constexpr double kMinStallTimeout = 1.0;
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
  /// This work is seen complete only when its waiter polls it (a CUDA event): the registry may list it past its
  /// end, so only a wait on it raises its stall, never raise_if_stalled's check of the oldest work.
  void seen_only_when_polled() noexcept { polled_ = true; }
  /// When the work started.
  std::chrono::steady_clock::time_point since() const noexcept { return since_; }
  /// When a wait on it gives up: since() + stall_timeout() (time_point::max() without a limit).
  std::chrono::steady_clock::time_point deadline() const noexcept;
  /// "NVMe read of 4.00 MiB (block 12), 3.2 s old".
  std::string describe() const;
  /// Throws stall_error for a wait on this work that lasted `waited_seconds`.
  [[noreturn]] void stalled(double waited_seconds) const;

  /// What is in flight now, oldest first: descriptions with their ages (at most `max`).
  static std::vector<std::string> in_flight(std::size_t max);

 private:
  friend struct PendingRegistry;
  friend const PendingWork* oldest_known(const PendingWork* w) noexcept;
  const char* kind_;
  std::uint64_t bytes_;
  std::int64_t id_;
  std::chrono::steady_clock::time_point since_;
  PendingWork* prev_ = nullptr;
  PendingWork* next_ = nullptr;
  bool listed_ = false;
  bool polled_ = false;
};

/// Throws stall_error for a wait of `waited_seconds` on the work `description` names ("a host -> device copy of
/// 4.00 MiB, 601 s old"), listing the work in flight.
[[noreturn]] void throw_stall(const std::string& description, double waited_seconds);

/// Throws stall_error naming the oldest work in flight when it is past its deadline, whoever waits for it (a
/// stall a release or a destructor only logged, or work nothing waits on yet): a call that can raise checks this
/// first, so a stall ends training at the limit, not at the limit of some later work (Note [Stall timeout]).
void raise_if_stalled();
/// The deadline of the oldest work in flight (time_point::max() when nothing is, or without a limit): a wait
/// ends by then too, and raises if that work has still not completed.
std::chrono::steady_clock::time_point oldest_deadline() noexcept;

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

/// The deadline of a wait on work that started at `since` (time_point::max() without a limit).
std::chrono::steady_clock::time_point stall_deadline(std::chrono::steady_clock::time_point since) noexcept;

/// Whether a stall_error was raised in this process (teardown then keeps memory still in use, Note [Stall
/// timeout]).
bool stall_seen() noexcept;

// Memory kept for good after a stall (keep_forever, note_kept_forever): keep_forever.hpp, included above.

/// A Runtime's claim on the process-wide limit: sets it, and refuses (config_error naming
/// TIERFLOW_STALL_TIMEOUT and both values) while another claim with a different value lives.
class StallTimeoutClaim {
 public:
  explicit StallTimeoutClaim(double seconds);
  ~StallTimeoutClaim();
  StallTimeoutClaim(const StallTimeoutClaim&) = delete;
  StallTimeoutClaim& operator=(const StallTimeoutClaim&) = delete;
};

}  // namespace tierflow
