// Host arrays as the step engine and its front ends hand them to the CPU Adam: a pointer, its bytes and what
// keeps it alive, and one parameter's arrays in one kernel call. adam_args.hpp turns them into the kernel's
// AdamTensor (checked, as every front end's tensors are).
#pragma once

#include <cstddef>
#include <memory>

#include "tierflow/optimizer/scalar_type.hpp"
#include "tierflow/optimizer/state_format.hpp"

namespace tierflow::optimizer {

/// A host buffer the engine reads or writes: `data` for `bytes`, alive while `keep` is (its owner, whatever
/// the front end allocated it as: a tensor, a pool block). A slice of a buffer shares the buffer's `keep`.
struct HostArray {
  void* data = nullptr;
  std::size_t bytes = 0;
  std::shared_ptr<void> keep;
  bool defined() const noexcept { return keep != nullptr; }
  /// `bytes` at `offset`, kept alive with this buffer.
  HostArray slice(std::size_t offset, std::size_t n) const {
    return {static_cast<char*>(data) + offset, n, keep};
  }
};

/// One parameter's arrays in one CPU Adam call (the engine's, or the front end's for its own steps).
struct KernelArrays {
  std::size_t numel = 0;
  StateFormat format = StateFormat::kFp32;  ///< the moments' (and their outputs') format
  ScalarType grad_type = ScalarType::kFloat32;
  ScalarType param_type = ScalarType::kFloat32;
  HostArray master, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, param_out;
  HostArray master_out, exp_avg_out, exp_avg_sq_out, max_exp_avg_sq_out;  ///< all undefined: in place
};

}  // namespace tierflow::optimizer
