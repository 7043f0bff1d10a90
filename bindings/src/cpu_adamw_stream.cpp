// CpuAdamW's steps during backward: the adapter over GradStream that the
// Python CPUAdamW is too. See Note [C++ steps during backward] in cpu_adamw.hpp.
#include <ATen/ATen.h>

#include "tierflow/bindings/block_offload.hpp"
#include "tierflow/bindings/cpu_adamw.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/stream_rules.hpp"

namespace tierflow::bindings {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

void CpuAdamW::start_streaming() {
  const CpuAdamWOptions& o = options_;
  if (!optimizer::check_stream_options(o, on_nvme_, runtime_->config().offload_optimizer)) return;
  auto stream = GradStream::create(runtime_, optimizer::stream_options(o));
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    for (const at::Tensor& p : param_groups_[g].params()) {
      // Only those it hooks are carried (the GPU share steps on the GPU: Note [C++ GPU share]).
      if (!stream->hooks(p) || carried(p) || on_gpu(p)) continue;
      const std::size_t slot = stream->add_parameter(p, static_cast<int>(g));
      records_.carry(p.unsafeGetTensorImpl(), slot);
      if (stream_params_.size() <= slot) stream_params_.resize(slot + 1);
      stream_params_[slot] = p;
    }
  }
  if (records_.carried_slots().empty()) return;  // nothing it could carry: every parameter steps in step()
  stream_ = std::move(stream);
  // The stream (owned here, and reset first by the destructor) calls back without a lock held.
  stream_->set_callbacks([this] { on_backward_begin(); }, [this](std::size_t slot) { init_slot(slot); });
  push_groups();
}

void CpuAdamW::push_groups() {
  for (std::size_t g = 0; g < param_groups_.size(); ++g)
    stream_->set_group(static_cast<int>(g), adam_options_of(static_cast<const AdamWOptions&>(param_groups_[g].options())));
}

void CpuAdamW::on_backward_begin() {
  push_groups();  // an LR scheduler may have changed them since the last step()
  stream_->set_enabled(!records_.masters_stale());  // after a load every carried parameter steps in step()
}

void CpuAdamW::init_slot(std::size_t slot_index) {
  // From autograd's thread, the first time a slot streams (the trainer's thread waits in backward()).
  const at::Tensor& p = stream_params_.at(slot_index);
  slot_of(p).registered = false;
  register_states(p.unsafeGetTensorImpl());
}

void CpuAdamW::register_states(const void* fresh) {
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& o = static_cast<const AdamWOptions&>(param_groups_[g].options());
    for (const at::Tensor& p : param_groups_[g].params()) {
      if (!carried(p)) continue;
      Slot& s = slot_of(p);
      if (s.registered) continue;
      const bool make = p.unsafeGetTensorImpl() == fresh;
      if (!make && !state_.count(p.unsafeGetTensorImpl())) continue;  // no state yet: its first stream makes it
      auto& entry = state_[p.unsafeGetTensorImpl()];
      if (!entry) entry = new_state(p, o.amsgrad());  // the first stream of the slot: as step_group makes one
      auto& st = static_cast<AdamWParamState&>(*entry);
      const at::Tensor master = slot(p, o).master;  // read from p when there is none
      if (!s.step_count.defined()) s.step_count = at::zeros({1}, at::kFloat);
      s.step_count.fill_(static_cast<double>(st.step()));
      stream_->set_state(records_.stream_slot(p.unsafeGetTensorImpl()), master, st.exp_avg(), st.exp_avg_sq(),
                         o.amsgrad() ? st.max_exp_avg_sq() : at::Tensor(), s.step_count);
      s.registered = true;
    }
  }
}

std::pair<double, bool> CpuAdamW::clip_coefficient() const {
  if (options_.max_grad_norm == 0.0 && !options_.skip_nonfinite) return {1.0, true};
  // torch.nn.utils.clip_grad_norm_'s norm: per-tensor norms (_foreach_norm) in parameter order, a released
  // gradient by the norm the stream took with the same op before freeing it; then the norm of those.
  std::unordered_map<std::size_t, at::Tensor> released;
  if (stream_ && options_.offload_gradients)
    for (auto& [slot, norm] : stream_->released_norms()) released.emplace(slot, norm);
  std::vector<at::Tensor> grads;
  std::vector<std::pair<bool, at::Tensor>> items;  // (a released norm, it) or (false, undefined: next computed)
  for (const auto& group : param_groups_) {
    for (const at::Tensor& p : group.params()) {
      if (p.grad().defined()) {
        grads.push_back(p.grad());
        items.emplace_back(false, at::Tensor());
        continue;
      }
      if (!carried(p)) continue;
      const auto norm = released.find(records_.stream_slot(p.unsafeGetTensorImpl()));
      if (norm != released.end()) items.emplace_back(true, norm->second);
    }
  }
  if (items.empty()) return {1.0, true};
  const std::vector<at::Tensor> computed = grads.empty() ? std::vector<at::Tensor>() : at::_foreach_norm(grads, 2);
  std::vector<at::Tensor> norms;
  std::size_t next = 0;
  for (const auto& [is_released, norm] : items) norms.push_back(is_released ? norm : computed[next++]);
  const at::Device device = norms.front().device();
  for (auto& n : norms) n = n.to(device);
  const at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  const bool finite = at::isfinite(total).item<bool>();
  if (options_.max_grad_norm == 0.0) return {1.0, finite};
  // Python's max_norm / (total + 1e-6) is reciprocal() * max_norm (Tensor.__rtruediv__).
  const at::Tensor coef = at::clamp((total + 1e-6).reciprocal() * options_.max_grad_norm, std::nullopt, 1.0);
  return {coef.item<double>(), finite};
}

bool CpuAdamW::step_streamed(double scale) {
  push_groups();
  std::vector<std::size_t> unhandled;
  try {
    unhandled = stream_->prepare_finish(scale, records_.masters_stale(), false);
  } catch (const out_of_memory&) {  // the early steps' out-of-place results let go for this path's room
    unhandled = stream_->prepare_finish(scale, records_.masters_stale(), true);
  }
  records_.reread_slots(stream_->weights_changed());
  const GradStream::Finish f = stream_->commit_finish();  // cannot fail
  adopt_stream_states(f.committed);
  unhandled.insert(unhandled.end(), f.unhandled.begin(), f.unhandled.end());
  records_.stream_finished(unhandled);  // the others were confirmed, redone, or had nothing to step
  return !f.committed.empty();
}

void CpuAdamW::adopt_stream_states(const std::vector<std::size_t>& slots) {
  // A commit swapped the out-of-place results in: torch's state (save, load, state()) holds them from now on.
  for (std::size_t i : slots) {
    const at::Tensor& p = stream_params_.at(i);
    const std::vector<at::Tensor> t = stream_->state_of(i);
    Slot& s = slot_of(p);
    s.master = t[0];
    auto& st = static_cast<AdamWParamState&>(*state_.at(p.unsafeGetTensorImpl()));
    st.exp_avg(t[1]);
    st.exp_avg_sq(t[2]);
    if (t[3].defined()) st.max_exp_avg_sq(t[3]);
    st.step(static_cast<std::int64_t>(s.step_count.item<float>()));
    records_.count_elements(static_cast<std::size_t>(p.numel()));
  }
}

void CpuAdamW::reconcile_master(const at::Tensor& p, at::Tensor& master) const {
  // Kept where p is its rounding (a 16-bit parameter's master after a load), else read from p.
  const at::Tensor now = p.detach().to(at::kCPU);
  if (at::equal(master.to(now.scalar_type()), now)) return;
  master.copy_(now);
}

void CpuAdamW::assign_gpu_share() {
  std::vector<at::Tensor> cuda;
  std::vector<std::size_t> numels;
  for (const auto& group : param_groups_)
    for (const at::Tensor& p : group.params())
      if (p.is_cuda() && p.is_contiguous() && p.requires_grad()) {
        cuda.push_back(p);
        numels.push_back(static_cast<std::size_t>(p.numel()));
      }
  const std::vector<bool> picked = optimizer::choose_gpu_share(options_.gpu_fraction, numels);
  for (std::size_t i = 0; i < cuda.size(); ++i)
    if (picked[i]) records_.share_on_gpu(cuda[i].unsafeGetTensorImpl());
}

void CpuAdamW::gpu_step(const std::vector<at::Tensor>& params, const AdamWOptions& o, const optimizer::AdamOptions& ao) {
  // States made on the device at a parameter's first step; an fp32 parameter is its own master (in place), a
  // 16-bit one steps an fp32 master on the device and is written from it (Note [C++ GPU share]).
  std::vector<std::int64_t> steps;
  for (const at::Tensor& p : params) {
    auto& entry = state_[p.unsafeGetTensorImpl()];
    if (!entry) {
      auto st = std::make_unique<AdamWParamState>();
      st->exp_avg(at::zeros_like(p, at::kFloat));
      st->exp_avg_sq(at::zeros_like(p, at::kFloat));
      if (o.amsgrad()) st->max_exp_avg_sq(at::zeros_like(p, at::kFloat));
      entry = std::move(st);
    }
    Slot& s = slot_of(p);
    if (p.scalar_type() != at::kFloat && !s.master.defined()) s.master = p.detach().to(at::kFloat);
    auto& st = static_cast<AdamWParamState&>(*entry);
    steps.push_back(st.step());  // taken so far: groups_by_next_step's step is the one stepped now
    st.step(st.step() + 1);
  }
  const auto* guard = c10::impl::getDeviceGuardImpl(params.front().device().type());
  void* stream = guard->getStream(params.front().device()).native_handle();
  for (const auto& b : optimizer::groups_by_next_step(steps)) {
    std::vector<optimizer::AdamTensor> ts;
    std::vector<at::Tensor> grads;  // kept alive until the kernel is queued
    for (std::size_t i : b.members) {
      const at::Tensor& p = params[i];
      auto& st = static_cast<AdamWParamState&>(*state_.at(p.unsafeGetTensorImpl()));
      const bool fp32 = p.scalar_type() == at::kFloat;
      const at::Tensor master = fp32 ? p.detach() : slot_of(p).master;
      grads.push_back(p.grad().contiguous());
      optimizer::AdamTensor t;
      t.numel = static_cast<std::size_t>(p.numel());
      t.master = master.data_ptr<float>();
      t.exp_avg = st.exp_avg().data_ptr<float>();
      t.exp_avg_sq = st.exp_avg_sq().data_ptr<float>();
      if (o.amsgrad()) t.max_exp_avg_sq = st.max_exp_avg_sq().data_ptr<float>();
      t.grad = grads.back().data_ptr();
      t.grad_type = optimizer_type(grads.back().scalar_type(), "tierflow CpuAdamW (GPU share): gradient");
      if (!fp32) {
        t.param_out = p.data_ptr();
        t.param_type = optimizer_type(p.scalar_type(), "tierflow CpuAdamW (GPU share): parameter");
      }
      ts.push_back(t);
      p.unsafeGetTensorImpl()->bump_version();
      records_.count_elements(static_cast<std::size_t>(p.numel()));
    }
    optimizer::cuda_adam_step(ao, b.step, ts, stream);
  }
}

GradStreamStats CpuAdamW::stream_stats() const { return stream_ ? stream_->stats() : GradStreamStats{}; }

void CpuAdamW::use_host_copies(const BlockOffload& offload) {
  if (!stream_) return;  // the kernel steps the parameters where they are (their host copies between uses)
  for (const auto& [impl, slot] : records_.carried_slots()) {
    const at::Tensor home = offload.host_copy(stream_params_.at(slot));
    if (home.defined()) stream_->set_home(slot, home);
  }
}

void CpuAdamW::zero_grad(bool set_to_none) {
  if (stream_) stream_->end_window();
  Optimizer::zero_grad(set_to_none);
}

void CpuAdamW::synchronize() {
  if (stream_) stream_->synchronize();
}

}  // namespace tierflow::bindings
