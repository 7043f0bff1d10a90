#include "tierflow/bindings/runtime.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/bindings/dtypes.hpp"

namespace tierflow::bindings {
namespace {

void check_cpu_contiguous(const at::Tensor& t, const char* what, std::size_t i, std::int64_t numel) {
  const bool cpu = t.defined() && t.is_cpu();  // each fact read only where the ones before it hold
  optimizer::check_kernel_tensor({t.defined(), cpu, cpu && t.is_contiguous(),
                                  t.defined() ? static_cast<std::size_t>(t.numel()) : 0},
                                 what, i, static_cast<std::size_t>(numel));
}

}  // namespace

Runtime::Runtime(Config config, swap::NvmeFaults* nvme_faults, std::shared_ptr<const swap::CopyFaults> copy_faults,
                 tiering::RankShare ranks)
    : config_(std::move(config)), tiers_(config_, nvme_faults, std::move(copy_faults), ranks) {
  set_log_level(config_.log_level);
  const tiering::TierSettings& s = tiers_.settings();
  adversarial_ = s.adversarial;
  // Note [Adversarial emulated device]: the pool, the copy engine and torch's
  // CPU allocator (the emulated device's memory) all turn hostile together.
  if (adversarial_) install_poisoning_device_memory();
  ActivationOffloaderOptions ao;
  ao.schedule = s.schedule;
  ao.min_offload_bytes = s.min_offload_bytes;
  offloader_ = std::make_shared<ActivationOffloader>(ao, host_pool(), copy_engine(),
                                                     s.activations_on_nvme ? nvme_engine() : nullptr);
  log(LogLevel::kInfo, std::string("runtime on the ") + std::string(allocator::to_string(device_kind())) +
                           " device, host pool budget " + format_bytes(s.pool.budget_bytes));
}

Runtime::~Runtime() { nvme_adam_.reset(); }

optimizer::NvmeAdamStore& Runtime::nvme_adam() {
  TIERFLOW_EXPECTS(has_nvme(), "optimizer states on NVMe need TIERFLOW_OFFLOAD_OPTIMIZER=nvme");
  if (!nvme_adam_)
    nvme_adam_ = std::make_unique<optimizer::NvmeAdamStore>(nvme_engine(), host_pool(), config_.cpu_threads, cpu_isa());
  return *nvme_adam_;
}

optimizer::CpuIsa Runtime::cpu_isa() const {
  const std::string& s = config_.cpu_isa;
  if (s == "avx512") return optimizer::CpuIsa::kAvx512;
  if (s == "avx2") return optimizer::CpuIsa::kAvx2;
  if (s == "portable") return optimizer::CpuIsa::kPortable;
  return adam_ ? adam_->isa() : optimizer::CpuIsa::kAuto;
}

int Runtime::cpu_threads() const {
  return adam_ ? adam_->threads() : (config_.cpu_threads > 0 ? config_.cpu_threads : 0);
}

at::Tensor Runtime::host_empty(at::IntArrayRef sizes, at::ScalarType dtype, bool zero) {
  std::int64_t numel = 1;
  for (auto s : sizes) {
    TIERFLOW_EXPECTS(s >= 0, "host_empty: negative size");
    numel *= s;
  }
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  auto pool = host_pool();  // the tensor keeps the pool alive
  void* p = pool->allocate(bytes == 0 ? 1 : bytes);
  if (zero) std::memset(p, 0, bytes);
  return at::from_blob(p, sizes, [pool](void* ptr) { pool->deallocate(ptr); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

bool Runtime::on_device(const at::Tensor& t) const {
  return on_engine_device(*copy_engine(), t);
}

namespace {
void check_copy_pair(const at::Tensor& host, const at::Tensor& device, const char* what) {
  TIERFLOW_EXPECTS(host.defined() && device.defined(), std::string(what) + ": undefined tensor");
  TIERFLOW_EXPECTS(host.is_cpu() && host.is_contiguous(),
                   std::string(what) + ": the host tensor must be a contiguous CPU tensor");
  TIERFLOW_EXPECTS(device.is_contiguous(), std::string(what) + ": the device tensor must be contiguous");
  TIERFLOW_EXPECTS(host.nbytes() == device.nbytes(),
                   std::string(what) + ": the tensors differ in size (" + std::to_string(host.nbytes()) +
                       " and " + std::to_string(device.nbytes()) + " bytes)");
}
}  // namespace

swap::TransferHandle Runtime::copy_to_host(const at::Tensor& dst, const at::Tensor& src) {
  check_copy_pair(dst, src, "copy_to_host");
  TIERFLOW_EXPECTS(on_device(src), "copy_to_host: the source must be a tensor of the runtime's device (" +
                                       std::string(allocator::to_string(device_kind())) + ")");
  swap::CopyEngine& engine = *copy_engine();
  return engine.copy(swap::Direction::kDeviceToHost, dst.data_ptr(), src.data_ptr(), src.nbytes(), {},
                     compute_stream_of(engine, src.device()));
}

swap::TransferHandle Runtime::copy_to_device(const at::Tensor& dst, const at::Tensor& src) {
  // After the kernels that still read the old value (rule 1); before any
  // kernel queued from now on reads the new one (rule 2).
  swap::TransferHandle h = queue_to_device(dst, src, "copy_to_device");
  await_on_device(h, dst.device());
  return h;
}

swap::TransferHandle Runtime::fetch_to_device(const at::Tensor& dst, const at::Tensor& src) {
  return queue_to_device(dst, src, "fetch_to_device");
}

swap::TransferHandle Runtime::queue_to_device(const at::Tensor& dst, const at::Tensor& src, const char* what) {
  check_copy_pair(src, dst, what);
  TIERFLOW_EXPECTS(on_device(dst), std::string(what) + ": the destination must be a tensor of the runtime's device (" +
                                       std::string(allocator::to_string(device_kind())) + ")");
  swap::CopyEngine& engine = *copy_engine();
  return engine.copy(swap::Direction::kHostToDevice, dst.data_ptr(), src.data_ptr(), dst.nbytes(), {},
                     compute_stream_of(engine, dst.device()));
}

void Runtime::await_on_device(const swap::TransferHandle& h, const at::Device& device) {
  swap::CopyEngine& engine = *copy_engine();
  engine.make_stream_wait(compute_stream_of(engine, device), h);
}

void Runtime::adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                        const std::vector<at::Tensor>& masters,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& max_exp_avg_sqs,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& params_out, const AdamOutputs& outputs) {
  const std::size_t n = masters.size();
  optimizer::check_kernel_lists(n, {exp_avgs.size(), exp_avg_sqs.size(), grads.size(), params_out.size()},
                                {max_exp_avg_sqs.size()});
  std::vector<optimizer::AdamTensor> tensors(n);
  std::uint64_t elements = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t numel = masters[i].numel();
    check_cpu_contiguous(masters[i], "master", i, numel);
    check_cpu_contiguous(exp_avgs[i], "exp_avg", i, numel);
    check_cpu_contiguous(exp_avg_sqs[i], "exp_avg_sq", i, numel);
    check_cpu_contiguous(grads[i], "grad", i, numel);
    optimizer::check_kernel_states_fp32(masters[i].scalar_type() == at::kFloat &&
                                            exp_avgs[i].scalar_type() == at::kFloat &&
                                            exp_avg_sqs[i].scalar_type() == at::kFloat, i);
    auto& t = tensors[i];
    t.numel = static_cast<std::size_t>(numel);
    t.master = masters[i].data_ptr<float>();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    if (!max_exp_avg_sqs.empty() && max_exp_avg_sqs[i].defined()) {
      check_cpu_contiguous(max_exp_avg_sqs[i], "max_exp_avg_sq", i, numel);
      t.max_exp_avg_sq = max_exp_avg_sqs[i].data_ptr<float>();
    }
    t.grad = grads[i].data_ptr();
    t.grad_type = optimizer_type(grads[i].scalar_type(), "tierflow CPU Adam: grad", i);
    if (params_out[i].defined()) {
      check_cpu_contiguous(params_out[i], "param", i, numel);
      t.param_out = params_out[i].data_ptr();
      t.param_type = optimizer_type(params_out[i].scalar_type(), "tierflow CPU Adam: param", i);
    }
    if (!outputs.masters.empty() && outputs.masters[i].defined()) {
      check_cpu_contiguous(outputs.masters[i], "master_out", i, numel);
      check_cpu_contiguous(outputs.exp_avgs[i], "exp_avg_out", i, numel);
      check_cpu_contiguous(outputs.exp_avg_sqs[i], "exp_avg_sq_out", i, numel);
      t.master_out = outputs.masters[i].data_ptr<float>();
      t.exp_avg_out = outputs.exp_avgs[i].data_ptr<float>();
      t.exp_avg_sq_out = outputs.exp_avg_sqs[i].data_ptr<float>();
      if (t.max_exp_avg_sq) {
        check_cpu_contiguous(outputs.max_exp_avg_sqs[i], "max_exp_avg_sq_out", i, numel);
        t.max_exp_avg_sq_out = outputs.max_exp_avg_sqs[i].data_ptr<float>();
      }
    }
    elements += static_cast<std::uint64_t>(numel);
  }
  std::lock_guard<std::mutex> lock(adam_mutex_);
  if (!adam_) adam_ = std::make_unique<optimizer::CpuAdam>(config_.cpu_threads, cpu_isa());
  const auto t0 = std::chrono::steady_clock::now();
  adam_->step(options, step, tensors);
  opt_stats_.step_ns += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  opt_stats_.steps += 1;
  opt_stats_.elements += elements;
}

}  // namespace tierflow::bindings
