// See Note [GPU budget] and Note [Tier descriptors] in tier_table.hpp.
#include "tierflow/tiering/tier_table.hpp"

#include <algorithm>

#include "tierflow/core/error.hpp"

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

}  // namespace tierflow::tiering
