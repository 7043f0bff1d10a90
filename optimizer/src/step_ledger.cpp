// See Note [Step ledger] in step_ledger.hpp.
#include "tierflow/optimizer/step_ledger.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {

bool same_gradient(const GradIdentity& a, const GradIdentity& b) noexcept {
  return a.id == b.id && a.version == b.version && same_content(a.content, b.content);
}

bool same_options(const AdamOptions& a, const AdamOptions& b) noexcept {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && a.amsgrad == b.amsgrad && a.maximize == b.maximize &&
         a.decoupled_weight_decay == b.decoupled_weight_decay && a.grad_scale == b.grad_scale;
}

StepLedger::StepLedger(StepLedgerOptions options) : options_(options) {
  TIERFLOW_EXPECTS(options_.accumulation_steps >= 1, "StepLedger: accumulation_steps must be >= 1");
  TIERFLOW_EXPECTS(options_.slice_alignment >= 1, "StepLedger: slice_alignment must be >= 1");
}

std::size_t StepLedger::add(std::size_t bytes, int group, bool streamable) {
  TIERFLOW_EXPECTS(!planned_, "StepLedger: parameters must be added before the first backward");
  TIERFLOW_EXPECTS(group >= 0, "StepLedger: negative group");
  Slot s;
  s.bytes = bytes;
  s.group = group;
  s.streamable = streamable;
  if (static_cast<std::size_t>(group) >= groups_.size()) groups_.resize(static_cast<std::size_t>(group) + 1);
  slots_.push_back(s);
  return slots_.size() - 1;
}

void StepLedger::take_back(Slot& s) noexcept {
  if (s.streamed && !s.discarded) stats_.taken_back += 1;
  s.discarded = true;
}

void StepLedger::exclude(std::size_t slot) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::exclude: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  take_back(s);
  s.streamable = false;
  planned_ = false;  // re-plan without it at the next gradient
  replanned_ = false;
}

void StepLedger::set_group(int group, const AdamOptions& options) {
  TIERFLOW_EXPECTS(group >= 0, "StepLedger::set_group: negative group");
  if (static_cast<std::size_t>(group) >= groups_.size()) groups_.resize(static_cast<std::size_t>(group) + 1);
  groups_[static_cast<std::size_t>(group)] = options;
}

const AdamOptions& StepLedger::group_options(int group) const {
  TIERFLOW_EXPECTS(group >= 0 && static_cast<std::size_t>(group) < groups_.size(),
                   "StepLedger: no group " + std::to_string(group));
  return groups_[static_cast<std::size_t>(group)];
}

void StepLedger::state_set(std::size_t slot) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::state_set: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  s.has_state = true;
  if (s.streamed) take_back(s);  // an early step read the state it replaces
}

void StepLedger::plan() {
  // Until a backward has been seen, the reverse of registration: backward
  // completes the last layers' gradients first. Then the order observed.
  std::vector<std::size_t> order;
  std::vector<bool> placed(slots_.size(), false);
  for (std::size_t i : arrival_)
    if (slots_[i].streamable && !placed[i]) {
      order.push_back(i);
      placed[i] = true;
    }
  for (std::size_t k = slots_.size(); k-- > 0;)
    if (slots_[k].streamable && !placed[k]) order.push_back(k);
  const std::size_t align = options_.slice_alignment;
  std::vector<std::size_t> bytes(order.size()), local(order.size());
  std::size_t total = 0;
  for (std::size_t j = 0; j < order.size(); ++j) {
    bytes[j] = (slots_[order[j]].bytes + align - 1) / align * align;
    local[j] = j;
    total += bytes[j];
  }
  const std::size_t bucket_bytes = options_.bucket_bytes > 0   ? options_.bucket_bytes
                                   : sized_bucket_bytes_ > 0 ? sized_bucket_bytes_
                                                             : auto_grad_bucket_bytes(total);
  buckets_.clear();
  for (const auto& pb : plan_grad_buckets(bytes, local, bucket_bytes)) {
    Bucket b;
    std::size_t offset = 0;
    for (std::size_t j : pb.tensors) {
      Slot& s = slots_[order[j]];
      s.bucket = buckets_.size();
      s.offset = offset;
      offset += bytes[j];
      b.slots.push_back(order[j]);
    }
    b.bytes = offset;
    buckets_.push_back(std::move(b));
  }
  stats_.bucket_count = buckets_.size();
  stats_.bucket_bytes = bucket_bytes;
  planned_ = true;
  plan_id_ += 1;
}

bool StepLedger::backward_begins(std::uint64_t now_ns) {
  if (in_backward_) return false;
  in_backward_ = true;
  backward_ += 1;
  backward_start_ns_ = now_ns;
  return true;
}

GradArrival StepLedger::arrive(std::size_t slot) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::arrive: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (!s.streamable) return GradArrival::kIgnore;
  s.grad_events += 1;
  if (!s.seen) {
    s.seen = true;
    arrival_.push_back(slot);
  }
  if (s.reduced) {  // counted; the reduced gradient streams (arrive_reduced)
    s.local_backward = backward_;
    if (!s.streamed || s.streamed_backward == backward_) return GradArrival::kIgnore;
    take_back(s);  // a later backward changed the reduced gradient that streamed
    return GradArrival::kTakeBack;
  }
  if (s.streamed) {  // the gradient changed again after it streamed (accumulation went on)
    take_back(s);
    return GradArrival::kTakeBack;
  }
  if (!enabled_ || s.discarded || s.grad_events != options_.accumulation_steps) return GradArrival::kIgnore;
  if (!planned_) plan();
  return s.has_state ? GradArrival::kStream : GradArrival::kNeedState;
}

void StepLedger::set_reduced(std::size_t slot, bool reduced) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::set_reduced: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (s.reduced != reduced && s.streamed) take_back(s);  // what streamed came the other way
  s.reduced = reduced;
}

GradArrival StepLedger::arrive_reduced(std::size_t slot) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::arrive_reduced: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (!s.streamable || !s.reduced) return GradArrival::kIgnore;
  if (!s.seen) {  // FSDP2's shards have no local arrivals: their order is the reductions'
    s.seen = true;
    arrival_.push_back(slot);
  }
  if (s.streamed) {  // reduced twice in one window: the gradient changed after it streamed
    take_back(s);
    return GradArrival::kTakeBack;
  }
  // The reduction started from this backward's local gradient, seen or not yet.
  const int local_events = s.grad_events + (s.local_backward == backward_ ? 0 : 1);
  if (!enabled_ || s.discarded || local_events < options_.accumulation_steps) return GradArrival::kIgnore;
  if (!planned_) plan();
  return s.has_state ? GradArrival::kStream : GradArrival::kNeedState;
}

bool StepLedger::rebind(std::size_t slot, GradIdentity grad) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::rebind: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (!s.reduced || !s.streamed || s.discarded || s.streamed_backward != backward_) return false;
  // The tensor p.grad is now; the bytes that streamed stay what confirm() compares with.
  const GradContent streamed = s.grad.content;
  s.grad = grad;
  s.grad.content = streamed;
  return true;
}

void StepLedger::streamed_content(std::size_t slot, GradContent content) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::streamed_content: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (s.streamed) s.grad.content = content;
}

bool StepLedger::compares_content(std::size_t slot) const {
  const Slot& s = slots_.at(slot);
  return s.streamable && s.streamed && !s.discarded && !s.released;
}

bool StepLedger::may_stream(std::size_t slot) const {
  const Slot& s = slots_.at(slot);
  return s.has_state && !s.streamed && !s.discarded && planned_ && !buckets_[s.bucket].launched;
}

bool StepLedger::streamed(std::size_t slot, GradIdentity grad, bool released) {
  TIERFLOW_EXPECTS(may_stream(slot), "StepLedger::streamed: slot " + std::to_string(slot) + " may not stream");
  Slot& s = slots_[slot];
  s.grad = grad;
  s.options_used = groups_[static_cast<std::size_t>(s.group)];
  s.streamed = true;
  s.streamed_backward = backward_;
  s.released = released;
  Bucket& b = buckets_[s.bucket];
  b.arrived += 1;
  return b.arrived == b.slots.size();
}

std::vector<std::size_t> StepLedger::launch(std::size_t bucket) {
  TIERFLOW_EXPECTS(bucket < buckets_.size(), "StepLedger::launch: no bucket " + std::to_string(bucket));
  Bucket& b = buckets_[bucket];
  if (b.launched) return {};
  b.launched = true;
  std::vector<std::size_t> out;
  for (std::size_t i : b.slots)
    if (slots_[i].streamed && !slots_[i].discarded) out.push_back(i);
  stats_.buckets += 1;
  return out;
}

std::vector<std::size_t> StepLedger::unlaunched() const {
  std::vector<std::size_t> out;
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (buckets_[b].arrived > 0 && !buckets_[b].launched) out.push_back(b);
  return out;
}

void StepLedger::backward_ends(std::uint64_t now_ns) {
  in_backward_ = false;
  stats_.last_backward_ns = now_ns >= backward_start_ns_ ? now_ns - backward_start_ns_ : 0;
}

bool StepLedger::needs_norm() const noexcept { return options_.skip_nonfinite || clip_norm() > 0; }

Landed StepLedger::landed(std::uint64_t generation, const std::vector<std::size_t>& slots, double sum_sq) {
  if (generation != generation_) return Landed::kGone;
  for (std::size_t i : slots) slots_.at(i).landed = true;
  if (needs_norm()) {
    partial_.add(sum_sq);
    stats_.last_partial_norm = partial_.norm();
    const bool stop = (clip_norm() > 0 && partial_.clip_must_bind(clip_norm())) ||
                      (options_.skip_nonfinite && !std::isfinite(sum_sq));
    if (stop && !stopped_) {
      stopped_ = true;
      stats_.speculation_stops += 1;
    }
  }
  return stopped_ ? Landed::kWait : Landed::kStep;
}

void StepLedger::copy_landed(std::uint64_t generation, std::size_t slot) {
  if (generation == generation_) slots_.at(slot).landed = true;
}

void StepLedger::copy_failed(std::size_t slot) {
  Slot& s = slots_.at(slot);
  s.released = false;
  s.discarded = true;
}

void StepLedger::stepped_early(std::uint64_t generation, const std::vector<std::size_t>& slots,
                               const std::vector<bool>& held) {
  TIERFLOW_EXPECTS(held.size() == slots.size(), "StepLedger::stepped_early: one held flag per slot");
  if (generation != generation_) return;
  for (std::size_t k = 0; k < slots.size(); ++k) {
    Slot& s = slots_.at(slots[k]);
    if (held[k] || s.discarded) continue;
    s.spec_done = true;
    stats_.early_steps += 1;
  }
}

void StepLedger::kernel_time(std::uint64_t ns, std::uint64_t grad_bytes) noexcept {
  window_kernel_ns_ += ns;
  window_kernel_bytes_ += grad_bytes;
}

Confirmation StepLedger::verdict(std::size_t slot, const GradIdentity& grad, double scale, bool stale) const {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::verdict: no slot " + std::to_string(slot));
  const Slot& s = slots_[slot];
  if (!s.streamable) return {};
  const bool released = s.released && !grad.defined();  // its gradient is the landed host copy
  const bool early = s.spec_done && !s.discarded;
  if (!grad.defined() && !released) return {};
  const bool same_grad = s.streamed && s.landed && !s.discarded && !stale && s.has_state &&
                         (released || same_gradient(grad, s.grad));
  const double slot_scale = s.clipped ? s.clip_scale : scale;  // Note [Clip picked up]
  if (same_grad && early && slot_scale == 1.0 &&
      same_options(s.options_used, groups_[static_cast<std::size_t>(s.group)]))
    return {Confirmation::kCommit, 1.0};
  if (same_grad) return {Confirmation::kRedo, slot_scale};
  return {Confirmation::kUnhandled, 1.0};
}

Confirmation StepLedger::confirm(std::size_t slot, GradIdentity grad, double scale, bool stale) {
  const Confirmation c = verdict(slot, grad, scale, stale);
  Slot& s = slots_[slot];
  if (!s.streamable) return c;
  if (c.kind == Confirmation::kNone) {  // no gradient now, and none released: nothing to step
    take_back(s);
    return c;
  }
  const bool early = s.spec_done && !s.discarded;
  if (c.kind == Confirmation::kCommit) {
    s.discarded = true;  // consumed: the window's end must not count it as taken back
    stats_.committed += 1;
    return c;
  }
  if (early) {
    stats_.taken_back += 1;
    stats_.redone += 1;
  } else if (s.streamed && !s.discarded && s.landed && c.kind != Confirmation::kRedo) {
    stats_.taken_back += 1;  // streamed, never stepped (speculation stopped), and now not usable
  }
  s.discarded = s.discarded || s.streamed;
  return c;
}

void StepLedger::forget_early(std::size_t slot) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepLedger::forget_early: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (!s.spec_done || s.discarded) return;
  s.spec_done = false;
  stats_.held += 1;
}

void StepLedger::discard_all() {
  for (auto& s : slots_)
    if (s.streamed) take_back(s);
}

bool StepLedger::has_unconfirmed() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.streamed && !s.discarded; });
}

void StepLedger::end_window(bool count_taken_back) {
  for (auto& s : slots_) {
    if (count_taken_back && s.streamed && !s.discarded) stats_.taken_back += 1;
    s.grad_events = 0;
    s.local_backward = s.streamed_backward = 0;
    s.seen = s.streamed = s.landed = s.discarded = s.spec_done = s.released = false;
    s.grad = GradIdentity{};
    s.clip_base = -1;
    s.clipped = false;
    s.clip_scale = 1.0;
  }
  for (auto& b : buckets_) {
    b.arrived = 0;
    b.launched = false;
  }
  last_window_kernel_ns_ = window_kernel_ns_;
  last_window_kernel_bytes_ = window_kernel_bytes_;
  window_kernel_ns_ = window_kernel_bytes_ = 0;
  partial_.reset();
  stopped_ = false;
  if (next_clip_norm_ > 0) learned_clip_norm_ = next_clip_norm_;
  generation_ += 1;
  // DDP-style: once one backward has shown the order, buckets follow it.
  if (planned_ && !replanned_ && !arrival_.empty()) {
    plan();
    replanned_ = true;
  }
  arrival_.clear();
}

bool StepLedger::clip_candidate(std::size_t slot, GradIdentity grad) {
  Slot& s = slots_.at(slot);
  s.clip_base = -1;
  if (!s.streamed || s.discarded || s.clipped || s.released) return false;
  if (!same_gradient(grad, s.grad)) return false;
  s.clip_base = s.grad.version;
  return true;
}

bool StepLedger::learn_clip(double max_norm) {
  if (options_.max_grad_norm > 0) {  // tierflow clips as well: a changed gradient, stepped from p.grad
    for (auto& s : slots_) s.clip_base = -1;
    return false;
  }
  if (max_norm > 0) next_clip_norm_ = max_norm;
  return true;
}

bool StepLedger::clip_ran(double max_norm, double coefficient) {
  if (clips_itself() && coefficient == 1.0) return true;
  return learn_clip(max_norm);
}

void StepLedger::clipped(std::size_t slot, GradIdentity grad, double coefficient, bool exact) {
  Slot& s = slots_.at(slot);
  const std::int64_t base = s.clip_base;
  s.clip_base = -1;
  if (base < 0) return;
  // The clip's one in-place multiply, and nothing else, since the copy.
  if (grad.id != s.grad.id || grad.version != base + 1) return;
  if (coefficient != 1.0 && !exact) return;
  // From here on the clipped bytes are the gradient (the landed copy times the coefficient): a later change to
  // them, counted or not, is a change at confirm(). Not known: stepped from p.grad.
  if (coefficient != 1.0) s.grad.content = grad.content;
  else if (!same_content(grad.content, s.grad.content)) return;
  s.grad.version = base + 1;
  stats_.clips_picked_up += 1;
  // A multiply by exactly 1 changed no value: the gradient is the one streamed, under whatever scale step()
  // brings (tierflow's own clip's, if any). Any other coefficient is the slot's scale.
  if (coefficient == 1.0) return;
  s.clipped = true;
  s.clip_scale = coefficient;
}

std::size_t StepLedger::size_buckets(double link_bytes_per_second) {
  if (options_.bucket_bytes > 0 || !planned_ || in_backward_) return stats_.bucket_bytes;
  for (const auto& s : slots_)
    if (s.streamed) return stats_.bucket_bytes;  // inside a window: its buckets are in use
  BucketSizing in;
  in.backward_seconds = static_cast<double>(stats_.last_backward_ns) / 1e9;
  in.link_bytes_per_second = link_bytes_per_second;
  // The last window's: the first one's also allocated the optimizer states.
  const double kernel_s = static_cast<double>(last_window_kernel_ns_) / 1e9;
  in.cpu_grad_bytes_per_second = kernel_s > 0 ? static_cast<double>(last_window_kernel_bytes_) / kernel_s : 0.0;
  for (const auto& s : slots_)
    if (s.streamable) in.total_grad_bytes += s.bytes;
  sized_bucket_bytes_ = measured_grad_bucket_bytes(in);
  stats_.sized_link_bytes_per_s = in.link_bytes_per_second;
  stats_.sized_cpu_grad_bytes_per_s = in.cpu_grad_bytes_per_second;
  stats_.sized_backward_s = in.backward_seconds;
  // The same order as now (observed in a backward), cut at the new size.
  arrival_.clear();
  for (const auto& b : buckets_) arrival_.insert(arrival_.end(), b.slots.begin(), b.slots.end());
  plan();
  arrival_.clear();
  return stats_.bucket_bytes;
}

std::vector<std::size_t> StepLedger::forward_order(std::vector<std::size_t> slots) const {
  // The bucket that backward filled last holds the first layers.
  std::stable_sort(slots.begin(), slots.end(), [&](std::size_t a, std::size_t b) {
    const Slot& x = slots_.at(a);
    const Slot& y = slots_.at(b);
    return x.bucket != y.bucket ? x.bucket > y.bucket : x.offset > y.offset;
  });
  return slots;
}

}  // namespace tierflow::optimizer
