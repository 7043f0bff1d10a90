// The torch-free part of the streaming CPU optimizer (Note [Gradient streaming] in
// bindings/include/tierflow/bindings/grad_stream.hpp): gradient buckets in pinned host buffers, the worker that
// waits for their copies and steps them during backward, step()'s commits and redone steps over raw host
// arrays, the window's timeline and the counters. What only a front end can do (allocate pinned memory it can
// hand to its own tensors, run its CPU Adam, count a state's steps, let go of a device gradient) comes through
// StepEngineHost; which step is committed, redone or left to the caller is optimizer::StepLedger's.
//
// Note [Streamed steps]
// ~~~~~~~~~~~~~~~~~~~~~
// What happens to the gradients the front end streams (Note [Gradient streaming] in bindings/: hooks, copies,
// released gradients):
//  1. Buckets. Parameters are cut into buckets of TIERFLOW_GRAD_BUCKET_BYTES
//     in the order backward completes their gradients (the reverse of
//     registration until one backward has been seen, then the order observed,
//     as DDP rebuilds its buckets; optimizer::plan_grad_buckets). With the
//     size on auto, the first step uses a sixteenth of the gradients (4 to
//     64 MiB); after it, size_buckets re-cuts them from what was measured:
//     the last bucket's copy and CPU step run after backward, so the bucket
//     is the largest whose copy (measured link) and step (measured AdamW
//     rate) take 2% of the measured backward (optimizer::
//     measured_grad_bucket_bytes). Each gradient lands in its slice of one
//     pinned buffer per bucket (stage_gradient).
//  2. Stepping. When the last gradient of a bucket is in (or backward ends,
//     for buckets with parameters that got none), the bucket goes to the
//     optimizer worker: it waits for the bucket's copies, adds the bucket's
//     sum of squares to the running norm when clipping or skip-non-finite is
//     on, and runs the oneTBB AdamW over the bucket, out of place (Note [Step
//     during backward]): new master, m, v and the 16-bit (or fp32) weights in
//     pinned staging; the old state stays.
//  3. step() confirms. What happens to each parameter's step (commit the
//     early step by a pointer swap, redo it from the landed host copy with
//     the clip coefficient as grad_scale, or leave it to the Python path when
//     its gradient changed) is decided by optimizer::StepLedger (Note [Step
//     ledger]); a gradient that the user's clip_grad_norm_ scaled and nothing
//     else counts as unchanged (Note [Clip picked up] in
//     bindings/python/tierflow/optim/clip.py).
//  4. Weights back. Committed weights are copied host -> device after the work
//     queued on the compute stream (kernels still reading the old value,
//     rule 1), in forward order (the last bucket first). With
//     TIERFLOW_WEIGHTS_RETURN=step the compute stream waits for all of them
//     when step() returns (on CUDA without blocking the host), and the
//     model's forward pre-hook makes any other stream it runs on wait too
//     (wait_step_uploads), until the copies are seen complete. With =forward
//     each module's forward pre-hook waits only for its own parameters
//     (wait_module), so the copies overlap the next forward. Copies in one
//     direction complete in submission order (Note [Copy ordering]), so a
//     module waits on one event: that of its parameter sent last. Staging is
//     kept until its copy is done (rule 3).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tierflow/core/stats.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/kernel_arrays.hpp"
#include "tierflow/optimizer/scalar_type.hpp"
#include "tierflow/optimizer/state_format.hpp"
#include "tierflow/optimizer/step_ledger.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/detail/serial_worker.hpp"

namespace tierflow::optimizer {

/// Settings of a StepEngine (GradStreamOptions' torch-free part, from the TIERFLOW_* table).
struct StepEngineOptions {
  std::size_t bucket_bytes = 0;       ///< 0: optimizer::auto_grad_bucket_bytes
  int accumulation_steps = 1;         ///< backward passes per step()
  double max_grad_norm = 0.0;         ///< 0: no clipping
  bool skip_nonfinite = false;        ///< skip the step on an inf/NaN gradient
};

/// Settings of the whole gradient stream (GradStream): the engine's and its front end's own.
struct StreamOptions : StepEngineOptions {
  bool weights_in_forward = false;    ///< TIERFLOW_WEIGHTS_RETURN=forward
  bool offload_gradients = false;     ///< TIERFLOW_OFFLOAD_GRADIENTS: p.grad is None once its copy is queued
};

/// Counters of the streaming path (cumulative, except the `last_` ones).
struct StepEngineStats {
  std::uint64_t early_steps = 0;      ///< parameters stepped during backward
  std::uint64_t committed = 0;        ///< early steps confirmed by step()
  std::uint64_t redone = 0;           ///< early steps stepped again in step()
  std::uint64_t taken_back = 0;       ///< early steps discarded
  std::uint64_t held = 0;             ///< parameters not streamed: pinned pool full
  std::uint64_t buckets = 0;          ///< buckets handed to the CPU
  std::uint64_t bucket_count = 0;     ///< buckets in the current plan
  std::uint64_t bucket_bytes = 0;     ///< bucket size in force
  std::uint64_t speculation_stops = 0;  ///< backwards where the running norm stopped speculation
  std::uint64_t clips_picked_up = 0;  ///< gradients scaled by the user's clip_grad_norm_ and kept as streamed
  std::uint64_t grad_bytes_to_host = 0;   ///< gradient bytes streamed device -> host
  std::uint64_t weight_bytes_to_device = 0;  ///< weight bytes streamed host -> device
  std::uint64_t weight_bytes_to_host_copy = 0;  ///< weight bytes written into parameters' host copies (set_home)
  std::uint64_t grads_released = 0;   ///< device gradients let go after their copy (offload_gradients)
  std::uint64_t grad_bytes_freed = 0; ///< ... whose device memory was freed by step() (nothing else held it)
  std::uint64_t grads_restored = 0;   ///< released gradients put back on the device (restore_grads)
  std::uint64_t kernel_ns = 0;        ///< time in the CPU AdamW during backward (worker)
  std::uint64_t step_kernel_ns = 0;   ///< time in the CPU AdamW inside step() (redone steps)
  std::uint64_t kernel_grad_bytes = 0;  ///< gradient bytes stepped in those times, both together
  double sized_link_bytes_per_s = 0;  ///< what size_buckets chose the buckets from: the link,
  double sized_cpu_grad_bytes_per_s = 0;  ///< ... the CPU AdamW's rate,
  double sized_backward_s = 0;        ///< ... and the backward (0: not sized from measurements)
  std::uint64_t step_wait_ns = 0;     ///< time waited for the worker after backward: step()'s waits, both
                                      ///< (wait_worker_unlocked's; a load's too)
  std::uint64_t grad_copy_wait_ns = 0;  ///< the worker's time waiting for gradient copies after a backward
                                        ///< ended, any micro-batch's (Note [Stream timeline]: [picked, landed]
                                        ///< past that backward_end)
  std::uint64_t weight_wait_ns = 0;   ///< host time spent waiting for weights (forward mode: in pre-hooks)
  std::uint64_t content_check_ns = 0; ///< host time spent on gradients' and weights' contents (Notes [Gradient content], [Weight content])
  std::uint64_t last_backward_ns = 0; ///< last backward, from its first gradient to its end
  double last_partial_norm = 0.0;     ///< norm of the gradients landed in the last window
};

/// StepEngineStats' exported fields (Note [Stat fields]): nanoseconds as *_ms.
const std::vector<StatField<StepEngineStats>>& step_engine_stat_fields();

/// `stepped during backward N (committed C, redone R, taken back T, held H)`, as Python's report prints it.
std::string describe_steps_during_backward(const StepEngineStats& s);

/// When one bucket of the last window moved, in ms from the window's first
/// gradient (Note [Stream timeline]).
struct BucketTimes {
  std::size_t bucket = 0;         ///< its index in the bucket plan
  std::uint64_t grad_bytes = 0;   ///< its gradients' bytes
  double launched_ms = -1;        ///< its last gradient is in: handed to the worker
  double picked_ms = -1;          ///< the worker takes it (the buckets before it are stepped)
  double landed_ms = -1;          ///< its copies are seen complete: the kernel begins
  double stepped_ms = -1;         ///< the kernel is done
};

/// Note [Stream timeline]
/// ~~~~~~~~~~~~~~~~~~~~~~
/// The times of the last finished window (a step() or a zero_grad), kept so
/// that a step slower than its parts can be taken apart: per bucket, when its
/// last gradient came in (launched), when the worker took it (picked: the
/// kernel of the bucket before it is done), when its copies were seen complete
/// (landed) and when its kernel was done (stepped); for the window, when
/// backward ended (its end callback, on the host: the GPU may still run it)
/// and when step() began waiting for the worker and when that wait ended.
/// launched <= picked <= landed <= stepped for every bucket; on a GPU,
/// `landed - picked` is the worker waiting for a copy and `picked - launched`
/// the bucket waiting behind the kernels of the buckets before it. -1: did not
/// happen in that window. The worker's waits for copies after the backward
/// ended (the part of each bucket's [picked, landed] past backward_end) add
/// up to StepEngineStats::grad_copy_wait_ns (Note [Step prediction]'s
/// gradient copies term). Every backward's end counts, not only the window's
/// last: with gradient accumulation a copy that lands after a non-final
/// micro-batch's backward ended (during the next forward) counts too, though
/// it holds no step() up; report()["plan"]["terms"] caps the term at step()'s
/// wait. A bucket that landed before an end callback took the lock is counted
/// by the callback.
struct WindowTimeline {
  double backward_end_ms = -1;    ///< the backward's end callback ran
  double step_ms = -1;            ///< step() began waiting for the worker
  double worker_done_ms = -1;     ///< ... and the worker was done
  std::vector<BucketTimes> buckets;  ///< in the order they went to the worker
};

/// The front end's name for a device (an index into its own table of them).
using DeviceId = std::size_t;

/// What only the front end can do for a StepEngine. Every call but allocate's comes with the engine's mutex
/// held (the worker's too): none may call back into the engine.
class StepEngineHost {
 public:
  virtual ~StepEngineHost() = default;
  /// `bytes` of pinned host memory; throws tierflow::out_of_memory when the pool has no room.
  virtual HostArray allocate(std::size_t bytes) = 0;
  /// One CPU Adam call over `arrays` (one group's options and step number).
  virtual void adam_step(const AdamOptions& options, std::int64_t step, const std::vector<KernelArrays>& arrays) = 0;
  /// The steps the state of `slot` has taken (its step counter).
  virtual std::int64_t steps_taken(std::size_t slot) = 0;
  /// The state of `slot` took one more step.
  virtual void count_step(std::size_t slot) = 0;
  /// The copy of `slot`'s released gradient landed (rule 3 of Note [Copy ordering]): its device memory may go.
  virtual void gradient_landed(std::size_t slot) = 0;
  /// The copy of `slot`'s gradient failed: a released one goes back where the caller steps it from.
  virtual void gradient_copy_failed(std::size_t slot) = 0;
  /// The stream `device`'s compute runs on now (the current one: a forward under another stream names it).
  virtual swap::StreamRef compute_stream(DeviceId device) = 0;
  /// Makes `stream` wait for `copy` (rule 2 of Note [Copy ordering]; on CUDA without blocking the host).
  virtual void make_stream_wait(swap::StreamRef stream, const swap::TransferHandle& copy) = 0;
};

/// The buckets, worker, commits and redone steps of the streaming CPU optimizer; see the file comment.
///
/// Locking: mutex() guards the engine and the front end's own records of the same slots. Methods named
/// `*_unlocked` take it themselves (they wait for the worker, which takes it); every other method runs with
/// the caller holding it.
class StepEngine {
 public:
  StepEngine(StepEngineOptions options, StepEngineHost& host);
  /// Waits for the worker and for every gradient copy still writing into the engine's buffers.
  ~StepEngine();
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  std::mutex& mutex() const noexcept { return mutex_; }
  /// The ledger that decides what happens to each step (Note [Step ledger]).
  StepLedger& ledger() noexcept { return ledger_; }
  const StepLedger& ledger() const noexcept { return ledger_; }
  /// The counters the front end adds to (its transfers, its waits); stats() merges the ledger's.
  StepEngineStats& counters() noexcept { return stats_; }

  // Slots and states.
  /// A parameter of `numel` elements, `bytes` bytes, of `param_type` (its new weights' type; any when it is
  /// not streamable) in hyperparameter group `group`; returns its slot.
  std::size_t add(std::size_t numel, std::size_t bytes, ScalarType param_type, int group, bool streamable);
  /// The state of `slot`: fp32 master, moments in `format` (moment_bytes each), fp32 max_exp_avg_sq or undefined.
  void set_state(std::size_t slot, HostArray master, HostArray exp_avg, HostArray exp_avg_sq,
                 HostArray max_exp_avg_sq, StateFormat format);
  /// Lets go of `slot`'s state and outputs (it steps elsewhere from now on; the ledger is told by the caller).
  void drop_state(std::size_t slot);
  /// The state of `slot` now: master, exp_avg, exp_avg_sq, max_exp_avg_sq.
  std::vector<HostArray> state_of(std::size_t slot) const;
  StateFormat format_of(std::size_t slot) const { return slots_.at(slot).format; }
  std::size_t numel_of(std::size_t slot) const { return slots_.at(slot).numel; }
  std::size_t size() const noexcept { return slots_.size(); }

  // Backward.
  /// A backward delivers a gradient at `now_ns`: true for its first (Note [Stream timeline]'s start).
  bool backward_begins(std::uint64_t now_ns);
  /// Backward's end callback ran at `now_ns`.
  void backward_ends(std::uint64_t now_ns);
  /// Hands every bucket whose gradients are all in, or whose backward ended, to the worker.
  void launch_unlaunched();
  /// The ledger re-cut the buckets: the buffers of the old cut go (slices still referenced stay).
  void sync_buckets();
  /// Where `slot`'s gradient of `bytes` (of `grad_type`) goes: its slice of its bucket's pinned buffer.
  /// Undefined when the pool has no room for the bucket (counted held; step() steps it from the device).
  HostArray stage_gradient(std::size_t slot, ScalarType grad_type, std::size_t bytes);
  /// The front end queued `copy` into stage_gradient's slice (after the work that produced the gradient).
  void gradient_copied(std::size_t slot, swap::TransferHandle copy);
  /// The gradient of `slot` streamed (the ledger's streamed()); launches its bucket when it was the last.
  void streamed(std::size_t slot, GradIdentity identity, bool released);
  /// The copy of `slot`'s gradient (undefined when none this window) and its submission order.
  const swap::TransferHandle& copy_of(std::size_t slot) const { return slots_.at(slot).copy; }
  std::uint64_t copy_seq_of(std::size_t slot) const { return slots_.at(slot).copy_seq; }
  /// The landed host copy of `slot`'s gradient this window (undefined when none).
  const HostArray& host_grad_of(std::size_t slot) const { return slots_.at(slot).host_grad; }
  ScalarType grad_type_of(std::size_t slot) const { return slots_.at(slot).grad_type; }

  // step().
  /// Waits for the worker (without the lock); rethrows the first failure of a bucket's step.
  void drain_unlocked() { worker_->drain(); }
  /// Waits for the worker, then takes the lock; counted in step_wait_ns either way; with `step` as step()'s own
  /// wait, without as its first (the timeline's step_ms: Note [Stream timeline]).
  void wait_worker_unlocked(bool step);
  /// The early step's out-of-place results of `slot` go (it is redone in place); with `staging` its new
  /// weights' staging too (it is not stepped here at all).
  void drop_outputs(std::size_t slot, bool staging);
  /// Allocates the staging of `slot`'s new weights if it has none (throws out_of_memory).
  void ensure_staging(std::size_t slot);
  /// The new weights of `slot` (its param_type), as the last commit or redone step wrote them.
  const HostArray& staging_of(std::size_t slot) const { return slots_.at(slot).staging; }
  /// What step() decided per slot.
  struct Finish {
    std::vector<std::size_t> committed;  ///< early steps committed, or stepped here from landed gradients
    std::vector<std::size_t> unhandled;  ///< the caller steps these (gradient changed, not streamed, stale)
  };
  /// One slot's verdict as prepared (the ledger's verdict()), confirmed here.
  struct Verdict {
    std::size_t slot;
    GradIdentity identity;
    Confirmation::Kind kind;
  };
  /// Confirms `verdicts` with the ledger (each must still be what it was), commits the early steps by a
  /// pointer swap and redoes the others in place from the landed gradients with the clip coefficient.
  Finish commit(const std::vector<Verdict>& verdicts, double scale, bool stale);
  /// step() in two (Note [Atomic step]), first the verdicts: `now` holds each slot's gradient identity now
  /// (read for the streamable ones). Asks the ledger for every streamable slot's verdict and keeps them (the
  /// prepared record); the unhandled ones' outputs and staging go, the redone ones' outputs. Returns the
  /// unhandled slots (the caller steps them from its device gradients).
  std::vector<std::size_t> prepare(const std::vector<GradIdentity>& now, double scale, bool stale);
  /// ... then the redone steps' staging. `frugal`, or no room for that staging beside the early steps'
  /// out-of-place results: those go and their steps are redone in place (the same kernel on the same values:
  /// the same bits). Throws out_of_memory (the window stays open; a retry prepares again).
  void prepare_staging(bool frugal);
  /// commit() of what prepare and prepare_staging decided; throws without them.
  Finish commit_prepared();
  /// What was prepared is no longer what step() commits (a prepare begins again).
  void unprepare() noexcept { prepared_.ready = false; }
  /// Ends the window: waits for the copies still writing into the buckets (rule 3), lets go of this window's
  /// gradients and outputs, tells the ledger, and closes the timeline.
  void end_window(bool count_taken_back);
  // Weights back (Note [Streamed steps], 4): which copy each slot and device sent last, which compute
  // stream waits for which, and when staging may go.
  /// One module's own parameters; returns its id for wait_module.
  std::size_t add_module(std::vector<std::size_t> slots);
  const std::vector<std::size_t>& module_slots(std::size_t module) const { return modules_.at(module); }
  /// The front end queued `upload`, of staging_of(slot) to `slot`'s parameter on `device`: the staging is
  /// kept until the copy is done (rule 3), and the upload is pending until a compute stream waits for it.
  void upload_sent(std::size_t slot, DeviceId device, swap::TransferHandle upload);
  /// Keeps `buffer` (the source of the front end's `copy`) until the copy is done (rule 3).
  void keep_until_done(swap::TransferHandle copy, HostArray buffer);
  /// Waits on the host for every upload and copy kept: their buffers go, no upload is pending (weight_wait_ns).
  void wait_uploads();
  /// TIERFLOW_WEIGHTS_RETURN=step: per device, the compute stream waits for the upload of `sent` sent last
  /// (copies in one direction complete in submission order), remembered for wait_step_uploads.
  void wait_for_step_uploads(const std::vector<std::size_t>& sent);
  /// ... and a compute stream current at a later forward that has not waited yet waits too, until they are done.
  void wait_step_uploads();
  /// The compute stream of `module`'s device waits for the last of its parameters' pending uploads.
  void wait_module(std::size_t module);
  /// The compute stream of `slot`'s device waits for its upload if pending (it stays pending).
  void wait_upload(std::size_t slot);
  bool upload_pending(std::size_t slot) const { return slots_.at(slot).upload_pending; }
  /// Every pending upload waited for by its compute stream, then wait_uploads.
  void synchronize();
  /// TIERFLOW_GRAD_BUCKET_BYTES=auto: the ledger's size_buckets, the buffers re-cut; the size in force.
  std::size_t size_buckets(double link_bytes_per_second);
  /// Counters, the ledger's merged.
  StepEngineStats stats() const;
  /// The last finished window's times (Note [Stream timeline]); empty before one finished.
  const WindowTimeline& last_window() const noexcept { return last_window_; }

 private:
  struct Slot {
    std::size_t numel = 0;
    ScalarType param_type = ScalarType::kFloat32;
    StateFormat format = StateFormat::kFp32;
    HostArray master, exp_avg, exp_avg_sq, max_exp_avg_sq;
    // This window.
    HostArray host_grad;
    ScalarType grad_type = ScalarType::kFloat32;
    swap::TransferHandle copy;   // of its gradient to host_grad
    std::uint64_t copy_seq = 0;  // submission order of `copy`
    HostArray out_master, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, staging;
    // Its weights on the way back.
    swap::TransferHandle upload;
    DeviceId device = 0;
    bool upload_pending = false;
    std::uint64_t upload_seq = 0;
  };
  struct Prepared {  // prepare's verdicts, for commit_prepared
    std::vector<Verdict> slots;
    double scale = 1.0;
    bool stale = false;
    bool ready = false;
  };
  struct Bucket {
    HostArray buffer;  // pinned, this window
    std::vector<swap::TransferHandle> copies;
  };
  struct Entry {  // one slot of a bucket on the worker: its arrays as they were at launch
    std::size_t slot = 0;
    AdamOptions options;
    std::int64_t step = 0;
    bool held = false;  // no memory for the out-of-place outputs: steps in step()
    KernelArrays arrays;
  };
  struct WindowClock {  // this window's times (absolute ns, 0: not yet)
    std::uint64_t start = 0, backward_end = 0, step = 0, worker_done = 0;
    std::uint64_t copies_exposed_from = 0;  // the backward streaming now ended here (0: running or none yet)
    struct Bucket {
      std::size_t bucket = 0;
      std::uint64_t grad_bytes = 0, launched = 0, picked = 0, landed = 0, stepped = 0;
      bool copy_wait_counted = false;  // its wait is in grad_copy_wait_ns (by the worker or the end callback)
    };
    std::vector<Bucket> buckets;
  };
  KernelArrays arrays_of(const Slot& s) const;
  void launch(std::size_t bucket);
  void run_bucket(std::uint64_t generation, std::vector<Entry> entries, std::vector<swap::TransferHandle> copies,
                  std::uint64_t clock_window, std::size_t timed);
  void settle_failed_bucket(std::uint64_t generation, const std::vector<Entry>& entries);
  // Keeps the host memory of `entries`' gradients for good: a copy into them stalled (Note [Stall timeout]).
  static void keep_stalled_grads(const std::vector<Entry>& entries) noexcept;
  std::uint64_t step_entries(const std::vector<Entry>& entries);
  void redo(const std::vector<std::pair<std::size_t, double>>& redo, std::vector<std::size_t>& committed);
  void finish_clock();
  // The part of [picked, landed] after the backward ended (grad_copy_wait_ns), 0 while it runs.
  std::uint64_t copy_wait_past_backward(std::uint64_t picked, std::uint64_t landed) const noexcept;

  StepEngineHost& host_;
  mutable std::mutex mutex_;
  StepLedger ledger_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::uint64_t buckets_plan_ = ~std::uint64_t{0};  // the ledger's plan_id that buckets_ follows
  StepEngineStats stats_;
  std::uint64_t copy_seq_ = 0;
  WindowClock clock_;
  std::uint64_t clock_window_ = 0;  // windows finished: a bucket's times go to its own window only
  WindowTimeline last_window_;
  Prepared prepared_;
  std::vector<std::vector<std::size_t>> modules_;
  std::vector<std::pair<swap::TransferHandle, HostArray>> uploads_;  // buffers kept until their copy is done
  std::uint64_t upload_seq_ = 0;  // submission order of weight copies (wait_module)
  // With TIERFLOW_WEIGHTS_RETURN=step: per device the copy sent last, and the compute streams that wait for it.
  std::vector<std::pair<DeviceId, swap::TransferHandle>> step_uploads_;
  std::vector<std::pair<DeviceId, void*>> waited_streams_;
  std::unique_ptr<swap::detail::SerialWorker> worker_;
};

}  // namespace tierflow::optimizer
