// tierflow._C's Adam kernels called from Python: the CUDA AdamW of the GPU share
// and the Adam-traffic roofline the optimizer benchmark times.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <map>
#include <string>

#include "module_parts.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/bindings/planner_bindings.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/swap/nvme_probe.hpp"

namespace py = pybind11;
using namespace tierflow;
using namespace tierflow::bindings;
using namespace tierflow::bindings::pymod;

namespace tierflow::bindings::pymod {

void bind_optimizer_kernels(py::module_& m) {
  m.def("cuda_adam_step", [](const py::dict& options, std::int64_t step, const std::vector<at::Tensor>& masters,
                             const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                             const std::vector<std::optional<at::Tensor>>& vmaxes,
                             const std::vector<at::Tensor>& grads,
                             const std::vector<std::optional<at::Tensor>>& outs) {
    // The GPU share: in-place step of CUDA tensors on the current stream.
    std::vector<optimizer::AdamTensor> ts(masters.size());
    void* stream = nullptr;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      for (const at::Tensor* t : {&masters[i], &ms[i], &vs[i], &grads[i]}) {
        TIERFLOW_EXPECTS(t->is_cuda() && t->is_contiguous(), "cuda_adam_step: every tensor must be a contiguous CUDA tensor");
      }
      ts[i].numel = static_cast<std::size_t>(masters[i].numel());
      ts[i].master = masters[i].data_ptr<float>();
      ts[i].exp_avg = ms[i].data_ptr<float>();
      ts[i].exp_avg_sq = vs[i].data_ptr<float>();
      if (vmaxes[i]) ts[i].max_exp_avg_sq = vmaxes[i]->data_ptr<float>();
      ts[i].grad = grads[i].data_ptr();
      ts[i].grad_type = optimizer_type(grads[i].scalar_type(), "cuda_adam_step");
      if (outs[i]) {
        ts[i].param_out = outs[i]->data_ptr();
        ts[i].param_type = optimizer_type(outs[i]->scalar_type(), "cuda_adam_step");
      }
      if (i == 0) {
        const auto* impl = c10::impl::getDeviceGuardImpl(masters[0].device().type());
        stream = impl->getStream(masters[0].device()).native_handle();
      }
    }
    optimizer::cuda_adam_step(adam_options(options), step, ts, stream);
  }, "One Adam/AdamW step of CUDA tensors on the current stream (the GPU optimizer share).");
  m.def("adam_traffic", [](const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& ms,
                           const std::vector<at::Tensor>& vs, const std::vector<at::Tensor>& grads,
                           const std::vector<std::optional<at::Tensor>>& outs, int threads, int repeats) {
    // Benchmark roofline: see optimizer/roofline.hpp. Returns the best time in seconds.
    std::vector<optimizer::AdamTensor> ts(masters.size());
    for (std::size_t i = 0; i < ts.size(); ++i) {
      ts[i].numel = static_cast<std::size_t>(masters[i].numel());
      ts[i].master = masters[i].data_ptr<float>();
      ts[i].exp_avg = ms[i].data_ptr<float>();
      ts[i].exp_avg_sq = vs[i].data_ptr<float>();
      ts[i].grad = grads[i].data_ptr();
      ts[i].grad_type = optimizer_type(grads[i].scalar_type(), "adam_traffic_step");
      if (outs[i]) {
        ts[i].param_out = outs[i]->data_ptr();
        ts[i].param_type = optimizer_type(outs[i]->scalar_type(), "adam_traffic_step");
      }
    }
    py::gil_scoped_release release;
    optimizer::AdamTrafficKernel k(threads);
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      k.run(ts);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  }, "Times the Adam-traffic roofline kernel over these arrays (overwrites them).");
}

}  // namespace tierflow::bindings::pymod
