// Gradients stream to the CPU optimizer in buckets during backward; updated
// weights stream back to the device (Fuyou, ZeRO-Offload), all in C++.
//
// Note [Gradient streaming]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Per parameter of the runtime's device, a C++ post hook on its
// AccumulateGrad node (the node is kept alive here, so autograd reuses it)
// runs when backward has finished that parameter's gradient. No Python runs
// per parameter in steady state:
//  1. Buckets. Parameters are cut into buckets in the order backward
//     completes their gradients, sized as Note [Streamed steps]
//     (optimizer/step_engine.hpp) says. Each gradient is copied device ->
//     host, on the copy engine's D2H stream after the work queued on the
//     stream that produced it (rule 1 of Note [Copy ordering]), into its
//     slice of one pinned buffer per bucket. The device
//     gradient stays referenced until its copy has landed (rule 3). By
//     default it is also p.grad, which the user may still read, clip or scale
//     before step(). With TIERFLOW_OFFLOAD_GRADIENTS=on (torchao's
//     offload_gradients) the hook sets p.grad to None at once and this
//     stream's reference is the last one: it is dropped as soon as the copy
//     is seen complete (polled whenever a later gradient streams, at
//     backward's end, and by the worker when it waits for the bucket), so the
//     device memory of a bucket returns to the allocator while backward goes
//     on, and never
//     before its copy has read it (rule 3; the adversarial device poisons a
//     freed block at once, so an early release shows up as a wrong step).
//     The gradients of a step then live only in the pinned bucket buffers.
//     Where torch would still need one on the device, it is copied back
//     (restore_grads, rule 1 and 2 as for weights): a forward before step()
//     (the backward was not the last one of the window), a second gradient
//     into a released parameter, load_state_dict or a stale master before
//     step(), a step skipped for a non-finite gradient. Clipping needs
//     clip_grad_norm_'s per-tensor norms: the hook computes each released
//     gradient's with the same op (_foreach_norm, on the stream that produced
//     it, queued before the copy so that the copy's completion covers it),
//     and step() combines them as clip_grad_norm_ does. What cannot work is
//     user code that reads p.grad between backward() and step() (its own
//     clip_grad_norm_ sees no gradient; GradScaler is refused with an error):
//     use TIERFLOW_MAX_GRAD_NORM, TIERFLOW_SKIP_NONFINITE and bf16 instead,
//     or leave the option off. After step() p.grad stays None, as after
//     zero_grad(set_to_none=True).
//  2.-4. The bucket's step on the worker, step()'s confirmation and the weights
//     back to the device (per device, or per module with =forward): Note
//     [Streamed steps] in optimizer/step_engine.hpp.
//
// Clipping, speculation's stop and gradient accumulation: Note [Step ledger]
// in optimizer/include/tierflow/optimizer/step_ledger.hpp.
//
// What needs no torch (the buckets' pinned buffers, the worker and its
// kernels, the commits and redone steps, the timeline and the counters) is
// optimizer::StepEngine (optimizer/include/tierflow/optimizer/step_engine.hpp,
// tested without torch in tests/cpp/test_step_engine.cpp). GradStream is its
// torch adapter: the autograd hooks, the tensors and their lifetimes, p.grad
// released and restored, DDP's and FSDP2's reduced gradients, the contents
// (Notes [Gradient content], [Weight content]) and the weights' copies queued to
// the device; which copy each device and module waits for, when staging may
// go, and each slot's verdict at step() are the engine's, and the stream's
// own bookkeeping without tensors (DDP's reduced slots, when backward's end
// runs, released gradients, stale masters) is optimizer/stream_slots.hpp's.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/stats.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/step_engine.hpp"
#include "tierflow/optimizer/step_ledger.hpp"
#include "tierflow/optimizer/stream_rules.hpp"
#include "tierflow/optimizer/stream_slots.hpp"

namespace tierflow::bindings {

class GradReadyHook;

/// Settings of a GradStream (from the TIERFLOW_* table).
using GradStreamOptions = optimizer::StreamOptions;

/// Counters of the streaming path (cumulative, except the `last_` ones): the engine's.
using GradStreamStats = optimizer::StepEngineStats;
/// When one bucket of the last window moved (Note [Stream timeline] in optimizer/step_engine.hpp).
using BucketTimes = optimizer::BucketTimes;
/// The times of the last finished window (Note [Stream timeline]).
using WindowTimeline = optimizer::WindowTimeline;

/// `t` as one array of an optimizer state (optimizer::check_stream_state, moments_format); undefined: none.
optimizer::StateArrayFacts state_array_facts(const at::Tensor& t);

/// GradStreamStats' exported fields (Note [Stat fields]): nanoseconds as *_ms.
const std::vector<StatField<GradStreamStats>>& grad_stream_stat_fields();

/// The streaming CPU optimizer path of one CPUAdamW; see Note [Gradient streaming].
class GradStream : public std::enable_shared_from_this<GradStream>, private optimizer::StepEngineHost {
 public:
  /// A stream over `runtime`'s copy engine, pool and CPU Adam.
  static std::shared_ptr<GradStream> create(std::shared_ptr<Runtime> runtime, GradStreamOptions options);
  ~GradStream();
  GradStream(const GradStream&) = delete;
  GradStream& operator=(const GradStream&) = delete;

  /// Registers a parameter of hyperparameter group `group`; returns its slot.
  /// A parameter of the runtime's device that requires grad gets the hook.
  std::size_t add_parameter(const at::Tensor& param, int group);
  /// True when add_parameter would hook `param` (optimizer::param_not_streamable finds nothing).
  bool hooks(const at::Tensor& param) const;
  /// FSDP2 (Note [Distributed training]): registers `shard`, the local tensor of the DTensor parameter `owner`,
  /// which no autograd hook sees (FSDP2 assigns the sharded gradient after its reduce-scatter); its gradient
  /// only ever comes through on_reduced. Its identity is owner.grad's with both version counters: the DTensor's
  /// moves with an in-place op on it (a clip), its local tensor's with FSDP2's accumulation into it
  /// (`shard.grad`, which the feed keeps at that local tensor).
  /// Streams like a parameter when it is contiguous, of a kernel dtype and on the runtime's device.
  std::size_t add_fed_parameter(const at::Tensor& shard, const at::Tensor& owner, int group);
  /// Stops streaming `slot` for good (it steps elsewhere: the GPU share, another rank of a partitioned
  /// optimizer): waits for the worker, then lets go of the slot's state tensors.
  void exclude(std::size_t slot);
  /// The parameter of `slot` lives on the host between uses (Note [Parameter storage]): its new weights go
  /// into `home` (a CPU tensor of its dtype and size) when its step is committed, instead of to the device;
  /// an undefined `home` sends them to the device again (the parameter became resident).
  void set_home(std::size_t slot, const at::Tensor& home);
  /// Current hyperparameters of `group` (pushed when each backward begins and at step()).
  void set_group(int group, const optimizer::AdamOptions& options);
  /// The optimizer state of `slot` (CPU tensors: the master fp32, the moments
  /// in the format of their dtype, Note [Optimizer state formats]; `step` is
  /// the state's step counter tensor, shared with the Python state).
  /// `max_exp_avg_sq` (fp32) may be undefined.
  void set_state(std::size_t slot, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                 at::Tensor max_exp_avg_sq, at::Tensor step);
  /// The state tensors of `slot` now, shaped like the parameter: master, exp_avg,
  /// exp_avg_sq, max_exp_avg_sq (maybe undefined).
  std::vector<at::Tensor> state_of(std::size_t slot) const;
  /// Called (without any lock held) when a backward delivers its first gradient,
  /// and for a slot that streams before it has state (it must call set_state).
  void set_callbacks(std::function<void()> on_backward_begin, std::function<void(std::size_t)> init_state);
  /// Enables or disables streaming of the next gradients (disabled: hooks only count).
  void set_enabled(bool enabled);
  /// DDP (Note [Distributed training]): the gradients of `slots` stream from
  /// their reduction (on_reduced), not from their local hooks, and each
  /// backward's end waits for the reduction's write-back into p.grad.
  void set_reduced(const std::vector<std::size_t>& slots);
  /// A reduction finished: `flat` holds the reduced gradients of `params` one
  /// after the other (DDP's bucket layout, on the runtime's device); each one
  /// of a slot set_reduced streams from its slice. Others are skipped.
  void on_reduced(const std::vector<at::Tensor>& params, const at::Tensor& flat);
  /// FSDP2: from an autograd final callback that runs after FSDP2's own (the feed's), queues this backward's
  /// end once more, after every callback queued so far; nothing when no gradient streamed in it.
  void queue_backward_end();
  /// Registers the slots of one module's own parameters; returns its id for wait_module.
  std::size_t add_module(const std::vector<std::size_t>& slots);

  /// Waits for every bucket on the worker; rethrows the first failure.
  void wait_worker();
  /// What step() decided per slot (committed, and left to the caller).
  using Finish = optimizer::StepEngine::Finish;
  /// step() in two (Note [Atomic step]), with `scale` the clip coefficient and `stale` when the masters must be
  /// re-read from the parameters (every streamed slot is unhandled): everything that can fail (the verdicts,
  /// the redone steps' staging, released gradients the caller steps back in p.grad), changing no weight or
  /// state; returns the slots the caller steps. A failure leaves the window open. `frugal`: the early steps' out-of-place results go first
  /// and every streamed step is redone in place (room for the caller's part under a tight host budget); they
  /// go as well when the redone steps' staging finds no room beside them.
  std::vector<std::size_t> prepare_finish(double scale, bool stale, bool frugal);
  /// ... then what cannot fail: commits, redoes, sends weights back, ends the window.
  Finish commit_finish();
  /// The slots whose parameter's bytes were not what tierflow wrote last (Note [Weight content]) and that no
  /// step has stepped since, as the last prepare_finish found them: the caller re-reads their masters from
  /// the parameters when it steps them (note_written).
  /// The caller wrote these slots' parameters (the Python path's steps, its uploads complete): their bytes
  /// now are what the next step compares with.
  void note_written(const std::vector<std::size_t>& slots);
  std::vector<std::size_t> weights_changed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return weights_changed_;
  }
  /// Discards every early step not yet confirmed (a forward before step(), a
  /// skipped step); released gradients go back to p.grad (restore_grads).
  void discard_all();
  /// Puts every released gradient of this window back on the device as
  /// p.grad (p.grad set meanwhile by the user is left as it is).
  void restore_grads();
  /// clip_grad_norm_'s per-tensor norm of each released gradient (device
  /// scalars), by slot; only with clipping or skip-non-finite on.
  std::vector<std::pair<std::size_t, at::Tensor>> released_norms() const;
  /// Ends the accumulation window (zero_grad, a skipped step): discards and resets counts.
  void end_window();
  /// True while gradients streamed since the last step() wait for confirmation.
  bool has_unconfirmed() const;
  /// The user's torch.nn.utils.clip_grad_norm_ over streamed gradients (Note
  /// [Clip picked up]): begin_clip before it runs, end_clip after, with its
  /// max_norm and the coefficient it multiplied the gradients by. A gradient
  /// the clip scaled by exactly that one in-place op still counts as the one
  /// streamed, to be stepped with the coefficient as grad_scale.
  void begin_clip();
  void end_clip(double max_norm, double coefficient);
  /// TIERFLOW_WEIGHTS_RETURN=step, at each forward of the model: a compute
  /// stream other than the one current at step() (a forward under
  /// torch.cuda.stream(s)) waits for the weights still on their way.
  void wait_step_uploads();
  /// Makes the compute stream wait for the weights of module `module` (forward mode).
  void wait_module(std::size_t module);
  /// Makes the compute stream wait for every weight still on its way, and
  /// waits for their copies on the host so that staging can go.
  void synchronize();
  /// TIERFLOW_GRAD_BUCKET_BYTES=auto after a measured step: re-cuts the buckets
  /// (in the observed order) with optimizer::measured_grad_bucket_bytes from
  /// the last backward, the CPU AdamW's rate so far and `link_bytes_per_second`
  /// (device -> host, measured by the caller). Between windows only; returns
  /// the bucket size in force (unchanged with an explicit size).
  std::size_t size_buckets(double link_bytes_per_second);
  /// Counters.
  GradStreamStats stats() const;
  /// The last finished window's times (Note [Stream timeline]); empty before one finished.
  WindowTimeline last_window() const;

 private:
  friend class GradReadyHook;
  struct Slot;
  GradStream(std::shared_ptr<Runtime> runtime, GradStreamOptions options);
  // optimizer::StepEngineHost: what only torch does for the engine (grad_stream_host.cpp).
  optimizer::HostArray allocate(std::size_t bytes) override;
  void adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                 const std::vector<optimizer::KernelArrays>& arrays) override;
  std::int64_t steps_taken(std::size_t slot) override;
  void count_step(std::size_t slot) override;
  void gradient_landed(std::size_t slot) override;
  void gradient_copy_failed(std::size_t slot) override;
  swap::StreamRef compute_stream(optimizer::DeviceId device) override;
  void make_stream_wait(swap::StreamRef stream, const swap::TransferHandle& copy) override;
  /// The engine's name for `device` (its index in devices_).
  optimizer::DeviceId device_id(const c10::Device& device);

  void on_grad(std::size_t slot);
  void begin_backward(bool queue_end);
  void on_backward_end();
  bool await_reduction();
  void rebind_reduced_locked();
  optimizer::GradIdentity identity_of(std::size_t slot) const;
  std::vector<optimizer::GradContent> grad_contents_locked();
  std::vector<std::size_t> weights_changed_;
  void probe_written_locked(Slot& s, std::size_t slot);
  std::vector<std::size_t> weights_changed_locked();
  void stream_locked(std::size_t slot);
  void stream_from_locked(std::size_t slot, const at::Tensor& grad, bool reduced);
  void reset_window_locked(bool count_taken_back);
  void upload_locked(const std::vector<std::size_t>& committed);
  void release_landed_locked();
  void count_freed_locked();
  void restore_locked(std::size_t slot, bool accumulate);
  at::Tensor staging_of(std::size_t slot) const;

  std::shared_ptr<Runtime> runtime_;
  GradStreamOptions options_;
  // The buckets, the worker, the commits and redone steps, the timeline (Note [Stream timeline]) and the
  // counters; its mutex guards this stream too, its ledger decides what happens to each step (Note [Step ledger]).
  std::unique_ptr<optimizer::StepEngine> engine_;
  std::mutex& mutex_;
  optimizer::StepLedger& ledger_;
  std::vector<Slot> slots_;              // the tensors of each engine slot
  optimizer::ReleasedGrads releasing_;   // released slots whose device gradient waits for its copy
  optimizer::WrittenWeights written_;    // Note [Weight content]: whose masters are stale
  std::vector<c10::Device> devices_;     // the engine's DeviceIds: the devices weights were sent to
  optimizer::ReducedSlots reduced_;      // slots set_reduced (DDP), by parameter (its TensorImpl)
  optimizer::BackwardEnds ends_;         // when on_backward_end is queued
  std::function<void()> on_backward_begin_;
  std::function<void(std::size_t)> init_state_;
};

}  // namespace tierflow::bindings
