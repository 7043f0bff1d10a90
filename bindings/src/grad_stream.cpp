// See Note [Gradient streaming] in grad_stream.hpp.
#include "tierflow/bindings/grad_stream.hpp"

#include "grad_stream_parts.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else  // torch before 2.12 (a GPU image's 2.11) declares Node in function.h
#include <torch/csrc/autograd/function.h>
#endif
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <utility>

#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/optimizer/stream_rules.hpp"

namespace tierflow::bindings {

/// The post hook on a parameter's AccumulateGrad node: backward has finished its gradient.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<GradStream> stream, std::size_t slot) : stream_(std::move(stream)), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto s = stream_.lock()) s->on_grad(slot_);
    return outputs;
  }

 private:
  std::weak_ptr<GradStream> stream_;  // the hook may outlive the optimizer in a graph still alive
  std::size_t slot_;
};

std::shared_ptr<GradStream> GradStream::create(std::shared_ptr<Runtime> runtime, GradStreamOptions options) {
  return std::shared_ptr<GradStream>(new GradStream(std::move(runtime), options));
}

namespace {
// The kernel type a parameter's new weights are written in (float32 when it has none: it never streams).
optimizer::ScalarType weight_type(const at::Tensor& param) {
  return kernel_type(param.scalar_type()).value_or(optimizer::ScalarType::kFloat32);
}
}  // namespace

GradStream::GradStream(std::shared_ptr<Runtime> runtime, GradStreamOptions options)
    : runtime_(std::move(runtime)),
      options_(options),
      engine_(std::make_unique<optimizer::StepEngine>(static_cast<const optimizer::StepEngineOptions&>(options),
                                                      static_cast<optimizer::StepEngineHost&>(*this))),
      mutex_(engine_->mutex()),
      ledger_(engine_->ledger()) {
  TIERFLOW_EXPECTS(runtime_ != nullptr, "GradStream: no runtime");
}

GradStream::~GradStream() {
  try {
    engine_->drain_unlocked();
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("a streamed optimizer step failed at shutdown: ") + e.what());
  }
  // Waits for the weights' uploads still reading their staging, and for the gradients' copies still reading
  // device memory a slot may hold last (rule 3).
  engine_.reset();
  for (auto& s : slots_)
    if (s.accumulator) s.accumulator->del_post_hook(s.hook_key);
}

bool GradStream::hooks(const at::Tensor& param) const {
  optimizer::ParamFacts f;  // each fact read only where the ones before it hold
  if ((f.requires_grad = param.requires_grad()) && (f.leaf = param.is_leaf()) &&
      (f.contiguous = param.is_contiguous()) && (f.type = kernel_type(param.scalar_type())))
    f.on_device = runtime_->on_device(param);
  return !optimizer::param_not_streamable(f);
}

std::size_t GradStream::add_parameter(const at::Tensor& param, int group) {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool streamable = hooks(param);
  const std::size_t slot = engine_->add(static_cast<std::size_t>(param.numel()), param.nbytes(), weight_type(param),
                                        group, streamable);
  Slot s;
  s.param = param;
  if (streamable) {
    s.accumulator = torch::autograd::impl::grad_accumulator(param);
    TIERFLOW_EXPECTS(s.accumulator, "GradStream: parameter " + std::to_string(slot) + " has no gradient accumulator");
    s.hook_key = s.accumulator->add_post_hook(std::make_unique<GradReadyHook>(weak_from_this(), slot));
  }
  slots_.push_back(std::move(s));
  written_.resize(slots_.size());
  return slot;
}

std::size_t GradStream::add_fed_parameter(const at::Tensor& shard, const at::Tensor& owner, int group) {
  std::lock_guard<std::mutex> lock(mutex_);
  optimizer::ParamFacts f;  // no hook: requires_grad and a leaf's accumulator are FSDP2's DTensor's, not its shard's
  f.requires_grad = f.leaf = true;
  if ((f.contiguous = shard.is_contiguous()) && (f.type = kernel_type(shard.scalar_type())))
    f.on_device = runtime_->on_device(shard);
  const std::size_t slot = engine_->add(static_cast<std::size_t>(shard.numel()), shard.nbytes(), weight_type(shard),
                                        group, !optimizer::param_not_streamable(f));
  Slot s;
  s.param = shard;
  s.owner = owner;
  slots_.push_back(std::move(s));
  written_.resize(slots_.size());
  return slot;
}

optimizer::GradIdentity GradStream::identity_of(std::size_t i) const {
  const Slot& s = slots_[i];
  if (!s.owner.defined()) return grad_identity(s.param.grad());
  const at::Tensor grad = s.owner.grad();
  if (!grad.defined()) return {};
  const at::Tensor local = s.param.grad();
  return {reinterpret_cast<std::uintptr_t>(grad.unsafeGetTensorImpl()),
          static_cast<std::int64_t>(grad._version() + (local.defined() ? local._version() : 0))};
}

std::vector<optimizer::GradContent> GradStream::grad_contents_locked() {
  // Note [Gradient content]: p.grad's bytes now, for the slots whose confirm (or clip) compares them, read
  // with the streamed ones' device results in one transfer per device.
  const std::uint64_t t0 = now_ns();
  std::vector<ContentProbe> now(slots_.size());
  std::vector<ContentProbe*> pending;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!ledger_.compares_content(i)) continue;
    Slot& s = slots_[i];
    const at::Tensor grad = s.param.grad();  // FSDP2's: the local tensor of the owner's gradient
    now[i] = ContentProbe::of(grad);  // not contiguous (other strides, same values): not known, stepped again
    for (ContentProbe* p : {&now[i], &s.streamed_content})
      if (p->pending()) pending.push_back(p);
  }
  ContentProbe::resolve(pending);
  std::vector<optimizer::GradContent> out(slots_.size());
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!ledger_.compares_content(i)) continue;
    ledger_.streamed_content(i, slots_[i].streamed_content.get());
    out[i] = now[i].get();
  }
  engine_->counters().content_check_ns += now_ns() - t0;
  return out;
}

void GradStream::set_home(std::size_t slot, const at::Tensor& home) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::set_home: slot " + std::to_string(slot));
  const at::Tensor& param = slots_[slot].param;
  TIERFLOW_EXPECTS(!home.defined() || (home.is_cpu() && home.is_contiguous() &&
                                        home.scalar_type() == param.scalar_type() && home.numel() == param.numel()),
                   "GradStream::set_home: the home of slot " + std::to_string(slot) +
                       " must be a contiguous CPU tensor of its parameter's dtype and size");
  slots_[slot].home = home;
}

void GradStream::exclude(std::size_t slot) {
  engine_->drain_unlocked();  // no step of this slot is running (a failed one's error surfaces here, as in wait_worker)
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::exclude: no slot " + std::to_string(slot));
  restore_locked(slot, false);  // a released gradient steps elsewhere, from p.grad
  ledger_.exclude(slot);
  // Its states are no longer the stream's: whoever steps it keeps them (the GPU share moves them to the device;
  // a partitioned optimizer's other rank has its own), so the host pool gets them back once Python lets go too.
  engine_->drop_state(slot);
  slots_[slot].step = at::Tensor();
}

void GradStream::set_group(int group, const optimizer::AdamOptions& options) {
  std::lock_guard<std::mutex> lock(mutex_);
  ledger_.set_group(group, options);
}

void GradStream::set_state(std::size_t slot, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                           at::Tensor max_exp_avg_sq, at::Tensor step) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::set_state: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  const optimizer::StateFormat format = optimizer::check_stream_state(  // throws naming what is wrong
      slot, static_cast<std::size_t>(s.param.numel()), state_array_facts(master), state_array_facts(exp_avg),
      state_array_facts(exp_avg_sq), state_array_facts(max_exp_avg_sq),
      step.defined() && step.is_cpu() && step.numel() == 1);
  engine_->set_state(slot, host_array(master), host_array(exp_avg), host_array(exp_avg_sq),
                     host_array(max_exp_avg_sq), format);  // tells the ledger (state_set)
  s.step = std::move(step);
  s.written = s.home.defined() ? ContentProbe() : ContentProbe::of(s.param);  // the master's source (Note [Weight content])
  s.probe_after_upload = false;
  written_.reread(slot);
}

void GradStream::note_written(const std::vector<std::size_t>& slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i : slots) {
    TIERFLOW_EXPECTS(i < slots_.size(), "GradStream::note_written: no slot " + std::to_string(i));
    Slot& s = slots_[i];
    s.written = s.home.defined() ? ContentProbe() : ContentProbe::of(s.param);
    s.probe_after_upload = false;
    written_.reread(i);  // its master was re-read and stepped
  }
}

std::vector<at::Tensor> GradStream::state_of(std::size_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::state_of: no slot " + std::to_string(slot));
  const Slot& s = slots_[slot];
  // Shaped like the parameter, as torch.optim keeps its state (the stream works on flat views).
  // An 8-bit moment stays the one flat buffer it is (codes, then scales).
  auto shaped = [&](const at::Tensor& t) {
    return t.defined() && t.numel() == s.param.numel() && t.scalar_type() != at::kByte ? t.view(s.param.sizes()) : t;
  };
  const std::vector<optimizer::HostArray> state = engine_->state_of(slot);
  const at::ScalarType moment = moment_dtype(engine_->format_of(slot));
  return {shaped(tensor_of(state[0], at::kFloat)), shaped(tensor_of(state[1], moment)),
          shaped(tensor_of(state[2], moment)), shaped(tensor_of(state[3], at::kFloat))};
}

void GradStream::set_callbacks(std::function<void()> on_backward_begin, std::function<void(std::size_t)> init_state) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_backward_begin_ = std::move(on_backward_begin);
  init_state_ = std::move(init_state);
}

void GradStream::set_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  ledger_.set_enabled(enabled);
}

std::size_t GradStream::add_module(const std::vector<std::size_t>& slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i : slots)
    TIERFLOW_EXPECTS(i < slots_.size(), "GradStream::add_module: no slot " + std::to_string(i));
  return engine_->add_module(slots);
}

void GradStream::begin_backward(bool queue_end) {
  bool first = false, queue = false;
  std::function<void()> begin;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::uint64_t now = now_ns();
    first = engine_->backward_begins(now);  // Note [Stream timeline]'s start
    if (first) begin = on_backward_begin_;
    queue = ends_.queue(queue_end);
  }
  if (queue) {  // on the autograd thread only (a reduction may come on another: on_reduced)
    std::weak_ptr<GradStream> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto s = weak.lock()) s->on_backward_end();
    });
  }
  if (first && begin) begin();  // pushes the groups' current hyperparameters (Python, once per backward)
}

void GradStream::on_grad(std::size_t i) {
  begin_backward(true);
  std::function<void(std::size_t)> init;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const optimizer::GradArrival what = ledger_.arrive(i);
    engine_->sync_buckets();
    switch (what) {
      case optimizer::GradArrival::kIgnore:
        return;
      case optimizer::GradArrival::kTakeBack:
        restore_locked(i, true);  // p.grad holds only the new part: add the released one
        return;
      case optimizer::GradArrival::kStream:
        stream_locked(i);
        return;
      case optimizer::GradArrival::kNeedState:
        init = init_state_;
        break;
    }
  }
  if (!init) return;
  init(i);  // first step only: the Python state is created, and set_state called
  std::lock_guard<std::mutex> lock(mutex_);
  stream_locked(i);
}

void GradStream::stream_locked(std::size_t i) {
  const at::Tensor grad = slots_[i].param.grad();  // a copy: p.grad may be released below
  stream_from_locked(i, grad, false);
}

void GradStream::stream_from_locked(std::size_t i, const at::Tensor& grad, bool reduced) {
  // `reduced`: `grad` is the reduction's result, not p.grad (its identity comes with rebind).
  if (!ledger_.may_stream(i)) return;
  Slot& s = slots_[i];
  optimizer::GradFacts g;  // each fact read only where the ones before it hold
  if ((g.defined = grad.defined()) && !(g.sparse = grad.is_sparse()) && (g.contiguous = grad.is_contiguous())) {
    g.numel = static_cast<std::size_t>(grad.numel());
    g.param_numel = static_cast<std::size_t>(s.param.numel());
    g.type = kernel_type(grad.scalar_type());
    g.on_device = g.numel == g.param_numel && g.type && runtime_->on_device(grad);
  }
  if (optimizer::grad_not_streamable(g)) return;  // step() takes it through the Python path, naming what it refuses
  const optimizer::HostArray slice = engine_->stage_gradient(i, *g.type, grad.nbytes());
  if (!slice.defined()) return;  // no room for its bucket: held, step() steps it from p.grad
  // Earlier gradients whose copies are done go now; not this one: autograd
  // still holds it until this hook returns.
  release_landed_locked();
  const at::Tensor host = tensor_of(slice, grad.scalar_type());
  // After the work queued on the stream that produced the gradient (rule 1).
  // clip_grad_norm_'s op, queued before the copy: the copy's completion then
  // covers it too, and the gradient can go once the copy is done.
  const bool release = options_.offload_gradients && !reduced;
  if (release && (options_.max_grad_norm > 0 || options_.skip_nonfinite))
    s.norm = at::_foreach_norm({grad}, 2)[0];
  engine_->gradient_copied(i, runtime_->copy_to_host(host, grad.view(-1)));
  s.grad_ref = grad;  // alive until the copy has landed (rule 3)
  if (release) {
    s.param.mutable_grad() = at::Tensor();  // p.grad is None; our reference goes once the copy is done
    s.grad_storage = std::make_unique<c10::weak_intrusive_ptr<c10::StorageImpl>>(grad.storage().getWeakStorageImpl());
    s.grad_bytes = grad.nbytes();
    s.freed_counted = false;
    releasing_.add(*engine_, i);
  }
  // DDP writes the reduced values into p.grad later (rebind); FSDP2 assigned its gradient before the feed: a
  // change after this (an accumulation by a later reduce-scatter, an in-place op) is a change at confirm.
  optimizer::GradIdentity identity =
      !reduced ? grad_identity(grad) : (s.owner.defined() ? identity_of(i) : optimizer::GradIdentity{});
  // What it streamed, by content (Note [Gradient content]): a write no version counter shows is a change at
  // confirm. Read on the stream that produced it, before anything later can write it; a device's result is
  // read in step(). A released gradient is gone from p.grad: nothing to compare.
  const std::uint64_t tc = now_ns();
  s.streamed_content = release ? ContentProbe() : ContentProbe::of(grad.view(-1));
  engine_->counters().content_check_ns += now_ns() - tc;
  if (!s.streamed_content.pending()) identity.content = s.streamed_content.get();
  engine_->streamed(i, identity, release);  // launches its bucket when it was the last
}

void GradStream::on_backward_end() {
  if (await_reduction()) return;  // queued again, after DDP's write-back (grad_stream_reduced.cpp)
  std::lock_guard<std::mutex> lock(mutex_);
  ends_.ended();
  rebind_reduced_locked();
  engine_->backward_ends(now_ns());
  release_landed_locked();
  count_freed_locked();
  engine_->launch_unlaunched();
}

void GradStream::wait_worker() {
  engine_->wait_worker_unlocked(false);  // Note [Stream timeline]: step()'s wait
  std::lock_guard<std::mutex> lock(mutex_);
  count_freed_locked();
}

bool GradStream::has_unconfirmed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ledger_.has_unconfirmed();
}

void GradStream::discard_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < slots_.size(); ++i) restore_locked(i, false);  // the next backward accumulates into it
  ledger_.discard_all();
}

void GradStream::restore_grads() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < slots_.size(); ++i) restore_locked(i, false);
}

std::vector<std::pair<std::size_t, at::Tensor>> GradStream::released_norms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::size_t, at::Tensor>> out;
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (ledger_.released(i) && slots_[i].norm.defined()) out.emplace_back(i, slots_[i].norm);
  return out;
}

void GradStream::count_freed_locked() {
  // A released gradient's storage is freed when its last holder lets go: this
  // stream once the copy is done, autograd once the node's hooks have
  // returned, or a user who kept `g = p.grad`. Counted once it is gone.
  for (auto& s : slots_) {
    if (!s.freed_counted && s.grad_storage && !s.grad_ref.defined() && s.grad_storage->expired()) {
      engine_->counters().grad_bytes_freed += s.grad_bytes;
      s.freed_counted = true;
    }
  }
}

void GradStream::release_landed_locked() {
  for (std::size_t i : releasing_.take_landed(*engine_, [&](std::size_t k) { return slots_[k].grad_ref.defined(); }))
    slots_[i].grad_ref = at::Tensor();
}

void GradStream::restore_locked(std::size_t i, bool accumulate) {
  if (!ledger_.released(i)) return;
  Slot& s = slots_[i];
  ledger_.restored(i);
  s.norm = at::Tensor();
  const at::Tensor current = s.param.grad();
  if (current.defined() && !accumulate) return;  // the user set p.grad meanwhile: theirs stands
  at::Tensor g = s.grad_ref;  // still on the device: no copy needed
  if (!g.defined()) {
    engine_->copy_of(i).wait();  // its bytes are on the host (rethrows a failed copy)
    const at::Tensor host = tensor_of(engine_->host_grad_of(i), torch_type(engine_->grad_type_of(i)));
    g = at::empty(s.param.sizes(), s.param.options().dtype(host.scalar_type()));
    // After the kernels queued so far, and before the next one (rules 1 and 2);
    // the host slice stays until the copy is done (rule 3).
    engine_->keep_until_done(runtime_->copy_to_device(g.view(-1), host), host_array(host));
  }
  g = g.view(s.param.sizes());
  if (current.defined()) {
    current.add_(g);  // as AccumulateGrad would have: old + new
  } else {
    s.param.mutable_grad() = g;
    // The streamed bytes (nothing wrote them while p.grad was None): compared at confirm like any gradient's.
    if (g.is_same(s.grad_ref)) s.streamed_content = ContentProbe::of(g.view(-1));
  }
  engine_->counters().grads_restored += 1;
}

void GradStream::end_window() {
  std::exception_ptr error;
  try {
    engine_->drain_unlocked();
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    reset_window_locked(true);
  }
  if (error) std::rethrow_exception(error);
}

void GradStream::reset_window_locked(bool count_taken_back) {
  // Copies of released gradients must be done before their memory goes (rule 3); the engine waits for its
  // buckets' own.
  // Note [Stall timeout]: one that stalled may still read its device gradient: kept for good, and the stall
  // is raised once the window is reset.
  const optimizer::ReleasedGrads::Waited waited = releasing_.wait_all(*engine_);
  for (std::size_t i : waited.stalled)
    if (slots_[i].grad_ref.defined())
      keep_forever(std::make_shared<at::Tensor>(slots_[i].grad_ref), slots_[i].grad_ref.nbytes(),
                   "a device gradient under a stalled copy");
  count_freed_locked();
  for (auto& s : slots_) {
    s.grad_ref = s.norm = at::Tensor();
    s.grad_storage.reset();
  }
  ends_.reset();  // a backward that failed never ran its end
  engine_->end_window(count_taken_back);  // the ledger's end_window, the timeline's (Note [Stream timeline])
  if (waited.stall) std::rethrow_exception(waited.stall);
}

WindowTimeline GradStream::last_window() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return engine_->last_window();
}

}  // namespace tierflow::bindings
