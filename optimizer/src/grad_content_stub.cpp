// cuda_grad_content_slabs without the CUDA backend: a clear error, never a silent no-op.
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/grad_content.hpp"

namespace tierflow::optimizer {

bool cuda_grad_content_compiled() noexcept { return false; }

void cuda_grad_content_slabs(const void*, std::size_t, std::size_t, std::uint64_t*, std::uint64_t*, void*) {
  throw logic_error("cuda_grad_content_slabs: tierflow was built without CUDA");
}

}  // namespace tierflow::optimizer
