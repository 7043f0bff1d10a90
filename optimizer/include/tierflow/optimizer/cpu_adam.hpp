// The CPU Adam / AdamW step on oneTBB.
//
// Note [Adam semantics]
// ~~~~~~~~~~~~~~~~~~~~~
// The update follows torch.optim.Adam / AdamW (single-tensor path) operation
// by operation in fp32, so results agree element-wise with torch on fp32
// parameters to rounding:
//   g = maximize ? -grad : grad
//   AdamW: p *= 1 - lr*wd            Adam: g = fma(wd, p, g)
//   m = fma(1-b1, g - m, m)          (torch's lerp)
//   v = fma((1-b2)*g, g, v*b2)       (torch's mul_ then addcmul_)
//   vmax = max(vmax, v)              (amsgrad; v below means vmax)
//   denom = sqrt(v) * (1/sqrt(1-b2^t)) + eps   (torch divides; see below)
//   p = p + (-lr/(1-b1^t) * m) / denom   (torch's addcdiv_)
// Bias corrections are computed in double, as torch does in Python; the lerp,
// Adam's L2 term and addcmul are fused multiply-adds, as in torch's
// vectorized CPU kernels, so m and v are bit-identical to torch's. Two
// places differ by design, each by at most an ulp: sqrt is IEEE-exact (torch's
// vectorized sqrt on this build is not), and the bias correction of the
// denominator multiplies by a reciprocal rounded once instead of dividing,
// as DeepSpeed does, which leaves one division per element; that division
// was what kept the step from memory speed when bandwidth was high. Results
// agree with torch.optim to 1e-6 relative (tests/python/test_optimizer.py). The fp32
// master is the parameter; when the model's parameter has another dtype (or
// lives elsewhere) the updated master is also written to `param_out` in that
// dtype, rounded to nearest even, in the same pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/optimizer/scalar_type.hpp"
#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// Hyperparameters of one parameter group, as torch.optim names them.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = true;  ///< true: AdamW; false: Adam (L2 added to the gradient)
  double grad_scale = 1.0;  ///< gradients are multiplied by float(grad_scale) first (clipping); 1 skips it
};

/// What is wrong with `options`, in torch.optim.AdamW's words ("Invalid learning
/// rate: -0.1"), checking lr, eps, betas and weight_decay in torch's order; nullopt when valid.
std::optional<std::string> adam_options_problem(const AdamOptions& options);

/// The parameters of one kernel call: every member takes step number `step`.
struct StepGroup {
  std::int64_t step = 0;
  std::vector<std::size_t> members;  ///< indices into the input, in input order
};

/// Parameters grouped for CpuAdam::step, one call per step number (parameters
/// of a group can differ in step count: a group added later, a failed step).
/// `steps[i]` is parameter i's step number; groups in order of first appearance.
std::vector<StepGroup> group_by_step(const std::vector<std::int64_t>& steps);

/// One parameter's buffers for a step. All pointers cover `numel` elements.
struct AdamTensor {
  float* master = nullptr;          ///< fp32 master weights, updated in place
  float* exp_avg = nullptr;         ///< first moment
  float* exp_avg_sq = nullptr;      ///< second moment
  float* max_exp_avg_sq = nullptr;  ///< amsgrad only; may be null otherwise
  const void* grad = nullptr;       ///< gradient of type grad_type
  ScalarType grad_type = ScalarType::kFloat32;
  void* param_out = nullptr;        ///< optional copy-out of the updated master
  ScalarType param_type = ScalarType::kFloat32;
  std::size_t numel = 0;
  /// Optional out-of-place outputs (null: update in place). With them the
  /// inputs are left untouched, so a step can be discarded (see
  /// Note [Step during backward] in step_ledger.hpp) at no extra memory traffic.
  float* master_out = nullptr;
  float* exp_avg_out = nullptr;
  float* exp_avg_sq_out = nullptr;
  float* max_exp_avg_sq_out = nullptr;
  /// How the moments are stored (Note [Optimizer state formats]). With kBf16
  /// or k8bit, exp_avg and exp_avg_sq (and their _out) stay null and the
  /// moments are `m` and `v` (out of place: `m_out` and `v_out`, set together
  /// with master_out); amsgrad is refused.
  StateFormat state_format = StateFormat::kFp32;
  PackedMoment m, v, m_out, v_out;
};

/// A tensor handed to the CPU Adam, as plain facts (what the kernel reads or writes).
struct KernelTensorFacts {
  bool defined = false;
  bool cpu = false;          ///< read only when defined
  bool contiguous = false;   ///< read only when defined
  std::size_t numel = 0;
};

/// Throws logic_error unless tensor `what` `index` is a contiguous CPU tensor
/// of `numel` elements, naming what it is and what is accepted: "tierflow CPU
/// Adam: grad 3 must be a contiguous CPU tensor".
void check_kernel_tensor(const KernelTensorFacts& t, std::string_view what, std::size_t index, std::size_t numel);

/// Throws logic_error unless the master and both moments of tensor `index` are float32.
void check_kernel_states_fp32(bool all_float32, std::size_t index);

/// Throws logic_error unless every list of one CPU Adam call has `n` entries
/// (`optional_sizes` may also be empty).
void check_kernel_lists(std::size_t n, const std::vector<std::size_t>& sizes,
                        const std::vector<std::size_t>& optional_sizes);

/// The SIMD code path of the CPU kernel. All paths give bit-identical results.
enum class CpuIsa : std::uint8_t { kAuto, kAvx512, kAvx2, kPortable };

/// "auto", "avx512", "avx2" or "portable".
const char* to_string(CpuIsa isa) noexcept;

/// The widest path this CPU runs (AVX-512 needs F, BW and VL; AVX2 needs FMA and F16C).
CpuIsa best_cpu_isa() noexcept;

/// Runs Adam/AdamW steps on a oneTBB arena of a fixed number of threads.
class CpuAdam {
 public:
  /// `threads` == 0 uses every core. `isa` kAuto picks best_cpu_isa(); asking
  /// for a path this CPU lacks throws logic_error naming it.
  explicit CpuAdam(int threads = 0, CpuIsa isa = CpuIsa::kAuto);
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  /// Applies step number `step` (1 for the first step) to every tensor.
  /// Throws logic_error naming the tensor when a required buffer is missing.
  void step(const AdamOptions& options, std::int64_t step, const std::vector<AdamTensor>& tensors);
  /// Threads of the arena.
  int threads() const noexcept;
  /// The SIMD path in use.
  CpuIsa isa() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierflow::optimizer
