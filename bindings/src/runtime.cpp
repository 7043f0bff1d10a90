#include "tierflow/bindings/runtime.hpp"

#include <sys/statvfs.h>

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

void refuse_unimplemented(const Config& c) {
  if (c.offload_activations == OffloadTarget::kNvme && c.nvme_paths.empty())
    throw config_error("TIERFLOW_OFFLOAD_ACTIVATIONS='nvme' needs TIERFLOW_NVME_PATHS: a comma-separated "
                       "list of directories on NVMe file systems");
  if (c.offload_optimizer == OffloadTarget::kNvme && c.nvme_paths.empty())
    throw config_error("TIERFLOW_OFFLOAD_OPTIMIZER='nvme' needs TIERFLOW_NVME_PATHS: a comma-separated "
                       "list of directories on NVMe file systems");
  if (c.offload_params != OffloadTarget::kNone)
    throw config_error("TIERFLOW_OFFLOAD_PARAMS='" + std::string(to_string(c.offload_params)) +
                       "': parameter offload is not available in this version of tierflow; "
                       "accepted here: none");
}

void check_cpu_contiguous(const at::Tensor& t, const char* what, std::size_t i, std::int64_t numel) {
  TIERFLOW_EXPECTS(t.defined() && t.is_cpu() && t.is_contiguous(),
                   std::string("tierflow CPU Adam: ") + what + " " + std::to_string(i) +
                       " must be a contiguous CPU tensor");
  TIERFLOW_EXPECTS(t.numel() == numel, std::string("tierflow CPU Adam: ") + what + " " +
                                           std::to_string(i) + " has " + std::to_string(t.numel()) +
                                           " elements, expected " + std::to_string(numel));
}

}  // namespace

Runtime::Runtime(Config config, swap::NvmeFaults* nvme_faults, std::shared_ptr<const swap::CopyFaults> copy_faults)
    : config_(std::move(config)), nvme_faults_(nvme_faults) {
  refuse_unimplemented(config_);
  set_log_level(config_.log_level);
  if (config_.device == DeviceChoice::kCuda && !allocator::cuda_available())
    throw config_error(std::string("TIERFLOW_DEVICE='cuda': ") +
                       (allocator::cuda_compiled() ? "no CUDA GPU is usable on this machine"
                                                   : "tierflow was built without the CUDA backend") +
                       "; accepted here: auto, emulated");
  const bool use_cuda = config_.device == DeviceChoice::kCuda ||
                        (config_.device == DeviceChoice::kAuto && allocator::cuda_available());
  const auto kind = use_cuda ? allocator::DeviceKind::kCuda : allocator::DeviceKind::kEmulated;
  // Note [Adversarial emulated device]: the pool, the copy engine and torch's
  // CPU allocator (the emulated device's memory) all turn hostile together.
  adversarial_ = kind == allocator::DeviceKind::kEmulated && config_.emulated_device == EmulationMode::kAdversarial;
  allocator::PinnedHostPoolOptions po;
  po.budget_bytes = config_.host_memory.resolve(allocator::host_capacity_bytes());
  po.slab_bytes = config_.pinned_slab_bytes;
  po.cuda_pinned = kind == allocator::DeviceKind::kCuda;
  po.poison_freed = adversarial_;
  pool_ = std::make_shared<allocator::PinnedHostPool>(po);
  swap::EmulatedCopyOptions eo;
  eo.adversarial = adversarial_;
  eo.seed = config_.emulated_seed;
  engine_ = std::shared_ptr<swap::CopyEngine>(swap::make_copy_engine(kind, std::move(copy_faults), eo));
  if (adversarial_) install_poisoning_device_memory();

  ActivationOffloaderOptions ao;
  ao.schedule.target = config_.offload_activations;
  ao.schedule.prefetch_bytes = config_.prefetch_bytes;
  ao.min_offload_bytes = config_.min_offload_bytes;
  ao.schedule.keep_tail_bytes = config_.prefetch_bytes;
  std::shared_ptr<swap::NvmeEngine> nvme;
  // Planned activations (auto, recompute) may use the NVMe tier when it is configured.
  const bool planned = config_.offload_activations == OffloadTarget::kAuto ||
                       config_.offload_activations == OffloadTarget::kRecompute;
  const bool activations_on_nvme = config_.offload_activations == OffloadTarget::kNvme ||
                                   (planned && !config_.nvme_paths.empty());
  if (activations_on_nvme || config_.offload_optimizer == OffloadTarget::kNvme) {
    swap::NvmeEngineOptions no;
    no.paths = config_.nvme_paths;
    std::uint64_t smallest_free = ~std::uint64_t{0};
    for (const auto& p : no.paths) {
      struct statvfs fs {};
      if (statvfs(p.c_str(), &fs) != 0)
        throw config_error("TIERFLOW_NVME_PATHS: '" + p + "' is not an accessible directory: " + std::strerror(errno));
      smallest_free = std::min<std::uint64_t>(smallest_free, static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize);
    }
    no.bytes_per_path = config_.nvme_memory.resolve(smallest_free);
    no.block_bytes = config_.aio_block_size;
    no.queue_depth = static_cast<unsigned>(config_.aio_queue_depth);
    no.checksums = config_.nvme_checksum;
    no.faults = nvme_faults_;
    nvme = std::make_shared<swap::NvmeEngine>(no);
    nvme_ = nvme;
  }
  offloader_ = std::make_shared<ActivationOffloader>(ao, pool_, engine_, activations_on_nvme ? nvme : nullptr);
  log(LogLevel::kInfo, std::string("runtime on the ") + std::string(allocator::to_string(kind)) +
                           " device, host pool budget " + format_bytes(po.budget_bytes));
}

Runtime::~Runtime() { nvme_adam_.reset(); }

optimizer::NvmeAdamStore& Runtime::nvme_adam() {
  TIERFLOW_EXPECTS(nvme_ != nullptr, "optimizer states on NVMe need TIERFLOW_OFFLOAD_OPTIMIZER=nvme");
  if (!nvme_adam_) nvme_adam_ = std::make_unique<optimizer::NvmeAdamStore>(nvme_, pool_, config_.cpu_threads, cpu_isa());
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
  void* p = pool_->allocate(bytes == 0 ? 1 : bytes);
  if (zero) std::memset(p, 0, bytes);
  auto pool = pool_;  // the tensor keeps the pool alive
  return at::from_blob(p, sizes, [pool](void* ptr) { pool->deallocate(ptr); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

bool Runtime::on_device(const at::Tensor& t) const {
  return on_engine_device(*engine_, t);
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
  return engine_->copy(swap::Direction::kDeviceToHost, dst.data_ptr(), src.data_ptr(), src.nbytes(), {},
                       compute_stream_of(*engine_, src.device()));
}

swap::TransferHandle Runtime::copy_to_device(const at::Tensor& dst, const at::Tensor& src) {
  check_copy_pair(src, dst, "copy_to_device");
  TIERFLOW_EXPECTS(on_device(dst), "copy_to_device: the destination must be a tensor of the runtime's device (" +
                                       std::string(allocator::to_string(device_kind())) + ")");
  const swap::StreamRef compute = compute_stream_of(*engine_, dst.device());
  // After the kernels that still read the old value (rule 1); before any
  // kernel queued from now on reads the new one (rule 2).
  auto h = engine_->copy(swap::Direction::kHostToDevice, dst.data_ptr(), src.data_ptr(), dst.nbytes(), {}, compute);
  engine_->make_stream_wait(compute, h);
  return h;
}

void Runtime::adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                        const std::vector<at::Tensor>& masters,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& max_exp_avg_sqs,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& params_out, const AdamOutputs& outputs) {
  const std::size_t n = masters.size();
  TIERFLOW_EXPECTS(exp_avgs.size() == n && exp_avg_sqs.size() == n && grads.size() == n &&
                       params_out.size() == n &&
                       (max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n),
                   "tierflow CPU Adam: the tensor lists differ in length");
  std::vector<optimizer::AdamTensor> tensors(n);
  std::uint64_t elements = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t numel = masters[i].numel();
    check_cpu_contiguous(masters[i], "master", i, numel);
    check_cpu_contiguous(exp_avgs[i], "exp_avg", i, numel);
    check_cpu_contiguous(exp_avg_sqs[i], "exp_avg_sq", i, numel);
    check_cpu_contiguous(grads[i], "grad", i, numel);
    TIERFLOW_EXPECTS(masters[i].scalar_type() == at::kFloat && exp_avgs[i].scalar_type() == at::kFloat &&
                         exp_avg_sqs[i].scalar_type() == at::kFloat,
                     "tierflow CPU Adam: master and moments must be float32 (tensor " +
                         std::to_string(i) + ")");
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
