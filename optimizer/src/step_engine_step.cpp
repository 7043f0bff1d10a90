// StepEngine's step(): the commits and redone steps (Note [Step ledger]), the window's end, the bucket sizing,
// the counters and the timeline (Note [Stream timeline]).
#include <cstdio>
#include <string>
#include <utility>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/trace.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/optimizer/step_engine.hpp"
#include "tierflow/optimizer/stream_rules.hpp"

namespace tierflow::optimizer {

void StepEngine::wait_worker_unlocked(bool step) {
  const std::uint64_t t0 = now_ns();
  worker_->drain();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t done = now_ns();
  // Both of step()'s waits: its first (wait_worker, where the worker still steps what backward left) and its
  // own after launching the buckets left (Note [Step prediction]: the optimizer's measured term).
  stats_.step_wait_ns += done - t0;
  if (step) {  // step()'s own wait, after the Python path's wait_worker (if any)
    if (clock_.start != 0) clock_.worker_done = done;  // buckets launched by step() itself included
  } else if (clock_.start != 0 && clock_.step == 0) {  // Note [Stream timeline]: step()'s wait
    clock_.step = t0;
    clock_.worker_done = done;
  }
}

void StepEngine::drop_outputs(std::size_t slot, bool staging) {
  Slot& s = slots_.at(slot);
  s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = HostArray{};
  if (staging) s.staging = HostArray{};
}

void StepEngine::ensure_staging(std::size_t slot) {
  Slot& s = slots_.at(slot);
  if (!s.staging.defined()) s.staging = host_.allocate(s.numel * element_size(s.param_type));
}

StepEngine::Finish StepEngine::commit(const std::vector<Verdict>& verdicts, double scale, bool stale) {
  Finish out;
  std::vector<std::pair<std::size_t, double>> redone;  // with the clip coefficient each is stepped with
  for (const auto& p : verdicts) {
    const std::size_t i = p.slot;
    Slot& s = slots_.at(i);
    const Confirmation c = ledger_.confirm(i, p.identity, scale, stale);
    TIERFLOW_EXPECTS(c.kind == p.kind, "StepEngine::commit: slot " + std::to_string(i) +
                                           "'s verdict changed since it was prepared");
    switch (c.kind) {
      case Confirmation::kNone:
        break;
      case Confirmation::kCommit:  // the early step's out-of-place results become the state
        s.master = s.out_master;
        s.exp_avg = s.out_exp_avg;
        s.exp_avg_sq = s.out_exp_avg_sq;
        if (s.out_max_exp_avg_sq.defined()) s.max_exp_avg_sq = s.out_max_exp_avg_sq;
        host_.count_step(i);
        out.committed.push_back(i);
        break;
      case Confirmation::kRedo:
        redone.emplace_back(i, c.scale);
        break;
      case Confirmation::kUnhandled:
        out.unhandled.push_back(i);
        break;
    }
  }
  redo(redone, out.committed);
  return out;
}

void StepEngine::redo(const std::vector<std::pair<std::size_t, double>>& list, std::vector<std::size_t>& committed) {
  // Stepped here from the gradients already on the host, with the clip
  // coefficient: the same kernel on the same values as the caller's own steps.
  // One call per (group, coefficient, step number).
  std::uint64_t adam_ns = 0, adam_bytes = 0;
  std::vector<KernelStep> keys;
  for (const auto& [i, scale] : list) {
    const int group = ledger_.group_of(i);
    AdamOptions o = ledger_.group_options(group);
    if (scale != 1.0) o.grad_scale = scale;
    keys.push_back({host_.steps_taken(i) + 1, o, group, false});
  }
  for (const auto& call : group_kernel_calls(keys)) {
    const KernelStep& key = keys[call.front()];
    std::vector<KernelArrays> arrays;
    for (std::size_t k : call) {
      Slot& s = slots_[list[k].first];
      ensure_staging(list[k].first);
      KernelArrays a = arrays_of(s);
      if (key.options.amsgrad) a.max_exp_avg_sq = s.max_exp_avg_sq;
      a.param_out = s.staging;
      adam_bytes += s.host_grad.bytes;
      arrays.push_back(std::move(a));
    }
    const std::uint64_t tk = now_ns();
    host_.adam_step(key.options, key.step, arrays);
    adam_ns += now_ns() - tk;
    trace::adam_span("AdamW step (redone)", tk, now_ns(), call.size());  // Note [Trace]
    for (std::size_t k : call) {
      host_.count_step(list[k].first);
      committed.push_back(list[k].first);
    }
  }
  stats_.step_kernel_ns += adam_ns;
  stats_.kernel_grad_bytes += adam_bytes;
  ledger_.kernel_time(adam_ns, adam_bytes);
}

void StepEngine::end_window(bool count_taken_back) {
  // Copies of a bucket that never went to the worker (a backward that failed)
  // must be done before their memory goes (rule 3).
  // Note [Stall timeout]: one that stalls may still write: every slot whose copy is not done keeps its host
  // memory for good, the window ends all the same, and the stall is raised.
  std::exception_ptr stall;
  for (auto& b : buckets_)
    for (const auto& h : b.copies) {
      try {
        h.wait();
      } catch (const stall_error&) {
        if (!stall) stall = std::current_exception();
      } catch (const std::exception& e) {
        log(LogLevel::kWarn, std::string("a gradient copy of a discarded window failed: ") + e.what());
      }
    }
  if (stall) {
    std::uint64_t bytes = 0;
    auto held = std::make_shared<std::vector<std::shared_ptr<void>>>();
    for (const auto& s : slots_) {
      bool done = true;
      try {
        done = !s.copy.valid() || s.copy.ready();
      } catch (...) {  // a failed query: kept
        done = false;
      }
      if (done || !s.host_grad.defined()) continue;
      held->push_back(s.host_grad.keep);
      bytes += s.host_grad.bytes;
    }
    keep_forever(held, bytes, "the host memory of a discarded window's stalled gradient copies, " + format_bytes(bytes));
  }
  for (auto& s : slots_) {
    s.host_grad = HostArray{};
    s.copy = swap::TransferHandle();
    s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = s.staging = HostArray{};
  }
  for (auto& b : buckets_) b = Bucket{};
  ledger_.end_window(count_taken_back);
  sync_buckets();
  finish_clock();
  if (stall) std::rethrow_exception(stall);
}

void StepEngine::finish_clock() {
  // Note [Stream timeline]: a window with buckets becomes the last one; the
  // worker's late records of this window (a discarded one) go nowhere.
  if (clock_.start != 0 && !clock_.buckets.empty()) {
    const std::uint64_t t0 = clock_.start;
    auto ms = [t0](std::uint64_t t) { return t == 0 ? -1.0 : (static_cast<double>(t) - static_cast<double>(t0)) / 1e6; };
    WindowTimeline w;
    w.backward_end_ms = ms(clock_.backward_end);
    w.step_ms = ms(clock_.step);
    w.worker_done_ms = ms(clock_.worker_done);
    for (const auto& b : clock_.buckets)
      w.buckets.push_back({b.bucket, b.grad_bytes, ms(b.launched), ms(b.picked), ms(b.landed), ms(b.stepped)});
    last_window_ = std::move(w);
  }
  clock_ = WindowClock{};
  ++clock_window_;
}

std::size_t StepEngine::size_buckets(double link_bytes_per_second) {
  const std::size_t bytes = ledger_.size_buckets(link_bytes_per_second);
  sync_buckets();
  return bytes;
}

StepEngineStats StepEngine::stats() const {
  StepEngineStats out = stats_;
  const StepLedgerStats l = ledger_.stats();
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

const std::vector<StatField<StepEngineStats>>& step_engine_stat_fields() {
  using S = StepEngineStats;
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
      {"grad_copy_wait_ms", &S::grad_copy_wait_ns, nullptr, 1e-6},
      {"weight_wait_ms", &S::weight_wait_ns, nullptr, 1e-6},
      {"content_check_ms", &S::content_check_ns, nullptr, 1e-6},
      {"last_backward_ms", &S::last_backward_ns, nullptr, 1e-6},
      {"last_partial_norm", nullptr, &S::last_partial_norm},
  };
  return fields;
}

std::string describe_steps_during_backward(const StepEngineStats& s) {
  char line[256];
  std::snprintf(line, sizeof line, "stepped during backward %llu (committed %llu, redone %llu, taken back %llu, held %llu)",
                static_cast<unsigned long long>(s.early_steps), static_cast<unsigned long long>(s.committed),
                static_cast<unsigned long long>(s.redone), static_cast<unsigned long long>(s.taken_back),
                static_cast<unsigned long long>(s.held));
  return line;
}

}  // namespace tierflow::optimizer
