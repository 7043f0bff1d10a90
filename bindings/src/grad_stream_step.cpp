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

std::vector<std::size_t> GradStream::prepare_finish(double scale, bool stale, bool frugal) {
  // Note [Atomic step]: everything that can fail, and nothing a caller sees: the verdicts, the redone steps'
  // staging; a released gradient the caller steps goes back to p.grad. A failure leaves the window open (a
  // retry prepares again); the commit then cannot fail.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->launch_unlaunched();  // a backward that ended without its callback
  }
  engine_->wait_worker_unlocked(true);  // step_wait_ns; Note [Stream timeline]: buckets launched here included
  std::lock_guard<std::mutex> lock(mutex_);
  count_freed_locked();
  engine_->wait_uploads();
  engine_->unprepare();
  weights_changed_ = weights_changed_locked();
  const std::vector<optimizer::GradContent> contents = grad_contents_locked();
  std::vector<optimizer::GradIdentity> now(slots_.size());
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!ledger_.streamable(i)) continue;
    // The caller re-reads the master and takes p.grad (a released one back first: the identity is p.grad's then).
    if (stale || written_.stale(i)) restore_locked(i, false);
    now[i] = identity_of(i);
    now[i].content = contents[i];
  }
  // The verdicts (optimizer::StepEngine::prepare); the caller steps the unhandled ones from p.grad.
  const std::vector<std::size_t> unhandled = engine_->prepare(now, scale, stale);
  for (std::size_t i : unhandled) restore_locked(i, false);
  engine_->prepare_staging(frugal);
  return unhandled;
}

GradStream::Finish GradStream::commit_finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Commits by a pointer swap, redoes the others in place (Note [Step ledger]); p.grad and the weights are ours.
  Finish out = engine_->commit_prepared();
  upload_locked(out.committed);
  reset_window_locked(false);
  return out;
}

void GradStream::upload_locked(const std::vector<std::size_t>& committed) {
  const auto& engine = runtime_->copy_engine();
  std::vector<std::size_t> sent;
  for (std::size_t i : ledger_.forward_order(committed)) {  // forward order: the first layers first
    Slot& s = slots_[i];
    const at::Tensor staging = staging_of(i);
    if (!staging.defined()) continue;
    if (s.home.defined()) {  // on the host between uses: the next fetch copies it (Note [Parameter storage])
      s.home.view(-1).copy_(staging.view(-1));
      s.written = ContentProbe();  // (its weight lives in the home: not checked, Note [Weight content])
      engine_->counters().weight_bytes_to_host_copy += s.param.nbytes();
      continue;
    }
    const swap::StreamRef compute = compute_stream_of(*engine, s.param.device());
    // After the kernels still reading the old value (rule 1); the engine keeps the staging until it is done.
    engine_->upload_sent(i, device_id(s.param.device()),
                         engine->copy(swap::Direction::kHostToDevice, s.param.data_ptr(), staging.data_ptr(),
                                      s.param.nbytes(), {}, compute));
    // Note [Weight content]: the bytes on their way are the staging's. On the host (the emulated device) read
    // them now; a GPU reads the parameter once its compute stream waits for the copy (below, or wait_module).
    s.probe_after_upload = !s.param.is_cpu();
    const std::uint64_t tw = now_ns();
    s.written = s.probe_after_upload ? ContentProbe() : ContentProbe::of(staging);
    engine_->counters().content_check_ns += now_ns() - tw;
    sent.push_back(i);
  }
  if (options_.weights_in_forward) return;  // each module's forward waits for its own (wait_module)
  if (sent.empty()) return;
  const std::uint64_t t0 = now_ns();
  engine_->wait_for_step_uploads(sent);  // rule 2: per device, for the copy sent last
  for (std::size_t i : sent) probe_written_locked(slots_[i], i);  // after the compute streams' waits
  engine_->counters().weight_wait_ns += now_ns() - t0;
}

void GradStream::wait_step_uploads() {
  std::lock_guard<std::mutex> lock(mutex_);
  engine_->wait_step_uploads();
}

void GradStream::begin_clip() {
  std::vector<std::pair<c10::Device, swap::TransferHandle>> copies;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::vector<optimizer::GradContent> contents = grad_contents_locked();  // changed since the copy?
    std::vector<std::pair<std::size_t, optimizer::DeviceId>> candidates;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      optimizer::GradIdentity now = identity_of(i);
      now.content = contents[i];
      if (ledger_.clip_candidate(i, now)) candidates.emplace_back(i, device_id(slots_[i].param.device()));
    }
    for (const auto& [d, i] : optimizer::last_copied(*engine_, candidates))
      copies.emplace_back(devices_[d], engine_->copy_of(i));
  }
  // The clip writes the gradients in place on the compute stream: after their
  // copies have read them (rule 2 of Note [Copy ordering]), or the host copy
  // stepped with the coefficient could already hold the clipped values.
  const auto& engine = runtime_->copy_engine();
  for (const auto& [device, copy] : copies) engine->make_stream_wait(compute_stream_of(*engine, device), copy);
}

void GradStream::end_clip(double max_norm, double coefficient) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ledger_.clip_ran(max_norm, coefficient)) return;  // tierflow clips as well: stepped from p.grad
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
  const std::uint64_t t0 = now_ns();
  engine_->wait_module(module);  // rule 2: for the last of its parameters' copies sent
  for (std::size_t i : engine_->module_slots(module)) probe_written_locked(slots_[i], i);
  engine_->counters().weight_wait_ns += now_ns() - t0;
}

void GradStream::probe_written_locked(Slot& s, std::size_t slot) {
  if (!s.probe_after_upload) return;
  s.probe_after_upload = false;
  engine_->wait_upload(slot);  // when its compute stream has not waited for it yet
  s.written = ContentProbe::of(s.param);
}

std::vector<std::size_t> GradStream::weights_changed_locked() {
  // Note [Weight content]: a parameter whose bytes are not what tierflow wrote last was written by the user.
  const std::uint64_t t0 = now_ns();
  std::vector<ContentProbe> now(slots_.size());
  std::vector<ContentProbe*> pending;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    probe_written_locked(s, i);
    if (!s.written.pending() && !s.written.get().known) continue;
    now[i] = ContentProbe::of(s.param);
    for (ContentProbe* p : {&now[i], &s.written})
      if (p->pending()) pending.push_back(p);
  }
  ContentProbe::resolve(pending);
  std::vector<bool> differs(slots_.size(), false);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.written.get().known || optimizer::same_content(now[i].get(), s.written.get())) continue;
    differs[i] = true;
    s.written = ContentProbe();
  }
  const std::vector<std::size_t> changed = written_.judge(differs, ledger_);  // their masters go stale
  engine_->counters().content_check_ns += now_ns() - t0;
  return changed;
}

void GradStream::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  engine_->synchronize();
}

std::size_t GradStream::size_buckets(double link_bytes_per_second) {
  std::lock_guard<std::mutex> lock(mutex_);
  return engine_->size_buckets(link_bytes_per_second);
}

const std::vector<StatField<GradStreamStats>>& grad_stream_stat_fields() {
  return optimizer::step_engine_stat_fields();
}

GradStreamStats GradStream::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return engine_->stats();
}

}  // namespace tierflow::bindings
