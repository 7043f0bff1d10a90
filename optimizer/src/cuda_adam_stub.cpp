// cuda_adam_step without the CUDA backend: a clear error, never a silent no-op.
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"

namespace tierflow::optimizer {

bool cuda_adam_compiled() noexcept { return false; }

void cuda_adam_step(const AdamOptions&, std::int64_t, const std::vector<AdamTensor>&, void*) {
  throw logic_error("cuda_adam_step: tierflow was built without CUDA (rebuild with the CUDA toolkit "
                    "and TIERFLOW_WITH_CUDA=ON or AUTO)");
}

}  // namespace tierflow::optimizer
