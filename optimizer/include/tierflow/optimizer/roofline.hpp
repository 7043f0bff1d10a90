// The physical limit an Adam step is measured against: a streaming kernel
// with exactly the step's loads and stores and trivial arithmetic.
#pragma once

#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// Reads master, exp_avg, exp_avg_sq and the gradient and writes master,
/// exp_avg, exp_avg_sq and the copy-out, in place, over the same arrays and
/// dtypes and with the same chunking, thread count and SIMD width as
/// CpuAdam::step, but with one add per array instead of Adam's arithmetic.
/// Its time is the memory-bandwidth floor of the step (benchmarks only: it
/// overwrites the state with meaningless values). bf16 and 8-bit moments
/// (AdamTensor::state_format) move their own bytes: 2 + 2, or 1 + 1 and a
/// scale per block each, read and written.
class AdamTrafficKernel {
 public:
  /// `threads` == 0 uses every core.
  explicit AdamTrafficKernel(int threads = 0);
  ~AdamTrafficKernel();
  /// One pass over every tensor.
  void run(const std::vector<AdamTensor>& tensors);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// What measure_cpu_adam_rate measured.
struct CpuAdamRate {
  double params_per_second = 0;
  std::size_t parameters = 0;  ///< stepped per pass
  int passes = 0;              ///< timed passes (after one untimed)
  double seconds = 0;          ///< their time
};

/// The CPU AdamW's rate on this machine (Note [Step prediction]): tierflow's own kernel (CpuAdam, `threads`, 0:
/// every core) over `parameters` parameters with bf16 gradients and weights and moments in `states`, in place,
/// timed over passes until `seconds` have gone by (at least two). Past the caches, so it is the rate a large
/// model's step sees; about `seconds` plus one pass.
CpuAdamRate measure_cpu_adam_rate(StateFormat states, double seconds = 0.06, std::size_t parameters = 1u << 22,
                                  int threads = 0);

}  // namespace tierflow::optimizer
