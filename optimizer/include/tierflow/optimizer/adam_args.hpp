// The CPU Adam's tensors as the kernels see them (facts, dtype, memory), and the
// validation that turns a front end's lists of them into AdamTensor: what the
// torch adapter (bindings/src/runtime.cpp) used to check tensor by tensor. Its
// errors name the tensor (what, index) and what is accepted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/kernel_arrays.hpp"
#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// The dtypes the CPU Adam reads or writes; kOther: any other.
enum class ArgDtype : std::uint8_t { kFloat32, kBFloat16, kFloat16, kUint8, kOther };

/// One tensor handed to the CPU Adam, as plain facts. `dtype_name` is what
/// errors print for its dtype (the front end's name of it: torch's "Float").
struct KernelArg {
  bool defined = false;
  bool cpu = false;
  bool contiguous = false;
  std::size_t numel = 0;
  std::size_t nbytes = 0;
  ArgDtype dtype = ArgDtype::kOther;
  std::string dtype_name;
  void* data = nullptr;
};

/// The moments' format their dtype says (Note [Optimizer state formats]):
/// float32 fp32, bfloat16 bf16, uint8 8bit; nullopt for any other or none.
std::optional<StateFormat> moment_format(const KernelArg& moment) noexcept;

/// The name errors give the dtype of a moment of format `f` ("Float", "BFloat16", "Byte").
const char* moment_dtype_name(StateFormat f) noexcept;

/// Throws logic_error unless moment `what` `index` of format `f` for `numel`
/// elements is a contiguous CPU tensor of its format's dtype and moment_bytes.
void check_moment(const KernelArg& t, StateFormat f, const char* what, std::size_t index, std::size_t numel);

/// Throws logic_error unless `t` (`what` `index`) is a contiguous CPU tensor of `numel` elements.
void check_cpu_contiguous(const KernelArg& t, const char* what, std::size_t index, std::size_t numel);

/// The packed view of moment `t` of format `f` (not fp32) of `numel` elements.
PackedMoment packed(const KernelArg& t, StateFormat f, std::size_t numel) noexcept;

/// "accepted: float32 (fp32), bfloat16 (bf16), uint8 (8bit; TIERFLOW_OPTIMIZER_STATES)".
extern const char* const kAcceptedMoments;

/// One CPU Adam call's tensors: `max_exp_avg_sqs` may be empty (no amsgrad);
/// `*_out` empty (in place) or one per parameter (out of place where the master's is defined).
struct AdamArgs {
  std::vector<KernelArg> masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, grads, params_out;
  std::vector<KernelArg> masters_out, exp_avgs_out, exp_avg_sqs_out, max_exp_avg_sqs_out;
};

/// The kernel's view of `args` after checking every tensor, in order (the
/// first one wrong throws, naming it and what is accepted); `*elements`: the
/// parameters' elements summed.
std::vector<AdamTensor> adam_tensors(const AdamArgs& args, std::uint64_t* elements = nullptr);

/// The same for host arrays (the step engine's and its hosts'): each array a contiguous CPU tensor of its
/// type (the master float32, the moments their format's dtype, the gradient grad_type, the new weights
/// param_type), checked as above; the first one wrong throws, naming it.
std::vector<AdamTensor> adam_tensors(const std::vector<KernelArrays>& arrays, std::uint64_t* elements = nullptr);

/// TIERFLOW_CPU_ISA's "avx512", "avx2", "portable"; nullopt for anything else (auto: the arena's choice).
std::optional<CpuIsa> parse_cpu_isa(const std::string& s) noexcept;

}  // namespace tierflow::optimizer
