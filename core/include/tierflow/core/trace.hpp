// The step's trace: a recorder of timed events written in the Chrome trace
// event format that torch.profiler exports and Perfetto opens (Note [Trace]).
//
// Note [Trace]
// ~~~~~~~~~~~~
// TIERFLOW_TRACE=path (or tierflow.trace(path)) records what a step did and when,
// one lane (a Chrome "thread") per kind of work: blocks' forward, backward and
// replay (bindings/python/tierflow/activations), each copy direction and NVMe
// reads and writes (every PendingWork, Note [Stall timeout], from its start to
// its done()), the CPU AdamW's buckets (Note [Stream timeline]); and counters of
// bytes per tier (device activations held, pinned host pool in use, NVMe),
// sampled from each runtime's meters at every block span's end (and at each
// outermost forward's start, also where the plan keeps everything); and a
// "steps" lane with one "step N" event per optimizer step, from the step's first
// forward to its step()'s end (bindings/python/tierflow/_step_stats.py), which
// `python -m tierflow timeline` splits the trace by (reading a trace back: Note
// [Trace file] in trace_file.hpp).
//
// Runs. A TIERFLOW_TRACE file holds every event recorded since its path was
// first attached in this process: a second runtime on the same path (wrap,
// train, delete, wrap again) writes the first one's steps too, never only its
// own. Events are therefore kept past the end of a recording while any path was
// attached (still at most kMaxTraceEvents).
//
// Off, every call site costs one relaxed atomic load (trace::on()), and call
// sites build their arguments only behind it. On, events go to one mutex-guarded
// vector (at most kMaxTraceEvents; more are counted as dropped and said in the
// file's metadata).
//
// Work in flight overlaps (a copy is an event from its submission to its
// completion, and several are in flight at once), but a Chrome "thread" holds
// only nested events. The writer gives such a lane as many threads as it needs:
// an event goes to the lane's first thread whose last event has ended (tid: the
// lane's value, then + 100, + 200, ...; thread_name "tierflow: <lane>", then
// "tierflow: <lane> #2", ...), so every thread's events are disjoint. A copy's
// event starts when it was submitted: a burst of prefetches queued at once on
// one stream shows as that many threads, each copy's time waiting included.
//
// Clock. Events are taken on the steady clock (now_ns(), the clock of every
// other tierflow timing). torch.profiler's (Kineto's) trace gives "ts" in
// microseconds since its "baseTimeNanoseconds", on CLOCK_REALTIME (c10's
// getTime()). The writer maps steady to realtime by the offset measured when it
// writes, and writes the same pair: "baseTimeNanoseconds" (the realtime of the
// first event, in whole milliseconds) and "ts" relative to it, so that the two
// traces line up by adding the difference of their bases (tierflow.trace's merge
// and `python -m tierflow timeline --merge`). The offset drifts only as the
// system clock is stepped (NTP), a few microseconds over a run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>
#include <atomic>

namespace tierflow::trace {

/// A lane of the trace: its Chrome thread id (tid) is the enum's value.
enum class Lane : int {
  kForward = 1,       ///< blocks' forward
  kBackward = 2,      ///< blocks' backward (from their output's gradient to their input's)
  kReplay = 3,        ///< blocks' replay (recompute) in backward
  kDeviceToHost = 4,  ///< copies device -> host
  kHostToDevice = 5,  ///< copies host -> device
  kNvmeWrite = 6,     ///< NVMe writes
  kNvmeRead = 7,      ///< NVMe reads
  kCpuAdam = 8,       ///< the CPU AdamW's buckets
  kOther = 9,         ///< any other asynchronous work
  kCpuAdamQueue = 10, ///< the CPU AdamW's buckets from handed to its worker to done (the queue included)
  kSteps = 11,        ///< training steps: from a step's first forward to its optimizer step()'s end (step_stats)
};
/// Every lane, in the order they are drawn.
inline constexpr Lane kLanes[] = {Lane::kSteps, Lane::kForward,   Lane::kBackward,     Lane::kReplay,
                                  Lane::kDeviceToHost, Lane::kHostToDevice, Lane::kNvmeWrite,
                                  Lane::kNvmeRead,  Lane::kCpuAdam,      Lane::kCpuAdamQueue, Lane::kOther};
/// "block forward", "copy device -> host", ...: the lane's thread_name.
const char* lane_name(Lane lane) noexcept;
/// "step", "block", "copy", "nvme", "optimizer", "work": the events' "cat".
const char* lane_category(Lane lane) noexcept;
/// The lane of a PendingWork's kind ("device -> host copy", "NVMe read", ...).
Lane lane_of_kind(const char* kind) noexcept;

/// One integer argument of an event ("bytes", "block").
struct Arg {
  const char* key;  ///< a string literal
  std::int64_t value;
};

/// Most events kept; later ones are counted as dropped.
inline constexpr std::size_t kMaxTraceEvents = 1u << 20;

namespace detail {
extern std::atomic<bool> g_on;
}  // namespace detail

/// Whether events are recorded now: one relaxed load (the check at every call site).
inline bool on() noexcept { return detail::g_on.load(std::memory_order_relaxed); }

/// Starts recording (one more recorder); the first of a new recording forgets the last recording's events.
void start();
/// One recorder less; recording stops with the last (its events stay until the next recording starts).
void stop() noexcept;
/// Forgets every event (and the dropped count).
void clear() noexcept;

/// A complete event ("ph":"X") on `lane` from `start_ns` to `end_ns` (now_ns()'s clock); nothing when off.
void complete(Lane lane, std::string name, std::uint64_t start_ns, std::uint64_t end_ns,
              std::initializer_list<Arg> args = {}) noexcept;
/// The same with arguments named at run time (Python's).
void complete_args(Lane lane, std::string name, std::uint64_t start_ns, std::uint64_t end_ns,
                   std::vector<std::pair<std::string, std::int64_t>> args) noexcept;
/// The same, from a PendingWork: its kind names the lane, `id` (>= 0) becomes the "block" argument.
void work_done(const char* kind, std::uint64_t bytes, std::int64_t id,
               std::chrono::steady_clock::time_point since) noexcept;
/// The CPU AdamW's spans on its lane (one call each from the step engine, Note [Stream timeline]): `name` (a string
/// literal) from `start_ns` to `end_ns` over `tensors` tensors, with their gradients' `bytes` when known (not 0);
/// nothing when off.
inline void adam_span(const char* name, std::uint64_t start_ns, std::uint64_t end_ns, std::size_t tensors,
                      std::uint64_t bytes = 0) noexcept {
  if (!on()) return;
  const Arg t{"tensors", static_cast<std::int64_t>(tensors)}, b{"bytes", static_cast<std::int64_t>(bytes)};
  if (bytes != 0)
    complete(Lane::kCpuAdam, name, start_ns, end_ns, {t, b});
  else
    complete(Lane::kCpuAdam, name, start_ns, end_ns, {t});
}
/// A counter event ("ph":"C") named `name` at `at_ns` with one series per value; nothing when off.
void counter(std::string name, std::uint64_t at_ns, std::vector<std::pair<std::string, std::int64_t>> values) noexcept;

/// What a meter reports: the series of the "bytes per tier" counter ("device activations", ...).
using Meter = std::function<std::vector<std::pair<std::string, std::int64_t>>()>;
/// Adds `meter` under `owner` (a runtime); when `path` is not empty, starts recording and writes the trace to
/// `path` when `owner` detaches (TIERFLOW_TRACE) and at exit: every event that ended since `path` was first
/// attached in this process, so that a later runtime's file holds the earlier runtimes' steps too. Throws
/// config_error naming TIERFLOW_TRACE and `path` when `path`'s folder does not exist or is not writable (a probe
/// file `path`.tmp is created and removed), before anything is attached.
void attach(const void* owner, std::string path, Meter meter);
/// Why `path` cannot take a trace file, in words after `who` (tierflow.trace(path=...)): its folder does not exist,
/// or a probe file `path`.tmp cannot be created there (one that exists already is fine); "" when it can.
std::string path_refusal(const std::string& path, const std::string& who);
/// Removes `owner`'s meter; writes its path's trace when it gave one. Never throws (a failed write is logged).
void detach(const void* owner) noexcept;
/// Records one "bytes per tier" counter event from every attached meter (summed by series); nothing when off.
void sample() noexcept;

/// Events recorded and kept; events dropped past kMaxTraceEvents.
std::size_t event_count() noexcept;
std::size_t dropped_count() noexcept;

/// The trace as Chrome trace JSON: {"traceEvents": [...], "displayTimeUnit": "ms", "baseTimeNanoseconds": ...},
/// the events ending at or after `since_ns` (0: all), under process id `pid` (0: this process's).
std::string chrome_json(std::uint64_t since_ns = 0, std::int64_t pid = 0);
/// Writes chrome_json(since_ns) to `path` (through a temporary file renamed into place); throws io_error naming
/// the path (not the setting: callers say which one gave it) when it cannot.
void write(const std::string& path, std::uint64_t since_ns = 0);

}  // namespace tierflow::trace
