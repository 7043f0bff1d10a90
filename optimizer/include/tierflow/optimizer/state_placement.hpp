// Where a CPU AdamW keeps a parameter's optimizer state and its fp32 master,
// decided from plain values (the bindings read them off the tensor).
//
// Note [CPU AdamW state placement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TIERFLOW_OFFLOAD_OPTIMIZER=nvme keeps master, exp_avg and exp_avg_sq on the
// NVMe tier (Note [Optimizer states on NVMe]); every other value (`host`, and
// `none`, since choosing a CPU optimizer is asking for it) keeps exp_avg and
// exp_avg_sq in the pinned host pool. A contiguous fp32 parameter in host
// memory is its own master and is updated in place; any other one (on the
// device, 16-bit, strided) gets an fp32 master in host memory (or on NVMe),
// and its updated value is written back to it after the step: straight into
// a host parameter by the kernel, through a staging buffer in the pinned pool
// for a device parameter (WeightUpdate).
#pragma once

#include "tierflow/core/config.hpp"
#include "tierflow/core/tier.hpp"

namespace tierflow::optimizer {

/// The tier of a CPU AdamW's states for TIERFLOW_OFFLOAD_OPTIMIZER=`target`: kNvme or kHost.
constexpr Tier adamw_state_tier(OffloadTarget target) noexcept {
  return target == OffloadTarget::kNvme ? Tier::kNvme : Tier::kHost;
}

/// What a parameter is, as far as its master is concerned.
struct ParamLayout {
  bool in_host_memory = false;  ///< a CPU tensor
  bool fp32 = false;            ///< its dtype is float32
  bool contiguous = false;
};

/// True when the parameter is its own fp32 master (updated in place); see Note [CPU AdamW state placement].
constexpr bool is_own_master(const ParamLayout& p) noexcept { return p.in_host_memory && p.fp32 && p.contiguous; }

/// Where the kernel writes a parameter's updated value.
enum class WeightUpdate {
  kInPlace,        ///< its own master: the kernel updates it
  kIntoParameter,  ///< a host parameter with a separate master: the kernel writes it (16-bit out)
  kStaged,         ///< elsewhere (the device): into a host staging buffer, then copied back
};

/// How `p`'s updated value reaches it; see Note [CPU AdamW state placement].
constexpr WeightUpdate weight_update(const ParamLayout& p) noexcept {
  if (is_own_master(p)) return WeightUpdate::kInPlace;
  return p.in_host_memory ? WeightUpdate::kIntoParameter : WeightUpdate::kStaged;
}

}  // namespace tierflow::optimizer
