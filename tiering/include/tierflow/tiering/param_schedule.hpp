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
// backward pair). Uses may overlap and nest (a use per call of a block: two
// forwards before one backward, a block whose input another block's
// backward still needs), and a unit may be used several times in a phase:
// each parameter counts the uses open on it. The schedule records the
// sequence of units each phase began and expects the next phase of that
// kind to repeat it (a backward: the recorded one when it followed a
// forward of the same uses, else the reverse of the forward it follows).
// Before any record it expects the blocks, in order (units
// 0..blocks-1; the other units, each a module outside the blocks, are
// fetched at their first use until a phase is recorded). A use that is not
// the expected one counts as an order miss and is served anyway; the
// caller may skip the events of a unit that fetches nothing.
//
// Fetch and release. A fetched parameter is fetched (state on tier or
// released -> in flight) at its first use in a phase, or ahead of it as a
// prefetch; the caller copies it and reports arrived (in flight -> on
// device) before the unit runs. At the end of a use, each of the unit's
// fetched parameters that no open use or hold needs, and the next expected
// use does not list, is released (on device -> released: the device copy is
// dropped; the host or NVMe copy is the parameter, which the CPU optimizer
// updates in place). So a parameter two units list (a tied embedding and
// head) is fetched for each use, not kept between them. A phase that
// begins with parameters of the previous phase still on the device (its
// order changed) releases them first; the caller ends a phase (end_phase)
// when backward ends, which releases every fetched parameter left that no
// hold keeps, those prefetched for a use that did not come included. A use
// that ends with a parameter still in flight (its wait failed) releases it
// all the same (the caller waits for the copy first), and fetch_failed puts
// back one the caller could not fetch, so an error in a step leaves the
// next step a schedule it can run. An illegal move throws std::logic_error
// naming the parameter and both states.
//
// Holds. hold(p) fetches a parameter for a read outside its units' uses
// (a weight read where no module of its own runs, tierflow.gathered) and
// keeps it on the device, through phase ends, until as many unhold(p);
// attach(u, p) makes p a member of unit u from now on (a weight a block
// reads that belongs to another module: fetched with the block's uses).
//
// Budget. device_budget_bytes (TIERFLOW_GPU_MEMORY) bounds the fetched
// parameters' device bytes, always: a prefetch that does not fit is not
// started, a fetch a use or hold needs first releases prefetched
// parameters no open use needs, and one that still does not fit throws
// tierflow::out_of_memory before anything changes, naming the unit, the
// open uses and holds, and the budget. So the device peak of parameter
// bytes never exceeds the budget.
//
// Prefetch window. After each event the schedule walks the expected uses
// after the current one, in order, and starts fetching their parameters
// while the bytes fetched ahead (in flight or arrived, not yet needed) stay
// within prefetch_bytes and the budget; it stops at the first that does not
// fit, so the order is kept. The plan's window is
// Plan::param_prefetch_bytes (the largest fetched unit: one unit ahead).
//
// Residence changes. make_resident(units), between phases, makes units
// resident for the rest of the run (the plan of auto, made after two steps
// with every unit fetched): their parameters are copied to the device once
// and stay; a parameter another fetched unit lists becomes resident too.
//
// Counters: fetches and their bytes per link (host->device for every fetch;
// NVMe->host as well for a parameter on NVMe), prefetch hits (a fetched
// parameter on the device or in flight when its use begins), stalls (one not
// yet fetched) and the time the compute waited for fetches to land (the
// caller's waited_for: stall_ms), order misses, device parameter bytes (resident, in flight
// and on device) current and peak, and the bytes each tier holds.
#pragma once

#include <cstdint>
#include <string>
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
  std::string name;              ///< what errors call it (a block's or module's name); "unit <index>" when empty
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
  /// Non-empty: the use or hold did not fit the budget and did not begin (nothing fetched, nothing counted);
  /// the caller carries out `release` and raises tierflow::out_of_memory with this text.
  std::string refused;
};

/// Counters since creation.
struct ParamScheduleStats {
  std::uint64_t fetches = 0;                  ///< parameters fetched (each fetch of a parameter counts)
  std::uint64_t host_to_device_bytes = 0;     ///< bytes of every fetch
  std::uint64_t nvme_to_host_bytes = 0;       ///< bytes of fetches of parameters on NVMe
  std::uint64_t prefetch_hits = 0;            ///< fetched parameters on the device or in flight when needed
  std::uint64_t stalls = 0;                   ///< fetched parameters not yet fetched when needed
  std::uint64_t stall_ns = 0;                 ///< time the compute waited for fetches to land (waited_for)
  std::uint64_t order_misses = 0;             ///< uses that were not the expected one
  std::uint64_t releases = 0;                 ///< device copies dropped
  std::uint64_t device_bytes = 0;             ///< parameters on the device now (resident, in flight, fetched),
                                              ///< and the open uses' extra bytes (autocast's casts)
  std::uint64_t device_peak_bytes = 0;        ///< the most device_bytes has been
  std::uint64_t host_bytes = 0, nvme_bytes = 0;  ///< fetched parameters each tier holds
};

/// The exported fields of ParamScheduleStats (Note [Stat fields]): tierflow.report()["params"].
const std::vector<StatField<ParamScheduleStats>>& param_schedule_stat_fields();

/// Settings of a ParamSchedule.
struct ParamScheduleOptions {
  std::uint64_t prefetch_bytes = 0;  ///< bytes fetched ahead of their use (Plan::param_prefetch_bytes)
  std::uint64_t device_budget_bytes = 0;  ///< the most parameter bytes on the device at once; 0: no bound
  std::size_t blocks = static_cast<std::size_t>(-1);  ///< units 0..blocks-1 are the blocks; default: all but the last
};

/// The fetches and releases of parameters (Note [Parameter residency]). Not thread-safe: called from the
/// thread that runs the module hooks.
class ParamSchedule {
 public:
  /// `units`: the blocks' then the rest unit's (at least one unit). Throws logic_error for no unit or a
  /// parameter listed with two different sizes.
  ParamSchedule(std::vector<ParamUnit> units, ParamScheduleOptions options);

  /// A forward use of `unit` begins. `extra_bytes`: device memory the use makes beside its parameters and
  /// that goes with it (autocast's 16-bit casts of its fp32 weights), counted in device_bytes and the budget
  /// until the end of the use, which passes the same figure.
  ParamActions begin_forward(UnitId unit, std::uint64_t extra_bytes = 0);
  /// It ended: releases its parameters not used again in this forward, and tops up the prefetch.
  ParamActions end_forward(UnitId unit, std::uint64_t extra_bytes = 0);
  /// A backward use of `unit` begins.
  ParamActions begin_backward(UnitId unit, std::uint64_t extra_bytes = 0);
  /// It ended.
  ParamActions end_backward(UnitId unit, std::uint64_t extra_bytes = 0);
  /// The phase in progress ended (the end of a backward, or of a forward no backward follows): every fetched
  /// parameter still on the device, or in flight (the caller waits for its copy first), is released, and the
  /// phase's order is recorded. Nothing when no phase is in progress.
  ParamActions end_phase();
  /// A read of `id` outside its units' uses: fetched (a stall) unless on the device already, and kept there
  /// until as many unhold. Throws out_of_memory (nothing changed) where the budget has no room.
  ParamActions hold(ParamId id);
  /// One hold of `id` ends: released when nothing else needs it. logic_error when it is not held.
  ParamActions unhold(ParamId id);
  /// `id` belongs to `unit` from now on (a parameter the unit's module reads that another module owns);
  /// fetched now when the unit's use is open. Nothing when it is listed already.
  ParamActions attach(UnitId unit, ParamId id);
  /// Whether `id` is on the device or in flight (a read of it now finds it there).
  bool on_device(ParamId id) const;
  /// A fetch the caller started has landed on the device (in flight -> on device).
  void arrived(ParamId id);
  /// The caller's compute waited `ns` for fetches to land (counted in stall_ns; Note [Step stats]).
  void waited_for(std::uint64_t ns) noexcept { stats_.stall_ns += ns; }
  /// A fetch the caller could not start or finish (out of memory, an NVMe read error): in flight ->
  /// released, so the next use fetches it again.
  void fetch_failed(ParamId id);
  /// Makes `units` resident from now on (a plan of TIERFLOW_OFFLOAD_PARAMS=auto): returns the parameters the
  /// caller keeps on the device from now on, copying there those not there yet (a held one is: its holds end).
  /// Between phases only (logic_error otherwise, or for an unknown unit).
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
    std::uint32_t open = 0;   // open uses of units listing it
    std::uint32_t holds = 0;  // hold() not yet undone
  };
  std::vector<UnitId> default_forward() const;
  ParamActions begin(UnitId unit, bool backward, std::uint64_t extra_bytes);
  ParamActions end(UnitId unit, std::uint64_t extra_bytes);
  void start_phase(bool backward, ParamActions& out);
  void record_phase();
  void top_up(ParamActions& out);
  void fetch(Param& p, bool ahead);
  void move(Param& p, ParamState to);
  void release(Param& p, ParamActions& out);
  // Fetches param i now unless it is on the device or in flight (within the budget: false, out.refused set).
  bool need_now(std::size_t i, const std::string& what, ParamActions& out);
  bool needed(std::size_t param) const;
  bool next_uses(std::size_t param) const;
  void make_room(std::uint64_t bytes, const std::vector<std::size_t>& wanted, const std::string& what,
                 ParamActions& out);
  std::string unit_name(UnitId u) const;
  std::size_t index_of(ParamId id) const;
  Param& param(ParamId id);
  const Param& param(ParamId id) const;

  std::vector<std::vector<std::size_t>> units_;  // per unit: indices into params_
  std::vector<std::string> names_;               // per unit
  std::vector<std::uint32_t> unit_open_;         // per unit: its open uses
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
  std::uint64_t extra_bytes_ = 0;  // the open uses' extra bytes
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
