// See Note [GPU budget] and Note [Tier descriptors] in tier_table.hpp.
#include "tierflow/tiering/tier_table.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/detail/plan_search.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

std::uint64_t gpu_budget_bytes(const Budget& setting, bool given, std::uint64_t capacity_bytes,
                               UnsetGpuBudget unset) {
  if (!given && unset == UnsetGpuBudget::kWholeDevice) return capacity_bytes;
  return setting.resolve(capacity_bytes);
}

double TierTable::path_write(std::size_t i) const {
  const TierRow& r = rows.at(i);
  return r.via < 0 ? r.link_write : std::min(path_write(static_cast<std::size_t>(r.via)), r.link_write);
}

double TierTable::path_read(std::size_t i) const {
  const TierRow& r = rows.at(i);
  return r.via < 0 ? r.link_read : std::min(path_read(static_cast<std::size_t>(r.via)), r.link_read);
}

bool TierTable::shares_own_link(std::size_t swap, std::size_t other) const {
  if (other >= rows.size() || rows[other].via < 0) return false;
  for (int i = static_cast<int>(swap); i >= 0; i = rows.at(static_cast<std::size_t>(i)).via) {
    if (static_cast<std::size_t>(i) == other) return true;
  }
  return false;
}

TierTable swap_tiers(const Links& links, const Budgets& budgets) {
  TierTable t;
  t.rows.push_back({"host", -1, links.d2h, links.h2d, budgets.host_bytes, true});
  t.rows.push_back({"nvme", 0, links.nvme_write, links.nvme_read, budgets.nvme_bytes,
                    detail::nvme_available(links, budgets)});
  for (TierRow row : budgets.further_swap_tiers) {
    if (row.via < -1 || row.via >= static_cast<int>(t.size()))
      throw config_error("swap tier '" + row.name + "' is reached through row " + std::to_string(row.via) +
                         "; accepted: -1 (the device) or an earlier row (0: host, 1: nvme, ...)");
    // A row is there only when the row it is reached through is (a remote host behind an absent NVMe is not).
    row.present = row.present && row.budget_bytes > 0 && row.link_write > 0 && row.link_read > 0 &&
                  (row.via < 0 || t.rows[static_cast<std::size_t>(row.via)].present);
    t.rows.push_back(std::move(row));
  }
  if (t.size() > kMaxSwapTiers)
    throw config_error(std::to_string(t.size()) + " swap tiers; accepted: at most " + std::to_string(kMaxSwapTiers) +
                       " (host, NVMe and " + std::to_string(kMaxSwapTiers - 2) + " further)");
  return t;
}

}  // namespace tierflow::tiering
