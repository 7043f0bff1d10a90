// Internals of the joint plan of parameters and activations (Note [Activation planner], Parameters),
// shared by planner.cpp (the model), plan_activations.cpp (plan_within) and plan_params.cpp (the search over fetched
// counts).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "tierflow/core/tier.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering::detail {

/// Parameter bytes per place, and the two largest fetched units (the parameter window).
struct ParamTotals {
  std::uint64_t device = 0, host = 0, nvme = 0;  ///< resident; fetched, held on each tier
  std::uint64_t largest = 0, second = 0;         ///< the two largest fetched units
  /// Counts a unit of `bytes` whose parameters live on `where` between uses.
  void add(std::uint64_t bytes, Tier where);
  /// Fetched parameter bytes on the device at once: the running unit's and the prefetched one's.
  std::uint64_t window() const noexcept { return largest + second; }
};

/// Seconds the rest unit's two fetches (forward, backward) take when `rest` is not kGpu.
double rest_fetch_seconds(const Links& links, const Budgets& budgets, Tier rest);

/// The fastest plan of activations alone (Budgets::params kResident) within the budgets, or none.
std::optional<Plan> plan_within(const std::vector<BlockProfile>& blocks, const Links& links,
                                const Budgets& budgets);

/// plan_activations for Budgets::params kAuto or kFetchAll; throws out_of_memory when nothing fits.
Plan plan_with_params(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets);

}  // namespace tierflow::tiering::detail
