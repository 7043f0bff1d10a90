// The trace's reading side: a trace file (Note [Trace]) read back, merged with torch.profiler's exported one, and
// cut to one step (Note [Trace file]). `python -m tierflow timeline` and tierflow.trace.merge call it; the
// picture (matplotlib) stays in bindings/python/tierflow/cli/timeline.py.
//
// Note [Trace file]
// ~~~~~~~~~~~~~~~~~
// Reading. A trace is a JSON object with a "traceEvents" list (a bare list of events is read as one). tierflow's
// lanes are the threads named "tierflow: <lane>" (a lane's further threads "tierflow: <lane> #2": one lane).
//
// Merging. Kineto (torch.profiler) and tierflow both write "ts" in microseconds since "baseTimeNanoseconds"
// (CLOCK_REALTIME). The merged trace is torch's (its fields, its events) with tierflow's events after them, on
// the earlier of the two bases: each file's "ts" shifted by the difference of its base to that one, computed
// from the integers (a realtime in microseconds, 1.8e15, has no room for fractions) and rounded to 3 decimals
// (Python's round(x, 3)). tierflow's process_name goes where torch names the same process already: tierflow's
// lanes are its threads. Both traces need a base: without one the clocks cannot be lined up.
//
// One step. A step is an optimizer step: the "steps" lane's events (from the step's first forward to its
// step()'s end, Note [Trace]) split the trace. An older trace without them is split by each forward of its first
// block (the lowest "block" argument), a step ending where the next begins (the last: at the trace's last event);
// one without either is one step, the whole trace. A step holds the spans that overlap it (or start at its
// start) and the "bytes per tier" counters inside it, after the last reading before it, moved to its start.
// Steps are indexed as Python indexes a list: -1 the last.
#pragma once

#include <cstdint>
#include <string>

namespace tierflow::trace {

/// The Chrome trace at `path` as JSON text {"traceEvents": [...], ...}. Throws io_error "cannot read the trace
/// <path>: <why>", config_error "<path> is not JSON (...)" or "<path> is not a Chrome trace (no traceEvents list)".
std::string load_file(const std::string& path);

/// One trace of a tierflow trace's events and torch.profiler's (both JSON text) on one clock (Note [Trace
/// file]); throws config_error when either lacks a baseTimeNanoseconds.
std::string merge(const std::string& tierflow_json, const std::string& torch_json);

/// merge() of two files, written to `out_path`; returns the merged trace's text. Throws load_file's errors, and
/// io_error naming `out_path` when it cannot be written.
std::string merge_files(const std::string& tierflow_path, const std::string& torch_path, const std::string& out_path);

/// Step `step` of a trace (JSON text; -1 the last) as JSON text: {"start", "end" (microseconds), "spans" (each
/// {"lane", "name", "ts", "dur", "args"}), "counters" (each [ts, {series: bytes}]), "count" (steps), "index"
/// (0-based), "split" ("steps", "block forward" or "trace": what told the steps apart)}. Throws config_error when
/// the trace has no tierflow events, or no step `step` ("--step N: the trace has K step(s) ...").
std::string one_step(const std::string& trace_json, std::int64_t step = -1);

}  // namespace tierflow::trace
