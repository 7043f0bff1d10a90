// See adam_args.hpp.
#include "tierflow/optimizer/adam_args.hpp"

#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {
namespace {

std::string who(const char* what, std::size_t index) {
  return std::string("tierflow CPU Adam: ") + what + " " + std::to_string(index);
}

std::optional<ScalarType> kernel_type(ArgDtype d) noexcept {
  switch (d) {
    case ArgDtype::kFloat32: return ScalarType::kFloat32;
    case ArgDtype::kBFloat16: return ScalarType::kBFloat16;
    case ArgDtype::kFloat16: return ScalarType::kFloat16;
    default: return std::nullopt;
  }
}

// A grad's or param's type for the kernel; config_error naming it and what is accepted otherwise.
ScalarType io_type(const KernelArg& t, const char* what, std::size_t index) {
  if (const auto k = kernel_type(t.dtype)) return *k;
  throw config_error(who(what, index) + ": dtype " + t.dtype_name + "; accepted: float32, bfloat16, float16");
}

float* floats(const KernelArg& t) noexcept { return static_cast<float*>(t.data); }

ArgDtype arg_dtype(ScalarType t) noexcept {
  switch (t) {
    case ScalarType::kFloat32: return ArgDtype::kFloat32;
    case ScalarType::kBFloat16: return ArgDtype::kBFloat16;
    case ScalarType::kFloat16: return ArgDtype::kFloat16;
  }
  return ArgDtype::kOther;
}

const char* dtype_name(ArgDtype d) noexcept {
  switch (d) {
    case ArgDtype::kFloat32: return "Float";
    case ArgDtype::kBFloat16: return "BFloat16";
    case ArgDtype::kFloat16: return "Half";
    case ArgDtype::kUint8: return "Byte";
    case ArgDtype::kOther: break;
  }
  return "other";
}

// `a` as a contiguous CPU tensor of dtype `d` (elements of `element_bytes` each); undefined stays undefined.
KernelArg arg_of(const HostArray& a, ArgDtype d, std::size_t element_bytes) {
  if (!a.defined()) return {};
  return {true, true, true, a.bytes / element_bytes, a.bytes, d, dtype_name(d), a.data};
}

KernelArg moment_arg(const HostArray& a, StateFormat f) {
  switch (f) {
    case StateFormat::kFp32: return arg_of(a, ArgDtype::kFloat32, 4);
    case StateFormat::kBf16: return arg_of(a, ArgDtype::kBFloat16, 2);
    case StateFormat::k8bit: return arg_of(a, ArgDtype::kUint8, 1);
  }
  return arg_of(a, ArgDtype::kOther, 1);
}

KernelArg typed_arg(const HostArray& a, ScalarType t) { return arg_of(a, arg_dtype(t), element_size(t)); }

}  // namespace

const char* const kAcceptedMoments =
    "accepted: float32 (fp32), bfloat16 (bf16), uint8 (8bit; TIERFLOW_OPTIMIZER_STATES)";

std::optional<StateFormat> moment_format(const KernelArg& moment) noexcept {
  if (!moment.defined) return std::nullopt;
  switch (moment.dtype) {
    case ArgDtype::kFloat32: return StateFormat::kFp32;
    case ArgDtype::kBFloat16: return StateFormat::kBf16;
    case ArgDtype::kUint8: return StateFormat::k8bit;
    default: return std::nullopt;
  }
}

const char* moment_dtype_name(StateFormat f) noexcept {
  switch (f) {
    case StateFormat::kFp32: return "Float";
    case StateFormat::kBf16: return "BFloat16";
    case StateFormat::k8bit: return "Byte";
  }
  return "Float";
}

void check_moment(const KernelArg& t, StateFormat f, const char* what, std::size_t index, std::size_t numel) {
  const std::string w = who(what, index);
  TIERFLOW_EXPECTS(t.defined && t.cpu && t.contiguous, w + " must be a contiguous CPU tensor");
  TIERFLOW_EXPECTS(moment_format(t) == f, w + " has dtype " + t.dtype_name + " where a " + to_string(f) +
                                              " moment (" + moment_dtype_name(f) +
                                              ") is expected: exp_avg, exp_avg_sq and their outputs take one format");
  const std::size_t want = moment_bytes(f, numel);
  TIERFLOW_EXPECTS(t.nbytes == want, w + " (" + to_string(f) + " moment) has " + std::to_string(t.nbytes) +
                                         " bytes, expected " + std::to_string(want) + " for " +
                                         std::to_string(numel) + " elements");
}

void check_cpu_contiguous(const KernelArg& t, const char* what, std::size_t index, std::size_t numel) {
  const bool cpu = t.defined && t.cpu;
  check_kernel_tensor({t.defined, cpu, cpu && t.contiguous, t.defined ? t.numel : 0}, what, index, numel);
}

PackedMoment packed(const KernelArg& t, StateFormat f, std::size_t numel) noexcept {
  if (f == StateFormat::k8bit) return packed_8bit(t.data, numel);
  return {t.data, nullptr};
}

std::vector<AdamTensor> adam_tensors(const AdamArgs& a, std::uint64_t* elements) {
  const std::size_t n = a.masters.size();
  check_kernel_lists(n, {a.exp_avgs.size(), a.exp_avg_sqs.size(), a.grads.size(), a.params_out.size()},
                     {a.max_exp_avg_sqs.size()});
  std::vector<AdamTensor> tensors(n);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const KernelArg& master = a.masters[i];
    const std::size_t numel = master.defined ? master.numel : 0;
    check_cpu_contiguous(master, "master", i, numel);
    // Note [Optimizer state formats]: the moments' format is their dtype.
    const auto format = moment_format(a.exp_avgs[i]);
    TIERFLOW_EXPECTS(!a.exp_avgs[i].defined || format.has_value(),
                     who("exp_avg", i) + " has dtype " + a.exp_avgs[i].dtype_name + "; " + kAcceptedMoments);
    const StateFormat f = format.value_or(StateFormat::kFp32);
    const bool master_fp32 = master.dtype == ArgDtype::kFloat32;
    AdamTensor& t = tensors[i];
    t.numel = numel;
    t.state_format = f;
    t.master = master_fp32 ? floats(master) : nullptr;
    const bool has_out = !a.masters_out.empty() && a.masters_out[i].defined;
    if (f == StateFormat::kFp32) {
      check_cpu_contiguous(a.exp_avgs[i], "exp_avg", i, numel);
      check_cpu_contiguous(a.exp_avg_sqs[i], "exp_avg_sq", i, numel);
      check_kernel_states_fp32(master_fp32 && a.exp_avg_sqs[i].dtype == ArgDtype::kFloat32, i);
      t.exp_avg = floats(a.exp_avgs[i]);
      t.exp_avg_sq = floats(a.exp_avg_sqs[i]);
    } else {
      check_kernel_states_fp32(master_fp32, i);
      check_moment(a.exp_avgs[i], f, "exp_avg", i, numel);
      check_moment(a.exp_avg_sqs[i], f, "exp_avg_sq", i, numel);
      t.m = packed(a.exp_avgs[i], f, numel);
      t.v = packed(a.exp_avg_sqs[i], f, numel);
    }
    if (!a.max_exp_avg_sqs.empty() && a.max_exp_avg_sqs[i].defined) {
      const KernelArg& vmax = a.max_exp_avg_sqs[i];
      check_cpu_contiguous(vmax, "max_exp_avg_sq", i, numel);
      TIERFLOW_EXPECTS(vmax.dtype == ArgDtype::kFloat32, who("max_exp_avg_sq", i) + " must be float32");
      t.max_exp_avg_sq = floats(vmax);
    }
    t.grad = a.grads[i].data;
    t.grad_type = io_type(a.grads[i], "grad", i);
    if (a.params_out[i].defined) {
      check_cpu_contiguous(a.params_out[i], "param", i, numel);
      t.param_out = a.params_out[i].data;
      t.param_type = io_type(a.params_out[i], "param", i);
    }
    if (has_out) {
      const KernelArg& master_out = a.masters_out[i];
      check_cpu_contiguous(master_out, "master_out", i, numel);
      TIERFLOW_EXPECTS(master_out.dtype == ArgDtype::kFloat32, who("master_out", i) + " must be float32");
      t.master_out = floats(master_out);
      const KernelArg& m_out = a.exp_avgs_out.at(i);
      const KernelArg& v_out = a.exp_avg_sqs_out.at(i);
      if (f == StateFormat::kFp32) {
        check_cpu_contiguous(m_out, "exp_avg_out", i, numel);
        check_cpu_contiguous(v_out, "exp_avg_sq_out", i, numel);
        TIERFLOW_EXPECTS(m_out.dtype == ArgDtype::kFloat32 && v_out.dtype == ArgDtype::kFloat32,
                         "tierflow CPU Adam: exp_avg_out and exp_avg_sq_out " + std::to_string(i) +
                             " must be float32, as their inputs are");
        t.exp_avg_out = floats(m_out);
        t.exp_avg_sq_out = floats(v_out);
      } else {
        check_moment(m_out, f, "exp_avg_out", i, numel);
        check_moment(v_out, f, "exp_avg_sq_out", i, numel);
        t.m_out = packed(m_out, f, numel);
        t.v_out = packed(v_out, f, numel);
      }
      if (t.max_exp_avg_sq) {
        check_cpu_contiguous(a.max_exp_avg_sqs_out.at(i), "max_exp_avg_sq_out", i, numel);
        t.max_exp_avg_sq_out = floats(a.max_exp_avg_sqs_out.at(i));
      }
    }
    total += numel;
  }
  if (elements) *elements = total;
  return tensors;
}

std::vector<AdamTensor> adam_tensors(const std::vector<KernelArrays>& arrays, std::uint64_t* elements) {
  AdamArgs args;
  for (const KernelArrays& a : arrays) {
    args.masters.push_back(typed_arg(a.master, ScalarType::kFloat32));
    args.exp_avgs.push_back(moment_arg(a.exp_avg, a.format));
    args.exp_avg_sqs.push_back(moment_arg(a.exp_avg_sq, a.format));
    args.max_exp_avg_sqs.push_back(typed_arg(a.max_exp_avg_sq, ScalarType::kFloat32));
    args.grads.push_back(typed_arg(a.grad, a.grad_type));
    args.params_out.push_back(typed_arg(a.param_out, a.param_type));
    args.masters_out.push_back(typed_arg(a.master_out, ScalarType::kFloat32));
    args.exp_avgs_out.push_back(moment_arg(a.exp_avg_out, a.format));
    args.exp_avg_sqs_out.push_back(moment_arg(a.exp_avg_sq_out, a.format));
    args.max_exp_avg_sqs_out.push_back(typed_arg(a.max_exp_avg_sq_out, ScalarType::kFloat32));
  }
  return adam_tensors(args, elements);
}

std::optional<CpuIsa> parse_cpu_isa(const std::string& s) noexcept {
  if (s == "avx512") return CpuIsa::kAvx512;
  if (s == "avx2") return CpuIsa::kAvx2;
  if (s == "portable") return CpuIsa::kPortable;
  return std::nullopt;
}

}  // namespace tierflow::optimizer
