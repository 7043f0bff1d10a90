// StepEngine's slots and backward: the buckets, the copies into them and the worker that steps them during
// backward (Note [Gradient streaming] in bindings/include/tierflow/bindings/grad_stream.hpp).
#include "tierflow/optimizer/step_engine.hpp"

#include <exception>
#include <string>
#include <utility>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/trace.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/stream_rules.hpp"

namespace tierflow::optimizer {

namespace {
StepLedgerOptions ledger_options(const StepEngineOptions& o) {
  StepLedgerOptions l;
  l.bucket_bytes = o.bucket_bytes;
  l.accumulation_steps = o.accumulation_steps;
  l.max_grad_norm = o.max_grad_norm;
  l.skip_nonfinite = o.skip_nonfinite;
  return l;
}

}  // namespace

StepEngine::StepEngine(StepEngineOptions options, StepEngineHost& host)
    : host_(host), ledger_(ledger_options(options)), worker_(std::make_unique<swap::detail::SerialWorker>()) {}

StepEngine::~StepEngine() {
  // Note [Stall timeout]: the worker's own waits on copies have their limit (on its thread), so it ends; its
  // CPU kernels end too. Waiting for it without a limit here never frees memory a bucket's step still uses.
  try {
    const UnlimitedWaits unlimited;
    worker_->drain();
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("a streamed optimizer step failed at shutdown: ") + e.what());
  }
  worker_.reset();
  // Copies still reading or writing the engine's buffers: waited for within the limit; one that stalled keeps
  // its buffer for good rather than have it freed under it (rule 3).
  for (auto& [h, buffer] : uploads_) {
    try {
      h.wait();  // a weight upload still reading its staging
    } catch (const stall_error&) {
      keep_forever(buffer.keep, buffer.bytes, "a weight upload's staging of " + format_bytes(buffer.bytes));
    } catch (const std::exception& e) {
      log(LogLevel::kError, std::string("a weight upload failed at shutdown: ") + e.what());
    }
  }
  for (auto& s : slots_) {
    try {
      s.copy.wait();  // a gradient's copy still writing into a bucket
    } catch (const stall_error&) {
      keep_forever(s.host_grad.keep, s.host_grad.bytes, "a gradient's host copy of " + format_bytes(s.host_grad.bytes));
    } catch (const std::exception& e) {
      log(LogLevel::kError, std::string("a gradient copy failed at shutdown: ") + e.what());
    }
  }
}

std::size_t StepEngine::add(std::size_t numel, std::size_t bytes, ScalarType param_type, int group,
                            bool streamable) {
  const std::size_t slot = ledger_.add(bytes, group, streamable);
  Slot s;
  s.numel = numel;
  s.param_type = param_type;
  slots_.push_back(std::move(s));
  return slot;
}

void StepEngine::set_state(std::size_t slot, HostArray master, HostArray exp_avg, HostArray exp_avg_sq,
                           HostArray max_exp_avg_sq, StateFormat format) {
  TIERFLOW_EXPECTS(slot < slots_.size(), "StepEngine::set_state: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  const std::size_t moment = moment_bytes(format, s.numel);
  TIERFLOW_EXPECTS(master.defined() && master.bytes == 4 * s.numel && exp_avg.defined() &&
                       exp_avg.bytes == moment && exp_avg_sq.defined() && exp_avg_sq.bytes == moment &&
                       (!max_exp_avg_sq.defined() || max_exp_avg_sq.bytes == 4 * s.numel),
                   "StepEngine::set_state: slot " + std::to_string(slot) + " needs an fp32 master, both moments "
                       "of moment_bytes(" + std::string(to_string(format)) + ") and an fp32 or no max_exp_avg_sq");
  s.master = std::move(master);
  s.exp_avg = std::move(exp_avg);
  s.exp_avg_sq = std::move(exp_avg_sq);
  s.max_exp_avg_sq = std::move(max_exp_avg_sq);
  s.format = format;
  ledger_.state_set(slot);
}

void StepEngine::drop_state(std::size_t slot) {
  Slot& s = slots_.at(slot);
  s.master = s.exp_avg = s.exp_avg_sq = s.max_exp_avg_sq = HostArray{};
  s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = HostArray{};
}

std::vector<HostArray> StepEngine::state_of(std::size_t slot) const {
  const Slot& s = slots_.at(slot);
  return {s.master, s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq};
}

bool StepEngine::backward_begins(std::uint64_t now) {
  const bool first = ledger_.backward_begins(now);
  if (first && clock_.start == 0) clock_.start = now;
  if (first) clock_.copies_exposed_from = 0;  // a backward runs: the worker's waits for copies overlap it
  return first;
}

void StepEngine::backward_ends(std::uint64_t now) {
  ledger_.backward_ends(now);
  if (clock_.start == 0) return;
  clock_.backward_end = now;
  clock_.copies_exposed_from = now;
  // Note [Stream timeline]: a bucket whose copies landed before this callback took the lock (its `now` read
  // before their landing) is counted here; the others by the worker when they land.
  for (auto& b : clock_.buckets) {
    if (b.landed == 0 || b.copy_wait_counted) continue;
    stats_.grad_copy_wait_ns += copy_wait_past_backward(b.picked, b.landed);
    b.copy_wait_counted = true;
  }
}

std::uint64_t StepEngine::copy_wait_past_backward(std::uint64_t picked, std::uint64_t landed) const noexcept {
  const std::uint64_t from = clock_.copies_exposed_from;
  if (from == 0) return 0;
  const std::uint64_t begin = picked > from ? picked : from;
  return landed > begin ? landed - begin : 0;
}

void StepEngine::launch_unlaunched() {
  for (std::size_t b : ledger_.unlaunched()) launch(b);
}

void StepEngine::sync_buckets() {
  if (buckets_plan_ == ledger_.plan_id()) return;
  buckets_.assign(ledger_.bucket_count(), Bucket{});
  buckets_plan_ = ledger_.plan_id();
}

HostArray StepEngine::stage_gradient(std::size_t slot, ScalarType grad_type, std::size_t bytes) {
  sync_buckets();
  Bucket& b = buckets_.at(ledger_.bucket_of(slot));
  if (!b.buffer.defined()) {
    try {
      b.buffer = host_.allocate(ledger_.bucket_bytes(ledger_.bucket_of(slot)));
    } catch (const out_of_memory&) {
      ledger_.held();
      return {};
    }
  }
  Slot& s = slots_.at(slot);
  s.host_grad = b.buffer.slice(ledger_.offset_of(slot), bytes);
  s.grad_type = grad_type;
  return s.host_grad;
}

void StepEngine::gradient_copied(std::size_t slot, swap::TransferHandle copy) {
  Slot& s = slots_.at(slot);
  s.copy = std::move(copy);
  s.copy_seq = ++copy_seq_;
  buckets_.at(ledger_.bucket_of(slot)).copies.push_back(s.copy);
  stats_.grad_bytes_to_host += s.host_grad.bytes;
}

void StepEngine::streamed(std::size_t slot, GradIdentity identity, bool released) {
  if (ledger_.streamed(slot, identity, released)) launch(ledger_.bucket_of(slot));
}

KernelArrays StepEngine::arrays_of(const Slot& s) const {
  KernelArrays a;
  a.numel = s.numel;
  a.format = s.format;
  a.grad_type = s.grad_type;
  a.param_type = s.param_type;
  a.master = s.master;
  a.exp_avg = s.exp_avg;
  a.exp_avg_sq = s.exp_avg_sq;
  a.grad = s.host_grad;
  return a;
}

void StepEngine::launch(std::size_t bi) {
  if (ledger_.launched(bi)) return;
  std::vector<Entry> entries;
  for (std::size_t i : ledger_.launch(bi)) {
    Slot& s = slots_[i];
    Entry e;
    e.slot = i;
    e.options = ledger_.options_used(i);
    e.step = host_.steps_taken(i) + 1;
    e.arrays = arrays_of(s);
    KernelArrays& a = e.arrays;
    if (e.options.amsgrad) a.max_exp_avg_sq = s.max_exp_avg_sq;
    try {
      a.master_out = host_.allocate(4 * s.numel);
      // Like the moments (Note [Optimizer state formats]): bf16, or 8bit's one buffer of codes and scales.
      a.exp_avg_out = host_.allocate(s.exp_avg.bytes);
      a.exp_avg_sq_out = host_.allocate(s.exp_avg_sq.bytes);
      if (e.options.amsgrad) a.max_exp_avg_sq_out = host_.allocate(4 * s.numel);
      a.param_out = host_.allocate(s.numel * element_size(s.param_type));
    } catch (const out_of_memory&) {
      e.held = true;  // its gradient still lands; step() steps it from there
      a.master_out = a.exp_avg_out = a.exp_avg_sq_out = a.max_exp_avg_sq_out = a.param_out = HostArray{};
      ledger_.held();
    }
    s.out_master = a.master_out;
    s.out_exp_avg = a.exp_avg_out;
    s.out_exp_avg_sq = a.exp_avg_sq_out;
    s.out_max_exp_avg_sq = a.max_exp_avg_sq_out;
    s.staging = a.param_out;
    entries.push_back(std::move(e));
  }
  std::vector<swap::TransferHandle> copies = std::move(buckets_[bi].copies);
  buckets_[bi].copies.clear();
  WindowClock::Bucket timed;  // Note [Stream timeline]
  timed.bucket = bi;
  timed.launched = now_ns();
  for (const Entry& e : entries) timed.grad_bytes += e.arrays.grad.bytes;
  clock_.buckets.push_back(timed);
  // In flight from now until the worker has stepped it (Note [Stall timeout]: step()'s wait has a limit).
  worker_->push(
      [this, gen = ledger_.generation(), entries = std::move(entries), copies = std::move(copies),
       window = clock_window_, index = clock_.buckets.size() - 1]() mutable {
        run_bucket(gen, std::move(entries), std::move(copies), window, index);
      },
      "CPU optimizer step of a gradient bucket", timed.grad_bytes);
}

void StepEngine::run_bucket(std::uint64_t generation, std::vector<Entry> entries,
                            std::vector<swap::TransferHandle> copies, std::uint64_t clock_window, std::size_t timed) {
  const std::uint64_t picked = now_ns();
  // Note [Stream timeline]: this bucket's record, when its window is still the current one.
  auto times = [&]() -> WindowClock::Bucket* {
    return clock_window == clock_window_ && timed < clock_.buckets.size() ? &clock_.buckets[timed] : nullptr;
  };
  // Rule 2: the CPU reads the gradients only once they landed. Every copy is
  // waited for, even after one failed: none may still use memory that goes.
  // A stall (Note [Stall timeout]) is not a failure: the copy may still write, so the bucket's gradients keep
  // their memory for good and the stall is raised (never settled as failed, which would let memory go).
  std::exception_ptr failed;
  for (const auto& h : copies) {
    try {
      h.wait();
    } catch (const stall_error&) {
      keep_stalled_grads(entries);
      throw;
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) {
    settle_failed_bucket(generation, entries);
    std::rethrow_exception(failed);
  }
  const std::uint64_t landed = now_ns();
  trace::adam_span("wait for gradient copies", picked, landed, copies.size());  // Note [Trace]
  bool need_norm = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    need_norm = ledger_.needs_norm();
    if (WindowClock::Bucket* t = times()) {
      t->picked = picked;
      t->landed = landed;
      if (clock_.copies_exposed_from != 0) {  // a backward ended (any micro-batch's): the wait past its end
        stats_.grad_copy_wait_ns += copy_wait_past_backward(picked, landed);
        t->copy_wait_counted = true;
      }
    }
  }
  double sum_sq = 0;
  if (need_norm)
    for (const auto& e : entries)
      sum_sq += sum_of_squares(e.arrays.grad.data, e.arrays.grad_type, e.arrays.numel);
  std::vector<std::size_t> slots;
  std::vector<bool> held;
  for (const auto& e : entries) {
    slots.push_back(e.slot);
    held.push_back(e.held);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Landed next = ledger_.landed(generation, slots, sum_sq);
    if (next == Landed::kGone) return;
    for (std::size_t i : slots)
      if (ledger_.released(i)) host_.gradient_landed(i);  // its copy is done (rule 3): the memory goes
    if (next == Landed::kWait) return;  // step() steps these once the norm is known
  }
  const std::uint64_t t0 = now_ns();
  const std::uint64_t stepped_bytes = step_entries(entries);
  const std::uint64_t ns = now_ns() - t0;
  trace::adam_span("AdamW bucket", t0, t0 + ns, entries.size(), stepped_bytes);  // Note [Trace]
  std::lock_guard<std::mutex> lock(mutex_);
  if (WindowClock::Bucket* t = times()) t->stepped = t0 + ns;
  stats_.kernel_ns += ns;
  stats_.kernel_grad_bytes += stepped_bytes;
  ledger_.kernel_time(ns, stepped_bytes);
  ledger_.stepped_early(generation, slots, held);
}

void StepEngine::settle_failed_bucket(std::uint64_t generation, const std::vector<Entry>& entries) {
  // A released gradient whose own copy failed is still on the device: back to
  // the front end. The others landed and stay released (restore_grads brings them).
  std::exception_ptr stall;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& e : entries) {
      bool ok = true;
      try {
        slots_[e.slot].copy.wait();
      } catch (const stall_error&) {
        // Note [Stall timeout]: not failed, still in flight: neither landed nor given back; its memory stays.
        if (!stall) stall = std::current_exception();
        continue;
      } catch (...) {
        ok = false;
      }
      if (ok) {
        ledger_.copy_landed(generation, e.slot);
        continue;
      }
      host_.gradient_copy_failed(e.slot);
      ledger_.copy_failed(e.slot);  // its early step cannot run: step() takes it from the device gradient
    }
  }
  if (stall) {
    keep_stalled_grads(entries);
    std::rethrow_exception(stall);  // raised instead of the failure: the run should end
  }
}

void StepEngine::keep_stalled_grads(const std::vector<Entry>& entries) noexcept {
  // Note [Stall timeout]: a copy into these gradients stalled and may still write them: kept for good.
  try {
    auto held = std::make_shared<std::vector<std::shared_ptr<void>>>();
    std::uint64_t bytes = 0;
    for (const auto& e : entries) {
      held->push_back(e.arrays.grad.keep);
      bytes += e.arrays.grad.bytes;
    }
    keep_forever(held, bytes, "a gradient bucket's host memory of " + format_bytes(bytes));
  } catch (...) {  // no room to hold them: the entries go, as they would have
  }
}

std::uint64_t StepEngine::step_entries(const std::vector<Entry>& entries) {
  std::uint64_t stepped_bytes = 0;
  std::vector<KernelStep> keys;
  for (const Entry& e : entries) keys.push_back({e.step, e.options, -1, e.held});
  for (const auto& call : group_kernel_calls(keys)) {
    std::vector<KernelArrays> arrays;
    for (std::size_t k : call) {
      arrays.push_back(entries[k].arrays);
      stepped_bytes += entries[k].arrays.grad.bytes;
    }
    const Entry& first = entries[call.front()];
    host_.adam_step(first.options, first.step, arrays);
  }
  return stepped_bytes;
}

}  // namespace tierflow::optimizer
