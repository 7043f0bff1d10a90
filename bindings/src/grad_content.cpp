// ContentProbe: Note [Gradient content] where the gradient lives.
#include "tierflow/bindings/grad_content.hpp"

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cstdint>

#include "tierflow/bindings/dtypes.hpp"

namespace tierflow::bindings {
namespace {

bool probed(const at::Tensor& grad) {
  return grad.defined() && !grad.is_sparse() && grad.is_contiguous() && kernel_type(grad.scalar_type());
}

// One kernel on the tensor's current stream (what wrote the gradient is ordered before it): [2, slabs] of
// uint64 sums in an int64 tensor.
at::Tensor cuda_slab_sums(const at::Tensor& grad) {
  const auto count = static_cast<std::size_t>(grad.numel());
  const auto slabs = static_cast<std::int64_t>((count + optimizer::kGradContentSlab - 1) / optimizer::kGradContentSlab);
  at::Tensor out = at::empty({2, slabs}, grad.options().dtype(at::kLong));
  const c10::DeviceGuard guard(grad.device());
  void* stream = c10::impl::getDeviceGuardImpl(grad.device().type())->getStream(grad.device()).native_handle();
  auto* sums = reinterpret_cast<std::uint64_t*>(out.data_ptr<std::int64_t>());
  optimizer::cuda_grad_content_slabs(grad.data_ptr(), grad.element_size(), count, sums, sums + slabs, stream);
  return out;
}

}  // namespace

ContentProbe ContentProbe::of(const at::Tensor& grad) {
  ContentProbe p;
  if (!probed(grad)) return p;
  if (grad.is_cpu()) {
    p.content_ = optimizer::grad_content(grad.data_ptr(), grad.element_size(), static_cast<std::size_t>(grad.numel()));
  } else if (grad.is_cuda() && optimizer::cuda_grad_content_compiled()) {
    p.slabs_ = cuda_slab_sums(grad);
  }  // any other device: not known (counts as changed)
  return p;
}

optimizer::GradContent ContentProbe::get() {
  if (pending()) resolve({this});
  return content_;
}

void ContentProbe::resolve(const std::vector<ContentProbe*>& probes) {
  // One device-to-host read per device: the slabs of all side by side.
  std::vector<std::pair<c10::Device, std::vector<ContentProbe*>>> by_device;
  for (ContentProbe* p : probes) {
    if (!p->pending()) continue;
    const c10::Device d = p->slabs_.device();
    auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& e) { return e.first == d; });
    if (it == by_device.end()) by_device.emplace_back(d, std::vector<ContentProbe*>{p});
    else it->second.push_back(p);
  }
  for (auto& [device, list] : by_device) {
    std::vector<at::Tensor> parts;
    for (ContentProbe* p : list) parts.push_back(p->slabs_);
    const at::Tensor host = at::cat(parts, 1).cpu().contiguous();
    const std::int64_t total = host.size(1);
    const auto* sums = reinterpret_cast<const std::uint64_t*>(host.data_ptr<std::int64_t>());
    const std::uint64_t* weighted = sums + total;
    std::int64_t offset = 0;
    for (ContentProbe* p : list) {
      const std::int64_t slabs = p->slabs_.size(1);
      p->content_ = optimizer::combine_grad_content(sums + offset, weighted + offset, static_cast<std::size_t>(slabs));
      p->slabs_ = at::Tensor();
      offset += slabs;
    }
  }
}

}  // namespace tierflow::bindings
