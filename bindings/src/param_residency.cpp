// See Note [Parameter storage] in param_residency.hpp.
#include "tierflow/bindings/param_residency.hpp"

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/tiering/param_residency_plan.hpp"

namespace tierflow::bindings {
namespace {

// param_wait_ns's totals by runtime (one entry per runtime that ever waited; an address a later runtime reuses
// goes on from the total: only its differences are read).
std::mutex g_wait_mutex;
std::unordered_map<const Runtime*, std::uint64_t>& wait_totals() {
  static auto* totals = new std::unordered_map<const Runtime*, std::uint64_t>;  // never destroyed (exit order)
  return *totals;
}

void add_param_wait(const Runtime& rt, std::uint64_t ns) noexcept {
  std::lock_guard<std::mutex> lock(g_wait_mutex);
  try {
    wait_totals()[&rt] += ns;
  } catch (...) {  // out of memory for the entry: the figure misses this wait
  }
}

tiering::ParamId param_id(const at::Tensor& p) {
  return static_cast<tiering::ParamId>(reinterpret_cast<std::uintptr_t>(p.unsafeGetTensorImpl()));
}

// Clearing the access error that drop_memory set. torch 2.13 has StorageImpl::clear_data_ptr_access_error_msg_;
// torch 2.11 (a GPU image's) has no public way back from release_data_and_set_meta_custom_data_ptr_error_msg_,
// so there the flag it set and the refresh it needs are reached through pointers to members named by an explicit
// instantiation (the one place access checks allow it). The first build on an H200 (torch 2.11) failed on this.
template <typename S, typename = void>
struct HasClearAccessError : std::false_type {};
template <typename S>
struct HasClearAccessError<S, std::void_t<decltype(std::declval<S&>().clear_data_ptr_access_error_msg_())>>
    : std::true_type {};

struct ThrowFlag { using type = bool c10::StorageImpl::*; friend type member(ThrowFlag); };
struct RefreshCheck { using type = void (c10::StorageImpl::*)(); friend type member(RefreshCheck); };
template <typename Tag, typename Tag::type M>
struct NameMember { friend typename Tag::type member(Tag) { return M; } };
template struct NameMember<ThrowFlag, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct NameMember<RefreshCheck, &c10::StorageImpl::refresh_has_data_ptr_check>;

template <typename S>
void clear_access_error(S* s) {
  if constexpr (HasClearAccessError<S>::value) {
    s->clear_data_ptr_access_error_msg_();
  } else {
    s->*member(ThrowFlag{}) = false;
    (s->*member(RefreshCheck{}))();
  }
}

// The storage's memory goes; the storage object (and every view of it) stays, its size too, and any access to
// its data raises `why` (Note [Parameter storage]).
void drop_memory(const at::Tensor& t, const std::string& why) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->release_data_and_set_meta_custom_data_ptr_error_msg_(why);
}

// Note [Stall timeout]: a copy into (or out of) `t`'s memory stalled and may still write it: the memory leaves
// the storage (which reads like a released one, `why`) but is kept for good, never freed.
void keep_stalled_memory(const at::Tensor& t, const std::string& why, const std::string& what) noexcept {
  try {
    c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    const std::size_t bytes = s->nbytes();
    auto held = std::make_shared<at::DataPtr>(s->set_data_ptr(at::DataPtr(nullptr, t.device())));
    s->release_data_and_set_meta_custom_data_ptr_error_msg_(why);
    keep_forever(held, bytes, what);
  } catch (...) {  // nothing to hold it with: it stays in its storage, which is not freed either
  }
}

// New memory for the same storage object: on CUDA from the storage's allocator (the caching allocator, on
// the current stream); on the emulated device from torch's CPU allocator as installed now (the adversarial
// mode's poisoning one).
void give_memory(const at::Tensor& t, std::size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  c10::OptionalDeviceGuard guard(t.device());
  at::Allocator* a = t.is_cpu() || s->allocator() == nullptr ? c10::GetAllocator(t.device().type()) : s->allocator();
  s->set_data_ptr_noswap(a->allocate(nbytes));
  s->set_nbytes(nbytes);
  clear_access_error(s);
}

// What a read of a released parameter raises.
std::string released_error(const std::string& name, bool nvme) {
  return "tierflow: parameter '" + name + "' lives on the " + (nvme ? "NVMe tier" : "host") +
         " between its uses (TIERFLOW_OFFLOAD_PARAMS, keyword offload_params) and its values were read or written "
         "where no use of it is open: after or between steps, or by code outside the modules that hold it. Read it "
         "inside `with tierflow.gathered(model):` (or a submodule holding it), copy it with model.state_dict(), or "
         "call tierflow.unwrap(model) first (model.to()/.half() included)";
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

at::Tensor autocast_cached_cast(const at::Tensor& p, at::ScalarType dtype, const std::string& device_type) {
  return at::autocast::cached_cast(dtype, p, c10::Device(device_type).type());
}

void drop_cast(const at::Tensor& cast, const std::string& why) { drop_memory(cast, why); }

void refill_cast(const at::Tensor& cast, const at::Tensor& p) {
  give_memory(cast, cast.storage().nbytes());
  at::NoGradGuard no_grad;
  // A tensor of its own over the cast's storage: the copy does not move the cast's version.
  at::Tensor into = at::empty({0}, cast.options()).set_(cast.storage(), cast.storage_offset(), cast.sizes(),
                                                         cast.strides());
  into.copy_(p);
}

struct ParamResidency::Param {
  at::Tensor param;    // the model's parameter
  std::string name;    // its name in the model
  std::string why;     // what a read of it raises when the release under way drops it, if not the usual
  at::Tensor device;   // a tensor over the parameter's storage: what fetches fill and releases empty
  at::Tensor host;     // its pinned host copy (host tier; undefined on NVMe)
  bool nvme = false;   // on NVMe between uses: `block`
  swap::NvmeBlock block = 0;
  at::Tensor staging;  // NVMe: the pinned buffer a fetch reads into (kept until the fetch is released), or
                       // what the parameter points at during point_at_host
  swap::TransferHandle fetch;
};

namespace {

// Each unit's parameters as the schedule sees them, after checking that each fetched one can be offloaded.
std::vector<tiering::ParamUnit> plan_units(const Runtime& rt, const std::vector<std::vector<at::Tensor>>& units,
                                           const std::vector<Tier>& residences, const std::vector<std::string>& names,
                                           const std::vector<std::string>& unit_names) {
  TIERFLOW_EXPECTS(!units.empty() && units.size() == residences.size(),
                   "ParamResidency: one residence per unit, the rest unit last");
  std::vector<tiering::ParamUnit> plan(units.size());
  tiering::ParamStorages storages;  // by StorageImpl
  std::size_t index = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const Tier tier = residences[u];
    if (tier == Tier::kNvme && !rt.has_nvme())
      throw config_error("offload_params: the NVMe tier for parameters needs TIERFLOW_NVME_PATHS");
    plan[u].residence = tier;
    if (u < unit_names.size()) plan[u].name = unit_names[u];
    for (const at::Tensor& p : units[u]) {
      const std::string name = index < names.size() ? names[index] : "#" + std::to_string(index);
      ++index;
      plan[u].params.push_back({param_id(p), p.nbytes()});
      if (tier == Tier::kGpu) continue;
      if (std::string why = cannot_offload(rt, p); !why.empty())
        throw config_error("offload_params: parameter '" + name + "' " + why + "; parameters offloaded to the " +
                           std::string(to_string(tier)) + " must be contiguous leaf tensors of the model's device, "
                           "each with its own storage");
      storages.add(p.storage().unsafeGetStorageImpl(), param_id(p), name);
    }
  }
  return plan;
}

}  // namespace

ParamResidency::ParamResidency(std::shared_ptr<Runtime> runtime, const std::vector<std::vector<at::Tensor>>& units,
                               const std::vector<Tier>& residences, const std::vector<std::string>& names,
                               std::size_t blocks, const std::vector<std::string>& unit_names)
    : runtime_(std::move(runtime)) {
  const std::vector<tiering::ParamUnit> plan = plan_units(*runtime_, units, residences, names, unit_names);
  auto schedule = std::make_unique<tiering::ParamSchedule>(
      plan, tiering::param_residency_options(plan, runtime_->tiers().device_budget_bytes(), blocks));
  std::unordered_map<tiering::ParamId, Param> copies;
  std::uint64_t nvme_bytes = 0;
  std::size_t index = 0;
  for (const auto& unit : units) {
    for (const at::Tensor& p : unit) {
      const std::string name = index < names.size() ? names[index] : "#" + std::to_string(index);
      ++index;
      const tiering::ParamId id = param_id(p);
      const Tier home = schedule->home(id);
      if (copies.count(id) || home == Tier::kGpu) continue;
      Param c{p, name, {}, p.detach(), {}, home == Tier::kNvme, 0, {}, {}};
      if (c.nvme) nvme_bytes += p.nbytes();
      copies.emplace(id, std::move(c));
    }
  }
  // NVMe space is checked before the first write; then every copy is made before any device memory goes.
  if (nvme_bytes > 0) tiering::check_param_nvme_space(nvme_bytes, runtime_->nvme_engine()->available_bytes());
  for (auto& [id, c] : copies) c.host = runtime_->host_empty(c.device.sizes(), c.device.scalar_type(), false);
  std::vector<swap::TransferHandle> copying;
  for (auto& [id, c] : copies) copying.push_back(runtime_->copy_to_host(c.host, c.device));
  for (const auto& h : copying) h.wait();
  try {
    for (auto& [id, c] : copies) {
      if (!c.nvme) continue;
      c.block = runtime_->nvme_engine()->allocate(c.host.nbytes());
      runtime_->nvme_engine()->write(c.block, c.host.data_ptr(), c.host.nbytes()).wait();
      c.host = at::Tensor();  // on NVMe only from now on
    }
  } catch (...) {
    for (auto& [id, c] : copies)
      if (c.nvme && c.block) runtime_->nvme_engine()->release(c.block);
    throw;
  }
  for (auto& [id, c] : copies) drop(c);
  params_ = std::move(copies);
  schedule_ = std::move(schedule);
}

ParamResidency::~ParamResidency() {
  // A fetch still in flight must not land in memory freed with the storage, nor read freed staging. One that
  // stalled (Note [Stall timeout]; waited for within the limit from its start) keeps both for good, and its
  // NVMe block.
  for (auto& [id, p] : params_) {
    try {
      p.fetch.wait();
    } catch (const stall_error&) {
      keep_stalled_memory(p.device, released_error(p.name, p.nvme), "parameter '" + p.name + "' under a stalled fetch");
      if (p.staging.defined()) keep_forever(std::make_shared<at::Tensor>(p.staging), p.staging.nbytes(),
                                            "the staging of parameter '" + p.name + "'");
      continue;
    } catch (...) {
    }
    if (p.nvme) runtime_->nvme_engine()->release(p.block);
  }
}

void ParamResidency::release(Param& p) {
  try {
    p.fetch.wait();  // rule 1
  } catch (const stall_error&) {
    // Note [Stall timeout]: the fetch may still write the device memory and read the staging: both kept for
    // good (the parameter reads as released), and the stall is raised.
    keep_stalled_memory(p.device, released_error(p.name, p.nvme), "parameter '" + p.name + "' under a stalled fetch");
    if (p.staging.defined()) keep_forever(std::make_shared<at::Tensor>(p.staging), p.staging.nbytes(),
                                          "the staging of parameter '" + p.name + "'");
    p.staging = at::Tensor();
    throw;
  } catch (...) {
    // A failed fetch has ended; its error reached the use that waited for it (carry_out), not the release.
  }
  p.fetch = swap::TransferHandle();
  if (p.nvme) p.staging = at::Tensor();
  drop(p);
}

void ParamResidency::drop(Param& p) {
  drop_memory(p.device, p.why.empty() ? released_error(p.name, p.nvme) : p.why);
  p.why.clear();
}

void ParamResidency::fetch(Param& p) {
  give_memory(p.device, p.device.nbytes());
  if (!p.nvme) {
    p.fetch = runtime_->fetch_to_device(p.device, p.host);  // rule 2
    return;
  }
  // NVMe -> pinned staging -> device: the copy to the device follows the read (a dependency of the copy
  // engine), after the compute stream's queued work (rule 2). The emulated engine waits for the read on its
  // worker; CUDA's waits for it on the caller's thread (a host dependency), so on CUDA an NVMe fetch blocks
  // for its read.
  at::Tensor staging = runtime_->host_empty(p.device.sizes(), p.device.scalar_type(), false);
  const swap::TransferHandle read = runtime_->nvme_engine()->read(p.block, staging.data_ptr(), staging.nbytes());
  swap::CopyEngine& engine = *runtime_->copy_engine();
  p.fetch = engine.copy(swap::Direction::kHostToDevice, p.device.data_ptr(), staging.data_ptr(), p.device.nbytes(),
                        {read}, compute_stream_of(engine, p.device.device()));
  p.staging = std::move(staging);  // until the fetch is released, which waits for the copy first (rule 1)
}

at::Tensor ParamResidency::read_home(Param& p) {
  if (!p.nvme) return p.host;
  at::Tensor out = runtime_->host_empty(p.device.sizes(), p.device.scalar_type(), false);
  runtime_->nvme_engine()->read(p.block, out.data_ptr(), out.nbytes()).wait();
  return out;
}

void ParamResidency::write_home(Param& p, const at::Tensor& value) {
  TIERFLOW_EXPECTS(value.is_cpu() && value.is_contiguous() && value.nbytes() == p.device.nbytes() &&
                       value.scalar_type() == p.device.scalar_type(),
                   "ParamResidency: a parameter's new value must be a contiguous CPU tensor of its dtype and size");
  if (!p.nvme) {
    if (p.host.data_ptr() != value.data_ptr()) p.host.copy_(value.view(p.host.sizes()));
    return;
  }
  runtime_->nvme_engine()->write(p.block, value.data_ptr(), value.nbytes()).wait();
}

void ParamResidency::carry_out(const tiering::ParamActions& a) {
  for (tiering::ParamId id : a.release) release(params_.at(id));
  if (!a.refused.empty()) throw out_of_memory(a.refused);
  std::vector<tiering::ParamId> started;
  try {
    for (const auto* ids : {&a.fetch, &a.prefetch}) {
      for (tiering::ParamId id : *ids) {
        fetch(params_.at(id));
        started.push_back(id);
      }
    }
  } catch (...) {  // out of memory, a failed read: what did not start is fetched again at its next use
    for (const auto* ids : {&a.fetch, &a.prefetch}) {
      for (tiering::ParamId id : *ids) {
        if (std::find(started.begin(), started.end(), id) != started.end()) continue;
        drop(params_.at(id));
        params_.at(id).staging = at::Tensor();
        schedule_->fetch_failed(id);
      }
    }
    throw;
  }
  if (a.wait.empty()) return;
  const std::uint64_t t0 = now_ns();
  for (tiering::ParamId id : a.wait) {  // rule 3
    Param& p = params_.at(id);
    runtime_->await_on_device(p.fetch, p.device.device());
    schedule_->arrived(id);
  }
  waited_for(now_ns() - t0);
}

void ParamResidency::waited_for(std::uint64_t ns) noexcept {
  schedule_->waited_for(ns);
  add_param_wait(*runtime_, ns);
}

void ParamResidency::use(std::size_t unit, Use what, std::uint64_t extra) {
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

void ParamResidency::point_back_locked() {
  if (!on_host_) return;  // a step that raised before its post-hook: the parameters point back at their storage
  for (auto& [id, p] : params_) p.param.set_data(p.device);
  on_host_ = false;
}

void ParamResidency::carry_out_named(const tiering::ParamActions& a, tiering::ParamId id) {
  try {
    carry_out(a);
  } catch (const out_of_memory& e) {  // the schedule knows the parameter by its id; the user, by its name
    throw out_of_memory(tiering::name_parameter(e.what(), id, params_.at(id).name));
  }
}

void ParamResidency::hold(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!params_.count(param_id(p))) return;
  point_back_locked();
  carry_out_named(schedule_->hold(param_id(p)), param_id(p));
}

void ParamResidency::unhold(const at::Tensor& p, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(param_id(p));
  if (it == params_.end()) return;
  it->second.why = why;
  try {
    carry_out(schedule_->unhold(param_id(p)));
  } catch (...) {
    it->second.why.clear();
    throw;
  }
  it->second.why.clear();  // not released now (another use or hold has it)
}

void ParamResidency::attach(std::size_t unit, const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!params_.count(param_id(p))) return;
  point_back_locked();
  carry_out_named(schedule_->attach(unit, param_id(p)), param_id(p));
}

bool ParamResidency::on_device(const at::Tensor& p) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return params_.count(param_id(p)) > 0 && schedule_->on_device(param_id(p));
}

void ParamResidency::gather(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  point_back_locked();
  std::vector<tiering::ParamId> held;
  try {
    for (const at::Tensor& t : params) {
      const tiering::ParamId id = param_id(t);
      if (!params_.count(id) || std::find(held.begin(), held.end(), id) != held.end()) continue;
      carry_out_named(schedule_->hold(id), id);
      held.push_back(id);
    }
  } catch (...) {  // all or none
    for (auto it = held.rbegin(); it != held.rend(); ++it) carry_out(schedule_->unhold(*it));
    throw;
  }
}

void ParamResidency::scatter(const std::vector<at::Tensor>& params, bool write_back) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<tiering::ParamId> done;
  for (const at::Tensor& t : params) {
    const tiering::ParamId id = param_id(t);
    if (!params_.count(id) || std::find(done.begin(), done.end(), id) != done.end()) continue;
    done.push_back(id);
    Param& p = params_.at(id);
    if (write_back) {
      p.fetch.wait();
      at::Tensor value = runtime_->host_empty(p.device.sizes(), p.device.scalar_type(), false);
      runtime_->copy_to_host(value, p.device).wait();
      write_home(p, value);
    }
    carry_out(schedule_->unhold(id));
  }
}

void ParamResidency::begin_forward(std::size_t unit, std::uint64_t extra) { use(unit, Use::kBeginForward, extra); }
void ParamResidency::end_forward(std::size_t unit, std::uint64_t extra) { use(unit, Use::kEndForward, extra); }
void ParamResidency::begin_backward(std::size_t unit, std::uint64_t extra) { use(unit, Use::kBeginBackward, extra); }
void ParamResidency::end_backward(std::size_t unit, std::uint64_t extra) { use(unit, Use::kEndBackward, extra); }
void ParamResidency::end_phase() { use(0, Use::kEndPhase); }

std::vector<at::Tensor> ParamResidency::make_resident(const std::vector<std::size_t>& units) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> out;
  for (tiering::ParamId id : schedule_->make_resident(units)) {
    auto it = params_.find(id);
    Param& p = it->second;
    // A held one (a read outside its units' uses) has its values on the device already.
    if (p.device.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get() == nullptr) {
      give_memory(p.device, p.device.nbytes());
      runtime_->copy_to_device(p.device, read_home(p)).wait();
    }
    if (p.nvme) runtime_->nvme_engine()->release(p.block);
    out.push_back(p.param);
    params_.erase(it);
  }
  return out;
}

at::Tensor ParamResidency::host_copy(const at::Tensor& p) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(param_id(p));
  return it == params_.end() ? at::Tensor() : it->second.host;
}

bool ParamResidency::offloaded(const at::Tensor& p) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return params_.count(param_id(p)) > 0;
}

at::Tensor ParamResidency::load(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(param_id(p));
  TIERFLOW_EXPECTS(it != params_.end(), "ParamResidency::load: not an offloaded parameter");
  Param& q = it->second;
  if (!q.nvme) return q.host;
  // Read into pageable memory, not the pinned pool: a snapshot the caller keeps (state_dict) holds none of it.
  at::Tensor out = at::empty(q.device.sizes(), q.device.options().device(at::kCPU).pinned_memory(false));
  runtime_->nvme_engine()->read(q.block, out.data_ptr(), out.nbytes()).wait();
  return out;
}

void ParamResidency::store(const at::Tensor& p, const at::Tensor& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = params_.find(param_id(p));
  TIERFLOW_EXPECTS(it != params_.end(), "ParamResidency::store: not an offloaded parameter");
  write_home(it->second, value);
}

void ParamResidency::point_at_host(bool on_host) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (on_host == on_host_) return;
  for (auto& [id, p] : params_) {
    TIERFLOW_EXPECTS(!on_host || schedule_->state(id) != tiering::ParamState::kInFlight,
                     "ParamResidency::point_at_host: a parameter is being fetched");
    if (!p.nvme) {
      p.param.set_data(on_host ? p.host : p.device);
    } else if (on_host) {  // NVMe: a host tensor for the step, written back after it
      p.staging = read_home(p);
      p.param.set_data(p.staging);
    } else {
      write_home(p, p.staging);
      p.param.set_data(p.device);
      p.staging = at::Tensor();
    }
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
    give_memory(p.device, p.device.nbytes());
    const at::Tensor value = read_home(p);
    runtime_->copy_to_device(p.device, value).wait();
    return;
  }
  if (held) p.fetch.wait();  // the device copy is complete before it is read back
  at::Tensor value = runtime_->host_empty(p.device.sizes(), p.device.scalar_type(), false);
  runtime_->copy_to_host(value, p.device).wait();
  write_home(p, value);
  if (!held) drop(p);
}

std::size_t ParamResidency::units() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_->units();
}

std::uint64_t param_wait_ns(const Runtime& runtime) noexcept {
  std::lock_guard<std::mutex> lock(g_wait_mutex);
  const auto it = wait_totals().find(&runtime);
  return it == wait_totals().end() ? 0 : it->second;
}

tiering::ParamScheduleStats ParamResidency::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedule_->stats();
}

}  // namespace tierflow::bindings
