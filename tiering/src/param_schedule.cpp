// See Note [Parameter residency] in param_schedule.hpp.
#include "tierflow/tiering/param_schedule.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::tiering {
namespace {

}  // namespace

const std::vector<StatField<ParamScheduleStats>>& param_schedule_stat_fields() {
  using S = ParamScheduleStats;
  static const std::vector<StatField<S>> fields = {
      {"fetches", &S::fetches},
      {"host_to_device_bytes", &S::host_to_device_bytes},
      {"nvme_to_host_bytes", &S::nvme_to_host_bytes},
      {"prefetch_hits", &S::prefetch_hits},
      {"stalls", &S::stalls},
      {"stall_ms", &S::stall_ns, nullptr, 1e-6},
      {"order_misses", &S::order_misses},
      {"releases", &S::releases},
      {"device_bytes", &S::device_bytes},
      {"device_peak_bytes", &S::device_peak_bytes},
      {"host_bytes", &S::host_bytes},
      {"nvme_bytes", &S::nvme_bytes},
  };
  return fields;
}

std::vector<UnitId> ParamSchedule::default_forward() const {
  std::vector<UnitId> order;
  for (UnitId u = 0; u < std::min(options_.blocks, units_.size()); ++u) order.push_back(u);
  return order;
}

std::string ParamSchedule::unit_name(UnitId u) const {
  return u < names_.size() && !names_[u].empty() ? names_[u] : "unit " + std::to_string(u);
}

std::string_view to_string(ParamState s) noexcept {
  switch (s) {
    case ParamState::kOnTier: return "on-tier";
    case ParamState::kInFlight: return "in-flight";
    case ParamState::kOnDevice: return "on-device";
    case ParamState::kReleased: return "released";
  }
  return "?";
}

ParamSchedule::ParamSchedule(std::vector<ParamUnit> units, ParamScheduleOptions options) : options_(options) {
  if (units.empty()) throw std::logic_error("ParamSchedule: no units (the rest unit at least)");
  auto& index = index_;
  units_.resize(units.size());
  unit_open_.assign(units.size(), 0);
  for (const auto& u : units) names_.push_back(u.name);
  if (options_.blocks == static_cast<std::size_t>(-1)) options_.blocks = units.size() - 1;
  // Resident units first, so that a parameter any resident unit lists is resident; then by index.
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t u = 0; u < units.size(); ++u) {
      if ((units[u].residence == Tier::kGpu) != (pass == 0)) continue;
      for (const auto& r : units[u].params) {
        auto [it, added] = index.emplace(r.id, params_.size());
        if (added) params_.push_back({r.id, r.bytes, units[u].residence, ParamState::kOnTier, false});
        if (params_[it->second].bytes != r.bytes)
          throw std::logic_error("ParamSchedule: parameter " + std::to_string(r.id) + " is listed with " +
                                 std::to_string(params_[it->second].bytes) + " and " + std::to_string(r.bytes) +
                                 " bytes");
        auto& members = units_[u];
        if (std::find(members.begin(), members.end(), it->second) == members.end()) members.push_back(it->second);
      }
    }
  }
  for (auto& p : params_) {
    if (p.home == Tier::kGpu) {
      p.state = ParamState::kOnDevice;
      stats_.device_bytes += p.bytes;
    } else {
      (p.home == Tier::kHost ? stats_.host_bytes : stats_.nvme_bytes) += p.bytes;
    }
  }
  stats_.device_peak_bytes = stats_.device_bytes;
  expected_ = default_forward();
}

std::size_t ParamSchedule::index_of(ParamId id) const {
  const auto it = index_.find(id);
  if (it == index_.end()) throw std::logic_error("ParamSchedule: unknown parameter " + std::to_string(id));
  return it->second;
}

ParamSchedule::Param& ParamSchedule::param(ParamId id) { return params_[index_of(id)]; }

const ParamSchedule::Param& ParamSchedule::param(ParamId id) const {
  return const_cast<ParamSchedule*>(this)->param(id);
}

ParamState ParamSchedule::state(ParamId id) const { return param(id).state; }
Tier ParamSchedule::home(ParamId id) const { return param(id).home; }

void ParamSchedule::move(Param& p, ParamState to) {
  const ParamState from = p.state;
  const bool legal = p.home != Tier::kGpu &&
                     ((to == ParamState::kInFlight && (from == ParamState::kOnTier || from == ParamState::kReleased)) ||
                      (to == ParamState::kOnDevice && from == ParamState::kInFlight) ||
                      (to == ParamState::kReleased && from == ParamState::kOnDevice));
  if (!legal)
    throw std::logic_error("ParamSchedule: parameter " + std::to_string(p.id) + " cannot move from " +
                           std::string(to_string(from)) + " to " + std::string(to_string(to)) +
                           (p.home == Tier::kGpu ? " (it is resident)" : ""));
  p.state = to;
}

void ParamSchedule::fetch(Param& p, bool ahead) {
  move(p, ParamState::kInFlight);
  ++stats_.fetches;
  stats_.host_to_device_bytes += p.bytes;
  if (p.home == Tier::kNvme) stats_.nvme_to_host_bytes += p.bytes;
  stats_.device_bytes += p.bytes;
  stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, stats_.device_bytes);
  p.ahead = ahead;
  if (ahead) ahead_bytes_ += p.bytes;
}

void ParamSchedule::arrived(ParamId id) { move(param(id), ParamState::kOnDevice); }

void ParamSchedule::fetch_failed(ParamId id) {
  Param& p = param(id);
  TIERFLOW_EXPECTS(p.state == ParamState::kInFlight, "ParamSchedule::fetch_failed: parameter " + std::to_string(id) +
                                                         " is " + std::string(to_string(p.state)));
  p.state = ParamState::kReleased;
  if (p.ahead) ahead_bytes_ -= p.bytes;
  p.ahead = false;
  stats_.device_bytes -= p.bytes;
}

void ParamSchedule::record_phase() {
  if (backward_) {
    recorded_backward_ = seen_;
    backward_followed_ = last_forward_;
  } else {
    recorded_forward_ = last_forward_ = seen_;
  }
}

std::vector<ParamId> ParamSchedule::make_resident(const std::vector<UnitId>& units) {
  TIERFLOW_EXPECTS(!in_phase_, "ParamSchedule::make_resident: between phases only (after end_phase)");
  std::vector<ParamId> out;
  for (UnitId u : units) {
    TIERFLOW_EXPECTS(u < units_.size(), "ParamSchedule::make_resident: unit " + std::to_string(u) + " of " +
                                            std::to_string(units_.size()));
    for (std::size_t i : units_[u]) {
      Param& p = params_[i];
      if (p.home == Tier::kGpu) continue;
      TIERFLOW_EXPECTS(p.state != ParamState::kInFlight, "ParamSchedule::make_resident: parameter " +
                                                              std::to_string(p.id) + " is in flight");
      (p.home == Tier::kHost ? stats_.host_bytes : stats_.nvme_bytes) -= p.bytes;
      p.home = Tier::kGpu;
      if (p.state != ParamState::kOnDevice) stats_.device_bytes += p.bytes;  // a held one is there already
      p.state = ParamState::kOnDevice;
      p.holds = 0;
      out.push_back(p.id);
    }
  }
  stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, stats_.device_bytes);
  if (recorded_forward_.empty()) expected_ = default_forward();
  return out;
}

void ParamSchedule::release(Param& p, ParamActions& out) {
  if (p.ahead) ahead_bytes_ -= p.bytes;
  p.ahead = false;
  if (p.state == ParamState::kInFlight) move(p, ParamState::kOnDevice);  // the caller waits for its copy first
  if (p.state != ParamState::kOnDevice) return;
  move(p, ParamState::kReleased);
  stats_.device_bytes -= p.bytes;
  ++stats_.releases;
  out.release.push_back(p.id);
}

ParamActions ParamSchedule::end_phase() {
  ParamActions out;
  if (!in_phase_) return out;
  record_phase();
  for (auto& p : params_) {
    p.open = 0;
    if (p.home != Tier::kGpu && p.holds == 0) release(p, out);
  }
  std::fill(unit_open_.begin(), unit_open_.end(), 0);
  stats_.device_bytes -= extra_bytes_;
  extra_bytes_ = 0;
  in_phase_ = false;
  return out;
}

bool ParamSchedule::next_uses(std::size_t param_index) const {
  if (!in_phase_ || cursor_ >= expected_.size()) return false;
  const auto& members = units_[expected_[cursor_]];
  return std::find(members.begin(), members.end(), param_index) != members.end();
}

bool ParamSchedule::needed(std::size_t param_index) const {
  const Param& p = params_[param_index];
  return p.open > 0 || p.holds > 0 || p.ahead || next_uses(param_index);
}

void ParamSchedule::make_room(std::uint64_t bytes, const std::vector<std::size_t>& wanted, const std::string& what,
                              ParamActions& out) {
  const std::uint64_t budget = options_.device_budget_bytes;
  if (budget == 0 || stats_.device_bytes + bytes <= budget) return;
  auto freeable = [&](std::size_t i) {
    const Param& p = params_[i];
    return p.ahead && p.open == 0 && p.holds == 0 && std::find(wanted.begin(), wanted.end(), i) == wanted.end();
  };
  std::uint64_t free = 0;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (freeable(i)) free += params_[i].bytes;
  if (stats_.device_bytes - free + bytes > budget) {
    std::string uses, held;
    std::uint64_t held_bytes = 0;
    for (UnitId u = 0; u < units_.size(); ++u)
      if (unit_open_[u] > 0)
        uses += (uses.empty() ? "" : ", ") + unit_name(u) + (unit_open_[u] > 1 ? " (x" + std::to_string(unit_open_[u]) + ")" : "");
    for (const auto& p : params_)
      if (p.holds > 0 && p.home != Tier::kGpu && p.state != ParamState::kReleased && p.state != ParamState::kOnTier)
        held_bytes += p.bytes;
    out.refused = "tierflow: parameters fetched from the host or NVMe would need " +
                  std::to_string(stats_.device_bytes - free + bytes) + " bytes (" +
                  format_bytes(stats_.device_bytes - free + bytes) + ") of device memory for " + what +
                  ", over the device budget (TIERFLOW_GPU_MEMORY, keyword gpu_memory) of " + std::to_string(budget) +
                  " bytes (" + format_bytes(budget) + "); on the device then: the uses of " +
                  (uses.empty() ? std::string("no unit") : uses) + " (open at once), " + format_bytes(held_bytes) +
                  " held by reads outside their modules (tierflow.gathered, a weight read inline). Raise "
                  "TIERFLOW_GPU_MEMORY, or use less at once (fewer forwards before a backward, fewer modules "
                  "gathered)";
    return;
  }
  for (std::size_t i = 0; i < params_.size() && stats_.device_bytes + bytes > budget; ++i)
    if (freeable(i)) release(params_[i], out);
}

void ParamSchedule::start_phase(bool backward, ParamActions& out) {
  if (in_phase_) record_phase();
  for (auto& p : params_)  // what the previous phase left on the device (its order changed)
    if (p.home != Tier::kGpu && p.open == 0 && p.holds == 0 && p.state == ParamState::kOnDevice) release(p, out);
  if (backward) {
    std::vector<UnitId> reverse(last_forward_.rbegin(), last_forward_.rend());
    // The recorded backward, when it followed a forward of the same uses as this one.
    const bool usable = !recorded_backward_.empty() && backward_followed_ == last_forward_;
    expected_ = usable ? recorded_backward_ : reverse;
  } else {
    expected_ = recorded_forward_.empty() ? default_forward() : recorded_forward_;
  }
  seen_.clear();
  cursor_ = 0;
  in_phase_ = true;
  backward_ = backward;
}

ParamActions ParamSchedule::begin(UnitId unit, bool backward, std::uint64_t extra_bytes) {
  TIERFLOW_EXPECTS(unit < units_.size(), "ParamSchedule: unit " + std::to_string(unit) + " of " +
                                             std::to_string(units_.size()));
  ParamActions out;
  if (!in_phase_ || backward_ != backward) start_phase(backward, out);
  std::uint64_t missing = 0;
  for (std::size_t i : units_[unit]) {
    const Param& p = params_[i];
    if (p.home != Tier::kGpu && p.state != ParamState::kOnDevice && p.state != ParamState::kInFlight) missing += p.bytes;
  }
  make_room(missing + extra_bytes, units_[unit], "the use of " + unit_name(unit), out);
  if (!out.refused.empty()) return out;
  ++unit_open_[unit];
  extra_bytes_ += extra_bytes;
  stats_.device_bytes += extra_bytes;
  stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, stats_.device_bytes);
  seen_.push_back(unit);
  if (cursor_ < expected_.size() && expected_[cursor_] == unit) {
    ++cursor_;
  } else {
    ++stats_.order_misses;
    auto f = std::find(expected_.begin() + static_cast<std::ptrdiff_t>(cursor_), expected_.end(), unit);
    if (f != expected_.end()) cursor_ = static_cast<std::size_t>(f - expected_.begin()) + 1;
  }
  for (std::size_t i : units_[unit]) {
    Param& p = params_[i];
    if (p.home == Tier::kGpu) continue;
    ++p.open;
    if (p.ahead) ahead_bytes_ -= p.bytes;
    p.ahead = false;
    if (p.open > 1) continue;  // another open use has it
    if (p.state == ParamState::kOnDevice || p.state == ParamState::kInFlight) {
      ++stats_.prefetch_hits;
      if (p.state == ParamState::kInFlight) out.wait.push_back(p.id);
      continue;
    }
    ++stats_.stalls;
    fetch(p, false);
    out.fetch.push_back(p.id);
    out.wait.push_back(p.id);
  }
  top_up(out);
  return out;
}

ParamActions ParamSchedule::end(UnitId unit, std::uint64_t extra_bytes) {
  TIERFLOW_EXPECTS(unit < units_.size() && in_phase_ && unit_open_[unit] > 0 && extra_bytes <= extra_bytes_,
                   "ParamSchedule: end of unit " + std::to_string(unit) + " outside a use");
  ParamActions out;
  --unit_open_[unit];
  extra_bytes_ -= extra_bytes;
  stats_.device_bytes -= extra_bytes;
  for (std::size_t i : units_[unit]) {
    Param& p = params_[i];
    if (p.home == Tier::kGpu) continue;
    if (p.open > 0) --p.open;
    if (!needed(i)) release(p, out);  // released already (a shared one): nothing
  }
  top_up(out);
  return out;
}

bool ParamSchedule::need_now(std::size_t i, const std::string& what, ParamActions& out) {
  Param& p = params_[i];
  if (p.state != ParamState::kOnDevice && p.state != ParamState::kInFlight) {
    make_room(p.bytes, {i}, what, out);
    if (!out.refused.empty()) return false;
    ++stats_.stalls;
    fetch(p, false);
    out.fetch.push_back(p.id);
    out.wait.push_back(p.id);
  } else if (p.state == ParamState::kInFlight) {
    out.wait.push_back(p.id);
  }
  if (p.ahead) ahead_bytes_ -= p.bytes;
  p.ahead = false;
  return true;
}

ParamActions ParamSchedule::hold(ParamId id) {
  const std::size_t i = index_of(id);
  ParamActions out;
  if (params_[i].home == Tier::kGpu) return out;
  if (need_now(i, "a read of parameter " + std::to_string(id) + " outside its modules", out)) ++params_[i].holds;
  return out;
}

ParamActions ParamSchedule::unhold(ParamId id) {
  const std::size_t i = index_of(id);
  Param& p = params_[i];
  ParamActions out;
  if (p.home == Tier::kGpu) return out;
  TIERFLOW_EXPECTS(p.holds > 0, "ParamSchedule::unhold: parameter " + std::to_string(id) + " is not held");
  --p.holds;
  if (!needed(i)) release(p, out);
  return out;
}

ParamActions ParamSchedule::attach(UnitId unit, ParamId id) {
  TIERFLOW_EXPECTS(unit < units_.size(), "ParamSchedule::attach: unit " + std::to_string(unit) + " of " +
                                             std::to_string(units_.size()));
  const std::size_t i = index_of(id);
  ParamActions out;
  auto& members = units_[unit];
  if (std::find(members.begin(), members.end(), i) != members.end()) return out;
  Param& p = params_[i];
  if (unit_open_[unit] > 0 && p.home != Tier::kGpu) {
    if (!need_now(i, "parameter " + std::to_string(id) + ", read by " + unit_name(unit), out)) return out;
    p.open += unit_open_[unit];
  }
  members.push_back(i);
  return out;
}

bool ParamSchedule::on_device(ParamId id) const {
  const Param& p = param(id);
  return p.state == ParamState::kOnDevice || p.state == ParamState::kInFlight;
}

void ParamSchedule::top_up(ParamActions& out) {
  const std::uint64_t budget = options_.device_budget_bytes;
  for (std::size_t i = cursor_; i < expected_.size(); ++i) {
    for (std::size_t j : units_[expected_[i]]) {
      Param& p = params_[j];
      if (p.home == Tier::kGpu || p.state == ParamState::kInFlight || p.state == ParamState::kOnDevice) continue;
      if (ahead_bytes_ + p.bytes > options_.prefetch_bytes) return;
      if (budget != 0 && stats_.device_bytes + p.bytes > budget) return;
      fetch(p, true);
      out.prefetch.push_back(p.id);
    }
  }
}

ParamActions ParamSchedule::begin_forward(UnitId unit, std::uint64_t extra) { return begin(unit, false, extra); }
ParamActions ParamSchedule::end_forward(UnitId unit, std::uint64_t extra) { return end(unit, extra); }
ParamActions ParamSchedule::begin_backward(UnitId unit, std::uint64_t extra) { return begin(unit, true, extra); }
ParamActions ParamSchedule::end_backward(UnitId unit, std::uint64_t extra) { return end(unit, extra); }

std::vector<Tier> residences_from_plan(const Plan& plan) {
  std::vector<Tier> out;
  for (const auto& b : plan.blocks) out.push_back(b.params);
  out.push_back(plan.rest_params);
  return out;
}

void check_param_budget(std::uint64_t device_budget_bytes, const std::vector<std::uint64_t>& unit_bytes,
                        std::uint64_t prefetch_bytes, std::uint64_t working_set_bytes) {
  const std::uint64_t largest = unit_bytes.empty() ? 0 : *std::max_element(unit_bytes.begin(), unit_bytes.end());
  std::uint64_t needed = 0;
  const bool wraps = __builtin_add_overflow(largest, prefetch_bytes, &needed) ||
                     __builtin_add_overflow(needed, working_set_bytes, &needed);
  if (!wraps && needed <= device_budget_bytes) return;
  throw out_of_memory("tierflow: parameters fetched from the host or NVMe need at least " +
                      (wraps ? std::string("2^64") : std::to_string(needed)) + " bytes of device memory (" +
                      format_bytes(largest) + " for the largest unit's parameters, " + format_bytes(prefetch_bytes) +
                      " for the parameter prefetch window, " + format_bytes(working_set_bytes) +
                      " for the working set) and the device budget (TIERFLOW_GPU_MEMORY) is " +
                      std::to_string(device_budget_bytes) + " bytes (" + format_bytes(device_budget_bytes) + ")");
}

}  // namespace tierflow::tiering
