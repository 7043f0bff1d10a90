// GradStream's step(): the confirmation of the early steps (Note [Step
// ledger]), the redone steps, the weights back to the device, the user's clip
// (Note [Clip picked up]) and the bucket sizing. See Note [Gradient streaming]
// in grad_stream.hpp.
#include <algorithm>
#include <utility>

#include "grad_stream_parts.hpp"
#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/stream_rules.hpp"

namespace tierflow::bindings {

GradStream::Finish GradStream::finish(double scale, bool stale) {
  prepare_finish(scale, stale, false);
  return commit_finish();
}

std::vector<std::size_t> GradStream::prepare_finish(double scale, bool stale, bool frugal) {
  // Note [Atomic step]: everything that can fail, and nothing a caller sees: the verdicts, the redone steps'
  // staging; a released gradient the caller steps goes back to p.grad. A failure leaves the window open (a
  // retry prepares again); the commit then cannot fail.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (std::size_t b : ledger_.unlaunched()) launch_locked(b);  // a backward that ended without its callback
  }
  const std::uint64_t t0 = now_ns();
  worker_->drain();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t drained = now_ns();
  stats_.step_wait_ns += drained - t0;
  if (clock_.start != 0) clock_.worker_done = drained;  // Note [Stream timeline]: buckets launched here included
  count_freed_locked();
  wait_uploads_locked();
  prepared_ = Prepared{};
  prepared_.scale = scale;
  prepared_.stale = stale;
  weights_changed_ = weights_changed_locked();
  std::vector<std::size_t> unhandled;
  const std::vector<optimizer::GradContent> contents = grad_contents_locked();
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!ledger_.streamable(i)) continue;
    Slot& s = slots_[i];
    // The caller re-reads the master and takes p.grad (a released one back first: the identity is p.grad's then).
    if (stale || s.master_stale) restore_locked(i, false);
    optimizer::GradIdentity now = identity_of(i);
    now.content = contents[i];
    const optimizer::Confirmation c = ledger_.verdict(i, now, scale, stale);
    prepared_.slots.push_back({i, now, c.kind});
    if (c.kind == optimizer::Confirmation::kUnhandled) {
      restore_locked(i, false);  // the caller steps it from p.grad
      unhandled.push_back(i);
      // Never committed: their pinned room goes to what the step needs (a tight host budget holds one or the other).
      s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = s.staging = at::Tensor();
    } else if (c.kind == optimizer::Confirmation::kRedo) {
      s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = at::Tensor();  // redone in place
    }
  }
  // The early steps' out-of-place results are an optimisation: with `frugal`, or when the redone steps'
  // staging finds no room beside them, they go and their steps are redone in place from the landed gradients
  // (the same kernel on the same values: the same bits).
  auto let_early_results_go = [&] {
    for (auto& p : prepared_.slots) {
      if (p.kind != optimizer::Confirmation::kCommit) continue;
      Slot& s = slots_[p.slot];
      s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = at::Tensor();
      ledger_.forget_early(p.slot);
      p.kind = optimizer::Confirmation::kRedo;
    }
  };
  if (frugal) let_early_results_go();
  auto allocate_staging = [&] {
    for (const auto& p : prepared_.slots) {
      Slot& s = slots_[p.slot];
      if (p.kind == optimizer::Confirmation::kRedo && !s.staging.defined())
        s.staging = runtime_->host_empty({s.param.numel()}, s.param.scalar_type(), false);
    }
  };
  try {
    allocate_staging();
  } catch (const out_of_memory&) {
    if (frugal) throw;
    let_early_results_go();
    allocate_staging();
  }
  prepared_.ready = true;
  return unhandled;
}

GradStream::Finish GradStream::commit_finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(prepared_.ready, "GradStream::commit_finish: no prepare_finish before it");
  prepared_.ready = false;
  Finish out;
  std::vector<std::pair<std::size_t, double>> redo;  // with the clip coefficient each is stepped with
  for (const auto& p : prepared_.slots) {
    const std::size_t i = p.slot;
    Slot& s = slots_[i];
    const optimizer::Confirmation c = ledger_.confirm(i, p.identity, prepared_.scale, prepared_.stale);
    TIERFLOW_EXPECTS(c.kind == p.kind, "GradStream::commit_finish: slot " + std::to_string(i) +
                                           "'s verdict changed since prepare_finish");
    switch (c.kind) {
      case optimizer::Confirmation::kNone:
        break;
      case optimizer::Confirmation::kCommit:
        s.master = s.out_master;
        s.exp_avg = s.out_exp_avg;
        s.exp_avg_sq = s.out_exp_avg_sq;
        if (s.out_max_exp_avg_sq.defined()) s.max_exp_avg_sq = s.out_max_exp_avg_sq;
        s.step.add_(1);
        out.committed.push_back(i);
        break;
      case optimizer::Confirmation::kRedo:
        redo.emplace_back(i, c.scale);
        break;
      case optimizer::Confirmation::kUnhandled:
        out.unhandled.push_back(i);
        break;
    }
  }
  prepared_.slots.clear();
  redo_locked(redo, out.committed);
  upload_locked(out.committed);
  reset_window_locked(false);
  return out;
}

void GradStream::redo_locked(const std::vector<std::pair<std::size_t, double>>& redo,
                             std::vector<std::size_t>& committed) {
  // Stepped here from the gradients already on the host, with the clip
  // coefficient: the same kernel on the same values as the Python path. One
  // call per (group, coefficient, step number).
  std::uint64_t adam_ns = 0, adam_bytes = 0;
  std::vector<optimizer::KernelStep> keys;
  for (const auto& [i, scale] : redo) {
    const int group = ledger_.group_of(i);
    optimizer::AdamOptions o = ledger_.group_options(group);
    if (scale != 1.0) o.grad_scale = scale;
    keys.push_back({static_cast<std::int64_t>(slots_[i].step.item<float>()) + 1, o, group, false});
  }
  for (const auto& call : optimizer::group_kernel_calls(keys)) {
    const optimizer::KernelStep& key = keys[call.front()];
    std::vector<at::Tensor> masters, ms, vs, vmaxes, grads, outs;
    for (std::size_t k : call) {
      Slot& s = slots_[redo[k].first];
      if (!s.staging.defined()) s.staging = runtime_->host_empty({s.param.numel()}, s.param.scalar_type(), false);
      masters.push_back(s.master);
      ms.push_back(s.exp_avg);
      vs.push_back(s.exp_avg_sq);
      vmaxes.push_back(key.options.amsgrad ? s.max_exp_avg_sq : at::Tensor());
      grads.push_back(s.host_grad);
      outs.push_back(s.staging);
      adam_bytes += s.host_grad.nbytes();
    }
    const std::uint64_t tk = now_ns();
    runtime_->adam_step(key.options, key.step, masters, ms, vs, vmaxes, grads, outs);
    adam_ns += now_ns() - tk;
    for (std::size_t k : call) {
      slots_[redo[k].first].step.add_(1);
      committed.push_back(redo[k].first);
    }
  }
  stats_.step_kernel_ns += adam_ns;
  stats_.kernel_grad_bytes += adam_bytes;
  ledger_.kernel_time(adam_ns, adam_bytes);
}

void GradStream::wait_uploads_locked() {
  const std::uint64_t t0 = now_ns();
  for (auto& [h, staging] : uploads_) h.wait();
  uploads_.clear();
  // Copies seen complete on the host are complete for any kernel queued from now on.
  for (auto& s : slots_) s.upload_pending = false;
  stats_.weight_wait_ns += now_ns() - t0;
}

void GradStream::upload_locked(const std::vector<std::size_t>& committed) {
  const auto& engine = runtime_->copy_engine();
  std::vector<std::size_t> sent;
  for (std::size_t i : ledger_.forward_order(committed)) {  // forward order: the first layers first
    Slot& s = slots_[i];
    if (!s.staging.defined()) continue;
    if (s.home.defined()) {  // on the host between uses: the next fetch copies it (Note [Parameter storage])
      s.home.view(-1).copy_(s.staging.view(-1));
      s.written = ContentProbe();  // (its weight lives in the home: not checked, Note [Weight content])
      stats_.weight_bytes_to_host_copy += s.param.nbytes();
      continue;
    }
    const swap::StreamRef compute = compute_stream_of(*engine, s.param.device());
    // After the kernels still reading the old value (rule 1).
    s.upload = engine->copy(swap::Direction::kHostToDevice, s.param.data_ptr(), s.staging.data_ptr(),
                            s.param.nbytes(), {}, compute);
    // Note [Weight content]: the bytes on their way are the staging's. On the host (the emulated device) read
    // them now; a GPU reads the parameter once its compute stream waits for the copy (below, or wait_module).
    s.probe_after_upload = !s.param.is_cpu();
    const std::uint64_t tw = now_ns();
    s.written = s.probe_after_upload ? ContentProbe() : ContentProbe::of(s.staging);
    stats_.content_check_ns += now_ns() - tw;
    s.upload_pending = true;
    s.upload_seq = ++upload_seq_;
    uploads_.emplace_back(s.upload, s.staging);  // staging stays until the copy is done (rule 3)
    stats_.weight_bytes_to_device += s.param.nbytes();
    sent.push_back(i);
  }
  if (options_.weights_in_forward) return;  // each module's forward waits for its own (wait_module)
  if (sent.empty()) return;
  const std::uint64_t t0 = now_ns();
  // Rule 2; host -> device copies complete in submission order, so one event
  // per device's compute stream: that of the last copy sent to it.
  std::vector<std::pair<c10::Device, std::size_t>> last;
  for (std::size_t i : sent) {
    slots_[i].upload_pending = false;
    const c10::Device d = slots_[i].param.device();
    auto it = std::find_if(last.begin(), last.end(), [&](const auto& l) { return l.first == d; });
    if (it == last.end()) last.emplace_back(d, i);
    else it->second = i;
  }
  step_uploads_.clear();
  waited_streams_.clear();
  for (const auto& [d, i] : last) {
    const swap::StreamRef compute = compute_stream_of(*engine, d);
    engine->make_stream_wait(compute, slots_[i].upload);
    step_uploads_.emplace_back(d, slots_[i].upload);
    waited_streams_.emplace_back(d, compute.native());
  }
  for (std::size_t i : sent) probe_written_locked(slots_[i]);  // after the compute streams' waits
  stats_.weight_wait_ns += now_ns() - t0;
}

void GradStream::wait_step_uploads() {
  std::lock_guard<std::mutex> lock(mutex_);
  step_uploads_.erase(std::remove_if(step_uploads_.begin(), step_uploads_.end(),
                                     [](const auto& u) { return u.second.ready(); }),
                      step_uploads_.end());
  if (step_uploads_.empty()) return;
  const auto& engine = runtime_->copy_engine();
  for (const auto& [device, upload] : step_uploads_) {
    const swap::StreamRef compute = compute_stream_of(*engine, device);
    const std::pair<c10::Device, void*> key(device, compute.native());
    if (std::find(waited_streams_.begin(), waited_streams_.end(), key) != waited_streams_.end()) continue;
    engine->make_stream_wait(compute, upload);  // rule 2, for a reader on another stream
    waited_streams_.push_back(key);
  }
}

void GradStream::begin_clip() {
  // Per device, the candidate whose copy was sent last: copies in one
  // direction complete in submission order (Note [Copy ordering]).
  std::vector<std::pair<c10::Device, const Slot*>> last;
  std::vector<std::pair<c10::Device, swap::TransferHandle>> copies;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::vector<optimizer::GradContent> contents = grad_contents_locked();  // changed since the copy?
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      optimizer::GradIdentity now = identity_of(i);
      now.content = contents[i];
      if (!ledger_.clip_candidate(i, now)) continue;
      const c10::Device d = s.param.device();
      auto it = std::find_if(last.begin(), last.end(), [&](const auto& l) { return l.first == d; });
      if (it == last.end()) last.emplace_back(d, &s);
      else if (s.copy_seq > it->second->copy_seq) it->second = &s;
    }
    for (const auto& [d, s] : last) copies.emplace_back(d, s->copy);
  }
  // The clip writes the gradients in place on the compute stream: after their
  // copies have read them (rule 2 of Note [Copy ordering]), or the host copy
  // stepped with the coefficient could already hold the clipped values.
  const auto& engine = runtime_->copy_engine();
  for (const auto& [device, copy] : copies) engine->make_stream_wait(compute_stream_of(*engine, device), copy);
}

void GradStream::end_clip(double max_norm, double coefficient) {
  std::lock_guard<std::mutex> lock(mutex_);
  // tierflow clips as well: a clip that changed the gradients is stepped from p.grad; one that multiplied them by
  // exactly 1 changed no value and keeps the streamed steps (a norm read: transformers 5's Trainer logs grad_norm
  // so, clip_grad_norm_(max_norm=inf), at every step).
  const bool unchanged = ledger_.clips_itself() && coefficient == 1.0;
  if (!unchanged && !ledger_.learn_clip(max_norm)) return;
  const std::vector<optimizer::GradContent> contents = grad_contents_locked();  // the clip's bytes
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const at::Tensor grad = slots_[i].param.grad();
    // The kernel's fp32 grad * grad_scale rounds as torch's multiply only for
    // fp32 gradients; a coefficient of exactly 1 changes no value in any type.
    const bool exact = grad.defined() && grad.scalar_type() == at::kFloat;
    optimizer::GradIdentity now = identity_of(i);
    now.content = contents[i];
    ledger_.clipped(i, now, coefficient, exact);
  }
}

void GradStream::wait_module(std::size_t module) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(module < modules_.size(), "GradStream::wait_module: no module " + std::to_string(module));
  const std::uint64_t t0 = now_ns();
  const auto& engine = runtime_->copy_engine();
  // Host -> device copies complete in submission order: waiting for the one
  // sent last waits for all of the module's (rule 2, one event per module).
  Slot* last = nullptr;
  for (std::size_t i : modules_[module]) {
    Slot& s = slots_[i];
    if (!s.upload_pending) continue;
    if (!last || s.upload_seq > last->upload_seq) last = &s;
    s.upload_pending = false;
  }
  // (A module's parameters are on one device: the runtime's.)
  if (last) engine->make_stream_wait(compute_stream_of(*engine, last->param.device()), last->upload);
  for (std::size_t i : modules_[module]) probe_written_locked(slots_[i]);
  stats_.weight_wait_ns += now_ns() - t0;
}

void GradStream::probe_written_locked(Slot& s) {
  if (!s.probe_after_upload) return;
  s.probe_after_upload = false;
  if (s.upload_pending)  // its compute stream has not waited for it yet
    runtime_->copy_engine()->make_stream_wait(compute_stream_of(*runtime_->copy_engine(), s.param.device()), s.upload);
  s.written = ContentProbe::of(s.param);
}

std::vector<std::size_t> GradStream::weights_changed_locked() {
  // Note [Weight content]: a parameter whose bytes are not what tierflow wrote last was written by the user.
  const std::uint64_t t0 = now_ns();
  std::vector<ContentProbe> now(slots_.size());
  std::vector<ContentProbe*> pending;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    probe_written_locked(s);
    if (!s.written.pending() && !s.written.get().known) continue;
    now[i] = ContentProbe::of(s.param);
    for (ContentProbe* p : {&now[i], &s.written})
      if (p->pending()) pending.push_back(p);
  }
  ContentProbe::resolve(pending);
  std::vector<std::size_t> changed;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.written.get().known && !optimizer::same_content(now[i].get(), s.written.get())) {
      s.master_stale = true;  // until a step re-reads it (note_written), whatever steps come without its gradient
      s.written = ContentProbe();
    }
    if (!s.master_stale) continue;
    changed.push_back(i);
    if (ledger_.is_streamed(i)) ledger_.state_set(i);  // an early step read the old master: stepped again
  }
  stats_.content_check_ns += now_ns() - t0;
  return changed;
}

void GradStream::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& engine = runtime_->copy_engine();
  for (auto& s : slots_)
    if (s.upload_pending) {
      engine->make_stream_wait(compute_stream_of(*engine, s.param.device()), s.upload);
      s.upload_pending = false;
    }
  wait_uploads_locked();
}

std::size_t GradStream::size_buckets(double link_bytes_per_second) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t bytes = ledger_.size_buckets(link_bytes_per_second);
  sync_buckets_locked();
  return bytes;
}

const std::vector<StatField<GradStreamStats>>& grad_stream_stat_fields() {
  using S = GradStreamStats;
  static const std::vector<StatField<S>> fields = {
      {"early_steps", &S::early_steps},
      {"committed", &S::committed},
      {"redone", &S::redone},
      {"taken_back", &S::taken_back},
      {"held", &S::held},
      {"buckets", &S::buckets},
      {"bucket_count", &S::bucket_count},
      {"bucket_bytes", &S::bucket_bytes},
      {"speculation_stops", &S::speculation_stops},
      {"clips_picked_up", &S::clips_picked_up},
      {"grad_bytes_to_host", &S::grad_bytes_to_host},
      {"weight_bytes_to_device", &S::weight_bytes_to_device},
      {"weight_bytes_to_host_copy", &S::weight_bytes_to_host_copy},
      {"grads_released", &S::grads_released},
      {"grad_bytes_freed", &S::grad_bytes_freed},
      {"grads_restored", &S::grads_restored},
      {"kernel_grad_bytes", &S::kernel_grad_bytes},
      {"sized_link_bytes_per_s", nullptr, &S::sized_link_bytes_per_s},
      {"sized_cpu_grad_bytes_per_s", nullptr, &S::sized_cpu_grad_bytes_per_s},
      {"sized_backward_ms", nullptr, &S::sized_backward_s, 1e3},
      {"kernel_ms", &S::kernel_ns, nullptr, 1e-6},
      {"step_kernel_ms", &S::step_kernel_ns, nullptr, 1e-6},
      {"step_wait_ms", &S::step_wait_ns, nullptr, 1e-6},
      {"weight_wait_ms", &S::weight_wait_ns, nullptr, 1e-6},
      {"content_check_ms", &S::content_check_ns, nullptr, 1e-6},
      {"last_backward_ms", &S::last_backward_ns, nullptr, 1e-6},
      {"last_partial_norm", nullptr, &S::last_partial_norm},
  };
  return fields;
}

GradStreamStats GradStream::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  GradStreamStats out = stats_;
  const optimizer::StepLedgerStats l = ledger_.stats();
  out.early_steps = l.early_steps;
  out.committed = l.committed;
  out.redone = l.redone;
  out.taken_back = l.taken_back;
  out.held = l.held;
  out.buckets = l.buckets;
  out.bucket_count = l.bucket_count;
  out.bucket_bytes = l.bucket_bytes;
  out.speculation_stops = l.speculation_stops;
  out.clips_picked_up = l.clips_picked_up;
  out.sized_link_bytes_per_s = l.sized_link_bytes_per_s;
  out.sized_cpu_grad_bytes_per_s = l.sized_cpu_grad_bytes_per_s;
  out.sized_backward_s = l.sized_backward_s;
  out.last_backward_ns = l.last_backward_ns;
  out.last_partial_norm = l.last_partial_norm;
  return out;
}

}  // namespace tierflow::bindings
