// What the torch adapter of parameter residency (bindings/src/param_residency.cpp) decides before any
// parameter moves, and the names its errors give, torch-free: the schedule's options from the units' bytes
// and the device budget, the NVMe space check, and the one-storage-per-parameter rule
// (Note [Parameter storage], Note [Parameter residency], Budget).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tierflow/tiering/param_schedule.hpp"

namespace tierflow::tiering {

/// The options the schedule of `plan` runs under: the prefetch window one unit ahead (the largest fetched
/// unit's bytes), the device budget, units 0..blocks-1 the blocks (at most every unit). Throws out_of_memory
/// (check_param_budget) where the budget is below the largest fetched unit, before anything moves.
ParamScheduleOptions param_residency_options(const std::vector<ParamUnit>& plan, std::uint64_t device_budget_bytes,
                                             std::size_t blocks);

/// Throws out_of_memory naming the settings where `nvme_bytes` of parameters exceed NVMe's `available_bytes`.
void check_param_nvme_space(std::uint64_t nvme_bytes, std::uint64_t available_bytes);

/// `what` (an error of the schedule, which knows a parameter by its id) with "parameter <id>" named as the
/// user knows it: "parameter '<name>'".
std::string name_parameter(std::string what, ParamId id, const std::string& name);

/// The storages of the offloaded parameters seen so far: each offloaded parameter must have its own.
class ParamStorages {
 public:
  /// `storage` (any key for the memory the parameter owns) is parameter `id`'s, called `name`; throws
  /// config_error naming both parameters where another one has it already.
  void add(const void* storage, ParamId id, const std::string& name);

 private:
  std::unordered_map<const void*, std::pair<ParamId, std::string>> by_storage_;
};

}  // namespace tierflow::tiering
