// The activation plan as text: mode and tier names, Plan::summary and Plan::block_line (Note [Activation
// planner]); the model is in planner.cpp.
#include "tierflow/tiering/planner.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::tiering {
namespace {

std::string seconds_text(double s) {
  char buf[32];
  if (!std::isfinite(s)) return "inf";
  if (s < 1) {
    std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  }
  return buf;
}

}  // namespace

std::string_view to_string(BlockMode m) noexcept {
  switch (m) {
    case BlockMode::kKeep: return "keep";
    case BlockMode::kSwap: return "swap";
    case BlockMode::kSplit: return "split";
    case BlockMode::kRecompute: return "recompute";
  }
  return "?";
}

BlockMode parse_block_mode(std::string_view text) {
  for (auto m : {BlockMode::kKeep, BlockMode::kSwap, BlockMode::kSplit, BlockMode::kRecompute})
    if (to_string(m) == text) return m;
  throw config_error("block mode '" + std::string(text) + "'; accepted: keep, swap, split, recompute");
}

std::string_view to_string(SwapTier t) noexcept {
  switch (static_cast<int>(t)) {
    case 0: return "host";
    case 1: return "nvme";
    case 2: return "tier 2";
    case 3: return "tier 3";
  }
  return "?";
}

std::string_view to_string(ParamPolicy p) noexcept {
  switch (p) {
    case ParamPolicy::kResident: return "resident";
    case ParamPolicy::kAuto: return "auto";
    case ParamPolicy::kFetchAll: return "fetch-all";
  }
  return "?";
}
std::string Plan::summary() const {
  std::array<int, 4> n{};
  double alpha_sum = 0;
  for (const auto& b : blocks) {
    ++n[static_cast<int>(b.mode)];
    if (b.mode == BlockMode::kSplit) alpha_sum += b.alpha;
  }
  std::string s = std::to_string(blocks.size()) + " blocks: " + std::to_string(n[0]) + " keep, " +
                  std::to_string(n[2]) + " split";
  if (n[2] > 0) {
    char buf[48];
    std::snprintf(buf, sizeof buf, " (mean alpha %.3f)", alpha_sum / n[2]);
    s += buf;
  }
  s += ", " + std::to_string(n[1]) + " swap, " + std::to_string(n[3]) + " recompute; device peak " +
       format_bytes(predicted_device_peak_bytes) + " of " + format_bytes(device_budget_bytes) + "; step " +
       seconds_text(predicted_step_seconds) + " vs " + seconds_text(keep_all_step_seconds) + " keeping all";
  if (keep_all_step_seconds > 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, " (x%.3f)", predicted_step_seconds / keep_all_step_seconds);
    s += buf;
  }
  // Activations only: the fetched parameters' share of each tier is in the parameters' part.
  s += "; swapped " + format_bytes(host_bytes - std::min(host_bytes, host_param_bytes)) + " host, " +
       format_bytes(nvme_bytes - std::min(nvme_bytes, nvme_param_bytes)) + " NVMe";
  for (std::size_t r = 2; r < tier_bytes.size(); ++r)  // further rows (Note [Tier descriptors]), by name
    if (tier_bytes[r] > 0) s += ", " + format_bytes(tier_bytes[r]) + " " + tier_name(static_cast<SwapTier>(r));
  if (outside_bytes > 0)
    s += std::string("; outside the blocks ") + format_bytes(outside_bytes) +
         (outside_kept ? " kept"
                       : std::string(" swapped to ") + (outside_tier == Tier::kNvme ? "NVMe" : "the host") + " (" +
                             seconds_text(outside_swap_seconds) +
                             (outside_staging_bytes > 0 ? "; " + format_bytes(outside_staging_bytes) + " host staging"
                                                        : std::string()) +
                             ")");
  const auto fetched = std::count_if(blocks.begin(), blocks.end(), [](const BlockPlan& b) { return b.params != Tier::kGpu; });
  if (fetched > 0 || rest_params != Tier::kGpu) {
    s += "; parameters: " + std::to_string(fetched) + " blocks fetched, rest " + std::string(to_string(rest_params)) +
         ", " + format_bytes(device_param_bytes) + " resident + " + format_bytes(param_window_bytes) +
         " window on the device, " + format_bytes(host_param_bytes) + " host, " + format_bytes(nvme_param_bytes) +
         " NVMe";
  }
  if (!fits) s += "; OVER BUDGET";
  if (!proven_optimal) s += "; not proven optimal";
  return s;
}

std::string Plan::tier_name(SwapTier t) const {
  const auto r = static_cast<std::size_t>(t);
  return r < tier_names.size() ? tier_names[r] : std::string(to_string(t));
}

std::string Plan::block_line(std::size_t i) const {
  TIERFLOW_EXPECTS(i < blocks.size(), "block_line: block " + std::to_string(i) + " of " +
                                          std::to_string(blocks.size()));
  const auto& b = blocks[i];
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "block %zu: %-9s alpha %.3f  keep %.3f swap %.3f recompute %.3f  %s %s/step  fwd %s bwd %s", i,
                std::string(to_string(b.mode)).c_str(), b.alpha, b.keep, b.swap, b.recompute,
                b.mode == BlockMode::kKeep ? "-" : tier_name(b.tier).c_str(),
                format_bytes(b.swap_bytes).c_str(),
                seconds_text(b.forward_seconds).c_str(), seconds_text(b.backward_seconds).c_str());
  std::string line = buf;
  if (b.params != Tier::kGpu) line += "  params fetched from " + std::string(to_string(b.params));
  return line;
}

}  // namespace tierflow::tiering
