// The bookkeeping of the optimizer step taken during backward, torch-free.
//
// Note [Step during backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// As in Fuyou, a parameter's CPU update starts as soon as backward has
// finished its gradient (a post-accumulate-grad hook), on tierflow's optimizer
// worker thread, while backward goes on with earlier layers. The catch is that
// some decisions need every gradient first: global-norm clipping (a scale
// applied to all gradients), skipping a step when a gradient is inf/NaN (AMP's
// GradScaler), and user code that changes gradients between backward() and
// step() (torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, gradient
// accumulation that continues).
//
// tierflow steps speculatively and can take any step back, exactly, at no
// extra memory traffic: the overlapped update writes the new master, m and v
// out of place into fresh pinned-pool buffers (the kernel reads the old ones
// and writes the new ones, the same 28 bytes per parameter as in place) and
// keeps the old ones. step() then checks, for every parameter stepped early,
// that its gradient is the same tensor at the same version (in-place changes
// bump it) with the same bytes (the counter does not see every write: Note
// [Gradient content]), that the hyperparameters did not change, and that no global
// decision alters the step: the clip coefficient, computed with the same torch
// ops as clip_grad_norm_, is exactly 1, and no gradient is non-finite when
// TIERFLOW_SKIP_NONFINITE is on. If so the new buffers are committed (a
// pointer swap) and the old ones return to the pool. If not, the old buffers
// are kept (the parameter was never written: its new value waited in pinned
// memory for step() to confirm it), and the step is redone from the gradient as
// it is now, scaled by the clip coefficient, or skipped. A step() that never
// comes (GradScaler skipping it) is taken back by zero_grad() or by the wrapped
// model's next forward (a forward before step() means that backward was not the
// last one). The cost is 12 bytes per parameter of pinned memory held between
// a gradient's completion and step(); when the pool cannot hold it, that
// parameter is simply stepped in step(). With gradient
// accumulation, TIERFLOW_GRAD_ACCUMULATION_STEPS says which backward is the
// last one before step(); a wrong value only costs redone steps.
//
// All of this runs in C++, bucket by bucket, with no Python per parameter: the
// gradients and weights move in Note [Gradient streaming]
// (bindings/include/tierflow/bindings/grad_stream.hpp), and what happens to each
// step is decided by the ledger below, Note [Step ledger]. It covers the
// parameters of the runtime's device (CUDA tensors, or CPU tensors on the
// emulated device); any other parameter (a CPU model beside a CUDA runtime)
// steps in step(). A parameter gets its new value in step(), when its step is
// confirmed.
//
// Note [Step ledger]
// ~~~~~~~~~~~~~~~~~~
// Gradients stream to the CPU optimizer while backward runs (Note [Gradient
// streaming] in bindings/, which moves the bytes); this ledger decides, per
// parameter ("slot"), what happens to its step. A slot's life in one window
// (the gradients since the last step()):
//
//   arrived    backward delivered a gradient (counted: with
//              TIERFLOW_GRAD_ACCUMULATION_STEPS = n only the n-th streams; a
//              gradient after that takes the early step back, since the
//              gradient changed again: a wrong hint costs redone work)
//   streamed   its copy to the host is queued, into its bucket's slice
//   landed     the worker saw the copy complete
//   stepped    the worker ran its step out of place ("early"), unless the
//              speculation had stopped (below) or there was no memory (held)
//   discarded  its early step must not be committed (taken back, or consumed)
//
// and step() confirms each one (confirm()):
//   commit     streamed, landed, stepped early, the gradient is the one that
//              streamed (same tensor at the same version with the same bytes,
//              Note [Gradient content], or released and p.grad still None),
//              its group's hyperparameters are the ones it
//              stepped with and the clip coefficient is exactly 1: the caller
//              swaps the out-of-place results in;
//   redo       the gradient is the one that streamed but the step is not
//              usable (clip coefficient != 1, hyperparameters changed,
//              speculation stopped, held): stepped again from the landed host
//              copy with the coefficient as grad_scale, no second copy;
//   unhandled  the gradient changed after it streamed, or never streamed: the
//              caller steps it from p.grad.
// Counters: early_steps (stepped during backward), committed, redone (an
// early step stepped again), taken_back (an early step or landed stream
// discarded), held.
//
// Clipping: the global norm is known only when backward ends. Two choices:
// defer every bucket's step until then, or step speculatively and redo. The
// deferred step would serialise the whole CPU step after backward every time
// clipping is on; the speculative one costs nothing when the clip does not
// bind (coefficient exactly 1) and, when it binds, redoes from the landed host
// gradients. Squares only add up, so the running norm over the buckets landed
// so far bounds the global norm from below: once it exceeds max_grad_norm
// (with a margin, PartialNorms::clip_must_bind) the clip is certain to bind
// and no further bucket steps speculatively; likewise once a landed gradient
// is non-finite under skip-non-finite. So the wasted work is the buckets
// before the bound was crossed; the coefficient itself is computed at step()
// by the caller with torch's own clip_grad_norm_ ops, which makes the result
// bit-identical to clip_grad_norm_ followed by step(). A user's own
// clip_grad_norm_ (Note [Clip picked up] in bindings/python/tierflow/optim/clip.py)
// teaches the ledger its max_norm: speculation stops from the next window
// (within the window it was seen in, buckets land before or after the clip as
// the worker happens to run: the stop waits for the window's end, so what is
// stepped early never depends on that race).
//
// Buckets: parameters are cut into buckets in the order backward completes
// their gradients: the reverse of registration until one backward has been
// seen, then the order observed (as DDP rebuilds its buckets), with
// plan_grad_buckets. The size is TIERFLOW_GRAD_BUCKET_BYTES, or on auto a
// sixteenth of the gradients for the first step (auto_grad_bucket_bytes) and,
// once a step is measured, measured_grad_bucket_bytes (size_buckets). A
// bucket goes to the worker when its last gradient has streamed, or when
// backward ends.
//
// Windows have generations: a bucket that lands after its window ended (a
// forward before step(), zero_grad) changes nothing.
//
// Reduced gradients (DDP; Note [Distributed training] in
// bindings/python/tierflow/_distributed.py): a slot marked reduced streams the
// gradient that a reduction across processes produced (arrive_reduced), never
// its local one: a local arrival only counts (the n-th rule above counts local
// backwards, so with no_sync the reducing backward is the n-th) and takes a
// step back that streamed in an earlier backward of the window (the gradient
// changed again). A reduced arrival implies this backward's local one (the
// reduction starts from the accumulated gradient), whichever the ledger saw
// first; a second reduced arrival in one window takes the step back. The
// reduced values reach p.grad later, by a write that changes its identity
// (DDP's copy into p.grad at the end of backward): rebind records the identity
// p.grad has once that write is done, which confirm() then checks as usual;
// until rebind the slot's identity matches no gradient (the step is unhandled).
//
// The ledger is not thread-safe: its owner serialises every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/grad_content.hpp"

namespace tierflow::optimizer {

/// Settings of a StepLedger (from the TIERFLOW_* table).
struct StepLedgerOptions {
  std::size_t bucket_bytes = 0;       ///< 0: auto (auto_grad_bucket_bytes, then size_buckets)
  std::size_t slice_alignment = 64;   ///< each gradient's slice of a bucket starts on this boundary
  int accumulation_steps = 1;         ///< backward passes per step()
  double max_grad_norm = 0.0;         ///< 0: no clipping by tierflow
  bool skip_nonfinite = false;        ///< skip the step on an inf/NaN gradient
};

/// Counters of the ledger (cumulative, except the `last_` and `sized_` ones).
struct StepLedgerStats {
  std::uint64_t early_steps = 0;      ///< parameters stepped during backward
  std::uint64_t committed = 0;        ///< early steps confirmed by step()
  std::uint64_t redone = 0;           ///< early steps stepped again in step()
  std::uint64_t taken_back = 0;       ///< early steps (or landed streams) discarded
  std::uint64_t held = 0;             ///< parameters not streamed or stepped: no pinned memory
  std::uint64_t buckets = 0;          ///< buckets handed to the worker
  std::uint64_t bucket_count = 0;     ///< buckets in the current plan
  std::uint64_t bucket_bytes = 0;     ///< bucket size in force
  std::uint64_t speculation_stops = 0;  ///< windows where the running norm stopped speculation
  std::uint64_t clips_picked_up = 0;  ///< gradients the user's clip scaled, kept as streamed
  std::uint64_t last_backward_ns = 0; ///< last backward, from its first gradient to its end
  double last_partial_norm = 0.0;     ///< norm of the gradients landed in the last window
  double sized_link_bytes_per_s = 0;  ///< what size_buckets chose from: the link,
  double sized_cpu_grad_bytes_per_s = 0;  ///< ... the CPU AdamW's rate,
  double sized_backward_s = 0;        ///< ... and the backward (0: not sized)
};

/// Which gradient a slot holds: an opaque identity (the tensor's
/// implementation), its version counter (bumped by most in-place writes, not
/// all) and its content (Note [Gradient content]: what the counter cannot promise).
struct GradIdentity {
  GradIdentity() = default;
  GradIdentity(std::uintptr_t id_, std::int64_t version_, GradContent content_ = {})
      : id(id_), version(version_), content(content_) {}
  std::uintptr_t id = 0;  ///< 0: no gradient (p.grad is None)
  std::int64_t version = 0;
  GradContent content;    ///< not known: the gradient counts as changed
  bool defined() const noexcept { return id != 0; }
};

/// True when `a` and `b` are the same gradient: the same tensor at the same version with the same bytes.
bool same_gradient(const GradIdentity& a, const GradIdentity& b) noexcept;

/// What to do with a gradient that backward just delivered.
enum class GradArrival {
  kIgnore,     ///< nothing: not streamed (not streamable, not the n-th, disabled, discarded)
  kTakeBack,   ///< it changed after it streamed: restore a released gradient (accumulate onto p.grad)
  kStream,     ///< stream it now
  kNeedState,  ///< stream it once the caller has created its optimizer state (then state_set)
};

/// What the worker does with a bucket whose gradients landed.
enum class Landed {
  kGone,  ///< its window ended: nothing (the results are dropped)
  kWait,  ///< speculation has stopped: step() steps them, once the norm is known
  kStep,  ///< step them now, out of place
};

/// What step() does with a slot (confirm()).
struct Confirmation {
  enum Kind { kNone, kCommit, kRedo, kUnhandled } kind = kNone;
  double scale = 1.0;  ///< kRedo: the clip coefficient to step with (grad_scale)
};

/// The torch-free ledger of the steps taken during backward; see Note [Step ledger].
class StepLedger {
 public:
  explicit StepLedger(StepLedgerOptions options);

  // -- registration ----------------------------------------------------------
  /// Registers a parameter of `bytes` gradient bytes in hyperparameter group
  /// `group`; `streamable`: its gradients may stream. Before the first plan only.
  std::size_t add(std::size_t bytes, int group, bool streamable);
  /// Stops streaming `slot` for good (it steps elsewhere); its early step, if
  /// any, is taken back and the buckets are re-cut at the next gradient.
  void exclude(std::size_t slot);
  /// Current hyperparameters of `group`.
  void set_group(int group, const AdamOptions& options);
  const AdamOptions& group_options(int group) const;
  /// The slot's optimizer state was (re)placed: an early step that read the
  /// old one must not be committed.
  void state_set(std::size_t slot);
  /// Streaming of further gradients on or off (off: gradients are only counted).
  void set_enabled(bool enabled) noexcept { enabled_ = enabled; }
  /// `slot`'s gradients stream from a reduction across processes
  /// (arrive_reduced), not from its local ones (see "Reduced gradients" above).
  void set_reduced(std::size_t slot, bool reduced);
  bool reduced(std::size_t slot) const { return slots_.at(slot).reduced; }

  // -- backward --------------------------------------------------------------
  /// A gradient arrived. Returns true for the first of a backward (the caller
  /// arranges for backward_end and pushes the groups' hyperparameters).
  bool backward_begins(std::uint64_t now_ns);
  /// A gradient of `slot` arrived: what to do with it (plans the buckets first if needed).
  GradArrival arrive(std::size_t slot);
  /// The reduced gradient of a reduced `slot` is ready (all processes'): what to do with it.
  GradArrival arrive_reduced(std::size_t slot);
  /// The reduced gradient `slot` streamed in this backward is now p.grad as
  /// `grad` (written back by the reduction): confirm() compares with it.
  /// False (nothing changed) when no reduced gradient of this backward streamed.
  bool rebind(std::size_t slot, GradIdentity grad);
  /// True when `slot` may stream now (state set, not streamed or discarded, its bucket not yet launched).
  bool may_stream(std::size_t slot) const;
  /// Its gradient's copy is queued: `grad` streamed (`released`: p.grad was set
  /// to None). Returns true when that completes its bucket (launch it).
  bool streamed(std::size_t slot, GradIdentity grad, bool released);
  /// The content of the gradient `slot` streamed, computed after streamed() (a
  /// device's result read later); ignored unless it streamed in this window.
  void streamed_content(std::size_t slot, GradContent content);
  /// True when confirm() or clip_candidate() would compare `slot`'s gradient
  /// with the one it streamed (streamed, landed or on its way, not released):
  /// the caller computes the content of p.grad for those only.
  bool compares_content(std::size_t slot) const;
  /// Hands bucket `bucket` to the worker: returns the slots to step (streamed,
  /// not discarded), or nothing if it was launched already.
  std::vector<std::size_t> launch(std::size_t bucket);
  /// Buckets with some gradients streamed but not launched (at backward's end and step()).
  std::vector<std::size_t> unlaunched() const;
  /// Backward ended at `now_ns`.
  void backward_ends(std::uint64_t now_ns);
  bool in_backward() const noexcept { return in_backward_; }
  /// The generation of the current window (given to the worker with a bucket).
  std::uint64_t generation() const noexcept { return generation_; }

  // -- worker ----------------------------------------------------------------
  /// True when the worker must sum the squares of a landed bucket.
  bool needs_norm() const noexcept;
  /// `slots` of a bucket of window `generation` landed, with `sum_sq` the sum
  /// of squares of their gradients when needs_norm().
  Landed landed(std::uint64_t generation, const std::vector<std::size_t>& slots, double sum_sq);
  /// A bucket's copies failed: `slot`'s own copy landed all the same.
  void copy_landed(std::uint64_t generation, std::size_t slot);
  /// `slot`'s own copy failed: its early step cannot run (step() takes it from p.grad).
  void copy_failed(std::size_t slot);
  /// A bucket of window `generation` was stepped early, except the `held` slots.
  void stepped_early(std::uint64_t generation, const std::vector<std::size_t>& slots,
                     const std::vector<bool>& held);
  /// No memory for a slot's stream or its out-of-place step: counted.
  void held() noexcept { stats_.held += 1; }
  /// The CPU AdamW ran `ns` over `grad_bytes` of gradients (sizes the buckets).
  void kernel_time(std::uint64_t ns, std::uint64_t grad_bytes) noexcept;

  // -- step() ----------------------------------------------------------------
  /// What step() does with `slot`, whose p.grad is `grad` now, with the clip
  /// coefficient `scale`; `stale`: the masters must be re-read (nothing streamed counts).
  Confirmation confirm(std::size_t slot, GradIdentity grad, double scale, bool stale);
  /// What confirm() would say, changing nothing (Note [Atomic step]: step() prepares before it commits).
  Confirmation verdict(std::size_t slot, const GradIdentity& grad, double scale, bool stale) const;
  /// `slot`'s early step's results were let go for room (Note [Atomic step]): step() redoes it from the
  /// landed gradient, as a held slot (counted as held).
  void forget_early(std::size_t slot);
  /// Discards every early step not yet confirmed (a forward before step()).
  void discard_all();
  /// Ends the window: resets the slots, re-cuts the buckets in the observed
  /// order after the first backward; `count_taken_back`: unconfirmed streams count as taken back.
  void end_window(bool count_taken_back);
  /// True while gradients streamed in this window wait for confirmation.
  bool has_unconfirmed() const;

  // -- the user's clip (Note [Clip picked up]) -----------------------------------
  /// A clip is about to run: `slot` (its gradient `grad` now) is a candidate if
  /// it streamed, is not released or discarded and is unchanged. Returns that.
  bool clip_candidate(std::size_t slot, GradIdentity grad);
  /// The clip ran with `max_norm`: speculation uses it from the next window on
  /// (buckets of this one may land before or after the clip; their steps do
  /// not depend on which). False when tierflow clips itself (nothing is picked up).
  bool learn_clip(double max_norm);
  /// tierflow clips the gradients itself (TIERFLOW_MAX_GRAD_NORM).
  bool clips_itself() const noexcept { return options_.max_grad_norm > 0; }
  /// The user's clip ran with `max_norm` and multiplied the gradients by `coefficient`: true when its
  /// candidates are judged next (clipped). When tierflow clips as well, a clip that changed the gradients is
  /// stepped from p.grad (learn_clip); one that multiplied them by exactly 1 changed no value and keeps the
  /// streamed steps (a norm read: transformers 5's Trainer logs grad_norm so, clip_grad_norm_(max_norm=inf), at
  /// every step).
  bool clip_ran(double max_norm, double coefficient);
  /// After the clip: a candidate whose gradient is `grad` now, scaled by
  /// `coefficient`; `exact`: multiplying by the coefficient in the kernel
  /// rounds as the clip did (fp32 gradients, or a coefficient of 1).
  void clipped(std::size_t slot, GradIdentity grad, double coefficient, bool exact);

  // -- bucket plan -----------------------------------------------------------
  /// TIERFLOW_GRAD_BUCKET_BYTES=auto between windows: re-cuts the buckets with
  /// measured_grad_bucket_bytes from the last backward, the CPU AdamW's rate
  /// of the last window and `link_bytes_per_second`. Returns the size in force.
  std::size_t size_buckets(double link_bytes_per_second);
  /// Bumped whenever the buckets are re-cut (the owner's per-bucket buffers go).
  std::uint64_t plan_id() const noexcept { return plan_id_; }
  std::size_t bucket_count() const noexcept { return buckets_.size(); }
  /// Bytes of bucket `b` (slices aligned), and where `slot`'s slice lies.
  std::size_t bucket_bytes(std::size_t b) const { return buckets_.at(b).bytes; }
  std::size_t bucket_of(std::size_t slot) const { return slots_.at(slot).bucket; }
  std::size_t offset_of(std::size_t slot) const { return slots_.at(slot).offset; }
  /// `slots` in forward order: the bucket that backward filled last first.
  std::vector<std::size_t> forward_order(std::vector<std::size_t> slots) const;

  // -- per slot --------------------------------------------------------------
  std::size_t size() const noexcept { return slots_.size(); }
  bool streamable(std::size_t slot) const { return slots_.at(slot).streamable; }
  bool is_streamed(std::size_t slot) const { return slots_.at(slot).streamed; }
  bool released(std::size_t slot) const { return slots_.at(slot).released; }
  /// A released gradient went back to p.grad.
  void restored(std::size_t slot) { slots_.at(slot).released = false; }
  int group_of(std::size_t slot) const { return slots_.at(slot).group; }
  /// The hyperparameters `slot`'s gradient streamed with (its early step's).
  const AdamOptions& options_used(std::size_t slot) const { return slots_.at(slot).options_used; }
  /// True once bucket `b` went to the worker in this window.
  bool launched(std::size_t b) const { return buckets_.at(b).launched; }

  StepLedgerStats stats() const noexcept { return stats_; }

 private:
  struct Slot {
    std::size_t bytes = 0;
    int group = 0;
    bool streamable = false;
    bool has_state = false;
    std::size_t bucket = 0, offset = 0;
    int grad_events = 0;
    bool seen = false, streamed = false, landed = false, discarded = false, spec_done = false;
    bool released = false;
    bool reduced = false;               // streams from arrive_reduced only
    std::uint64_t local_backward = 0;   // the backward of its last local arrival (0: none this window)
    std::uint64_t streamed_backward = 0;  // the backward it streamed in
    GradIdentity grad;
    std::int64_t clip_base = -1;  // its version when the user's clip began (-1: not a candidate)
    bool clipped = false;
    double clip_scale = 1.0;
    AdamOptions options_used;
  };
  struct Bucket {
    std::vector<std::size_t> slots;
    std::size_t bytes = 0;
    std::size_t arrived = 0;
    bool launched = false;
  };
  void plan();
  void take_back(Slot& s) noexcept;
  double clip_norm() const noexcept { return options_.max_grad_norm > 0 ? options_.max_grad_norm : learned_clip_norm_; }

  StepLedgerOptions options_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<AdamOptions> groups_;
  std::vector<std::size_t> arrival_;  // slots in the order their gradients came, this window
  bool planned_ = false;
  bool replanned_ = false;            // the plan follows an observed order
  std::uint64_t plan_id_ = 0;
  std::size_t sized_bucket_bytes_ = 0;  // size_buckets' choice (0: not yet)
  bool enabled_ = true;
  bool in_backward_ = false;
  std::uint64_t backward_ = 0;        // backwards begun (numbers them for reduced slots)
  bool stopped_ = false;              // speculation stopped in this window
  std::uint64_t generation_ = 0;
  std::uint64_t backward_start_ns_ = 0;
  PartialNorms partial_;
  double learned_clip_norm_ = 0.0;    // the user's clip_grad_norm_ max_norm, in force
  double next_clip_norm_ = 0.0;       // ... as last seen, in force from the next window
  std::uint64_t window_kernel_ns_ = 0, window_kernel_bytes_ = 0;
  std::uint64_t last_window_kernel_ns_ = 0, last_window_kernel_bytes_ = 0;
  StepLedgerStats stats_;
};

/// True when two sets of hyperparameters step identically.
bool same_options(const AdamOptions& a, const AdamOptions& b) noexcept;

}  // namespace tierflow::optimizer
