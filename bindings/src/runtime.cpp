#include "tierflow/bindings/runtime.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/bindings/trace_meter.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/trace.hpp"
#include "tierflow/optimizer/adam_args.hpp"

namespace tierflow::bindings {
namespace {

// `t` as the CPU Adam's checks see it (optimizer/adam_args.hpp): facts read only where the ones before hold.
optimizer::KernelArg kernel_arg(const at::Tensor& t) {
  optimizer::KernelArg a;
  if (!t.defined()) {
    a.dtype_name = "undefined";
    return a;
  }
  a.defined = true;
  a.cpu = t.is_cpu();
  a.contiguous = a.cpu && t.is_contiguous();
  a.numel = static_cast<std::size_t>(t.numel());
  a.nbytes = t.nbytes();
  switch (t.scalar_type()) {
    case at::kFloat: a.dtype = optimizer::ArgDtype::kFloat32; break;
    case at::kBFloat16: a.dtype = optimizer::ArgDtype::kBFloat16; break;
    case at::kHalf: a.dtype = optimizer::ArgDtype::kFloat16; break;
    case at::kByte: a.dtype = optimizer::ArgDtype::kUint8; break;
    default: a.dtype = optimizer::ArgDtype::kOther; break;
  }
  a.dtype_name = c10::toString(t.scalar_type());
  if (t.has_storage()) a.data = t.data_ptr();
  return a;
}

std::vector<optimizer::KernelArg> kernel_args(const std::vector<at::Tensor>& ts) {
  std::vector<optimizer::KernelArg> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(kernel_arg(t));
  return out;
}

}  // namespace

Runtime::Runtime(Config config, swap::NvmeFaults* nvme_faults, std::shared_ptr<const swap::CopyFaults> copy_faults,
                 tiering::RankShare ranks)
    : config_(std::move(config)),
      stall_claim_(config_.stall_timeout_seconds),  // refuses another live runtime's other limit (Note [Stall timeout])
      tiers_(config_, nvme_faults, std::move(copy_faults), ranks) {
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
  attach_trace(*this);  // Note [Trace]: its meters, and TIERFLOW_TRACE
}

Runtime::~Runtime() {
  trace::detach(this);  // writes TIERFLOW_TRACE's file; no meter of it runs after this
  nvme_adam_.reset();
}

optimizer::NvmeAdamStore& Runtime::nvme_adam() {
  TIERFLOW_EXPECTS(has_nvme(), "optimizer states on NVMe need TIERFLOW_OFFLOAD_OPTIMIZER=nvme");
  if (!nvme_adam_)
    nvme_adam_ = std::make_unique<optimizer::NvmeAdamStore>(nvme_engine(), host_pool(), config_.cpu_threads, cpu_isa());
  return *nvme_adam_;
}

optimizer::CpuIsa Runtime::cpu_isa() const {
  if (const auto isa = optimizer::parse_cpu_isa(config_.cpu_isa)) return *isa;
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

using optimizer::StateFormat;

std::optional<StateFormat> moment_format(const at::Tensor& moment) noexcept {
  if (!moment.defined()) return std::nullopt;
  switch (moment.scalar_type()) {
    case at::kFloat: return StateFormat::kFp32;
    case at::kBFloat16: return StateFormat::kBf16;
    case at::kByte: return StateFormat::k8bit;
    default: return std::nullopt;
  }
}

at::ScalarType moment_dtype(StateFormat f) noexcept {
  switch (f) {
    case StateFormat::kFp32: return at::kFloat;
    case StateFormat::kBf16: return at::kBFloat16;
    case StateFormat::k8bit: return at::kByte;
  }
  return at::kFloat;
}

std::vector<std::int64_t> moment_shape(StateFormat f, at::IntArrayRef like) {
  if (f != StateFormat::k8bit) return like.vec();
  std::int64_t numel = 1;
  for (auto s : like) numel *= s;
  return {static_cast<std::int64_t>(optimizer::moment_bytes(f, static_cast<std::size_t>(numel)))};
}

at::Tensor Runtime::host_moment(at::IntArrayRef like, StateFormat f) {
  return host_empty(moment_shape(f, like), moment_dtype(f), true);
}

void encode_moments(StateFormat f, const at::Tensor& m, const at::Tensor& v, const at::Tensor& m_out,
                    const at::Tensor& v_out) {
  TIERFLOW_EXPECTS(m.defined() && v.defined() && m.numel() == v.numel(),
                   "encode_moments: m and v must be tensors of one size");
  const std::int64_t n = m.numel();
  const optimizer::KernelArg mo = kernel_arg(m_out), vo = kernel_arg(v_out);
  optimizer::check_moment(mo, f, "encoded exp_avg", 0, static_cast<std::size_t>(n));
  optimizer::check_moment(vo, f, "encoded exp_avg_sq", 0, static_cast<std::size_t>(n));
  const at::Tensor mf = m.to(at::kCPU, at::kFloat).contiguous(), vf = v.to(at::kCPU, at::kFloat).contiguous();
  if (f == StateFormat::kFp32) {
    m_out.view({n}).copy_(mf.view({n}));
    v_out.view({n}).copy_(vf.view({n}));
    return;
  }
  optimizer::encode_moments(f, mf.data_ptr<float>(), vf.data_ptr<float>(), static_cast<std::size_t>(n),
                            optimizer::packed(mo, f, static_cast<std::size_t>(n)),
                            optimizer::packed(vo, f, static_cast<std::size_t>(n)));
}

void decode_moments(const at::Tensor& m, const at::Tensor& v, std::size_t numel, const at::Tensor& m_out,
                    const at::Tensor& v_out) {
  const auto f = moment_format(m);
  TIERFLOW_EXPECTS(f.has_value(), "decode_moments: exp_avg has dtype " +
                                      std::string(m.defined() ? c10::toString(m.scalar_type()) : "undefined") +
                                      "; " + optimizer::kAcceptedMoments);
  const auto n = static_cast<std::int64_t>(numel);
  const optimizer::KernelArg mi = kernel_arg(m), vi = kernel_arg(v);
  optimizer::check_moment(mi, *f, "exp_avg", 0, numel);
  optimizer::check_moment(vi, *f, "exp_avg_sq", 0, numel);
  optimizer::check_cpu_contiguous(kernel_arg(m_out), "decoded exp_avg", 0, numel);
  optimizer::check_cpu_contiguous(kernel_arg(v_out), "decoded exp_avg_sq", 0, numel);
  TIERFLOW_EXPECTS(m_out.scalar_type() == at::kFloat && v_out.scalar_type() == at::kFloat,
                   "decode_moments: the outputs must be float32");
  if (*f == StateFormat::kFp32) {
    m_out.view({n}).copy_(m.view({n}));
    v_out.view({n}).copy_(v.view({n}));
    return;
  }
  optimizer::decode_moments(*f, optimizer::packed(mi, *f, numel), optimizer::packed(vi, *f, numel), numel,
                            m_out.data_ptr<float>(),
                            v_out.data_ptr<float>());
}

void Runtime::adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                        const std::vector<at::Tensor>& masters,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& max_exp_avg_sqs,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& params_out, const AdamOutputs& outputs) {
  optimizer::AdamArgs args{kernel_args(masters),  kernel_args(exp_avgs),      kernel_args(exp_avg_sqs),
                           kernel_args(max_exp_avg_sqs), kernel_args(grads), kernel_args(params_out),
                           kernel_args(outputs.masters), kernel_args(outputs.exp_avgs),
                           kernel_args(outputs.exp_avg_sqs), kernel_args(outputs.max_exp_avg_sqs)};
  std::uint64_t elements = 0;
  run_adam(options, step, optimizer::adam_tensors(args, &elements), elements);
}

void Runtime::adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                        const std::vector<optimizer::KernelArrays>& arrays) {
  std::uint64_t elements = 0;
  run_adam(options, step, optimizer::adam_tensors(arrays, &elements), elements);
}

void Runtime::run_adam(const optimizer::AdamOptions& options, std::int64_t step,
                       std::vector<optimizer::AdamTensor> tensors, std::uint64_t elements) {
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
