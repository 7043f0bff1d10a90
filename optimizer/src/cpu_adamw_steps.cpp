// See cpu_adamw_steps.hpp.
#include "tierflow/optimizer/cpu_adamw_steps.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <unordered_set>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/state_tier.hpp"

namespace tierflow::optimizer {

CpuAdamWOptions CpuAdamWOptions::from_config(const Config& c) {
  CpuAdamWOptions o;
  o.step_during_backward = c.overlap_step;
  o.grad_bucket_bytes = c.grad_bucket_bytes;
  o.offload_gradients = c.offload_gradients;
  o.max_grad_norm = c.max_grad_norm;
  o.skip_nonfinite = c.skip_nonfinite;
  o.accumulation_steps = c.grad_accumulation_steps;
  o.weights_in_forward = c.weights_return_in_forward;
  o.gpu_fraction = c.gpu_optimizer_fraction_auto ? 0.0 : c.gpu_optimizer_fraction;  // Note [C++ GPU share]
  return o;
}

bool check_stream_options(const CpuAdamWOptions& o, bool states_on_nvme, OffloadTarget offload_optimizer) {
  if (o.weights_in_forward)
    throw config_error("tierflow CpuAdamW: TIERFLOW_WEIGHTS_RETURN=forward (CpuAdamWOptions::weights_in_forward) "
                       "waits for each module's weights in its forward pre-hook, which a C++ module does not have; "
                       "accepted from C++: TIERFLOW_WEIGHTS_RETURN=step");
  if (!(o.max_grad_norm >= 0.0) || !std::isfinite(o.max_grad_norm))
    throw config_error("tierflow CpuAdamW: TIERFLOW_MAX_GRAD_NORM (CpuAdamWOptions::max_grad_norm) is " +
                       std::to_string(o.max_grad_norm) + "; accepted: a finite number >= 0 (0: no clipping)");
  if (o.accumulation_steps < 1)
    throw config_error("tierflow CpuAdamW: TIERFLOW_GRAD_ACCUMULATION_STEPS (CpuAdamWOptions::accumulation_steps) "
                       "is " + std::to_string(o.accumulation_steps) + "; accepted: an integer >= 1");
  const bool streams = o.step_during_backward && !states_on_nvme;  // steps during backward are host-tier only
  if (auto why = offload_gradients_refusal(o.offload_gradients, streams, o.step_during_backward ? "on" : "off",
                                           std::string(to_string(offload_optimizer))))
    throw config_error("tierflow CpuAdamW: " + *why);
  return streams;
}

StreamOptions stream_options(const CpuAdamWOptions& o) {
  StreamOptions s;
  s.bucket_bytes = o.grad_bucket_bytes;
  s.accumulation_steps = o.accumulation_steps;
  s.max_grad_norm = o.max_grad_norm;
  s.skip_nonfinite = o.skip_nonfinite;
  s.offload_gradients = o.offload_gradients;
  return s;
}

void check_amsgrad_format(const std::vector<bool>& amsgrad, StateFormat f) {
  if (f == StateFormat::kFp32) return;
  for (std::size_t g = 0; g < amsgrad.size(); ++g) {
    if (!amsgrad[g]) continue;
    throw config_error("tierflow CpuAdamW: param group " + std::to_string(g) +
                       " has amsgrad, and amsgrad keeps fp32 moments; TIERFLOW_OPTIMIZER_STATES=" +
                       std::string(to_string(f)) + " (set_state_format) is refused with it (accepted: fp32)");
  }
}

std::vector<bool> choose_gpu_share(double fraction, const std::vector<std::size_t>& numels) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw config_error("tierflow CpuAdamW: TIERFLOW_GPU_OPTIMIZER_FRACTION (CpuAdamWOptions::gpu_fraction) is " +
                       std::to_string(fraction) + "; accepted: a number from 0 to 1");
  if (fraction == 0.0 || numels.empty()) return std::vector<bool>(numels.size(), false);
  if (!cuda_adam_compiled())
    throw config_error("tierflow CpuAdamW: TIERFLOW_GPU_OPTIMIZER_FRACTION=" + std::to_string(fraction) +
                       " (CpuAdamWOptions::gpu_fraction) needs the CUDA AdamW, which this build lacks "
                       "(TIERFLOW_WITH_CUDA); accepted: 0");
  return GpuShareChoice(std::to_string(fraction)).assign(numels);
}

// A set of the slots, not a scan per carried parameter: every slot may be left (tens of thousands of experts').
void CpuAdamWSteps::stream_finished(const std::vector<std::size_t>& left) {
  const std::unordered_set<std::size_t> caller(left.begin(), left.end());
  for (const auto& [p, slot] : carried_)
    if (!caller.count(slot)) stream_confirmed(p);
}

void CpuAdamWSteps::reread_slots(const std::vector<std::size_t>& slots) {
  const std::unordered_set<std::size_t> stale(slots.begin(), slots.end());
  for (const auto& [p, slot] : carried_)
    if (stale.count(slot)) reread(p);
}

WeightUpdate CpuAdamWSteps::weight_update(ParamId p, const ParamLayout& layout) const {
  const WeightUpdate update = optimizer::weight_update(layout);
  return update == WeightUpdate::kInPlace && !own_master(p, layout) ? WeightUpdate::kIntoParameter : update;
}

std::size_t CpuAdamWSteps::index_of(ParamId p) {
  const auto [it, made] = index_.try_emplace(p, index_.size());
  return it->second;
}

void CpuAdamWSteps::begin(double scale) {
  scale_ = scale;
  unstepped_.clear();
  first_error_.clear();
}

CpuAdamWSteps::Route CpuAdamWSteps::route(ParamId p, bool has_grad) const {
  if (!has_grad || by_stream_.count(p)) return Route::kSkip;
  return on_gpu(p) ? Route::kGpu : Route::kCpu;
}

bool CpuAdamWSteps::stepped_before(ParamId p, const GradIdentity& grad) const {
  const auto it = index_.find(p);
  return it != index_.end() && retry_marks_.stepped_with(it->second, grad);
}

void CpuAdamWSteps::stepped(ParamId p, const GradIdentity& grad, std::size_t numel) {
  retry_marks_.mark(index_of(p), grad);
  stats_.elements += numel;
  const auto c = carried_.find(p);
  if (c != carried_.end()) written_.push_back(c->second);
}

void CpuAdamWSteps::unstepped(UnsteppedParameter p, const std::string& error) {
  unstepped_.push_back(std::move(p));
  if (first_error_.empty()) first_error_ = error;
}

std::vector<std::size_t> CpuAdamWSteps::take_written() {
  std::vector<std::size_t> out = std::move(written_);
  written_.clear();
  return out;
}

void CpuAdamWSteps::finish(bool stepped) {
  by_stream_.clear();
  reread_.clear();
  masters_stale_ = false;
  if (!unstepped_.empty()) throw io_error(EIO, unstepped_message(unstepped_, first_error_));
  retry_marks_.clear();  // a step that completed: every parameter is even again (Note [C++ CpuAdamW faults])
  if (stepped) stats_.steps += 1;
}

}  // namespace tierflow::optimizer
