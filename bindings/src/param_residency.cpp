// See Note [Parameter storage] in param_residency.hpp.
#include "tierflow/bindings/param_residency.hpp"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <utility>

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::bindings {
namespace {

tiering::ParamId param_id(const at::Tensor& p) {
  return static_cast<tiering::ParamId>(reinterpret_cast<std::uintptr_t>(p.unsafeGetTensorImpl()));
}

// The storage's memory goes; the storage object (and every view of it) stays.
void drop_memory(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// New memory of the device's allocator (CUDA: on the current stream) for the same storage object.
void give_memory(const at::Tensor& t, std::size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  c10::OptionalDeviceGuard guard(t.device());
  s->set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(nbytes));
  s->set_nbytes(nbytes);
}

// Why `p` cannot live on the host between uses, or "".
std::string cannot_offload(const Runtime& rt, const at::Tensor& p) {
  if (!p.defined() || !p.is_leaf()) return "is not a leaf tensor";
  if (!rt.on_device(p)) return "is not on the runtime's device (" + p.device().str() + ")";
  if (!p.has_storage() || !p.is_contiguous() || p.storage_offset() != 0 || p.storage().nbytes() != p.nbytes())
    return "is not a contiguous tensor with a storage of its own (a view of a flat buffer?)";
  return "";
}

}  // namespace

struct ParamResidency::Param {
  at::Tensor param;   // the model's parameter
  at::Tensor device;  // a tensor over the parameter's storage: what fetches fill and releases empty
  at::Tensor host;    // its pinned host copy
  swap::TransferHandle fetch;
};

ParamResidency::ParamResidency(std::shared_ptr<Runtime> runtime, const std::vector<std::vector<at::Tensor>>& units,
                               const std::vector<Tier>& residences, const std::vector<std::string>& names)
    : runtime_(std::move(runtime)) {
  TIERFLOW_EXPECTS(!units.empty() && units.size() == residences.size(),
                   "ParamResidency: one residence per unit, the rest unit last");
  std::vector<tiering::ParamUnit> plan(units.size());
  std::unordered_map<const void*, std::pair<tiering::ParamId, std::string>> storages;  // StorageImpl -> its parameter
  std::uint64_t largest = 0;
  std::size_t index = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (residences[u] != Tier::kGpu && residences[u] != Tier::kHost)
      throw config_error(std::string("offload_params: tier '") + std::string(to_string(residences[u])) +
                         "' for parameters; accepted: host (the NVMe tier for parameters is not available yet)");
    plan[u].residence = residences[u];
    std::uint64_t bytes = 0;
    for (const at::Tensor& p : units[u]) {
      const std::string name = index < names.size() ? names[index] : "#" + std::to_string(index);
      ++index;
      if (std::string why = cannot_offload(*runtime_, p); !why.empty() && residences[u] != Tier::kGpu)
        throw config_error("offload_params: parameter '" + name + "' " + why +
                           "; parameters offloaded to the host must be contiguous leaf tensors of the model's "
                           "device, each with its own storage");
      if (residences[u] != Tier::kGpu) {
        auto [it, added] = storages.emplace(p.storage().unsafeGetStorageImpl(), std::make_pair(param_id(p), name));
        if (!added && it->second.first != param_id(p))
          throw config_error("offload_params: parameters '" + it->second.second + "' and '" + name +
                             "' share one storage; parameters offloaded to the host must each have their own");
      }
      plan[u].params.push_back({param_id(p), p.nbytes()});
      bytes += p.nbytes();
    }
    if (residences[u] != Tier::kGpu) largest = std::max(largest, bytes);
  }
  std::vector<std::uint64_t> fetched;
  for (const auto& u : plan) {
    if (u.residence == Tier::kGpu) continue;
    fetched.push_back(0);
    for (const auto& r : u.params) fetched.back() += r.bytes;
  }
  // A budget below the largest unit and the window is refused before anything moves (the working set is
  // the activation planner's to count: Budgets::params).
  tiering::check_param_budget(runtime_->tiers().device_budget_bytes(), fetched, largest, 0);
  tiering::ParamScheduleOptions o;
  o.prefetch_bytes = largest;  // one unit ahead (Note [Parameter residency])
  auto schedule = std::make_unique<tiering::ParamSchedule>(plan, o);
  // The host copies, in full, before any device memory goes.
  std::unordered_map<tiering::ParamId, Param> copies;
  std::vector<swap::TransferHandle> copying;
  for (const auto& unit : units) {
    for (const at::Tensor& p : unit) {
      const tiering::ParamId id = param_id(p);
      if (copies.count(id) || schedule->home(id) == Tier::kGpu) continue;
      Param c{p, p.detach(), runtime_->host_empty(p.sizes(), p.scalar_type(), false), {}};
      copying.push_back(runtime_->copy_to_host(c.host, c.device));
      copies.emplace(id, std::move(c));
    }
  }
  for (const auto& h : copying) h.wait();
  for (auto& [id, c] : copies) drop_memory(c.device);
  params_ = std::move(copies);
  schedule_ = std::move(schedule);
}

ParamResidency::~ParamResidency() {
  // A fetch still in flight must not land in memory freed with the storage.
  for (auto& [id, p] : params_) {
    try {
      p.fetch.wait();
    } catch (...) {
    }
  }
}

void ParamResidency::release(Param& p) {
  p.fetch.wait();  // rule 1
  p.fetch = swap::TransferHandle();
  drop_memory(p.device);
}

void ParamResidency::fetch(Param& p) {
  give_memory(p.device, p.host.nbytes());
  p.fetch = runtime_->fetch_to_device(p.device, p.host);  // rule 2
}

void ParamResidency::carry_out(const tiering::ParamActions& a) {
  for (tiering::ParamId id : a.release) release(params_.at(id));
  for (const auto* ids : {&a.fetch, &a.prefetch})
    for (tiering::ParamId id : *ids) fetch(params_.at(id));
  for (tiering::ParamId id : a.wait) {  // rule 3
    Param& p = params_.at(id);
    runtime_->await_on_device(p.fetch, p.device.device());
    schedule_->arrived(id);
  }
}

void ParamResidency::use(std::size_t unit, Use what) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIERFLOW_EXPECTS(unit < schedule_->units(), "ParamResidency: unit " + std::to_string(unit) + " of " +
                                                  std::to_string(schedule_->units()));
  if (on_host_) {  // a step that raised before its post-hook: the parameters point back at their storage
    for (auto& [id, p] : params_) p.param.set_data(p.device);
    on_host_ = false;
  }
  switch (what) {
    case Use::kBeginForward: carry_out(schedule_->begin_forward(unit)); break;
    case Use::kEndForward: carry_out(schedule_->end_forward(unit)); break;
    case Use::kBeginBackward: carry_out(schedule_->begin_backward(unit)); break;
    case Use::kEndBackward: carry_out(schedule_->end_backward(unit)); break;
    case Use::kEndPhase: carry_out(schedule_->end_phase()); break;
  }
}

void ParamResidency::begin_forward(std::size_t unit) { use(unit, Use::kBeginForward); }
void ParamResidency::end_forward(std::size_t unit) { use(unit, Use::kEndForward); }
void ParamResidency::begin_backward(std::size_t unit) { use(unit, Use::kBeginBackward); }
void ParamResidency::end_backward(std::size_t unit) { use(unit, Use::kEndBackward); }
void ParamResidency::end_phase() { use(0, Use::kEndPhase); }

at::Tensor ParamResidency::host_copy(const at::Tensor& p) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(param_id(p));
  return it == params_.end() ? at::Tensor() : it->second.host;
}

void ParamResidency::point_at_host(bool on_host) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (on_host == on_host_) return;
  for (auto& [id, p] : params_) {
    TIERFLOW_EXPECTS(!on_host || schedule_->state(id) != tiering::ParamState::kInFlight,
                     "ParamResidency::point_at_host: a parameter is being fetched");
    p.param.set_data(on_host ? p.host : p.device);
  }
  on_host_ = on_host;
}

void ParamResidency::materialize(const at::Tensor& t, bool fetch_it) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(param_id(t));
  if (it == params_.end()) return;
  Param& p = it->second;
  const bool held = schedule_->state(it->first) == tiering::ParamState::kOnDevice ||
                    schedule_->state(it->first) == tiering::ParamState::kInFlight;
  if (fetch_it) {
    if (held) {
      p.fetch.wait();
      return runtime_->await_on_device(p.fetch, p.device.device());
    }
    give_memory(p.device, p.host.nbytes());
    runtime_->copy_to_device(p.device, p.host).wait();
    return;
  }
  runtime_->copy_to_host(p.host, p.device).wait();
  if (!held) drop_memory(p.device);
}

std::size_t ParamResidency::units() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_->units();
}

tiering::ParamScheduleStats ParamResidency::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_->stats();
}

}  // namespace tierflow::bindings
