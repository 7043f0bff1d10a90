// What tierflow.wrap refuses before it attaches anything, decided and worded torch-free (Note [Wrap refusals]).
//
// Note [Wrap refusals]
// ~~~~~~~~~~~~~~~~~~~~
// wrap() measures the model where torch holds it (its tensors' bytes, devices and names, its optimizer's
// parameters) and asks these functions what to refuse; each returns "" when nothing is, else the refusal, which
// names what was wrong and what is accepted (bindings/python/tierflow/_wrap.py raises it after "tierflow.wrap: ").
// They run before the runtime is attached, so a refused wrap leaves the model as it was.
//
// The device budget: with the parameters on the device (TIERFLOW_OFFLOAD_PARAMS=none), their bytes and their
// gradients' (none with TIERFLOW_OFFLOAD_GRADIENTS) above TIERFLOW_GPU_MEMORY leave no room in any activation mode:
// under auto no plan can fit, under a fixed mode the budget cannot be kept (Note [Settings a mode ignores]); said
// at wrap, where the shapes are known, not at the first forward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"

namespace tierflow::tiering {

/// The model's parameters on the runtime's device, each counted once.
struct DeviceParamBytes {
  std::uint64_t weights = 0;    ///< bytes of the parameters on the device
  std::uint64_t trainable = 0;  ///< bytes of those that require grad (their gradients take as much)
};

/// Why `settings` cannot run a model whose parameters take `params` of a device whose TIERFLOW_GPU_MEMORY
/// grants `budget_bytes` (Note [Wrap refusals]); "" when it can, or when the parameters are offloaded.
std::string device_budget_refusal(const Config& settings, std::uint64_t budget_bytes, DeviceParamBytes params);

/// A model with `count` parameters and buffers on the meta device, the first named `first_name` (as Python's
/// repr writes it) of shape `first_shape`.
std::string meta_refusal(std::size_t count, const std::string& first_name, const std::vector<std::int64_t>& first_shape);

/// An optimizer `foreign` of whose `held` parameters are not the model's, the first of shape `first_shape`.
std::string foreign_parameters_refusal(std::size_t foreign, std::size_t held, const std::vector<std::int64_t>& first_shape);

/// An optimizer wrapper of class `wrapper` (module.qualname) that keeps its own reference to the optimizer of class
/// `optimizer` it wraps, in its attribute `attribute` (as Python's repr writes it): Note [Optimizer wrappers].
std::string wrapper_refusal(const std::string& wrapper, const std::string& optimizer, const std::string& attribute);

/// copy.deepcopy of a wrapped model: its hooks would drive the original's runtime.
std::string deepcopy_refusal();

}  // namespace tierflow::tiering
