// Per-step figures (tierflow.step_stats()) from snapshots of the runtime's
// counters taken at a step's boundaries. Torch-free: the bindings read the
// counters and the front end says when a boundary is crossed.
//
// Note [Step stats]
// ~~~~~~~~~~~~~~~~~
// A step is what happens between the first forward after the last step and
// the end of the optimizer's step(): one or more forwards and backwards
// (gradient accumulation) and one step(). The front end marks each boundary
// (forward begin/end, backward begin/end, step begin/end) with the counters
// read at that instant; the recorder turns the differences into one StepStats
// per step. Without an optimizer to watch (wrap(model) alone), a step ends
// where the next one's first forward begins, after a backward.
//
// Times: forward_s, backward_s and step_s add up the spans between their
// marks (a micro-batch's forward and backward each count); wall_s is from the
// step's first mark to its last. Exposure: compute that waited is the
// counters' difference over the step: copy_wait (the forward's waits for the
// copy window plus the backward's waits for a fetch not yet landed), cpu_step
// (the CPU optimizer's time inside step(): its wait for the stream's worker
// after backward plus what it stepped there, Note [Stream timeline]; without
// the stream the whole CPU step), nvme_wait (the CPU's waits for NVMe reads
// not hidden by the pipeline). Bytes per link: the copy engine's and the NVMe
// engine's totals' differences.
//
// Peaks per tier: each mark takes every tier's window peak (Note [Window
// peak] in core/stats.hpp: the most bytes since the previous mark, the
// reading now included), so a step's peak is the highest of its marks'
// windows after the first and the first's reading: exact, whether or not an
// earlier step went higher. The pinned pool, the NVMe engine's bytes in use
// and the saved activations' registry keep one; one reader each (the step
// recorder), so two sessions' recorders on one runtime would split each
// other's windows. A tier read without a window (TierReading::kNoPeak) falls
// back on its meter's all-time peak: when it rose during the step the step
// reached it (exact); otherwise the highest reading at the marks, a lower
// bound. `peaks_exact` says whether every tier's figure is exact: always,
// once every tier has a window (the device activations' reading has none
// until the activation offloader passes the registry's on).
//
// Parameter fetches: exposed_param_wait_s is the time the compute waited for
// a parameter fetch to land (TIERFLOW_OFFLOAD_PARAMS; ParamScheduleStats'
// stall_ns of every ParamResidency of the runtime), apart from
// exposed_copy_wait_s (the activations' copies): the two add up to the
// step's exposed copy time. On CUDA both are the host's time queuing the
// stream's wait (the compute stream waits, not the host), on the emulated
// device the host's wait itself.
//
// The trace's "steps" lane (Note [Trace]): each step ended, from its first
// forward to its end (the optimizer's step(), or without one its last
// backward's end: gradient accumulation's micro-batches are one step), is a
// complete event "step <n>" with its number and forwards, what
// `python -m tierflow timeline` splits a trace by; the recorder adds it at the
// marks while the trace records.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/stats.hpp"

namespace tierflow::tiering {

/// One tier's bytes at an instant: held now, the most its meter ever saw, and the most since the previous reading
/// (its window peak, the reading now included); kNoPeak: the meter keeps none (Note [Step stats]).
struct TierReading {
  static constexpr std::int64_t kNoPeak = -1;
  std::int64_t current = 0;
  std::int64_t peak = kNoPeak;
  std::int64_t window = kNoPeak;
};

/// The runtime's counters at one instant (Note [Step stats]); every count but the readings only grows.
struct StepCounters {
  std::uint64_t device_to_host_bytes = 0;
  std::uint64_t host_to_device_bytes = 0;
  std::uint64_t host_to_nvme_bytes = 0;
  std::uint64_t nvme_to_host_bytes = 0;
  std::uint64_t copy_wait_ns = 0;      ///< forward's copy-window waits + backward's fetch waits
  std::uint64_t cpu_step_ns = 0;       ///< the CPU optimizer's time inside step()
  std::uint64_t nvme_wait_ns = 0;      ///< the CPU's waits for NVMe reads
  std::uint64_t param_wait_ns = 0;     ///< the compute's waits for parameter fetches to land
  TierReading device_activations;      ///< saved activations held on the device
  TierReading pinned_host;             ///< the pinned pool's bytes in use
  TierReading nvme;                    ///< NVMe bytes in use
};

/// A step's boundary, as the front end sees it.
enum class StepMark : std::uint8_t { kForwardBegin, kForwardEnd, kBackwardBegin, kBackwardEnd, kStepBegin, kStepEnd };

/// One training step's figures (Note [Step stats]).
struct StepStats {
  std::uint64_t step = 0;           ///< 1 for the first step recorded
  std::uint64_t forwards = 0;       ///< forwards in the step (micro-batches)
  std::uint64_t backwards = 0;      ///< backwards in the step
  double wall_s = 0;                ///< first mark to last
  double forward_s = 0;
  double backward_s = 0;
  double step_s = 0;                ///< the optimizer's step()
  double exposed_copy_wait_s = 0;
  double exposed_cpu_step_s = 0;
  double exposed_nvme_wait_s = 0;
  double exposed_param_wait_s = 0;  ///< the compute waited for a parameter fetch (apart from exposed_copy_wait_s)
  std::uint64_t device_to_host_bytes = 0;
  std::uint64_t host_to_device_bytes = 0;
  std::uint64_t host_to_nvme_bytes = 0;
  std::uint64_t nvme_to_host_bytes = 0;
  std::uint64_t peak_device_activation_bytes = 0;
  std::uint64_t peak_pinned_host_bytes = 0;
  std::uint64_t peak_nvme_bytes = 0;
  bool peaks_exact = true;          ///< every peak is the step's true peak, not a lower bound
};

/// StepStats' exported fields (Note [Stat fields]): tierflow.step_stats()'s keys (with peaks_exact).
const std::vector<StatField<StepStats>>& step_stat_fields();

/// The steps `steps` summed up for a logger: times, waits and bytes as their mean per step, peaks as the
/// highest, forwards/backwards as their mean, `step` the last one's, exact when every step's peaks are.
/// Throws logic_error for no steps.
StepStats mean_of_steps(const std::vector<StepStats>& steps);

/// Turns marks into StepStats and keeps the last `capacity` (Note [Step stats]). Not thread-safe: the front
/// end marks from the thread that runs the model's hooks (and autograd's end-of-backward callback).
class StepRecorder {
 public:
  /// `ends_at_step`: steps end at kStepEnd (an optimizer is watched); else at the next step's first forward.
  /// Throws logic_error for capacity 0.
  explicit StepRecorder(std::size_t capacity = 1000, bool ends_at_step = true);

  /// A boundary crossed at `now_ns` with the counters read then.
  void mark(StepMark m, std::uint64_t now_ns, const StepCounters& c);
  /// Whether steps end at step() (else at the next forward).
  void set_ends_at_step(bool on) noexcept { ends_at_step_ = on; }
  bool ends_at_step() const noexcept { return ends_at_step_; }

  /// The recorded steps, oldest first (at most capacity()).
  const std::deque<StepStats>& steps() const noexcept { return steps_; }
  /// The newest step, if any.
  std::optional<StepStats> last() const;
  /// Steps recorded since construction (also those dropped from the ring).
  std::uint64_t recorded() const noexcept { return recorded_; }
  std::size_t capacity() const noexcept { return capacity_; }
  /// True while a step has begun and not ended.
  bool open() const noexcept { return open_; }
  /// Forgets the recorded steps and any open one (numbering goes on).
  void clear() noexcept;

 private:
  void begin(std::uint64_t now_ns, const StepCounters& c);
  void finish(std::uint64_t now_ns, const StepCounters& c);
  void sample(const StepCounters& c) noexcept;

  std::size_t capacity_;
  bool ends_at_step_;
  std::deque<StepStats> steps_;
  std::uint64_t recorded_ = 0;
  // The open step.
  bool open_ = false;
  bool backward_seen_ = false;
  StepCounters first_{};
  std::uint64_t first_ns_ = 0;
  std::uint64_t forward_at_ = 0, backward_at_ = 0, step_at_ = 0;  // 0: no span open
  std::uint64_t forward_ns_ = 0, backward_ns_ = 0, step_ns_ = 0;
  std::uint64_t forwards_ = 0, backwards_ = 0;
  // Per tier: the highest reading at the marks, and the highest window after the first mark (`windowed` while
  // every such mark had one).
  struct Seen {
    std::int64_t reading = 0, window = 0;
    bool windowed = true;
  };
  Seen seen_device_, seen_host_, seen_nvme_;
  bool first_sample_ = true;  // the next sample is the step's first (its window is the time before the step)
  // The trace's steps lane: the open step's first forward (0: none yet), its forwards, the steps ended.
  void trace_mark(StepMark m, std::uint64_t now_ns);
  std::uint64_t trace_begin_ns_ = 0, trace_forwards_ = 0, trace_steps_ = 0;
};

}  // namespace tierflow::tiering
