// See Note [C++ CpuAdamW] in cpu_adamw.hpp.
#include "tierflow/bindings/cpu_adamw.hpp"

#include <torch/optim/serialize.h>

#include <algorithm>
#include <chrono>

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/core/clock.hpp"

namespace tierflow::bindings {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

namespace {

// Waits for `copies` into or out of `buffers`. Note [Stall timeout]: when one stalls it may still write or read
// them: all are kept for good, and the stall is raised.
void wait_or_keep(const std::vector<swap::TransferHandle>& copies, const std::vector<at::Tensor>& buffers,
                  const char* what) {
  try {
    for (const auto& h : copies) h.wait();
  } catch (const stall_error&) {
    auto held = std::make_shared<std::vector<at::Tensor>>();
    std::uint64_t bytes = 0;
    for (const at::Tensor& t : buffers)
      if (t.defined()) {
        held->push_back(t);
        bytes += t.nbytes();
      }
    keep_forever(held, bytes, what);
    throw;
  }
}

// The same groups and materialized states, for save(): an optimizer only in
// the sense that torch's archive writer takes one.
class ArchiveView : public torch::optim::Optimizer {
 public:
  ArchiveView(const std::vector<torch::optim::OptimizerParamGroup>& groups, std::unique_ptr<torch::optim::OptimizerOptions> defaults)
      : Optimizer(groups, std::move(defaults)) {}
  at::Tensor step(LossClosure) override { TORCH_CHECK(false, "ArchiveView cannot step"); }
};

}  // namespace

// torch's AdamW options as the kernel's (AdamW: decoupled weight decay).
optimizer::AdamOptions adam_options_of(const AdamWOptions& o) {
  optimizer::AdamOptions ao;
  ao.lr = o.lr();
  ao.beta1 = std::get<0>(o.betas());
  ao.beta2 = std::get<1>(o.betas());
  ao.eps = o.eps();
  ao.weight_decay = o.weight_decay();
  ao.amsgrad = o.amsgrad();
  ao.decoupled_weight_decay = true;
  return ao;
}

namespace {

// A parameter as Note [CPU AdamW state placement] sees it.
optimizer::ParamLayout layout(const at::Tensor& p) {
  return {p.is_cpu(), p.scalar_type() == at::kFloat, p.is_contiguous()};
}

}  // namespace

CpuAdamW::CpuAdamW(std::shared_ptr<Runtime> runtime, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                   AdamWOptions defaults, std::optional<CpuAdamWOptions> options)
    : Optimizer(param_groups, std::make_unique<AdamWOptions>(defaults)), runtime_(std::move(runtime)) {
  TIERFLOW_EXPECTS(runtime_ != nullptr, "CpuAdamW: a runtime is required");
  if (auto why = optimizer::adam_options_problem(adam_options_of(defaults))) TORCH_CHECK(false, *why);
  on_nvme_ = optimizer::adamw_state_tier(runtime_->config().offload_optimizer) == Tier::kNvme;
  format_ = runtime_->config().optimizer_states;
  check_amsgrad();
  options_ = options ? *options : CpuAdamWOptions::from_config(runtime_->config());
  assign_gpu_share();  // Note [C++ GPU share]: before the stream takes the rest
  start_streaming();   // Note [C++ steps during backward]
}

void CpuAdamW::check_amsgrad() const {
  std::vector<bool> amsgrad;
  for (const auto& group : param_groups_)
    amsgrad.push_back(static_cast<const AdamWOptions&>(group.options()).amsgrad());
  optimizer::check_amsgrad_format(amsgrad, format_);
}

void CpuAdamW::set_state_format(optimizer::StateFormat f) {
  TIERFLOW_EXPECTS(state_.empty() && std::all_of(slots_.begin(), slots_.end(),
                                                 [](const auto& s) { return s.second.nvme_key == 0; }),
                   "CpuAdamW::set_state_format: the optimizer has states already; set the format before the first "
                   "step or load");
  const optimizer::StateFormat before = format_;
  format_ = f;
  try {
    check_amsgrad();
  } catch (...) {
    format_ = before;
    throw;
  }
}

CpuAdamW::CpuAdamW(std::shared_ptr<Runtime> runtime, std::vector<at::Tensor> params, AdamWOptions defaults,
                   std::optional<CpuAdamWOptions> options)
    : CpuAdamW(std::move(runtime), {torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults),
               std::move(options)) {}

CpuAdamW::~CpuAdamW() {
  stream_.reset();  // its callbacks reach this optimizer: it goes first (its hooks with it)
  if (!on_nvme_) return;
  for (auto& [impl, s] : slots_)
    if (s.nvme_key) runtime_->nvme_adam().remove(s.nvme_key);
}

bool CpuAdamW::own_master(const at::Tensor& p) const {
  return records_.own_master(p.unsafeGetTensorImpl(), layout(p));
}

CpuAdamW::Slot& CpuAdamW::slot(const at::Tensor& p, const AdamWOptions& options) {
  Slot& s = slot_of(p);
  if (on_nvme_) {
    if (s.nvme_key == 0) {  // the master lives on NVMe from here on
      at::Tensor master = own_master(p) ? p.detach() : p.detach().to(at::kCPU, at::kFloat).contiguous();
      s.nvme_key = runtime_->nvme_adam().add(static_cast<std::size_t>(p.numel()), options.amsgrad(),
                                             master.data_ptr<float>(), nullptr, nullptr, nullptr, format_);
    }
  } else if (!own_master(p) && !s.master.defined()) {
    s.master = runtime_->host_empty(p.sizes(), at::kFloat, false);
    s.master.copy_(p.detach());
  }
  return s;
}

std::unique_ptr<AdamWParamState> CpuAdamW::new_state(const at::Tensor& p, bool amsgrad) const {
  auto st = std::make_unique<AdamWParamState>();
  st->exp_avg(runtime_->host_moment(p.sizes(), format_));  // Note [Optimizer state formats]
  st->exp_avg_sq(runtime_->host_moment(p.sizes(), format_));
  if (amsgrad) st->max_exp_avg_sq(runtime_->host_empty(p.sizes(), at::kFloat, true));
  return st;
}

at::Tensor CpuAdamW::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  check_amsgrad();  // a group's amsgrad set, or a group added, since construction
  if (stream_) {
    try {
      stream_->wait_worker();
    } catch (...) {  // an early step failed: all of them are taken back
      stream_->discard_all();
      throw;
    }
  }
  const auto [scale, finite] = clip_coefficient();
  if (options_.skip_nonfinite && !finite) {
    if (stream_) {
      stream_->restore_grads();  // a skipped step leaves p.grad as torch's does
      stream_->end_window();
    }
    records_.skipped();
    return loss;
  }
  records_.begin(scale);
  bool stepped = stream_ ? step_streamed(scale) : false;
  for (std::size_t g = 0; g < param_groups_.size(); ++g) stepped = step_group(param_groups_[g], g) || stepped;
  if (stream_) {
    register_states();  // states this path made for carried parameters
    const std::vector<std::size_t> written = records_.take_written();
    if (!written.empty()) stream_->note_written(written);  // Note [Weight content]
  }
  records_.finish(stepped);  // throws io_error naming what did not step (Note [C++ CpuAdamW faults])
  return loss;
}

bool CpuAdamW::step_group(torch::optim::OptimizerParamGroup& group, std::size_t group_index) {
  const auto& o = static_cast<const AdamWOptions&>(group.options());
  optimizer::AdamOptions ao = adam_options_of(o);
  if (records_.scale() != 1.0) ao.grad_scale = records_.scale();  // TIERFLOW_MAX_GRAD_NORM's coefficient

  // Parameters with a gradient and the steps each has taken; one kernel call
  // per step number (Note [C++ CpuAdamW faults]).
  std::vector<at::Tensor> candidates;
  std::vector<std::int64_t> steps_taken;
  std::unordered_map<const void*, std::size_t> index_in_group;
  std::vector<at::Tensor> gpu;  // Note [C++ GPU share]
  for (std::size_t k = 0; k < group.params().size(); ++k) {
    const auto& p = group.params()[k];
    const Route route = records_.route(p.unsafeGetTensorImpl(), p.grad().defined());
    if (route == Route::kSkip) continue;
    if (route == Route::kGpu) {
      gpu.push_back(p);
      continue;
    }
    TORCH_CHECK(!p.grad().is_sparse(), "tierflow CpuAdamW does not support sparse gradients");
    TORCH_CHECK(p.is_contiguous(), "tierflow CpuAdamW: parameters must be contiguous");
    if (records_.stepped_before(p.unsafeGetTensorImpl(), grad_identity(p.grad())))
      continue;  // stepped with this gradient in a step() that failed for others
    index_in_group[p.unsafeGetTensorImpl()] = k;
    auto& entry = state_[p.unsafeGetTensorImpl()];
    if (!entry && !on_nvme_) {  // NVMe states are made once their parameter has stepped
      check_amsgrad();  // a group added since construction
      entry = new_state(p, o.amsgrad());
    }
    const std::int64_t taken = entry ? static_cast<AdamWParamState&>(*entry).step() : 0;
    if (!entry) state_.erase(p.unsafeGetTensorImpl());
    candidates.push_back(p);
    steps_taken.push_back(taken);
  }

  for (const auto& b : optimizer::groups_by_next_step(steps_taken)) {
    std::vector<at::Tensor> params;
    params.reserve(b.members.size());
    for (std::size_t i : b.members) params.push_back(candidates[i]);
    step_batch({b.step, std::move(params), group_index, &index_in_group}, o, ao);
  }
  if (!gpu.empty()) gpu_step(gpu, o, ao);
  return !candidates.empty() || !gpu.empty();
}

void CpuAdamW::step_batch(const Batch& batch, const AdamWOptions& o, const optimizer::AdamOptions& ao) {
  const std::vector<at::Tensor>& params = batch.params;
  const std::size_t n = params.size();
  // Gradients and updated values cross between the device and the host
  // through the copy engine (Note [Copy ordering]); CPU tensors are used as they are.
  std::vector<at::Tensor> grads(n), params_out(n), staged_out(n);
  std::vector<swap::TransferHandle> grad_copies;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    at::Tensor g = p.grad();
    if (g.is_cpu()) {
      grads[i] = g.contiguous();
    } else if (runtime_->on_device(g)) {
      grads[i] = runtime_->host_empty(g.sizes(), g.scalar_type(), false);
      grad_copies.push_back(runtime_->copy_to_host(grads[i], g.contiguous()));
    } else {
      grads[i] = g.to(at::kCPU).contiguous();
    }
    const optimizer::WeightUpdate update = records_.weight_update(p.unsafeGetTensorImpl(), layout(p));
    if (carried(p) && records_.rereads(p.unsafeGetTensorImpl())) reconcile_master(p, slot(p, o).master);
    switch (update) {
      case optimizer::WeightUpdate::kInPlace: break;
      case optimizer::WeightUpdate::kIntoParameter: params_out[i] = p.detach(); break;
      case optimizer::WeightUpdate::kStaged:
        staged_out[i] = runtime_->host_empty(p.sizes(), p.scalar_type(), false);
        params_out[i] = staged_out[i];
        break;
    }
  }
  wait_or_keep(grad_copies, grads, "a CPU AdamW step's host gradients");

  const std::uint64_t t0 = now_ns();
  const std::vector<bool> stepped = run_kernel(batch, o, ao, grads, params_out);
  records_.stats().kernel_ns += now_ns() - t0;

  std::vector<swap::TransferHandle> param_copies;
  for (std::size_t i = 0; i < n; ++i) {
    if (!stepped[i]) continue;  // its state and weight are as before
    at::Tensor p = params[i].detach();
    records_.stepped(params[i].unsafeGetTensorImpl(), grad_identity(params[i].grad()),
                     static_cast<std::size_t>(p.numel()));
    auto& entry = state_[params[i].unsafeGetTensorImpl()];
    if (!entry) entry = std::make_unique<AdamWParamState>();
    static_cast<AdamWParamState&>(*entry).step(batch.step);
    if (carried(params[i])) {  // the stream's counter follows (Note [C++ steps during backward])
      Slot& s = slot_of(params[i]);
      if (!s.step_count.defined()) s.step_count = at::zeros({1}, at::kFloat);
      s.step_count.fill_(static_cast<double>(batch.step));
    }
    p.unsafeGetTensorImpl()->bump_version();  // an in-place update, as torch's p.addcdiv_ is
    if (!staged_out[i].defined()) continue;
    if (runtime_->on_device(p))
      param_copies.push_back(runtime_->copy_to_device(p, staged_out[i]));
    else
      p.copy_(staged_out[i]);
  }
  wait_or_keep(param_copies, staged_out, "a CPU AdamW step's staged weights");  // staging goes after the copy
}

std::vector<bool> CpuAdamW::run_kernel(const Batch& batch, const AdamWOptions& o, const optimizer::AdamOptions& ao,
                                       const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params_out) {
  const std::vector<at::Tensor>& params = batch.params;
  const std::size_t n = params.size();
  std::vector<bool> stepped(n, true);
  if (on_nvme_) {
    std::vector<optimizer::NvmeAdamStore::Item> items(n);
    for (std::size_t i = 0; i < n; ++i) {
      const at::Tensor& p = params[i];
      items[i].key = slot(p, o).nvme_key;
      items[i].grad = grads[i].data_ptr();
      items[i].grad_type = optimizer_type(grads[i].scalar_type(), "tierflow CpuAdamW: gradient", i);
      at::Tensor out = own_master(p) ? p.detach() : params_out[i];
      items[i].param_out = out.data_ptr();
      items[i].param_type = optimizer_type(out.scalar_type(), "tierflow CpuAdamW: parameter", i);
    }
    auto result = runtime_->nvme_adam().step(ao, batch.step, items);
    for (std::size_t i : result.failed) {
      stepped[i] = false;
      const at::Tensor& p = params[i];
      records_.unstepped({batch.group, batch.by_index->at(p.unsafeGetTensorImpl()), p.sizes().vec()},
                         result.first_error);
    }
    return stepped;
  }
  std::vector<at::Tensor> masters(n), exp_avgs(n), exp_avg_sqs(n), max_exp_avg_sqs;
  if (o.amsgrad()) max_exp_avg_sqs.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    masters[i] = own_master(p) ? p.detach() : slot(p, o).master;
    auto& st = static_cast<AdamWParamState&>(*state_.at(p.unsafeGetTensorImpl()));
    exp_avgs[i] = st.exp_avg();
    exp_avg_sqs[i] = st.exp_avg_sq();
    if (o.amsgrad()) max_exp_avg_sqs[i] = st.max_exp_avg_sq();
  }
  runtime_->adam_step(ao, batch.step, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, grads, params_out);
  return stepped;
}

void CpuAdamW::save(torch::serialize::OutputArchive& archive) const {
  if (!on_nvme_ && format_ == optimizer::StateFormat::kFp32) {
    torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
    return;
  }
  // bf16 or 8-bit moments decoded to fp32, or states read back from NVMe: torch's layout (Note [C++ CpuAdamW]).
  ArchiveView view(param_groups_, defaults_->clone());
  for (const auto& group : param_groups_) {
    const bool amsgrad = static_cast<const AdamWOptions&>(group.options()).amsgrad();
    for (const auto& p : group.params()) {
      auto found = state_.find(p.unsafeGetTensorImpl());
      if (found == state_.end()) continue;
      const auto& st = static_cast<const AdamWParamState&>(*found->second);
      auto copy = std::make_unique<AdamWParamState>(st);
      const auto fp32 = [&] { return at::empty(p.sizes(), at::kFloat); };
      at::Tensor m, v;  // the moments in fp32 (undefined: kept as they are)
      if (on_nvme_) {  // (the state holds the step only)
        auto s = slots_.find(p.unsafeGetTensorImpl());
        if (s == slots_.end() || s->second.nvme_key == 0) continue;
        at::Tensor master = fp32(), vmax = amsgrad ? fp32() : at::Tensor();
        m = fp32(), v = fp32();
        runtime_->nvme_adam().read(s->second.nvme_key, master.data_ptr<float>(), m.data_ptr<float>(),
                                   v.data_ptr<float>(), amsgrad ? vmax.data_ptr<float>() : nullptr);
        copy->max_exp_avg_sq(vmax);
      } else if (st.exp_avg().defined() && st.exp_avg_sq().defined()) {
        m = fp32(), v = fp32();
        decode_moments(st.exp_avg(), st.exp_avg_sq(), static_cast<std::size_t>(p.numel()), m, v);
      }
      if (m.defined()) {
        copy->exp_avg(m);
        copy->exp_avg_sq(v);
      }
      view.state()[p.unsafeGetTensorImpl()] = std::move(copy);
    }
  }
  torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, view);
}

void CpuAdamW::load(torch::serialize::InputArchive& archive) {
  if (stream_) {  // early steps of the states being replaced are taken back
    stream_->wait_worker();
    stream_->end_window();
  }
  torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
  check_amsgrad();
  adopt_loaded_state();
  if (stream_) {  // the stream gets the loaded states at the next step(), which steps every carried one here
    for (auto& [impl, s] : slots_) s.registered = false;
    records_.set_masters_stale();
  }
}

void CpuAdamW::adopt_loaded_state() {
  // Masters are rebuilt from the parameters (the archive has none).
  for (auto& [impl, s] : slots_) s.master = at::Tensor();
  for (auto& group : param_groups_) {
    const bool amsgrad = static_cast<const AdamWOptions&>(group.options()).amsgrad();
    for (const auto& p : group.params()) {
      auto found = state_.find(p.unsafeGetTensorImpl());
      if (found == state_.end()) continue;
      auto& st = static_cast<AdamWParamState&>(*found->second);
      if (on_gpu(p)) {  // Note [C++ GPU share]: fp32 states on the device
        const auto fp32_there = [&](const at::Tensor& t) {
          return t.defined() ? t.to(p.device(), at::kFloat).contiguous() : at::zeros_like(p, at::kFloat);
        };
        st.exp_avg(fp32_there(st.exp_avg()));
        st.exp_avg_sq(fp32_there(st.exp_avg_sq()));
        st.max_exp_avg_sq(amsgrad ? fp32_there(st.max_exp_avg_sq()) : at::Tensor());
        continue;
      }
      const auto fp32_cpu = [&](const at::Tensor& t) {
        return t.defined() ? t.to(at::kCPU, at::kFloat).contiguous() : at::zeros(p.sizes(), at::kFloat);
      };
      at::Tensor m = fp32_cpu(st.exp_avg()), v = fp32_cpu(st.exp_avg_sq());
      at::Tensor vmax = amsgrad ? fp32_cpu(st.max_exp_avg_sq()) : at::Tensor();
      if (on_nvme_) {
        Slot& s = slot_of(p);
        if (s.nvme_key) runtime_->nvme_adam().remove(s.nvme_key);
        s.nvme_key = 0;
        at::Tensor master = own_master(p) ? p.detach() : p.detach().to(at::kCPU, at::kFloat).contiguous();
        s.nvme_key = runtime_->nvme_adam().add(static_cast<std::size_t>(p.numel()), amsgrad, master.data_ptr<float>(),
                                               m.data_ptr<float>(), v.data_ptr<float>(),
                                               amsgrad ? vmax.data_ptr<float>() : nullptr, format_,
                                               optimizer::StateFormat::kFp32);
        st.exp_avg(at::Tensor());
        st.exp_avg_sq(at::Tensor());
        st.max_exp_avg_sq(at::Tensor());
      } else {
        const auto pinned = [&](const at::Tensor& t) {
          at::Tensor h = runtime_->host_empty(p.sizes(), at::kFloat, false);
          h.copy_(t.view(p.sizes()));
          return h;
        };
        // Note [Optimizer state formats]: the archive's fp32 moments encoded into this optimizer's format.
        at::Tensor hm = runtime_->host_moment(p.sizes(), format_), hv = runtime_->host_moment(p.sizes(), format_);
        encode_moments(format_, m, v, hm, hv);
        st.exp_avg(hm);
        st.exp_avg_sq(hv);
        st.max_exp_avg_sq(amsgrad ? pinned(vmax) : at::Tensor());
      }
    }
  }
}

}  // namespace tierflow::bindings
