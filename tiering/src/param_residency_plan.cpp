// See param_residency_plan.hpp.
#include "tierflow/tiering/param_residency_plan.hpp"

#include <algorithm>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::tiering {

ParamScheduleOptions param_residency_options(const std::vector<ParamUnit>& plan, std::uint64_t device_budget_bytes,
                                             std::size_t blocks) {
  std::vector<std::uint64_t> fetched;
  for (const auto& u : plan) {
    if (u.residence == Tier::kGpu) continue;
    fetched.push_back(0);
    for (const auto& r : u.params) fetched.back() += r.bytes;
  }
  const std::uint64_t largest = fetched.empty() ? 0 : *std::max_element(fetched.begin(), fetched.end());
  // A budget below the largest unit is refused before anything moves; the prefetch window shrinks to what the
  // budget leaves (Note [Parameter residency], Budget), and the working set is the activation planner's to
  // count (Budgets::params).
  check_param_budget(device_budget_bytes, fetched, 0, 0);
  ParamScheduleOptions o;
  o.prefetch_bytes = largest;  // one unit ahead (Note [Parameter residency])
  o.device_budget_bytes = device_budget_bytes;
  o.blocks = std::min(blocks, plan.size());
  return o;
}

void check_param_nvme_space(std::uint64_t nvme_bytes, std::uint64_t available_bytes) {
  if (nvme_bytes > 0 && nvme_bytes > available_bytes)
    throw out_of_memory("offload_params: the parameters need " + std::to_string(nvme_bytes) + " bytes (" +
                        format_bytes(nvme_bytes) + ") on NVMe and the NVMe tier has " +
                        format_bytes(available_bytes) + " available (TIERFLOW_NVME_MEMORY, TIERFLOW_NVME_PATHS)");
}

std::string name_parameter(std::string what, ParamId id, const std::string& name) {
  const std::string number = "parameter " + std::to_string(id);
  const auto at = what.find(number);
  if (at != std::string::npos) what.replace(at, number.size(), "parameter '" + name + "'");
  return what;
}

void ParamStorages::add(const void* storage, ParamId id, const std::string& name) {
  auto [it, added] = by_storage_.emplace(storage, std::make_pair(id, name));
  if (!added && it->second.first != id)
    throw config_error("offload_params: parameters '" + it->second.second + "' and '" + name +
                       "' share one storage; offloaded parameters must each have their own");
}

}  // namespace tierflow::tiering
