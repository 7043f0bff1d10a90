// What only torch does for GradStream's optimizer::StepEngine (its StepEngineHost): pinned buffers as tensors,
// the runtime's CPU Adam over them, the state's step counter tensor, a device gradient's last reference.
#include <algorithm>
#include <memory>
#include <string>

#include "grad_stream_parts.hpp"
#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/bindings/runtime.hpp"

namespace tierflow::bindings {

optimizer::HostArray host_array(const at::Tensor& t) {
  if (!t.defined()) return {};
  return {t.data_ptr(), t.nbytes(), std::make_shared<at::Tensor>(t)};
}

at::Tensor tensor_of(const optimizer::HostArray& a, at::ScalarType dtype) {
  if (!a.defined()) return at::Tensor();
  // Every array the engine holds came from host_array or allocate: its keep is a tensor.
  const at::Tensor& t = *static_cast<const at::Tensor*>(a.keep.get());
  if (t.data_ptr() == a.data && t.nbytes() == a.bytes && t.scalar_type() == dtype) return t;
  const auto offset = static_cast<std::int64_t>(static_cast<const char*>(a.data) - static_cast<const char*>(t.data_ptr()));
  return t.view(-1).view(at::kByte).narrow(0, offset, static_cast<std::int64_t>(a.bytes)).view(dtype);
}

at::ScalarType torch_type(optimizer::ScalarType t) noexcept {
  switch (t) {
    case optimizer::ScalarType::kFloat32: return at::kFloat;
    case optimizer::ScalarType::kBFloat16: return at::kBFloat16;
    case optimizer::ScalarType::kFloat16: return at::kHalf;
  }
  return at::kFloat;
}

optimizer::StateArrayFacts state_array_facts(const at::Tensor& t) {
  if (!t.defined()) return {};
  return {true, t.is_cpu(), t.is_contiguous(), moment_format(t), t.nbytes()};
}

optimizer::HostArray GradStream::allocate(std::size_t bytes) {
  return host_array(runtime_->host_empty({static_cast<std::int64_t>(bytes)}, at::kByte, false));
}

void GradStream::adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                           const std::vector<optimizer::KernelArrays>& arrays) {
  runtime_->adam_step(options, step, arrays);  // in place where an array's master_out is undefined
}

std::int64_t GradStream::steps_taken(std::size_t slot) {
  return static_cast<std::int64_t>(slots_[slot].step.item<float>());
}

void GradStream::count_step(std::size_t slot) { slots_[slot].step.add_(1); }

void GradStream::gradient_landed(std::size_t slot) {
  slots_[slot].grad_ref = at::Tensor();  // its copy is done (rule 3): the memory goes
}

void GradStream::gradient_copy_failed(std::size_t slot) {
  Slot& s = slots_[slot];
  if (ledger_.released(slot) && s.grad_ref.defined() && !s.param.grad().defined()) s.param.mutable_grad() = s.grad_ref;
}

swap::StreamRef GradStream::compute_stream(optimizer::DeviceId device) {
  return compute_stream_of(*runtime_->copy_engine(), devices_.at(device));
}

void GradStream::make_stream_wait(swap::StreamRef stream, const swap::TransferHandle& copy) {
  runtime_->copy_engine()->make_stream_wait(stream, copy);
}

optimizer::DeviceId GradStream::device_id(const c10::Device& device) {
  const auto it = std::find(devices_.begin(), devices_.end(), device);
  if (it != devices_.end()) return static_cast<optimizer::DeviceId>(it - devices_.begin());
  devices_.push_back(device);
  return devices_.size() - 1;
}

at::Tensor GradStream::staging_of(std::size_t slot) const {
  return tensor_of(engine_->staging_of(slot), slots_[slot].param.scalar_type());
}

}  // namespace tierflow::bindings
