#include "tierflow/tiering/saved_actions.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

SavedAction saved_action(BlockMode mode, SavedClass cls, bool exact) noexcept {
  if (mode == BlockMode::kKeep || cls == SavedClass::kExternal) return SavedAction::kReference;
  if (mode == BlockMode::kSwap || cls == SavedClass::kInput) return SavedAction::kSwap;
  if (mode == BlockMode::kSplit && exact) {
    if (cls == SavedClass::kAttention) return SavedAction::kSwap;
    if (cls == SavedClass::kSplit) return SavedAction::kSwapRows;
  }
  return SavedAction::kRecompute;
}

std::int64_t split_rows(double alpha, std::int64_t rows, std::int64_t granule) noexcept {
  if (rows <= 0 || !(alpha > 0)) return 0;
  if (alpha >= 1) return rows;
  granule = std::max<std::int64_t>(granule, 1);
  const auto r = static_cast<std::int64_t>(std::floor(alpha * static_cast<double>(rows)));
  return std::min(r / granule * granule, rows);
}

std::string_view to_string(SavedClass c) noexcept {
  switch (c) {
    case SavedClass::kExternal: return "external";
    case SavedClass::kInput: return "input";
    case SavedClass::kAttention: return "attention";
    case SavedClass::kSplit: return "split";
    case SavedClass::kCheap: return "cheap";
  }
  return "?";
}

std::string_view to_string(SavedAction a) noexcept {
  switch (a) {
    case SavedAction::kReference: return "reference";
    case SavedAction::kSwap: return "swap";
    case SavedAction::kSwapRows: return "swap_rows";
    case SavedAction::kRecompute: return "recompute";
  }
  return "?";
}

SavedClass parse_saved_class(std::string_view text) {
  for (auto c : {SavedClass::kExternal, SavedClass::kInput, SavedClass::kAttention, SavedClass::kSplit, SavedClass::kCheap})
    if (to_string(c) == text) return c;
  throw config_error("saved-tensor class '" + std::string(text) + "'; accepted: external, input, attention, split, cheap");
}

}  // namespace tierflow::tiering
