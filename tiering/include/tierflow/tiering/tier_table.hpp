// The tiers as rows: the GPU's budget resolved once, and the swap tiers (host,
// NVMe, ...) as descriptors the activation planner iterates over.
//
// Note [GPU budget]
// ~~~~~~~~~~~~~~~~~
// TIERFLOW_GPU_MEMORY becomes bytes in one function, gpu_budget_bytes, and
// travels typed from there: Tiers::device_budget_bytes (the runtime: the
// planner's Budgets::device_bytes, parameter residency's bound, the GPU
// share's room through Runtime.device_budget_bytes) and `python -m tierflow
// plan` (plan_command_budgets) both call it. They differ in one thing, named
// by UnsetGpuBudget: a run that was not given the variable takes the table's
// default (90% of the device: the CUDA context and the caching allocator's
// slack live in the rest), while the plan command, which has no device of its
// own and answers "what would fit a device of this size", takes the device's
// whole memory (its --help says so and its printed budgets are the user's
// record of what was asked). Pass --gpu-memory 90% to the command to see what
// a run with the default would plan.
//
// Note [Tier descriptors]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A swap tier is a row of a TierTable: its name, the row it is reached
// through (`via`; -1: the device), the bandwidths of its own link to that
// neighbour, measured (Links), and its room (Budgets). The bandwidth of a swap
// to a tier is the slowest link on its path to the device (path_write,
// path_read): the host's is PCIe, NVMe's is min(PCIe, NVMe) since its bytes
// are staged through the host. The planner's model prices a block's swap on a
// row by those two numbers, and its search (plan_search.cpp) enumerates
// keep + {swap, split, recompute} x rows, with each row's budget as the room
// of a fractional knapsack and a Lagrangian price: it never names a tier.
// Rows are ordered fastest first; ties in the search go to the earlier row,
// and forced plans fill the rows in order. BlockPlan::tier is a row's index
// (SwapTier::kHost = 0 and kNvme = 1 are the rows the configuration builds).
//
// What is still named: the configuration's rows (swap_tiers: host from
// Links.d2h/h2d and Budgets.host_bytes, NVMe from Links.nvme_* and
// Budgets.nvme_bytes, the names the profile file and the plan command's JSON
// keep), Plan::host_bytes/nvme_bytes (the JSON's fields; Plan::tier_bytes has
// every row), and fetched parameters' homes (Budgets::param_tier, a core::Tier:
// a fetch from row r shares row r's own link with a swap on row r).
//
// Adding a fourth tier (say a remote host's memory over RDMA, slower than the
// local host, faster than NVMe):
//  - a row: {"remote", via = 0 (the host; or -1 for GPUDirect RDMA),
//    link_write/link_read = the network's measured rates, budget_bytes = the
//    remote's room}, given to the planner in Budgets::further_swap_tiers (a
//    configuration would build it in swap_tiers from a TIERFLOW_REMOTE_MEMORY
//    budget and a measured Links field; the profile file would gain a links
//    field, optional, so old files still read);
//  - the runtime: a BlockAction for it and an engine that moves the bytes
//    (block_actions.cpp maps a row to its engine);
//  - nothing in the search or the model: plan_activations puts blocks on
//    "remote" when the host is full and remote beats NVMe (tests/cpp/
//    test_tiers.cpp, PlannerUsesAFurtherTierRow).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/core/size.hpp"

namespace tierflow::tiering {

/// What a TIERFLOW_GPU_MEMORY that was not given means (Note [GPU budget]).
enum class UnsetGpuBudget : std::uint8_t {
  kTableDefault,  ///< the configuration table's default (90% of the device): what a run plans within
  kWholeDevice,   ///< the device's total memory: `python -m tierflow plan`'s what-if for a device of that size
};

/// TIERFLOW_GPU_MEMORY in bytes on a device of `capacity_bytes` (Note [GPU budget]): `setting` resolved when
/// `given`, else per `unset` (kTableDefault resolves `setting`, which then holds the table's default).
std::uint64_t gpu_budget_bytes(const Budget& setting, bool given, std::uint64_t capacity_bytes,
                               UnsetGpuBudget unset);

/// One swap tier as the planner sees it (Note [Tier descriptors]).
struct TierRow {
  std::string name;                ///< what reports call it: "host", "nvme", "remote"
  int via = -1;                    ///< the row it is reached through, an earlier one; -1: the device
  double link_write = 0;           ///< bytes per second over its own link, towards it (from `via` or the device)
  double link_read = 0;            ///< bytes per second over its own link, back
  std::uint64_t budget_bytes = 0;  ///< room for swapped activations (and fetched parameters)
  bool present = true;             ///< it exists in this run (NVMe: a budget and both rates)
};

/// Most swap tiers a table holds (the search keeps per-tier arrays of this size).
inline constexpr std::size_t kMaxSwapTiers = 4;

/// The swap tiers, fastest first; a row's `via` is an earlier row.
struct TierTable {
  std::vector<TierRow> rows;
  std::size_t size() const noexcept { return rows.size(); }
  const TierRow& operator[](std::size_t i) const { return rows[i]; }
  /// Bytes per second from the device to row i: its path's slowest link.
  double path_write(std::size_t i) const;
  /// Bytes per second from row i to the device.
  double path_read(std::size_t i) const;
  /// Whether a swap to row `swap` crosses row `other`'s own link (row `other` is on its path), and that link
  /// is not the device's own (via -1: PCIe, which the model prices by Links.h2d already).
  bool shares_own_link(std::size_t swap, std::size_t other) const;
};

}  // namespace tierflow::tiering
