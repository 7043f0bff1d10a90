// See Note [Gradient streaming] in grad_stream.hpp.
#include "tierflow/bindings/grad_stream.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <map>
#include <utility>

#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/bindings/dtypes.hpp"

namespace tierflow::bindings {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kSliceAlignment = 64;  // each gradient's slice of a bucket starts on a cache line

std::uint64_t since_ns(Clock::time_point t0) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

bool same_options(const optimizer::AdamOptions& a, const optimizer::AdamOptions& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && a.amsgrad == b.amsgrad && a.maximize == b.maximize &&
         a.decoupled_weight_decay == b.decoupled_weight_decay && a.grad_scale == b.grad_scale;
}

bool streamable_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace

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

struct GradStream::Slot {
  at::Tensor param;
  int group = 0;
  bool streamable = false;
  c10::intrusive_ptr<torch::autograd::Node> accumulator;  // kept alive: autograd reuses it, with our hook
  std::uintptr_t hook_key = 0;
  // The optimizer state (shared with the Python state dict).
  bool has_state = false;
  at::Tensor master, exp_avg, exp_avg_sq, max_exp_avg_sq, step;
  // Where its gradient goes in the plan.
  std::size_t bucket = 0, offset = 0;
  // This window (gradients since the last step()).
  int grad_events = 0;
  bool seen = false;       // in arrival_
  bool streamed = false;   // its gradient was copied to the host
  bool landed = false;     // ... and the copy has completed (seen by the worker)
  bool discarded = false;  // its early step must not be committed
  bool spec_done = false;  // its early step has run
  at::Tensor grad_ref, host_grad;
  swap::TransferHandle copy;  // of its gradient to host_grad
  std::uint64_t copy_seq = 0; // submission order of `copy` (begin_clip)
  bool released = false;      // p.grad was set to None after the copy was queued (offload_gradients)
  // The released gradient's storage, to see when it is freed (grad_bytes_freed).
  std::unique_ptr<c10::weak_intrusive_ptr<c10::StorageImpl>> grad_storage;
  std::size_t grad_bytes = 0;
  bool freed_counted = false;
  at::Tensor norm;            // clip_grad_norm_'s per-tensor norm of the released gradient
  const c10::TensorImpl* grad_impl = nullptr;
  std::int64_t grad_version = 0;
  // Note [Clip picked up]: its version when the user's clip began (-1: not a
  // candidate), and the coefficient that clip scaled it by.
  std::int64_t clip_base = -1;
  bool clipped = false;
  double clip_scale = 1.0;
  optimizer::AdamOptions options_used;
  at::Tensor out_master, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, staging;
  // Its weights on the way back.
  swap::TransferHandle upload;
  bool upload_pending = false;
  std::uint64_t upload_seq = 0;
};

struct GradStream::Bucket {
  std::vector<std::size_t> slots;
  std::size_t bytes = 0;
  at::Tensor buffer;  // pinned, this window
  std::vector<swap::TransferHandle> copies;
  std::size_t arrived = 0;
  bool launched = false;
};

struct GradStream::Entry {
  std::size_t slot = 0;
  optimizer::AdamOptions options;
  std::int64_t step = 0;
  bool held = false;  // no memory for the out-of-place outputs: steps in step()
  at::Tensor host_grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq;
  at::Tensor out_master, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, staging;
};

std::shared_ptr<GradStream> GradStream::create(std::shared_ptr<Runtime> runtime, GradStreamOptions options) {
  return std::shared_ptr<GradStream>(new GradStream(std::move(runtime), options));
}

GradStream::GradStream(std::shared_ptr<Runtime> runtime, GradStreamOptions options)
    : runtime_(std::move(runtime)), options_(options), worker_(std::make_unique<swap::detail::SerialWorker>()) {
  TIERFLOW_EXPECTS(runtime_ != nullptr, "GradStream: no runtime");
  TIERFLOW_EXPECTS(options_.accumulation_steps >= 1, "GradStream: accumulation_steps must be >= 1");
}

GradStream::~GradStream() {
  try {
    worker_->drain();
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("a streamed optimizer step failed at shutdown: ") + e.what());
  }
  worker_.reset();
  try {
    for (auto& [h, staging] : uploads_) h.wait();
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("a weight upload failed at shutdown: ") + e.what());
  }
  for (auto& s : slots_) {
    try {
      s.copy.wait();  // a gradient's copy still reading device memory this slot may hold last (rule 3)
    } catch (const std::exception& e) {
      log(LogLevel::kError, std::string("a gradient copy failed at shutdown: ") + e.what());
    }
    if (s.accumulator) s.accumulator->del_post_hook(s.hook_key);
  }
}

std::size_t GradStream::add_parameter(const at::Tensor& param, int group) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(!planned_, "GradStream: parameters must be added before the first backward");
  Slot s;
  s.param = param;
  s.group = group;
  s.streamable = param.requires_grad() && param.is_leaf() && param.is_contiguous() &&
                 streamable_dtype(param.scalar_type()) && runtime_->on_device(param);
  const std::size_t slot = slots_.size();
  if (s.streamable) {
    s.accumulator = torch::autograd::impl::grad_accumulator(param);
    TIERFLOW_EXPECTS(s.accumulator, "GradStream: parameter " + std::to_string(slot) + " has no gradient accumulator");
    s.hook_key = s.accumulator->add_post_hook(std::make_unique<GradReadyHook>(weak_from_this(), slot));
  }
  if (static_cast<std::size_t>(group) >= groups_.size()) groups_.resize(static_cast<std::size_t>(group) + 1);
  slots_.push_back(std::move(s));
  return slot;
}

void GradStream::exclude(std::size_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::exclude: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  if (s.released) restore_locked(slot, false);  // it steps elsewhere, from p.grad
  if (s.streamed && !s.discarded) stats_.taken_back += 1;
  s.discarded = true;
  s.streamable = false;
  planned_ = false;  // re-plan without it at the next gradient
  replanned_ = false;
}

void GradStream::set_group(int group, const optimizer::AdamOptions& options) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(group >= 0, "GradStream::set_group: negative group");
  if (static_cast<std::size_t>(group) >= groups_.size()) groups_.resize(static_cast<std::size_t>(group) + 1);
  groups_[static_cast<std::size_t>(group)] = options;
}

void GradStream::set_state(std::size_t slot, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                           at::Tensor max_exp_avg_sq, at::Tensor step) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::set_state: no slot " + std::to_string(slot));
  Slot& s = slots_[slot];
  const std::int64_t n = s.param.numel();
  for (const at::Tensor* t : {&master, &exp_avg, &exp_avg_sq})
    TIERFLOW_EXPECTS(t->defined() && t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                         t->numel() == n,
                     "GradStream::set_state: slot " + std::to_string(slot) +
                         " needs contiguous fp32 CPU master and moments of the parameter's size");
  TIERFLOW_EXPECTS(step.defined() && step.is_cpu() && step.numel() == 1,
                   "GradStream::set_state: the step counter must be a one-element CPU tensor");
  s.master = std::move(master);
  s.exp_avg = std::move(exp_avg);
  s.exp_avg_sq = std::move(exp_avg_sq);
  s.max_exp_avg_sq = std::move(max_exp_avg_sq);
  s.step = std::move(step);
  s.has_state = true;
  // An early step read the state it replaces: it must not be committed.
  if (s.streamed && !s.discarded) {
    s.discarded = true;
    stats_.taken_back += 1;
  }
}

std::vector<at::Tensor> GradStream::state_of(std::size_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(slot < slots_.size(), "GradStream::state_of: no slot " + std::to_string(slot));
  const Slot& s = slots_[slot];
  // Shaped like the parameter, as torch.optim keeps its state (the stream works on flat views).
  auto shaped = [&](const at::Tensor& t) { return t.defined() ? t.view(s.param.sizes()) : t; };
  return {shaped(s.master), shaped(s.exp_avg), shaped(s.exp_avg_sq), shaped(s.max_exp_avg_sq)};
}

void GradStream::set_callbacks(std::function<void()> on_backward_begin, std::function<void(std::size_t)> init_state) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_backward_begin_ = std::move(on_backward_begin);
  init_state_ = std::move(init_state);
}

void GradStream::set_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_ = enabled;
}

std::size_t GradStream::add_module(const std::vector<std::size_t>& slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i : slots)
    TIERFLOW_EXPECTS(i < slots_.size(), "GradStream::add_module: no slot " + std::to_string(i));
  modules_.push_back(slots);
  return modules_.size() - 1;
}

std::size_t GradStream::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.size();
}

void GradStream::plan_locked() {
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
  std::vector<std::size_t> bytes(order.size()), local(order.size());
  std::size_t total = 0;
  for (std::size_t j = 0; j < order.size(); ++j) {
    bytes[j] = (slots_[order[j]].param.nbytes() + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment;
    local[j] = j;
    total += bytes[j];
  }
  const std::size_t bucket_bytes = options_.bucket_bytes > 0   ? options_.bucket_bytes
                                   : sized_bucket_bytes_ > 0 ? sized_bucket_bytes_
                                                             : optimizer::auto_grad_bucket_bytes(total);
  const auto plan = optimizer::plan_grad_buckets(bytes, local, bucket_bytes);
  buckets_.clear();
  for (const auto& pb : plan) {
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
}

void GradStream::on_grad(std::size_t i) {
  bool first = false;
  std::function<void()> begin;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!in_backward_) {
      in_backward_ = true;
      first = true;
      backward_start_ = Clock::now();
      begin = on_backward_begin_;
    }
  }
  if (first) {
    std::weak_ptr<GradStream> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto s = weak.lock()) s->on_backward_end();
    });
    if (begin) begin();  // pushes the groups' current hyperparameters (Python, once per backward)
  }
  std::function<void(std::size_t)> init;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& s = slots_[i];
    if (!s.streamable) return;
    s.grad_events += 1;
    if (!s.seen) {
      s.seen = true;
      arrival_.push_back(i);
    }
    if (s.streamed) {  // the gradient changed again after it streamed (accumulation went on)
      if (s.released) restore_locked(i, true);  // p.grad holds only the new part: add the released one
      if (!s.discarded) {
        s.discarded = true;
        stats_.taken_back += 1;
      }
      return;
    }
    if (!enabled_ || s.discarded || s.grad_events != options_.accumulation_steps) return;
    if (!planned_) plan_locked();
    if (s.has_state) {
      stream_locked(i);
      return;
    }
    init = init_state_;
  }
  if (!init) return;
  init(i);  // first step only: the Python state is created, and set_state called
  std::lock_guard<std::mutex> lock(mutex_);
  stream_locked(i);
}

void GradStream::stream_locked(std::size_t i) {
  Slot& s = slots_[i];
  if (!s.has_state || s.streamed || s.discarded || !planned_) return;
  const at::Tensor grad = s.param.grad();
  if (!grad.defined() || grad.is_sparse() || !grad.is_contiguous() || grad.numel() != s.param.numel() ||
      !streamable_dtype(grad.scalar_type()) || !runtime_->on_device(grad))
    return;  // step() takes it through the Python path, which names what is refused
  Bucket& b = buckets_[s.bucket];
  if (b.launched) return;  // a late gradient of a bucket already on the CPU: step() steps it
  if (!b.buffer.defined()) {
    try {
      b.buffer = runtime_->host_empty({static_cast<std::int64_t>(b.bytes)}, at::kByte, false);
    } catch (const out_of_memory&) {
      stats_.held += 1;
      return;
    }
  }
  // Earlier gradients whose copies are done go now; not this one: autograd
  // still holds it until this hook returns.
  release_landed_locked();
  at::Tensor host = b.buffer.narrow(0, static_cast<std::int64_t>(s.offset), static_cast<std::int64_t>(grad.nbytes()))
                        .view(grad.scalar_type());
  // After the work queued on the stream that produced the gradient (rule 1).
  // clip_grad_norm_'s op, queued before the copy: the copy's completion then
  // covers it too, and the gradient can go once the copy is done.
  if (options_.offload_gradients && (options_.max_grad_norm > 0 || options_.skip_nonfinite))
    s.norm = at::_foreach_norm({grad}, 2)[0];
  s.copy = runtime_->copy_to_host(host, grad.view(-1));
  s.copy_seq = ++copy_seq_;
  b.copies.push_back(s.copy);
  s.host_grad = host;
  s.grad_ref = grad;  // alive until the copy has landed (rule 3)
  s.grad_impl = grad.unsafeGetTensorImpl();
  s.grad_version = grad._version();
  s.options_used = groups_[static_cast<std::size_t>(s.group)];
  s.streamed = true;
  stats_.grad_bytes_to_host += grad.nbytes();
  if (options_.offload_gradients) {
    s.param.mutable_grad() = at::Tensor();  // p.grad is None; our reference goes once the copy is done
    s.grad_storage = std::make_unique<c10::weak_intrusive_ptr<c10::StorageImpl>>(grad.storage().getWeakStorageImpl());
    s.grad_bytes = grad.nbytes();
    s.freed_counted = false;
    s.released = true;
    releasing_.push_back(i);
    stats_.grads_released += 1;
  }
  b.arrived += 1;
  if (b.arrived == b.slots.size()) launch_locked(s.bucket);
}

void GradStream::launch_locked(std::size_t bi) {
  Bucket& b = buckets_[bi];
  if (b.launched) return;
  b.launched = true;
  std::vector<Entry> entries;
  for (std::size_t i : b.slots) {
    Slot& s = slots_[i];
    if (!s.streamed || s.discarded) continue;
    Entry e;
    e.slot = i;
    e.options = s.options_used;
    e.step = static_cast<std::int64_t>(s.step.item<float>()) + 1;
    e.host_grad = s.host_grad;
    e.master = s.master;
    e.exp_avg = s.exp_avg;
    e.exp_avg_sq = s.exp_avg_sq;
    if (e.options.amsgrad) e.max_exp_avg_sq = s.max_exp_avg_sq;
    try {
      const std::vector<std::int64_t> flat = {s.param.numel()};
      e.out_master = runtime_->host_empty(flat, at::kFloat, false);
      e.out_exp_avg = runtime_->host_empty(flat, at::kFloat, false);
      e.out_exp_avg_sq = runtime_->host_empty(flat, at::kFloat, false);
      if (e.options.amsgrad) e.out_max_exp_avg_sq = runtime_->host_empty(flat, at::kFloat, false);
      e.staging = runtime_->host_empty(flat, s.param.scalar_type(), false);
    } catch (const out_of_memory&) {
      e.held = true;  // its gradient still lands; step() steps it from there
      e.out_master = e.out_exp_avg = e.out_exp_avg_sq = e.out_max_exp_avg_sq = e.staging = at::Tensor();
      stats_.held += 1;
    }
    s.out_master = e.out_master;
    s.out_exp_avg = e.out_exp_avg;
    s.out_exp_avg_sq = e.out_exp_avg_sq;
    s.out_max_exp_avg_sq = e.out_max_exp_avg_sq;
    s.staging = e.staging;
    entries.push_back(std::move(e));
  }
  std::vector<swap::TransferHandle> copies = std::move(b.copies);
  b.copies.clear();
  stats_.buckets += 1;
  worker_->push([this, gen = generation_, entries = std::move(entries), copies = std::move(copies)]() mutable {
    run_bucket(gen, std::move(entries), std::move(copies));
  });
}

void GradStream::run_bucket(std::uint64_t generation, std::vector<Entry> entries,
                            std::vector<swap::TransferHandle> copies) {
  // Rule 2: the CPU reads the gradients only once they landed. Every copy is
  // waited for, even after one failed: none may still use memory that goes.
  std::exception_ptr failed;
  for (const auto& h : copies) {
    try {
      h.wait();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) {
    // A released gradient whose own copy failed is still on the device: back to
    // p.grad. The others landed and stay released (restore_grads brings them).
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& e : entries) {
      Slot& s = slots_[e.slot];
      bool ok = true;
      try {
        s.copy.wait();
      } catch (...) {
        ok = false;
      }
      if (ok) {
        if (generation == generation_) s.landed = true;
        continue;
      }
      if (s.released && s.grad_ref.defined() && !s.param.grad().defined()) s.param.mutable_grad() = s.grad_ref;
      s.released = false;
      s.discarded = true;  // its early step cannot run: step() takes it from p.grad
    }
    std::rethrow_exception(failed);
  }
  bool need_norm = options_.skip_nonfinite;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    need_norm = need_norm || clip_norm() > 0;
  }
  double sum_sq = 0;
  if (need_norm)
    for (const auto& e : entries)
      sum_sq += optimizer::sum_of_squares(e.host_grad.data_ptr(), optimizer_type(e.host_grad.scalar_type(), "GradStream: a gradient"),
                                          static_cast<std::size_t>(e.host_grad.numel()));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (generation != generation_) return;
    for (const auto& e : entries) {
      Slot& s = slots_[e.slot];
      s.landed = true;
      if (s.released) s.grad_ref = at::Tensor();  // its copy is done (rule 3): the memory goes
    }
    if (need_norm) {
      partial_.add(sum_sq);
      stats_.last_partial_norm = partial_.norm();
      const bool stop = (clip_norm() > 0 && partial_.clip_must_bind(clip_norm())) ||
                        (options_.skip_nonfinite && !std::isfinite(sum_sq));
      if (stop && !stopped_) {
        stopped_ = true;
        stats_.speculation_stops += 1;
      }
    }
    if (stopped_) return;  // step() steps these from the landed gradients, once the norm is known
  }
  // One kernel call per distinct (hyperparameters, step number) in the bucket; usually one.
  const auto t0 = Clock::now();
  std::uint64_t stepped_bytes = 0;
  std::vector<bool> done(entries.size(), false);
  for (std::size_t a = 0; a < entries.size(); ++a) {
    if (done[a] || entries[a].held) continue;
    std::vector<at::Tensor> masters, ms, vs, vmaxes, grads, outs;
    Runtime::AdamOutputs out;
    for (std::size_t k = a; k < entries.size(); ++k) {
      const Entry& e = entries[k];
      if (done[k] || e.held || e.step != entries[a].step || !same_options(e.options, entries[a].options)) continue;
      done[k] = true;
      masters.push_back(e.master);
      ms.push_back(e.exp_avg);
      vs.push_back(e.exp_avg_sq);
      vmaxes.push_back(e.max_exp_avg_sq);
      grads.push_back(e.host_grad);
      outs.push_back(e.staging);
      stepped_bytes += e.host_grad.nbytes();
      out.masters.push_back(e.out_master);
      out.exp_avgs.push_back(e.out_exp_avg);
      out.exp_avg_sqs.push_back(e.out_exp_avg_sq);
      out.max_exp_avg_sqs.push_back(e.out_max_exp_avg_sq);
    }
    runtime_->adam_step(entries[a].options, entries[a].step, masters, ms, vs, vmaxes, grads, outs, out);
  }
  const std::uint64_t ns = since_ns(t0);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.kernel_ns += ns;
  stats_.kernel_grad_bytes += stepped_bytes;
  window_kernel_ns_ += ns;
  window_kernel_bytes_ += stepped_bytes;
  if (generation != generation_) return;
  for (const auto& e : entries) {
    Slot& s = slots_[e.slot];
    if (e.held || s.discarded) continue;
    s.spec_done = true;
    stats_.early_steps += 1;
  }
}

void GradStream::on_backward_end() {
  std::lock_guard<std::mutex> lock(mutex_);
  in_backward_ = false;
  stats_.last_backward_ns = since_ns(backward_start_);
  release_landed_locked();
  count_freed_locked();
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (buckets_[b].arrived > 0 && !buckets_[b].launched) launch_locked(b);
}

void GradStream::wait_worker() {
  worker_->drain();
  std::lock_guard<std::mutex> lock(mutex_);
  count_freed_locked();
}

bool GradStream::has_unconfirmed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& s : slots_)
    if (s.streamed && !s.discarded) return true;
  return false;
}

void GradStream::discard_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.released) restore_locked(i, false);  // the next backward accumulates into it
    if (s.streamed && !s.discarded) {
      s.discarded = true;
      stats_.taken_back += 1;
    }
  }
}

void GradStream::restore_grads() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].released) restore_locked(i, false);
}

std::vector<std::pair<std::size_t, at::Tensor>> GradStream::released_norms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::size_t, at::Tensor>> out;
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].released && slots_[i].norm.defined()) out.emplace_back(i, slots_[i].norm);
  return out;
}

void GradStream::count_freed_locked() {
  // A released gradient's storage is freed when its last holder lets go: this
  // stream once the copy is done, autograd once the node's hooks have
  // returned, or a user who kept `g = p.grad`. Counted once it is gone.
  for (auto& s : slots_) {
    if (!s.freed_counted && s.grad_storage && !s.grad_ref.defined() && s.grad_storage->expired()) {
      stats_.grad_bytes_freed += s.grad_bytes;
      s.freed_counted = true;
    }
  }
}

void GradStream::release_landed_locked() {
  std::size_t kept = 0;
  for (std::size_t i : releasing_) {
    Slot& s = slots_[i];
    if (!s.released || !s.grad_ref.defined()) continue;
    bool done = false;
    if (s.copy.ready()) {
      try {
        s.copy.wait();  // does not block: rethrows a failed copy, whose gradient the worker puts back
        done = true;
      } catch (const std::exception&) {
      }
    }
    if (done) s.grad_ref = at::Tensor();
    else releasing_[kept++] = i;
  }
  releasing_.resize(kept);
}

void GradStream::restore_locked(std::size_t i, bool accumulate) {
  Slot& s = slots_[i];
  if (!s.released) return;
  s.released = false;
  s.norm = at::Tensor();
  const at::Tensor current = s.param.grad();
  if (current.defined() && !accumulate) return;  // the user set p.grad meanwhile: theirs stands
  at::Tensor g = s.grad_ref;  // still on the device: no copy needed
  if (!g.defined()) {
    s.copy.wait();  // its bytes are on the host (rethrows a failed copy)
    g = at::empty(s.param.sizes(), s.param.options().dtype(s.host_grad.scalar_type()));
    // After the kernels queued so far, and before the next one (rules 1 and 2);
    // the host slice stays until the copy is done (rule 3).
    uploads_.emplace_back(runtime_->copy_to_device(g.view(-1), s.host_grad), s.host_grad);
  }
  g = g.view(s.param.sizes());
  if (current.defined()) current.add_(g);  // as AccumulateGrad would have: old + new
  else s.param.mutable_grad() = g;
  stats_.grads_restored += 1;
}

void GradStream::end_window() {
  std::exception_ptr error;
  try {
    worker_->drain();
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
  // Copies of a bucket that never went to the worker (a backward that failed)
  // and of released gradients must be done before their memory goes (rule 3).
  auto settle = [](const swap::TransferHandle& h) {
    try {
      h.wait();
    } catch (const std::exception& e) {
      log(LogLevel::kWarn, std::string("a gradient copy of a discarded window failed: ") + e.what());
    }
  };
  for (auto& b : buckets_)
    for (const auto& h : b.copies) settle(h);
  for (std::size_t i : releasing_) settle(slots_[i].copy);
  count_freed_locked();
  for (auto& s : slots_) {
    if (count_taken_back && s.streamed && !s.discarded) stats_.taken_back += 1;
    s.grad_events = 0;
    s.seen = s.streamed = s.landed = s.discarded = s.spec_done = false;
    s.grad_ref = s.host_grad = s.norm = at::Tensor();
    s.copy = swap::TransferHandle();
    s.released = false;
    s.grad_storage.reset();
    s.grad_impl = nullptr;
    s.clip_base = -1;
    s.clipped = false;
    s.clip_scale = 1.0;
    s.out_master = s.out_exp_avg = s.out_exp_avg_sq = s.out_max_exp_avg_sq = s.staging = at::Tensor();
  }
  for (auto& b : buckets_) {
    b.buffer = at::Tensor();
    b.copies.clear();
    b.arrived = 0;
    b.launched = false;
  }
  releasing_.clear();
  last_window_kernel_ns_ = window_kernel_ns_;
  last_window_kernel_bytes_ = window_kernel_bytes_;
  window_kernel_ns_ = window_kernel_bytes_ = 0;
  partial_.reset();
  stopped_ = false;
  generation_ += 1;
  // DDP-style: once one backward has shown the order, buckets follow it.
  if (planned_ && !replanned_ && !arrival_.empty()) {
    plan_locked();
    replanned_ = true;
  }
  arrival_.clear();
}

void GradStream::wait_uploads_locked(std::unique_lock<std::mutex>& /*lock*/) {
  const auto t0 = Clock::now();
  for (auto& [h, staging] : uploads_) h.wait();
  uploads_.clear();
  // Copies seen complete on the host are complete for any kernel queued from now on.
  for (auto& s : slots_) s.upload_pending = false;
  stats_.weight_wait_ns += since_ns(t0);
}

void GradStream::upload_locked(std::vector<std::size_t> order) {
  // Forward order: the bucket that backward filled last holds the first layers.
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return slots_[a].bucket != slots_[b].bucket ? slots_[a].bucket > slots_[b].bucket
                                                : slots_[a].offset > slots_[b].offset;
  });
  const auto& engine = runtime_->copy_engine();
  std::vector<std::size_t> sent;
  for (std::size_t i : order) {
    Slot& s = slots_[i];
    if (!s.staging.defined()) continue;
    const swap::StreamRef compute = compute_stream_of(*engine, s.param.device());
    // After the kernels still reading the old value (rule 1).
    s.upload = engine->copy(swap::Direction::kHostToDevice, s.param.data_ptr(), s.staging.data_ptr(),
                            s.param.nbytes(), {}, compute);
    s.upload_pending = true;
    s.upload_seq = ++upload_seq_;
    uploads_.emplace_back(s.upload, s.staging);  // staging stays until the copy is done (rule 3)
    stats_.weight_bytes_to_device += s.param.nbytes();
    sent.push_back(i);
  }
  if (options_.weights_in_forward) return;  // each module's forward waits for its own (wait_module)
  if (sent.empty()) return;
  const auto t0 = Clock::now();
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
  stats_.weight_wait_ns += since_ns(t0);
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

GradStream::Finish GradStream::finish(double scale, bool stale) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (std::size_t b = 0; b < buckets_.size(); ++b)  // a backward that ended without its callback
      if (buckets_[b].arrived > 0 && !buckets_[b].launched) launch_locked(b);
  }
  const auto t0 = Clock::now();
  worker_->drain();
  std::unique_lock<std::mutex> lock(mutex_);
  stats_.step_wait_ns += since_ns(t0);
  count_freed_locked();
  wait_uploads_locked(lock);
  Finish out;
  std::vector<std::size_t> redo;
  std::vector<double> redo_scale;  // the clip coefficient each is stepped with
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.streamable) continue;
    if (stale && s.released) restore_locked(i, false);  // the caller re-reads the master and takes p.grad
    const at::Tensor grad = s.param.grad();
    const bool released = s.released && !grad.defined();  // its gradient is the landed host copy
    const bool early = s.spec_done && !s.discarded;
    if (!grad.defined() && !released) {
      if (s.streamed && !s.discarded) stats_.taken_back += 1;
      s.discarded = true;
      continue;
    }
    const bool same_grad = s.streamed && s.landed && !s.discarded && !stale && s.has_state &&
                           (released || (grad.unsafeGetTensorImpl() == s.grad_impl &&
                                         grad._version() == s.grad_version));
    const double slot_scale = s.clipped ? s.clip_scale : scale;  // Note [Clip picked up]
    if (same_grad && early && slot_scale == 1.0 &&
        same_options(s.options_used, groups_[static_cast<std::size_t>(s.group)])) {
      s.master = s.out_master;
      s.exp_avg = s.out_exp_avg;
      s.exp_avg_sq = s.out_exp_avg_sq;
      if (s.out_max_exp_avg_sq.defined()) s.max_exp_avg_sq = s.out_max_exp_avg_sq;
      s.step.add_(1);
      s.discarded = true;  // consumed: the window reset below must not count it as taken back
      out.committed.push_back(i);
      stats_.committed += 1;
      continue;
    }
    if (early) {
      stats_.taken_back += 1;
      stats_.redone += 1;
    } else if (s.streamed && !s.discarded && s.landed && !same_grad) {
      stats_.taken_back += 1;  // streamed, never stepped (speculation stopped), and now not usable
    }
    if (s.streamed && !s.discarded) s.discarded = true;
    if (same_grad) {
      redo.push_back(i);
      redo_scale.push_back(slot_scale);
    } else {
      if (s.released) restore_locked(i, false);  // the caller steps it from p.grad
      out.unhandled.push_back(i);
    }
  }
  // Stepped here from the gradients already on the host, with the clip
  // coefficient: the same kernel on the same values as the Python path.
  std::uint64_t adam_ns = 0;
  std::vector<bool> done(redo.size(), false);
  for (std::size_t a = 0; a < redo.size(); ++a) {
    if (done[a]) continue;
    const Slot& first = slots_[redo[a]];
    optimizer::AdamOptions o = groups_[static_cast<std::size_t>(first.group)];
    const std::int64_t step = static_cast<std::int64_t>(first.step.item<float>()) + 1;
    if (redo_scale[a] != 1.0) o.grad_scale = redo_scale[a];
    std::vector<at::Tensor> masters, ms, vs, vmaxes, grads, outs;
    std::vector<std::size_t> members;
    for (std::size_t k = a; k < redo.size(); ++k) {
      Slot& s = slots_[redo[k]];
      // (Scales compare as bits: a NaN coefficient, from a non-finite norm, groups with itself.)
      if (done[k] || s.group != first.group || std::memcmp(&redo_scale[k], &redo_scale[a], sizeof(double)) != 0 ||
          static_cast<std::int64_t>(s.step.item<float>()) + 1 != step)
        continue;
      done[k] = true;
      if (!s.staging.defined()) s.staging = runtime_->host_empty({s.param.numel()}, s.param.scalar_type(), false);
      masters.push_back(s.master);
      ms.push_back(s.exp_avg);
      vs.push_back(s.exp_avg_sq);
      vmaxes.push_back(o.amsgrad ? s.max_exp_avg_sq : at::Tensor());
      grads.push_back(s.host_grad);
      outs.push_back(s.staging);
      stats_.kernel_grad_bytes += s.host_grad.nbytes();
      window_kernel_bytes_ += s.host_grad.nbytes();
      members.push_back(redo[k]);
    }
    const auto tk = Clock::now();
    runtime_->adam_step(o, step, masters, ms, vs, vmaxes, grads, outs);
    adam_ns += since_ns(tk);
    for (std::size_t i : members) {
      slots_[i].step.add_(1);
      out.committed.push_back(i);
    }
  }
  stats_.step_kernel_ns += adam_ns;
  window_kernel_ns_ += adam_ns;
  upload_locked(out.committed);
  reset_window_locked(false);
  return out;
}

void GradStream::begin_clip() {
  // Per device, the candidate whose copy was sent last: copies in one
  // direction complete in submission order (Note [Copy ordering]).
  std::vector<std::pair<c10::Device, const Slot*>> last;
  std::vector<std::pair<c10::Device, swap::TransferHandle>> copies;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : slots_) {
      s.clip_base = -1;
      if (!s.streamed || s.discarded || s.clipped || s.released) continue;
      const at::Tensor grad = s.param.grad();
      if (!grad.defined() || grad.unsafeGetTensorImpl() != s.grad_impl || grad._version() != s.grad_version)
        continue;
      s.clip_base = s.grad_version;
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
  if (options_.max_grad_norm > 0) return;  // tierflow clips as well: a changed gradient, stepped from p.grad
  if (max_norm > 0) learned_clip_norm_ = max_norm;
  for (auto& s : slots_) {
    const std::int64_t base = s.clip_base;
    s.clip_base = -1;
    if (base < 0) continue;
    const at::Tensor grad = s.param.grad();
    // The clip's one in-place multiply, and nothing else, since the copy.
    if (!grad.defined() || grad.unsafeGetTensorImpl() != s.grad_impl || grad._version() != base + 1) continue;
    // The kernel's fp32 grad * grad_scale rounds as torch's multiply only for
    // fp32 gradients; a coefficient of exactly 1 changes no value in any type.
    if (coefficient != 1.0 && grad.scalar_type() != at::kFloat) continue;
    s.grad_version = base + 1;
    s.clipped = true;
    s.clip_scale = coefficient;
    stats_.clips_picked_up += 1;
  }
}

void GradStream::wait_module(std::size_t module) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(module < modules_.size(), "GradStream::wait_module: no module " + std::to_string(module));
  const auto t0 = Clock::now();
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
  stats_.weight_wait_ns += since_ns(t0);
}

void GradStream::synchronize() {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto& engine = runtime_->copy_engine();
  for (auto& s : slots_)
    if (s.upload_pending) {
      engine->make_stream_wait(compute_stream_of(*engine, s.param.device()), s.upload);
      s.upload_pending = false;
    }
  wait_uploads_locked(lock);
}

std::size_t GradStream::size_buckets(double link_bytes_per_second) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (options_.bucket_bytes > 0 || !planned_ || in_backward_) return stats_.bucket_bytes;
  for (const auto& s : slots_)
    if (s.streamed) return stats_.bucket_bytes;  // inside a window: its buckets are in use
  optimizer::BucketSizing in;
  in.backward_seconds = static_cast<double>(stats_.last_backward_ns) / 1e9;
  in.link_bytes_per_second = link_bytes_per_second;
  // The last window's: the first one's also allocated the optimizer states.
  const double kernel_s = static_cast<double>(last_window_kernel_ns_) / 1e9;
  in.cpu_grad_bytes_per_second = kernel_s > 0 ? static_cast<double>(last_window_kernel_bytes_) / kernel_s : 0.0;
  for (const auto& s : slots_)
    if (s.streamable) in.total_grad_bytes += s.param.nbytes();
  sized_bucket_bytes_ = optimizer::measured_grad_bucket_bytes(in);
  stats_.sized_link_bytes_per_s = in.link_bytes_per_second;
  stats_.sized_cpu_grad_bytes_per_s = in.cpu_grad_bytes_per_second;
  stats_.sized_backward_s = in.backward_seconds;
  // The same order as now (observed in a backward), cut at the new size.
  arrival_.clear();
  for (const auto& b : buckets_) arrival_.insert(arrival_.end(), b.slots.begin(), b.slots.end());
  plan_locked();
  arrival_.clear();
  return stats_.bucket_bytes;
}

GradStreamStats GradStream::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace tierflow::bindings
