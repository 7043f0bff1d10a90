// See Note [Parameter moves] in param_mover.hpp.
#include "tierflow/tiering/param_mover.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/swap/transfer_handle.hpp"
#include "tierflow/tiering/param_residency_plan.hpp"

namespace tierflow::tiering {

std::string released_param_error(const std::string& name, bool nvme) {
  return "tierflow: parameter '" + name + "' lives on the " + (nvme ? "NVMe tier" : "host") +
         " between its uses (TIERFLOW_OFFLOAD_PARAMS, keyword offload_params) and its values were read or written "
         "where no use of it is open: after or between steps, or by code outside the modules that hold it. Read it "
         "inside `with tierflow.gathered(model):` (or a submodule holding it), copy it with model.state_dict(), or "
         "call tierflow.unwrap(model) first (model.to()/.half() included)";
}

namespace {

// param_wait_total's totals by runtime.
std::mutex g_wait_mutex;
std::unordered_map<const void*, std::uint64_t>& wait_totals() {
  static auto* totals = new std::unordered_map<const void*, std::uint64_t>;  // never destroyed (exit order)
  return *totals;
}

void add_param_wait(const void* runtime, std::uint64_t ns) noexcept {
  std::lock_guard<std::mutex> lock(g_wait_mutex);
  try {
    wait_totals()[runtime] += ns;
  } catch (...) {  // out of memory for the entry: the figure misses this wait
  }
}

// Each unit's parameters as the schedule sees them, after checking that each fetched one can be offloaded.
std::vector<ParamUnit> plan_units(const std::vector<std::vector<ParamSpec>>& units, const std::vector<Tier>& residences,
                                  const std::vector<std::string>& unit_names, bool has_nvme) {
  TIERFLOW_EXPECTS(!units.empty() && units.size() == residences.size(),
                   "ParamResidency: one residence per unit, the rest unit last");
  std::vector<ParamUnit> plan(units.size());
  ParamStorages storages;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const Tier tier = residences[u];
    if (tier == Tier::kNvme && !has_nvme)
      throw config_error("offload_params: the NVMe tier for parameters needs TIERFLOW_NVME_PATHS");
    plan[u].residence = tier;
    if (u < unit_names.size()) plan[u].name = unit_names[u];
    for (const ParamSpec& p : units[u]) {
      plan[u].params.push_back({p.id, p.bytes});
      if (tier == Tier::kGpu) continue;
      if (!p.cannot_offload.empty())
        throw config_error("offload_params: parameter '" + p.name + "' " + p.cannot_offload +
                           "; parameters offloaded to the " + std::string(to_string(tier)) + " must be contiguous "
                           "leaf tensors of the model's device, each with its own storage");
      storages.add(p.storage, p.id, p.name);
    }
  }
  return plan;
}

// A read that has landed: the fetch of an unwritten parameter copies from the staging that holds its value.
struct Landed final : swap::detail::TransferState {
  explicit Landed(std::size_t bytes) : bytes_(bytes) {}
  bool ready() const override { return true; }
  void wait() const override {}
  std::size_t bytes() const noexcept override { return bytes_; }
  std::size_t bytes_;
};

// What a failed write of a parameter's values says after the engine's words (`what`: which values).
std::string unwritten_error(const io_error& e, const std::string& name, const std::string& what) {
  return std::string(e.what()) + "; parameter '" + name + "': " + what + " were not written to NVMe; they are kept "
         "in host memory (its staging), read from there, and will be written at its next write";
}

}  // namespace

std::uint64_t param_wait_total(const void* runtime) noexcept {
  std::lock_guard<std::mutex> lock(g_wait_mutex);
  const auto it = wait_totals().find(runtime);
  return it == wait_totals().end() ? 0 : it->second;
}

ParamMover::ParamMover(const std::vector<std::vector<ParamSpec>>& units, const std::vector<Tier>& residences,
                       std::size_t blocks, const std::vector<std::string>& unit_names,
                       std::uint64_t device_budget_bytes, std::shared_ptr<swap::NvmeEngine> nvme, ParamMoverHost& host,
                       const void* runtime)
    : host_(host), nvme_(std::move(nvme)), runtime_(runtime) {
  const std::vector<ParamUnit> plan = plan_units(units, residences, unit_names, nvme_ != nullptr);
  schedule_ = std::make_unique<ParamSchedule>(plan, param_residency_options(plan, device_budget_bytes, blocks));
  std::vector<ParamId> order;  // the fetched parameters, each once
  std::uint64_t nvme_bytes = 0;
  for (const auto& unit : units) {
    for (const ParamSpec& p : unit) {
      const Tier home = schedule_->home(p.id);
      if (params_.count(p.id) || home == Tier::kGpu) continue;
      Record r;
      r.name = p.name;
      r.bytes = p.bytes;
      r.nvme = home == Tier::kNvme;
      if (r.nvme) nvme_bytes += p.bytes;
      params_.emplace(p.id, std::move(r));
      order.push_back(p.id);
    }
  }
  // NVMe space is checked before the first write; then every copy is made before any device memory goes.
  if (nvme_bytes > 0) check_param_nvme_space(nvme_bytes, nvme_->available_bytes());
  make_copies(order);
}

void ParamMover::make_copies(std::vector<ParamId>& order) {
  for (ParamId id : order) host_.make_host_copy(id);
  std::vector<swap::TransferHandle> copying;
  for (ParamId id : order) copying.push_back(host_.copy_to_host_copy(id));
  for (const auto& h : copying) h.wait();
  try {
    for (ParamId id : order) {
      Record& r = record(id);
      if (!r.nvme) continue;
      r.block = nvme_->allocate(r.bytes);
      nvme_->write(r.block, host_.host_copy(id), r.bytes).wait();
      host_.free_host_copy(id);  // on NVMe only from now on
    }
  } catch (...) {
    for (auto& [id, r] : params_)
      if (r.nvme && r.block) nvme_->release(r.block);
    throw;
  }
  for (ParamId id : order) drop(id, record(id));
}

ParamMover::~ParamMover() {
  // A fetch still in flight must not land in memory freed with the storage, nor read freed staging. One that
  // stalled (Note [Stall timeout]; waited for within the limit from its start) keeps both for good, and its
  // NVMe block.
  for (auto& [id, r] : params_) {
    try {
      r.fetch.wait();
    } catch (const stall_error&) {
      keep_stalled(id, r);
      continue;
    } catch (...) {
    }
    if (r.unwritten) unstage(id, r);  // its value goes with the mover
    if (r.nvme) nvme_->release(r.block);
  }
}

void ParamMover::keep_stalled(ParamId id, Record& r) noexcept {
  host_.keep_stalled(id, released_param_error(r.name, r.nvme), r.name);
  r.staging = nullptr;
  r.unwritten = false;  // (its block reads as it was last written, or as failed)
}

void* ParamMover::stage(ParamId id, Record& r) {
  r.staging = host_.stage(id);
  return r.staging;
}

void ParamMover::unstage(ParamId id, Record& r) noexcept {
  if (r.staging == nullptr) return;
  host_.unstage(id);
  r.staging = nullptr;
}

void ParamMover::let_go(ParamId id, Record& r) noexcept {
  if (!r.unwritten) unstage(id, r);
}

void ParamMover::keep_unwritten(ParamId id, Record& r, const void* value) noexcept {
  try {
    if (r.staging == nullptr) stage(id, r);
  } catch (...) {  // no pinned memory to keep it in: its block reads as failed until written again
    return;
  }
  if (value != r.staging) std::memcpy(r.staging, value, r.bytes);
  r.unwritten = true;
}

void ParamMover::written(ParamId id, Record& r) noexcept {
  r.unwritten = false;
  // A use or hold (whose release lets it go), or the step pointed at it (pointing back does), keeps it.
  const ParamState state = schedule_->state(id);
  if (!on_host_ && state != ParamState::kOnDevice && state != ParamState::kInFlight) unstage(id, r);
}

void ParamMover::release(ParamId id, Record& r) {
  try {
    r.fetch.wait();  // rule 1
  } catch (const stall_error&) {
    // Note [Stall timeout]: the fetch may still write the device memory and read the staging: both kept for
    // good (the parameter reads as released), and the stall is raised.
    keep_stalled(id, r);
    throw;
  } catch (...) {
    // A failed fetch has ended; its error reached the use that waited for it (carry_out), not the release.
  }
  r.fetch = swap::TransferHandle();
  if (r.nvme) let_go(id, r);  // an unwritten one's staging holds its value
  drop(id, r);
}

void ParamMover::drop(ParamId id, Record& r) {
  host_.drop(id, r.why.empty() ? released_param_error(r.name, r.nvme) : r.why);
  r.why.clear();
}

void ParamMover::fetch(ParamId id, Record& r) {
  if (!r.nvme) {
    r.fetch = host_.fetch(id, swap::TransferHandle());  // rule 2
    return;
  }
  if (r.unwritten) {  // its staging holds its value: no read
    r.fetch = host_.fetch(id, swap::TransferHandle(std::make_shared<Landed>(r.bytes)));
    return;
  }
  // NVMe -> pinned staging -> device: the copy to the device follows the read (a dependency of the copy
  // engine), after the compute stream's queued work (rule 2). The staging stays until the fetch is released,
  // which waits for the copy first (rule 1).
  void* staging = stage(id, r);
  const swap::TransferHandle read = nvme_->read(r.block, staging, r.bytes);
  try {
    r.fetch = host_.fetch(id, read);
  } catch (...) {  // the read must not land in staging that goes
    try {
      read.wait();
    } catch (...) {
    }
    throw;
  }
}

void ParamMover::upload_home(ParamId id, Record& r) {
  if (!r.nvme) return host_.upload(id, ParamView::kHostCopy);
  if (r.unwritten) return host_.upload(id, ParamView::kStaging);  // its staging holds its value
  void* staging = stage(id, r);
  nvme_->read(r.block, staging, r.bytes).wait();
  host_.upload(id, ParamView::kStaging);
  unstage(id, r);
}

void ParamMover::write_home(ParamId id, Record& r, const void* value) {
  if (!r.nvme) {
    void* copy = host_.host_copy(id);
    if (copy != value) std::memcpy(copy, value, r.bytes);
    return;
  }
  nvme_->write(r.block, value, r.bytes).wait();
}

void ParamMover::write_device_home(ParamId id, Record& r, bool* kept) {
  void* value = r.unwritten ? r.staging : stage(id, r);  // (the device's values are the newer)
  try {
    host_.download(id);
    try {
      write_home(id, r, value);
    } catch (const io_error& e) {  // the engine's words, named; the values stay in the staging (unwritten)
      keep_unwritten(id, r, value);
      if (kept) *kept = r.unwritten;
      throw io_error(e.error_number(), unwritten_error(e, r.name, "its values on the device"));
    }
  } catch (const stall_error&) {  // Note [Stall timeout]: the write may still read the staging: kept for good
    keep_stalled(id, r);
    throw;
  } catch (...) {
    let_go(id, r);
    throw;
  }
  r.unwritten = false;
  unstage(id, r);
}

void ParamMover::carry_out(const ParamActions& a) {
  for (ParamId id : a.release) release(id, record(id));
  if (!a.refused.empty()) throw out_of_memory(a.refused);
  std::vector<ParamId> started;
  try {
    for (const auto* ids : {&a.fetch, &a.prefetch}) {
      for (ParamId id : *ids) {
        fetch(id, record(id));
        started.push_back(id);
      }
    }
  } catch (...) {  // out of memory, a failed read: what did not start is fetched again at its next use
    for (const auto* ids : {&a.fetch, &a.prefetch}) {
      for (ParamId id : *ids) {
        if (std::find(started.begin(), started.end(), id) != started.end()) continue;
        drop(id, record(id));
        let_go(id, record(id));
        schedule_->fetch_failed(id);
      }
    }
    throw;
  }
  if (a.wait.empty()) return;
  const std::uint64_t t0 = now_ns();
  for (ParamId id : a.wait) {  // rule 3
    host_.await_on_device(id, record(id).fetch);
    schedule_->arrived(id);
  }
  const std::uint64_t waited = now_ns() - t0;
  schedule_->waited_for(waited);
  add_param_wait(runtime_, waited);
}

void ParamMover::carry_out_named(const ParamActions& a, ParamId id) {
  try {
    carry_out(a);
  } catch (const out_of_memory& e) {  // the schedule knows the parameter by its id; the user, by its name
    throw out_of_memory(name_parameter(e.what(), id, record(id).name));
  }
}

void ParamMover::use(UnitId unit, Use what, std::uint64_t extra) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(unit < schedule_->units(), "ParamResidency: unit " + std::to_string(unit) + " of " +
                                                  std::to_string(schedule_->units()));
  point_back_locked();
  switch (what) {
    case Use::kBeginForward: carry_out(schedule_->begin_forward(unit, extra)); break;
    case Use::kEndForward: carry_out(schedule_->end_forward(unit, extra)); break;
    case Use::kBeginBackward: carry_out(schedule_->begin_backward(unit, extra)); break;
    case Use::kEndBackward: carry_out(schedule_->end_backward(unit, extra)); break;
    case Use::kEndPhase: carry_out(schedule_->end_phase()); break;
  }
}

void ParamMover::begin_forward(UnitId unit, std::uint64_t extra) { use(unit, Use::kBeginForward, extra); }
void ParamMover::end_forward(UnitId unit, std::uint64_t extra) { use(unit, Use::kEndForward, extra); }
void ParamMover::begin_backward(UnitId unit, std::uint64_t extra) { use(unit, Use::kBeginBackward, extra); }
void ParamMover::end_backward(UnitId unit, std::uint64_t extra) { use(unit, Use::kEndBackward, extra); }
void ParamMover::end_phase() { use(0, Use::kEndPhase, 0); }

void ParamMover::point_back_locked() {
  if (!on_host_) return;  // a step that raised before its post-hook: the parameters point back at their storage
  for (auto& [id, r] : params_) host_.point(id, ParamView::kDevice);
  on_host_ = false;
}

void ParamMover::hold(ParamId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!params_.count(id)) return;
  point_back_locked();
  carry_out_named(schedule_->hold(id), id);
}

void ParamMover::unhold(ParamId id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(id);
  if (it == params_.end()) return;
  point_back_locked();  // as every event (a release unstages the staging a step that raised left pointed)
  it->second.why = why;
  try {
    carry_out(schedule_->unhold(id));
  } catch (...) {
    it->second.why.clear();
    throw;
  }
  it->second.why.clear();  // not released now (another use or hold has it)
}

void ParamMover::attach(UnitId unit, ParamId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!params_.count(id)) return;
  point_back_locked();
  carry_out_named(schedule_->attach(unit, id), id);
}

bool ParamMover::on_device(ParamId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return params_.count(id) > 0 && schedule_->on_device(id);
}

void ParamMover::gather(const std::vector<ParamId>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  point_back_locked();
  std::vector<ParamId> held;
  const auto none = [&] {  // all or none
    for (auto it = held.rbegin(); it != held.rend(); ++it) carry_out(schedule_->unhold(*it));
  };
  try {
    for (ParamId id : ids) {
      if (!params_.count(id) || std::find(held.begin(), held.end(), id) != held.end()) continue;
      carry_out_named(schedule_->hold(id), id);
      held.push_back(id);
    }
  } catch (const out_of_memory& e) {
    none();
    throw out_of_memory(std::string(e.what()) + "; tierflow.gathered: gather fewer modules at a time (one block, "
                        "say: `with tierflow.gathered(model.layers[i])` in a loop over the blocks), or raise "
                        "TIERFLOW_GPU_MEMORY (gpu_memory=)");
  } catch (...) {
    none();
    throw;
  }
}

void ParamMover::scatter(const std::vector<ParamId>& ids, bool write_back) {
  std::lock_guard<std::mutex> lock(mutex_);
  point_back_locked();  // as every event: its staging is the parameter's one (a step that raised left it pointed)
  std::vector<ParamId> held;  // each offloaded one once
  for (ParamId id : ids)
    if (params_.count(id) && std::find(held.begin(), held.end(), id) == held.end()) held.push_back(id);
  // Every value home first (one repeated by a retry writes the same device values again), then the unholds: a
  // staging out of memory or a copy that fails leaves every hold as it was. A failed NVMe write keeps its values
  // in its staging (unwritten) and goes on: every one is unheld, then the first such error is raised.
  std::exception_ptr unwritten;
  if (write_back) {
    for (ParamId id : held) {
      Record& r = record(id);
      r.fetch.wait();  // (its staging, if any, is read no more)
      bool kept = false;
      try {
        write_device_home(id, r, &kept);
      } catch (const io_error&) {
        if (!kept) throw;  // a failed copy, no memory to keep it in: nothing released
        if (!unwritten) unwritten = std::current_exception();
      }
    }
  }
  for (ParamId id : held) carry_out(schedule_->unhold(id));
  if (unwritten) std::rethrow_exception(unwritten);
}

std::vector<ParamId> ParamMover::make_resident(const std::vector<UnitId>& units) {
  std::lock_guard<std::mutex> lock(mutex_);
  point_back_locked();  // as every event: its staging is the parameter's one (a step that raised left it pointed)
  std::vector<ParamId> out;
  for (ParamId id : schedule_->make_resident(units)) {
    auto it = params_.find(id);
    Record& r = it->second;
    // A held one (a read outside its units' uses) has its values on the device already.
    if (!host_.has_memory(id)) upload_home(id, r);
    if (r.unwritten) unstage(id, r);  // its value is on the device now
    if (r.nvme) nvme_->release(r.block);
    out.push_back(id);
    params_.erase(it);
  }
  return out;
}

bool ParamMover::offloaded(ParamId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return params_.count(id) > 0;
}

bool ParamMover::on_nvme(ParamId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(id);
  return it != params_.end() && it->second.nvme;
}

void ParamMover::read_nvme(ParamId id, void* dst) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(id);
  TIERFLOW_EXPECTS(it != params_.end() && it->second.nvme, "ParamResidency::load: not a parameter on NVMe");
  const Record& r = it->second;
  if (r.unwritten) {  // its staging holds its value
    std::memcpy(dst, r.staging, r.bytes);
    return;
  }
  nvme_->read(r.block, dst, r.bytes).wait();
}

void ParamMover::store(ParamId id, const void* value) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(id);
  TIERFLOW_EXPECTS(it != params_.end(), "ParamResidency::store: not an offloaded parameter");
  Record& r = it->second;
  if (!r.nvme) return write_home(id, r, value);
  try {
    write_home(id, r, value);
  } catch (const io_error& e) {  // the engine's words, named; the value stays in the staging (unwritten)
    keep_unwritten(id, r, value);
    if (!r.unwritten)  // no pinned memory to keep them in: its block reads as failed until stored again
      throw io_error(e.error_number(), std::string(e.what()) + "; parameter '" + r.name + "': its new values were "
                     "not written to NVMe and no host memory was left to keep them: it has no value until its values "
                     "are stored again (model.load_state_dict)");
    throw io_error(e.error_number(), unwritten_error(e, r.name, "its new values"));
  }
  if (r.unwritten) written(id, r);
}

void ParamMover::point_at_host(bool on_host) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (on_host == on_host_) return;
  if (on_host) {
    point_at_host_locked();
  } else {
    point_at_device_locked();
  }
}

void ParamMover::point_at_host_locked() {
  for (const auto& [id, r] : params_)
    TIERFLOW_EXPECTS(schedule_->state(id) != ParamState::kInFlight,
                     "ParamResidency::point_at_host: a parameter is being fetched");
  std::vector<ParamId> pointed;
  pointed.reserve(params_.size());  // the rollback's bookkeeping (pointed and the one tried) cannot throw
  ParamId trying = 0;
  try {
    for (auto& [id, r] : params_) {
      trying = id;
      if (r.nvme && !r.unwritten) {  // a host buffer for the step, written back after it (an unwritten one's holds
                                      // its value already)
        void* staging = stage(id, r);
        try {
          nvme_->read(r.block, staging, r.bytes).wait();
        } catch (const stall_error&) {  // Note [Stall timeout]: the read may still land in it: kept for good
          keep_stalled(id, r);
          throw;
        } catch (const io_error& e) {  // the engine's words, named
          throw io_error(e.error_number(), std::string(e.what()) + "; parameter '" + r.name + "': its values were "
                         "not read from NVMe for the optimizer's step");
        }
      }
      host_.point(id, r.nvme ? ParamView::kStaging : ParamView::kHostCopy);
      pointed.push_back(id);
    }
  } catch (...) {  // all or none: a staging out of memory, a failed read; those pointed go back, stagings go (a
                   // stalled read's was kept above: its r.staging is null)
    for (ParamId id : pointed) host_.point(id, ParamView::kDevice);
    pointed.push_back(trying);
    for (ParamId id : pointed)
      if (record(id).nvme) let_go(id, record(id));
    throw;
  }
  on_host_ = true;
}

void ParamMover::point_at_device_locked() {
  // A write that failed goes on: every parameter is pointed back all the same; the failed one's staging stays as
  // its value (unwritten, written at its next write) and the first error goes on, naming its parameter. A write
  // that stalled (Note [Stall timeout]) may still read its staging: kept for good; no further write goes to the
  // hung disk (the rest are pointed back, their stagings go unless unwritten, their step values are lost), and the
  // stall is what is raised.
  std::exception_ptr first;
  bool stalled = false;
  for (auto& [id, r] : params_) {
    if (r.nvme && r.staging != nullptr && !stalled) {  // (none: an event pointed it back meanwhile)
      try {
        write_home(id, r, r.staging);
        r.unwritten = false;
      } catch (const io_error& e) {
        r.unwritten = true;  // its staging holds the step's values
        if (!first)
          first = std::make_exception_ptr(
              io_error(e.error_number(), unwritten_error(e, r.name, "its values from the optimizer's step")));
      } catch (const stall_error&) {  // over an earlier failure: the run must end
        first = std::current_exception();
        keep_stalled(id, r);
        stalled = true;
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    host_.point(id, ParamView::kDevice);
    if (r.nvme) let_go(id, r);
  }
  on_host_ = false;
  if (first) std::rethrow_exception(first);
}

void ParamMover::materialize(ParamId id, bool fetch_it) {
  std::lock_guard<std::mutex> lock(mutex_);
  point_back_locked();  // as every event: its staging is the parameter's one (a step that raised left it pointed)
  const auto it = params_.find(id);
  if (it == params_.end()) return;
  Record& r = it->second;
  const bool held = schedule_->state(id) == ParamState::kOnDevice || schedule_->state(id) == ParamState::kInFlight;
  if (fetch_it) {
    if (held) {
      r.fetch.wait();
      return host_.await_on_device(id, r.fetch);
    }
    return upload_home(id, r);
  }
  if (held) r.fetch.wait();  // the device copy is complete before it is read back
  bool kept = false;
  try {
    write_device_home(id, r, &kept);
  } catch (const io_error&) {
    if (!held && kept) drop(id, r);  // its values are kept in its staging
    throw;
  }
  if (!held) drop(id, r);
}

std::size_t ParamMover::units() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_->units();
}

ParamScheduleStats ParamMover::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_->stats();
}

}  // namespace tierflow::tiering
