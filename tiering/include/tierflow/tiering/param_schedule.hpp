// Where each unit's 16-bit parameters live between uses, and when they are
// fetched to the device and released. Torch-free: the torch side's module
// hooks call the events and carry out the lists they return.
//
// Note [Parameter residency]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Units. The repeated blocks are units 0..n-1 and everything outside them
// (embeddings, final norm, head) is one more unit, n (the rest unit). Each
// unit lists its parameters as (id, bytes); an id listed by several units
// (tied weights, a module used twice) is one parameter, fetched once.
//
// Residence. Each unit is resident (Tier::kGpu: on the device the whole
// step, never moved) or fetched from Tier::kHost (the pinned pool) or
// Tier::kNvme; the plan decides which (Note [Activation planner],
// Parameters: residences_from_plan). A parameter any resident unit lists is
// resident; otherwise it lives on the tier of the first fetched unit (by
// index) that lists it.
//
// Uses and order. A use is begin_forward(u) .. end_forward(u) (or the
// backward pair); a unit may be used several times in one phase (the rest
// unit: the embeddings first, the head last). The schedule records the
// sequence of units each phase began and expects the next phase of that
// kind to repeat it (a backward: the recorded one when it followed a
// forward of the same uses, else the reverse of the forward it follows).
// Before any record it expects: forward rest, 0..n-1, rest (the rest unit's
// uses only when it fetches a parameter). A use that is not the expected one
// counts as an order miss and is served anyway. Uses do not nest (the rest
// unit's embeddings use ends before block 0 begins); the caller may skip the
// events of a unit that fetches nothing.
//
// Fetch and release. A fetched parameter is fetched (state on tier or
// released -> in flight) at its first use in a phase, or ahead of it as a
// prefetch; the caller copies it and reports arrived (in flight -> on
// device) before the unit runs. At the end of a use, each of the unit's
// fetched parameters that the rest of the expected phase does not use again
// is released (on device -> released: the device copy is dropped; the host
// or NVMe copy is the parameter, which the CPU optimizer updates in place).
// So a shared parameter is fetched at its first use and released after its
// last use, once per phase. A phase that begins with parameters of the
// previous phase still on the device (its order changed) releases them
// first; the caller ends a phase (end_phase) when backward ends, which
// releases every fetched parameter left, those prefetched for a use that
// did not come included. A use that ends with a parameter still in flight
// (its wait failed) releases it all the same (the caller waits for the copy
// first), and fetch_failed puts back one the caller could not fetch, so an
// error in a step leaves the next step a schedule it can run. An illegal move throws std::logic_error naming the parameter and
// both states.
//
// Prefetch window. After each event the schedule walks the expected uses
// after the current one, in order, and starts fetching their parameters
// while the bytes fetched ahead (in flight or arrived, not yet needed) stay
// within prefetch_bytes; it stops at the first that does not fit, so the
// order is kept. The plan's window is Plan::param_prefetch_bytes (the
// largest fetched unit: one unit ahead).
//
// Residence changes. make_resident(units), between phases, makes units
// resident for the rest of the run (the plan of auto, made after two steps
// with every unit fetched): their parameters are copied to the device once
// and stay; a parameter another fetched unit lists becomes resident too.
//
// Counters: fetches and their bytes per link (host->device for every fetch;
// NVMe->host as well for a parameter on NVMe), prefetch hits (a fetched
// parameter on the device or in flight when its use begins), stalls (one not
// yet fetched), order misses, device parameter bytes (resident, in flight
// and on device) current and peak, and the bytes each tier holds.
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tierflow/core/stats.hpp"
#include "tierflow/core/tier.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// A parameter's id, chosen by the caller (unique per parameter tensor).
using ParamId = std::uint64_t;
/// A unit's index: 0..n-1 the repeated blocks, n the rest unit.
using UnitId = std::size_t;

/// One parameter of a unit.
struct ParamRef {
  ParamId id = 0;
  std::uint64_t bytes = 0;  ///< its 16-bit bytes on the device
};

/// A unit: its parameters and where they live between uses.
struct ParamUnit {
  Tier residence = Tier::kGpu;   ///< kGpu: resident; kHost or kNvme: fetched from there
  std::vector<ParamRef> params;
};

/// Where a parameter is (Note [Parameter residency]).
enum class ParamState : std::uint8_t { kOnTier, kInFlight, kOnDevice, kReleased };

/// What the caller does at an event, in this order: drop `release`, start copying `fetch` and `prefetch`
/// (host or NVMe -> device), then wait for `wait` (and report each arrived) before the unit runs.
struct ParamActions {
  std::vector<ParamId> release;   ///< drop their device copies
  std::vector<ParamId> fetch;     ///< needed now and not yet fetched (stalls)
  std::vector<ParamId> prefetch;  ///< for later uses, within the window
  std::vector<ParamId> wait;      ///< the unit's parameters not yet on the device (fetch and earlier prefetches)
};

/// Counters since creation.
struct ParamScheduleStats {
  std::uint64_t fetches = 0;                  ///< parameters fetched (each fetch of a parameter counts)
  std::uint64_t host_to_device_bytes = 0;     ///< bytes of every fetch
  std::uint64_t nvme_to_host_bytes = 0;       ///< bytes of fetches of parameters on NVMe
  std::uint64_t prefetch_hits = 0;            ///< fetched parameters on the device or in flight when needed
  std::uint64_t stalls = 0;                   ///< fetched parameters not yet fetched when needed
  std::uint64_t order_misses = 0;             ///< uses that were not the expected one
  std::uint64_t releases = 0;                 ///< device copies dropped
  std::uint64_t device_bytes = 0;             ///< parameters on the device now (resident, in flight, fetched)
  std::uint64_t device_peak_bytes = 0;        ///< the most device_bytes has been
  std::uint64_t host_bytes = 0, nvme_bytes = 0;  ///< fetched parameters each tier holds
};

/// The exported fields of ParamScheduleStats (Note [Stat fields]): tierflow.report()["params"].
const std::vector<StatField<ParamScheduleStats>>& param_schedule_stat_fields();

/// Settings of a ParamSchedule.
struct ParamScheduleOptions {
  std::uint64_t prefetch_bytes = 0;  ///< bytes fetched ahead of their use (Plan::param_prefetch_bytes)
};

/// The fetches and releases of parameters (Note [Parameter residency]). Not thread-safe: called from the
/// thread that runs the module hooks.
class ParamSchedule {
 public:
  /// `units`: the blocks' then the rest unit's (at least one unit). Throws logic_error for no unit or a
  /// parameter listed with two different sizes.
  ParamSchedule(std::vector<ParamUnit> units, ParamScheduleOptions options);

  /// A forward use of `unit` begins.
  ParamActions begin_forward(UnitId unit);
  /// It ended: releases its parameters not used again in this forward, and tops up the prefetch.
  ParamActions end_forward(UnitId unit);
  /// A backward use of `unit` begins.
  ParamActions begin_backward(UnitId unit);
  /// It ended.
  ParamActions end_backward(UnitId unit);
  /// The phase in progress ended (the end of a backward, or of a forward no backward follows): every fetched
  /// parameter still on the device, or in flight (the caller waits for its copy first), is released, and the
  /// phase's order is recorded. Nothing when no phase is in progress.
  ParamActions end_phase();
  /// A fetch the caller started has landed on the device (in flight -> on device).
  void arrived(ParamId id);
  /// A fetch the caller could not start or finish (out of memory, an NVMe read error): in flight ->
  /// released, so the next use fetches it again.
  void fetch_failed(ParamId id);
  /// Makes `units` resident from now on (a plan of TIERFLOW_OFFLOAD_PARAMS=auto): returns the parameters the
  /// caller copies to the device and keeps there (those not resident already). Between phases only
  /// (logic_error otherwise, or for an unknown unit).
  std::vector<ParamId> make_resident(const std::vector<UnitId>& units);

  /// The state of a parameter; logic_error for an unknown id.
  ParamState state(ParamId id) const;
  /// Where a parameter lives between uses (kGpu: resident).
  Tier home(ParamId id) const;
  /// The uses the current (or next) phase of each kind is expected to follow.
  const std::vector<UnitId>& expected_order() const noexcept { return expected_; }
  /// Counters.
  const ParamScheduleStats& stats() const noexcept { return stats_; }
  /// Number of units, the rest unit included.
  std::size_t units() const noexcept { return units_.size(); }

 private:
  struct Param {
    ParamId id = 0;
    std::uint64_t bytes = 0;
    Tier home = Tier::kGpu;
    ParamState state = ParamState::kOnTier;
    bool ahead = false;  // fetched for a later use, not yet needed (counted in the window)
  };
  std::vector<UnitId> default_forward() const;
  ParamActions begin(UnitId unit, bool backward);
  ParamActions end(UnitId unit);
  void start_phase(bool backward, ParamActions& out);
  void record_phase();
  void top_up(ParamActions& out);
  void fetch(Param& p, bool ahead);
  void move(Param& p, ParamState to);
  bool used_later(std::size_t param) const;
  Param& param(ParamId id);
  const Param& param(ParamId id) const;

  std::vector<std::vector<std::size_t>> units_;  // per unit: indices into params_
  std::vector<Param> params_;
  std::unordered_map<ParamId, std::size_t> index_;  // id -> index into params_
  ParamScheduleOptions options_;
  ParamScheduleStats stats_;
  bool in_phase_ = false, backward_ = false;
  std::vector<UnitId> expected_;                  // this phase's expected uses
  std::vector<UnitId> seen_;                      // this phase's uses so far
  std::vector<UnitId> recorded_forward_, recorded_backward_, last_forward_;
  std::vector<UnitId> backward_followed_;          // the forward recorded_backward_ followed
  std::size_t cursor_ = 0;                        // position of the current use in expected_
  std::uint64_t ahead_bytes_ = 0;
};

/// Name of a state: "on-tier", "in-flight", "on-device", "released".
std::string_view to_string(ParamState) noexcept;

/// Each unit's residence from a plan: its blocks' BlockPlan::params, then Plan::rest_params.
std::vector<Tier> residences_from_plan(const Plan& plan);

/// Refuses a device budget below what fetched parameters need at least: the largest unit's parameters,
/// the parameter prefetch window and the working set (a block's activations and workspace) together.
/// Throws tierflow::out_of_memory naming the bytes needed, each part and the budget.
void check_param_budget(std::uint64_t device_budget_bytes, const std::vector<std::uint64_t>& unit_bytes,
                        std::uint64_t prefetch_bytes, std::uint64_t working_set_bytes);

}  // namespace tierflow::tiering
