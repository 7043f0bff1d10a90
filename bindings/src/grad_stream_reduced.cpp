// GradStream fed by DDP's reduction (Note [Distributed training] in
// bindings/python/tierflow/_distributed.py; the ledger's side is "Reduced
// gradients" in Note [Step ledger]).
//
// The Python communication hook (tierflow/_ddp_feed.py) calls on_reduced from
// the callback of the reduction's future, once per DDP bucket: on the thread
// that completed the all-reduce (gloo's, or the autograd thread when it had
// completed already), before DDP's finalize_backward, which waits for that
// future and only then writes the result into p.grad (a copy_ into p.grad with
// gradient_as_bucket_view=False; p.grad already is the bucket's view with True).
// So the stream copies the reduced slice itself, on the copy engine after the
// work queued on the calling thread's current stream (rule 1 of Note [Copy
// ordering]; on CUDA the future's callback runs on a stream that waits for the
// all-reduce), and keeps the slice referenced until the copy landed (rule 3).
//
// The identity step() checks is p.grad's after the write-back: DDP queues
// finalize_backward as an autograd final callback during backward (at the last
// gradient), after ours (queued at the first gradient); so our end of backward
// queues itself once more, from within the final callbacks, which puts it after
// DDP's, and there records p.grad's identity (rebind) before backward ends.
#include "tierflow/bindings/grad_stream.hpp"

#include "grad_stream_parts.hpp"

#include <torch/csrc/autograd/engine.h>

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::bindings {

void GradStream::set_reduced(const std::vector<std::size_t>& slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i : slots) {
    TIERFLOW_EXPECTS(i < slots_.size(), "GradStream::set_reduced: no slot " + std::to_string(i));
    if (ledger_.streamable(i) && reduced_.add(slots_[i].param.unsafeGetTensorImpl(), i)) ledger_.set_reduced(i, true);
  }
}

void GradStream::on_reduced(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  std::vector<optimizer::ReducedSlots::Member> members;
  for (const auto& p : params) {
    const bool same_type = p.scalar_type() == flat.scalar_type();
    members.push_back({p.unsafeGetTensorImpl(), static_cast<std::size_t>(p.numel()), same_type});
  }
  std::vector<std::pair<std::size_t, at::Tensor>> mine;  // (slot, its reduced gradient)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& c : reduced_.slices(members, {flat.numel(), flat.dim(), flat.is_contiguous()})) {
      const auto offset = static_cast<std::int64_t>(c.offset), numel = static_cast<std::int64_t>(c.numel);
      mine.emplace_back(c.slot, flat.narrow(0, offset, numel));
    }
  }
  if (mine.empty()) return;
  begin_backward(false);  // the end of backward is queued by the local hooks (autograd thread)
  for (const auto& [i, grad] : mine) {
    std::function<void(std::size_t)> init;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const optimizer::GradArrival what = ledger_.arrive_reduced(i);
      engine_->sync_buckets();
      if (what == optimizer::GradArrival::kStream) stream_from_locked(i, grad, true);
      if (what != optimizer::GradArrival::kNeedState) continue;
      init = init_state_;
    }
    if (!init) continue;
    init(i);  // first step only: the Python state is created, and set_state called
    std::lock_guard<std::mutex> lock(mutex_);
    stream_from_locked(i, grad, true);
  }
}

void GradStream::queue_backward_end() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!ledger_.in_backward()) return;  // nothing arrived in this backward: nothing to end
  }
  begin_backward(true);
}

bool GradStream::await_reduction() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!ends_.requeue(!reduced_.empty())) return false;
  }
  // From within the final callbacks: runs after every callback queued so far, DDP's finalize_backward included.
  std::weak_ptr<GradStream> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto s = weak.lock()) s->on_backward_end();
  });
  return true;
}

void GradStream::rebind_reduced_locked() {
  for (std::size_t i : reduced_.slots())
    if (!slots_[i].owner.defined()) ledger_.rebind(i, identity_of(i));  // FSDP2's: their identity at the feed
}

}  // namespace tierflow::bindings
