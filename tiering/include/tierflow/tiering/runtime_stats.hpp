// A runtime's statistics as tierflow.report() and Runtime.stats() give them: one JSON object per part (the saved
// activations, the prefetch, the pinned host pool, the links, the CPU optimizer, the emulated device), each
// field named by its struct's table (Note [Stat fields]). The bindings read the counters off the live runtime;
// the document is built here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/stats.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/tiering/saved_tensors.hpp"

namespace tierflow::tiering {

/// Statistics of a runtime's CPU optimizer (its Adam steps on host tensors).
struct CpuOptimizerStats {
  std::uint64_t steps = 0;     ///< CpuAdam::step calls
  std::uint64_t elements = 0;  ///< parameters updated, summed over steps
  std::uint64_t step_ns = 0;   ///< time inside the CPU step
};
/// CpuOptimizerStats' exported fields (Note [Stat fields]): steps, elements, step_ms.
const std::vector<StatField<CpuOptimizerStats>>& cpu_optimizer_stat_fields();

/// What a runtime's statistics are made of, read off it by the bindings.
struct RuntimeStatsParts {
  std::string device;                       ///< "cuda" or "emulated"
  SavedTensorStats activations;             ///< the saved tensors' counters
  allocator::PinnedHostPoolStats host_pool;  ///< the pinned host pool's
  std::uint64_t host_budget_bytes = 0;      ///< TIERFLOW_HOST_MEMORY in bytes
  bool host_pinned = false;                 ///< whether the pool's memory is CUDA-pinned
  CpuOptimizerStats optimizer;              ///< the CPU optimizer's counters
  int cpu_threads = 0;                      ///< its threads
  std::string cpu_isa;                      ///< its SIMD path
  swap::EmulatedCopyStats emulated;         ///< the emulated device's copies
  std::string emulated_mode;                ///< polite / adversarial, or "n/a" on a GPU
  bool poisoned_device_memory = false;      ///< whether the adversarial device's allocator serves torch's CPU tensors
  std::uint64_t device_late_writes = 0;     ///< freed device blocks found written in quarantine
  swap::CopyEngineStats links;              ///< the copy engine's traffic
};

/// The statistics as JSON text: {"device", "emulated", "activations" (with "nvme", "device_bytes", "host_bytes",
/// "nvme_bytes"), "prefetch", "host_pool" (with "budget_bytes", "pinned", "in_use", "reserved"), "links",
/// "optimizer" (with "threads", "isa")}; counts as integers, scaled fields as numbers with a fraction.
std::string runtime_stats_json(const RuntimeStatsParts& parts);

}  // namespace tierflow::tiering
