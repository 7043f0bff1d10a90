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

namespace {

using optimizer::StateFormat;

// Moment `t` (`what` `i`) of format `f` for `numel` elements: a contiguous CPU tensor of moment_dtype(f) and
// moment_bytes(f, numel) bytes; throws naming it and what is accepted otherwise.
void check_moment(const at::Tensor& t, StateFormat f, const char* what, std::size_t i, std::int64_t numel) {
  const std::string who = std::string("tierflow CPU Adam: ") + what + " " + std::to_string(i);
  const bool cpu = t.defined() && t.is_cpu();
  TIERFLOW_EXPECTS(cpu && t.is_contiguous(), who + " must be a contiguous CPU tensor");
  const auto g = moment_format(t);
  TIERFLOW_EXPECTS(g == f, who + " has dtype " + std::string(c10::toString(t.scalar_type())) + " where a " +
                               to_string(f) + " moment (" + std::string(c10::toString(moment_dtype(f))) +
                               ") is expected: exp_avg, exp_avg_sq and their outputs take one format");
  const std::size_t want = optimizer::moment_bytes(f, static_cast<std::size_t>(numel));
  TIERFLOW_EXPECTS(t.nbytes() == want, who + " (" + to_string(f) + " moment) has " + std::to_string(t.nbytes()) +
                                           " bytes, expected " + std::to_string(want) + " for " +
                                           std::to_string(numel) + " elements");
}

// The packed view (Note [Optimizer state formats]) of moment `t` of format `f` (not fp32) of `numel` elements.
optimizer::PackedMoment packed(const at::Tensor& t, StateFormat f, std::int64_t numel) {
  if (f == StateFormat::k8bit) return optimizer::packed_8bit(t.data_ptr(), static_cast<std::size_t>(numel));
  return {t.data_ptr(), nullptr};
}

const char* kAcceptedMoments = "accepted: float32 (fp32), bfloat16 (bf16), uint8 (8bit; TIERFLOW_OPTIMIZER_STATES)";

}  // namespace

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
  check_moment(m_out, f, "encoded exp_avg", 0, n);
  check_moment(v_out, f, "encoded exp_avg_sq", 0, n);
  const at::Tensor mf = m.to(at::kCPU, at::kFloat).contiguous(), vf = v.to(at::kCPU, at::kFloat).contiguous();
  if (f == StateFormat::kFp32) {
    m_out.view({n}).copy_(mf.view({n}));
    v_out.view({n}).copy_(vf.view({n}));
    return;
  }
  optimizer::encode_moments(f, mf.data_ptr<float>(), vf.data_ptr<float>(), static_cast<std::size_t>(n),
                            packed(m_out, f, n), packed(v_out, f, n));
}

void decode_moments(const at::Tensor& m, const at::Tensor& v, std::size_t numel, const at::Tensor& m_out,
                    const at::Tensor& v_out) {
  const auto f = moment_format(m);
  TIERFLOW_EXPECTS(f.has_value(), "decode_moments: exp_avg has dtype " +
                                      std::string(m.defined() ? c10::toString(m.scalar_type()) : "undefined") +
                                      "; " + kAcceptedMoments);
  const auto n = static_cast<std::int64_t>(numel);
  check_moment(m, *f, "exp_avg", 0, n);
  check_moment(v, *f, "exp_avg_sq", 0, n);
  check_cpu_contiguous(m_out, "decoded exp_avg", 0, n);
  check_cpu_contiguous(v_out, "decoded exp_avg_sq", 0, n);
  TIERFLOW_EXPECTS(m_out.scalar_type() == at::kFloat && v_out.scalar_type() == at::kFloat,
                   "decode_moments: the outputs must be float32");
  if (*f == StateFormat::kFp32) {
    m_out.view({n}).copy_(m.view({n}));
    v_out.view({n}).copy_(v.view({n}));
    return;
  }
  optimizer::decode_moments(*f, packed(m, *f, n), packed(v, *f, n), numel, m_out.data_ptr<float>(),
                            v_out.data_ptr<float>());
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
    // Note [Optimizer state formats]: the moments' format is their dtype.
    const auto format = moment_format(exp_avgs[i]);
    TIERFLOW_EXPECTS(!exp_avgs[i].defined() || format.has_value(),
                     "tierflow CPU Adam: exp_avg " + std::to_string(i) + " has dtype " +
                         std::string(c10::toString(exp_avgs[i].scalar_type())) + "; " + kAcceptedMoments);
    const StateFormat f = format.value_or(StateFormat::kFp32);
    auto& t = tensors[i];
    t.numel = static_cast<std::size_t>(numel);
    t.state_format = f;
    t.master = masters[i].scalar_type() == at::kFloat ? masters[i].data_ptr<float>() : nullptr;
    const bool has_out = !outputs.masters.empty() && outputs.masters[i].defined();
    if (f == StateFormat::kFp32) {
      check_cpu_contiguous(exp_avgs[i], "exp_avg", i, numel);
      check_cpu_contiguous(exp_avg_sqs[i], "exp_avg_sq", i, numel);
      optimizer::check_kernel_states_fp32(masters[i].scalar_type() == at::kFloat &&
                                              exp_avg_sqs[i].scalar_type() == at::kFloat, i);
      t.exp_avg = exp_avgs[i].data_ptr<float>();
      t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    } else {
      optimizer::check_kernel_states_fp32(masters[i].scalar_type() == at::kFloat, i);
      check_moment(exp_avgs[i], f, "exp_avg", i, numel);
      check_moment(exp_avg_sqs[i], f, "exp_avg_sq", i, numel);
      t.m = packed(exp_avgs[i], f, numel);
      t.v = packed(exp_avg_sqs[i], f, numel);
    }
    if (!max_exp_avg_sqs.empty() && max_exp_avg_sqs[i].defined()) {
      check_cpu_contiguous(max_exp_avg_sqs[i], "max_exp_avg_sq", i, numel);
      TIERFLOW_EXPECTS(max_exp_avg_sqs[i].scalar_type() == at::kFloat,
                       "tierflow CPU Adam: max_exp_avg_sq " + std::to_string(i) + " must be float32");
      t.max_exp_avg_sq = max_exp_avg_sqs[i].data_ptr<float>();
    }
    t.grad = grads[i].data_ptr();
    t.grad_type = optimizer_type(grads[i].scalar_type(), "tierflow CPU Adam: grad", i);
    if (params_out[i].defined()) {
      check_cpu_contiguous(params_out[i], "param", i, numel);
      t.param_out = params_out[i].data_ptr();
      t.param_type = optimizer_type(params_out[i].scalar_type(), "tierflow CPU Adam: param", i);
    }
    if (has_out) {
      check_cpu_contiguous(outputs.masters[i], "master_out", i, numel);
      TIERFLOW_EXPECTS(outputs.masters[i].scalar_type() == at::kFloat,
                       "tierflow CPU Adam: master_out " + std::to_string(i) + " must be float32");
      t.master_out = outputs.masters[i].data_ptr<float>();
      if (f == StateFormat::kFp32) {
        check_cpu_contiguous(outputs.exp_avgs[i], "exp_avg_out", i, numel);
        check_cpu_contiguous(outputs.exp_avg_sqs[i], "exp_avg_sq_out", i, numel);
        TIERFLOW_EXPECTS(outputs.exp_avgs[i].scalar_type() == at::kFloat &&
                             outputs.exp_avg_sqs[i].scalar_type() == at::kFloat,
                         "tierflow CPU Adam: exp_avg_out and exp_avg_sq_out " + std::to_string(i) +
                             " must be float32, as their inputs are");
        t.exp_avg_out = outputs.exp_avgs[i].data_ptr<float>();
        t.exp_avg_sq_out = outputs.exp_avg_sqs[i].data_ptr<float>();
      } else {
        check_moment(outputs.exp_avgs[i], f, "exp_avg_out", i, numel);
        check_moment(outputs.exp_avg_sqs[i], f, "exp_avg_sq_out", i, numel);
        t.m_out = packed(outputs.exp_avgs[i], f, numel);
        t.v_out = packed(outputs.exp_avg_sqs[i], f, numel);
      }
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
