// Carrying out a ParamSchedule's actions on the parameters offloaded between uses, torch-free: each parameter's
// record (its name, its NVMe block, the fetch in flight, what a read of it raises once released), the order an
// event's actions run in, what an error midway leaves, holds and tierflow.gathered's all-or-none, the NVMe
// blocks' lifecycle, residence changes and the optimizer's view of the host copies. The torch side
// (bindings/src/param_residency.cpp, Note [Parameter storage]) implements ParamMoverHost on the parameters'
// storages: it gives and drops their device memory and copies between buffers; this class decides when.
//
// Note [Parameter moves]
// ~~~~~~~~~~~~~~~~~~~~~~
// Rules, in the order the events carry them out (ParamActions):
// 1. release: a parameter whose fetch is still in flight is waited for first
//    (the copy must not land in freed memory); then its memory goes. On
//    CUDA the caching allocator gives the block back to the compute stream,
//    after whose queued kernels any reuse on that stream runs; a fetch into
//    reused memory is queued after the compute stream's earlier work
//    (Runtime::fetch_to_device).
// 2. fetch and prefetch: new memory, then the copy host -> device on the copy
//    engine after the compute stream's queued work; the compute stream does
//    not wait yet.
// 3. wait: the compute stream waits for each copy the unit needs before the
//    unit's kernels (Runtime::await_on_device), then the schedule is told it
//    arrived.
// 4. The host copy is written only by the optimizer, in step(), when no fetch
//    of it is in flight: a step's last use (the rest unit's, when backward
//    ends) releases what is left, and the next forward's fetches come after
//    step() returns.
// NVMe: a parameter's only copy between uses is its NVMe block (written once
// at construction, then by store() after each step). A fetch reads it into a
// pinned staging buffer and the copy to the device depends on that read (the
// copy engine's dependency: the emulated engine waits for it on its worker,
// CUDA's on the caller's thread, so on CUDA an NVMe fetch blocks for its
// read); the staging stays until the fetch is released, which waits for the
// copy first (rule 1 for its source). NVMe space is checked before the first
// write. A fetch that fails (out of memory, a read error) is put back
// (ParamSchedule::fetch_failed) and the error goes to the caller. A fetch that
// stalled (Note [Stall timeout]) keeps its device memory and staging for good;
// so does any other request that stalls on a staging (pointing at the host or
// back, a write home): its stall_error goes to the caller, and the run should
// end.
// A write that fails (the engine's io_error, not a stall) loses nothing: the
// parameter's values stay in its staging, marked unwritten (the staging, not
// the block, holds its value), and the error names the parameter and says so.
// Until a write of it succeeds every reader reads the staging (a fetch copies
// from it with no read, pointing at the host points at it, read_nvme copies
// it, make_resident and materialize upload it) and no release lets it go;
// every writer (store, pointing back, a write home) writes it again, and on
// success the mark goes and the staging with it (at the release, when a use
// or hold has it). The mover's teardown lets an unwritten staging go.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/core/tier.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/transfer_handle.hpp"
#include "tierflow/tiering/param_schedule.hpp"

namespace tierflow::tiering {

/// One parameter of a unit as the torch side describes it before anything moves.
struct ParamSpec {
  ParamId id = 0;
  std::uint64_t bytes = 0;
  std::string name;                ///< its name in the model
  const void* storage = nullptr;   ///< the memory it owns (each offloaded parameter must own its own)
  std::string cannot_offload;      ///< why it cannot live off the device ("" when it can)
};

/// What a parameter's tensor points at (ParamMoverHost::point).
enum class ParamView : std::uint8_t { kDevice, kHostCopy, kStaging };

/// The torch side of ParamMover: the parameters' memory and copies, by id. Called under the mover's lock.
class ParamMoverHost {
 public:
  virtual ~ParamMoverHost() = default;
  /// The parameter's device memory goes (its tensor and storage stay); any access to its values raises `why`.
  virtual void drop(ParamId id, const std::string& why) = 0;
  /// Whether the parameter has device memory now.
  virtual bool has_memory(ParamId id) = 0;
  /// New device memory, and the copy into it started after the compute stream's queued work: from the host
  /// copy (`read` empty) or from the staging once `read` has landed there.
  virtual swap::TransferHandle fetch(ParamId id, const swap::TransferHandle& read) = 0;
  /// The compute stream waits for `fetch` before its next kernels.
  virtual void await_on_device(ParamId id, const swap::TransferHandle& fetch) = 0;
  /// A new pinned buffer of the parameter's bytes (its staging, replacing any), kept until unstage; its address.
  virtual void* stage(ParamId id) = 0;
  virtual void unstage(ParamId id) noexcept = 0;
  /// Note [Stall timeout]: the device memory (reading as `why` from now on) and the staging are kept for good
  /// (`name`: the parameter's, for the warning).
  virtual void keep_stalled(ParamId id, const std::string& why, const std::string& name) noexcept = 0;
  /// A pinned host copy for the parameter (uninitialised), then the copy device -> it started.
  virtual void make_host_copy(ParamId id) = 0;
  virtual swap::TransferHandle copy_to_host_copy(ParamId id) = 0;
  /// The host copy's address (nullptr: none); free_host_copy lets it go (the parameter lives on NVMe).
  virtual void* host_copy(ParamId id) = 0;
  virtual void free_host_copy(ParamId id) = 0;
  /// New device memory with the host copy's (or the staging's) values, waited for.
  virtual void upload(ParamId id, ParamView from) = 0;
  /// The device values into the staging (which must exist), waited for.
  virtual void download(ParamId id) = 0;
  /// The parameter's tensor points at `view` (a torch optimizer steps the host's values).
  virtual void point(ParamId id, ParamView view) = 0;
};

/// What a read of a released parameter raises (Note [Parameter storage]).
std::string released_param_error(const std::string& name, bool nvme);

/// The time compute waited for parameter fetches to land (ParamScheduleStats::stall_ns) under every ParamMover of
/// `runtime` (any key for it) so far, those gone included: a total that only grows (one entry per runtime that ever
/// waited; an address a later runtime reuses goes on from the total: only its differences are read).
std::uint64_t param_wait_total(const void* runtime) noexcept;

/// The parameters of units kept off the device between uses, moved as a ParamSchedule says (Note [Parameter
/// moves]). Thread-safe: forward events come from the Python thread, backward events from autograd's.
class ParamMover {
 public:
  /// `units[u]`: unit u's parameters (blocks first, the rest unit last); `residences[u]`: kGpu (stays), kHost or
  /// kNvme (`nvme` required: else config_error). Throws config_error naming a parameter that cannot be offloaded
  /// or two that share a storage, out_of_memory where the budget or NVMe's space falls short, before anything
  /// changes; then makes every fetched parameter's host copy (and NVMe block) and drops its device memory.
  /// `runtime`: whose param_wait_total its waits add to.
  ParamMover(const std::vector<std::vector<ParamSpec>>& units, const std::vector<Tier>& residences,
             std::size_t blocks, const std::vector<std::string>& unit_names, std::uint64_t device_budget_bytes,
             std::shared_ptr<swap::NvmeEngine> nvme, ParamMoverHost& host, const void* runtime = nullptr);
  /// Waits for fetches in flight (one that stalled keeps its memory for good) and releases the NVMe blocks.
  ~ParamMover();
  ParamMover(const ParamMover&) = delete;
  ParamMover& operator=(const ParamMover&) = delete;

  /// The schedule's events, carried out (ParamSchedule; `unit` checked). `extra_bytes`: what the use makes beside
  /// its parameters (autocast's casts). end_phase: the forward (no backward follows) or the backward ended:
  /// everything fetched is released but holds.
  void begin_forward(UnitId unit, std::uint64_t extra_bytes);
  void end_forward(UnitId unit, std::uint64_t extra_bytes);
  void begin_backward(UnitId unit, std::uint64_t extra_bytes);
  void end_backward(UnitId unit, std::uint64_t extra_bytes);
  void end_phase();
  /// ParamSchedule::hold (a read outside its units' uses: fetched now, waited for, and kept until as many unhold;
  /// out_of_memory, nothing changed, where the budget has no room), unhold (`why`: what a read raises if this
  /// releases it) and attach (a weight the unit's module reads that another module owns: fetched now when the
  /// unit's use is open); nothing for a parameter that is not offloaded. Errors name the parameter.
  void hold(ParamId id);
  void unhold(ParamId id, const std::string& why);
  void attach(UnitId unit, ParamId id);
  /// tierflow.gathered: holds every offloaded one of `ids` (all, or none: out_of_memory names the budget and says to
  /// gather fewer); scatter unholds each, after writing every one's device values to its home when `write_back`.
  /// A staging out of memory or a device-to-host copy that fails leaves every hold as it was and goes to the
  /// caller (a retry writes them all again). An NVMe write that fails keeps that parameter's values in its staging
  /// (unwritten, Note [Parameter moves]) and scatter goes on: every one is unheld, then the first such io_error is
  /// raised (the engine's, with its parameter named and its values said kept). A device-to-host copy or NVMe write
  /// that stalls (stall_error) keeps that parameter's staging and device memory for good (keep_stalled); the holds
  /// stay.
  void gather(const std::vector<ParamId>& ids);
  void scatter(const std::vector<ParamId>& ids, bool write_back);
  /// Makes `units` resident (TIERFLOW_OFFLOAD_PARAMS=auto's plan, between phases): their parameters' device
  /// values are made whole and their NVMe blocks go; they are offloaded no more (the host lets their tensors go,
  /// the optimizer steps them on the device). Returns them.
  std::vector<ParamId> make_resident(const std::vector<UnitId>& units);

  bool offloaded(ParamId id) const;
  /// Whether `id` is offloaded and on the device or in flight.
  bool on_device(ParamId id) const;
  /// Whether `id` lives on NVMe (false for one not offloaded).
  bool on_nvme(ParamId id) const;
  /// The NVMe block's value read into `dst` (its bytes), waited for (an unwritten one's: its staging copied). `id`
  /// must live on NVMe.
  void read_nvme(ParamId id, void* dst);
  /// `value` (its bytes) becomes the parameter's value between uses: into its host copy, or written to NVMe (a
  /// write that fails keeps it in the staging, unwritten, and raises the engine's io_error naming the parameter;
  /// with no pinned memory left for that staging the error says the values are lost, and the block reads as failed
  /// until a store succeeds).
  void store(ParamId id, const void* value);
  /// Every offloaded parameter points at its host copy (NVMe: the block read into its staging; an unwritten one's
  /// staging as it is) or back at its device storage (NVMe: the staging written back first, then let go). Pointing at the host is all or none:
  /// logic_error while a fetch is in flight, or a staging's out_of_memory or a read's io_error (the engine's, with
  /// its parameter named), leaves every parameter at its device storage with no staging, as before the call.
  /// Pointing back goes on past a write that fails: every parameter points at its device storage, the failed one's
  /// staging stays as its value (unwritten, written at its next write), every other staging goes, then the first
  /// error is raised naming its parameter and saying its values are kept. A stall (Note [Stall timeout]) is not undone
  /// either: a read that stalls while pointing at the host, or a write while pointing back, keeps its parameter's
  /// staging and device memory for good (keep_stalled: reads of it raise); pointing back then writes no more (the
  /// rest's step values are lost, their stagings go), every parameter points at its device storage and the
  /// stall_error is raised (over any earlier error).
  void point_at_host(bool on_host);
  /// Fetches `id` now and waits for it (`fetch`: a module's load_state_dict writes into it), or writes its device
  /// values home and drops them unless a use or hold has it on the device (an NVMe write's io_error names the
  /// parameter, its values kept in its staging (unwritten); a copy or write that stalls keeps its staging and
  /// device memory for good and raises stall_error).
  void materialize(ParamId id, bool fetch);

  std::size_t units() const;
  ParamScheduleStats stats() const;

 private:
  struct Record {
    std::string name;
    std::uint64_t bytes = 0;
    bool nvme = false;
    swap::NvmeBlock block = 0;
    std::string why;            // what a read raises when the release under way drops it, if not the usual
    swap::TransferHandle fetch;
    void* staging = nullptr;    // the host's staging (ParamMoverHost::stage) until unstaged
    bool unwritten = false;     // its last NVMe write failed: the staging, not the block, holds its value
  };
  enum class Use { kBeginForward, kEndForward, kBeginBackward, kEndBackward, kEndPhase };
  void use(UnitId unit, Use what, std::uint64_t extra_bytes);
  void make_copies(std::vector<ParamId>& order);
  void point_back_locked();
  void point_at_host_locked();
  void point_at_device_locked();
  void carry_out(const ParamActions& a);
  void carry_out_named(const ParamActions& a, ParamId id);
  void drop(ParamId id, Record& r);
  void release(ParamId id, Record& r);
  void fetch(ParamId id, Record& r);
  void keep_stalled(ParamId id, Record& r) noexcept;
  void* stage(ParamId id, Record& r);
  void unstage(ParamId id, Record& r) noexcept;
  void let_go(ParamId id, Record& r) noexcept;  // unstage, unless the staging holds its value (unwritten)
  void keep_unwritten(ParamId id, Record& r, const void* value) noexcept;  // after a failed write of `value`
  void written(ParamId id, Record& r) noexcept;  // after a write that succeeded: the mark cleared, staging let go
  void upload_home(ParamId id, Record& r);
  void write_home(ParamId id, Record& r, const void* value);
  void write_device_home(ParamId id, Record& r, bool* kept = nullptr);  // *kept: a failed write's values kept
  Record& record(ParamId id) { return params_.at(id); }

  ParamMoverHost& host_;
  std::shared_ptr<swap::NvmeEngine> nvme_;
  const void* runtime_;
  mutable std::mutex mutex_;
  std::unique_ptr<ParamSchedule> schedule_;
  std::unordered_map<ParamId, Record> params_;
  bool on_host_ = false;
};

}  // namespace tierflow::tiering
