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

// Elements per group of slabs widened to int64 at once: bounds the device's scratch to 2 x 256 MiB.
constexpr std::int64_t kGroupElements = std::int64_t{1} << 25;

at::Tensor bits_of(const at::Tensor& grad) {
  return grad.reshape(-1).view(grad.element_size() == 2 ? at::kShort : at::kInt);
}

bool probed(const at::Tensor& grad) {
  return grad.defined() && !grad.is_sparse() && grad.is_contiguous() && kernel_type(grad.scalar_type());
}

// One kernel on the tensor's current stream (what wrote the gradient is ordered before it).
at::Tensor cuda_slab_sums(const at::Tensor& grad) {
  const auto count = static_cast<std::size_t>(grad.numel());
  const auto slabs = static_cast<std::int64_t>((count + optimizer::kGradContentSlab - 1) / optimizer::kGradContentSlab);
  at::Tensor out = at::empty({2, slabs}, grad.options().dtype(at::kLong));
  const c10::DeviceGuard guard(grad.device());
  void* stream = c10::impl::getDeviceGuardImpl(grad.device().type())->getStream(grad.device()).native_handle();
  optimizer::cuda_grad_content_slabs(grad.data_ptr(), grad.element_size(), count, out.data_ptr<std::int64_t>(),
                                     out.data_ptr<std::int64_t>() + slabs, stream);
  return out;
}

}  // namespace

at::Tensor content_slab_sums(const at::Tensor& grad) {
  TIERFLOW_EXPECTS(probed(grad), "content_slab_sums: a contiguous float32, bfloat16 or float16 tensor");
  at::AutoGradMode no_grad(false);  // plain reads: no graph
  const auto slab = static_cast<std::int64_t>(optimizer::kGradContentSlab);
  const at::Tensor bits = bits_of(grad);
  const std::int64_t n = bits.numel();
  const at::Tensor weights = at::arange(1, slab + 1, bits.options().dtype(at::kLong));
  std::vector<at::Tensor> sums, weighted;
  const std::int64_t full = n / slab * slab;
  for (std::int64_t start = 0; start < full; start += kGroupElements) {
    const std::int64_t len = std::min(kGroupElements, full - start);
    const at::Tensor wide = bits.narrow(0, start, len).view({len / slab, slab}).to(at::kLong);
    sums.push_back(wide.sum(1));
    weighted.push_back(wide.mul(weights).sum(1));
  }
  if (full < n) {
    const at::Tensor tail = bits.narrow(0, full, n - full).to(at::kLong);
    sums.push_back(tail.sum().reshape(1));
    weighted.push_back(tail.mul(weights.narrow(0, 0, n - full)).sum().reshape(1));
  }
  if (sums.empty()) return at::zeros({2, 0}, bits.options().dtype(at::kLong));
  return at::stack({at::cat(sums), at::cat(weighted)});
}

ContentProbe ContentProbe::of(const at::Tensor& grad) {
  ContentProbe p;
  if (!probed(grad)) return p;
  if (grad.is_cpu()) {
    p.content_ = optimizer::grad_content(grad.data_ptr(), grad.element_size(), static_cast<std::size_t>(grad.numel()));
    return p;
  }
  p.slabs_ = grad.is_cuda() && optimizer::cuda_grad_content_compiled() ? cuda_slab_sums(grad) : content_slab_sums(grad);
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
    const std::int64_t* sums = host.data_ptr<std::int64_t>();
    const std::int64_t* weighted = sums + total;
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
