// See Note [Parameter storage] in param_residency.hpp.
#include "tierflow/bindings/param_residency.hpp"

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <iterator>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/keep_forever.hpp"

namespace tierflow::bindings {
namespace {

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

ParamResidency::ParamResidency(std::shared_ptr<Runtime> runtime, const std::vector<std::vector<at::Tensor>>& units,
                               const std::vector<Tier>& residences, const std::vector<std::string>& names,
                               std::size_t blocks, const std::vector<std::string>& unit_names)
    : runtime_(std::move(runtime)) {
  std::vector<std::vector<tiering::ParamSpec>> specs(units.size());
  std::size_t index = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const at::Tensor& p : units[u]) {
      tiering::ParamSpec s;
      s.name = index < names.size() ? names[index] : "#" + std::to_string(index);
      ++index;
      s.id = param_id(p);
      s.bytes = p.nbytes();
      if (u < residences.size() && residences[u] != Tier::kGpu) {
        s.cannot_offload = cannot_offload(*runtime_, p);
        if (s.cannot_offload.empty()) {
          s.storage = p.storage().unsafeGetStorageImpl();
          tensors_.emplace(s.id, Tensors{p, p.detach(), {}, {}});
        }
      }
      specs[u].push_back(std::move(s));
    }
  }
  mover_ = std::make_unique<tiering::ParamMover>(specs, residences, blocks, unit_names,
                                                 runtime_->tiers().device_budget_bytes(), runtime_->nvme_engine(),
                                                 static_cast<tiering::ParamMoverHost&>(*this), runtime_.get());
  for (auto it = tensors_.begin(); it != tensors_.end();)  // resident: another unit keeps it on the device
    it = mover_->offloaded(it->first) ? std::next(it) : tensors_.erase(it);
}

ParamResidency::~ParamResidency() { mover_.reset(); }  // (its teardown calls this host)

ParamResidency::Tensors& ParamResidency::entry(tiering::ParamId id) {
  std::lock_guard<std::mutex> lock(tensors_mutex_);
  return tensors_.at(id);
}

void ParamResidency::drop(tiering::ParamId id, const std::string& why) { drop_memory(entry(id).device, why); }

bool ParamResidency::has_memory(tiering::ParamId id) {
  return entry(id).device.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get() != nullptr;
}

swap::TransferHandle ParamResidency::fetch(tiering::ParamId id, const swap::TransferHandle& read) {
  Tensors& t = entry(id);
  give_memory(t.device, t.device.nbytes());
  if (!read.valid()) return runtime_->fetch_to_device(t.device, t.host);  // rule 2
  // The emulated engine waits for the NVMe read on its worker; CUDA's waits for it on the caller's thread (a
  // host dependency), so on CUDA an NVMe fetch blocks for its read.
  swap::CopyEngine& engine = *runtime_->copy_engine();
  return engine.copy(swap::Direction::kHostToDevice, t.device.data_ptr(), t.staging.data_ptr(), t.device.nbytes(),
                     {read}, compute_stream_of(engine, t.device.device()));
}

void ParamResidency::await_on_device(tiering::ParamId id, const swap::TransferHandle& fetch) {
  runtime_->await_on_device(fetch, entry(id).device.device());
}

void* ParamResidency::stage(tiering::ParamId id) {
  Tensors& t = entry(id);
  t.staging = runtime_->host_empty(t.device.sizes(), t.device.scalar_type(), false);
  return t.staging.data_ptr();
}

void ParamResidency::unstage(tiering::ParamId id) noexcept { entry(id).staging = at::Tensor(); }

void ParamResidency::keep_stalled(tiering::ParamId id, const std::string& why, const std::string& name) noexcept {
  try {
    Tensors& t = entry(id);
    keep_stalled_memory(t.device, why, "parameter '" + name + "' under a stalled fetch");
    if (t.staging.defined()) keep_forever(std::make_shared<at::Tensor>(t.staging), t.staging.nbytes(),
                                          "the staging of parameter '" + name + "'");
    t.staging = at::Tensor();
  } catch (...) {  // nothing to hold it with (out of memory): it stays where it is, never freed either
  }
}

void ParamResidency::make_host_copy(tiering::ParamId id) {
  Tensors& t = entry(id);
  t.host = runtime_->host_empty(t.device.sizes(), t.device.scalar_type(), false);
}

swap::TransferHandle ParamResidency::copy_to_host_copy(tiering::ParamId id) {
  Tensors& t = entry(id);
  return runtime_->copy_to_host(t.host, t.device);
}

void* ParamResidency::host_copy(tiering::ParamId id) {
  Tensors& t = entry(id);
  return t.host.defined() ? t.host.data_ptr() : nullptr;
}

void ParamResidency::free_host_copy(tiering::ParamId id) { entry(id).host = at::Tensor(); }

void ParamResidency::upload(tiering::ParamId id, tiering::ParamView from) {
  Tensors& t = entry(id);
  give_memory(t.device, t.device.nbytes());
  runtime_->copy_to_device(t.device, from == tiering::ParamView::kStaging ? t.staging : t.host).wait();
}

void ParamResidency::download(tiering::ParamId id) {
  Tensors& t = entry(id);
  runtime_->copy_to_host(t.staging, t.device).wait();
}

void ParamResidency::point(tiering::ParamId id, tiering::ParamView view) {
  Tensors& t = entry(id);
  t.param.set_data(view == tiering::ParamView::kDevice ? t.device
                   : view == tiering::ParamView::kHostCopy ? t.host : t.staging);
}

bool ParamResidency::on_device(const at::Tensor& p) const { return mover_->on_device(param_id(p)); }
bool ParamResidency::offloaded(const at::Tensor& p) const { return mover_->offloaded(param_id(p)); }
void ParamResidency::point_at_host(bool on_host) { mover_->point_at_host(on_host); }
void ParamResidency::materialize(const at::Tensor& p, bool fetch) { mover_->materialize(param_id(p), fetch); }
tiering::ParamScheduleStats ParamResidency::stats() const { return mover_->stats(); }

void ParamResidency::gather(const std::vector<at::Tensor>& params) {
  std::vector<tiering::ParamId> ids;
  for (const at::Tensor& p : params) ids.push_back(param_id(p));
  mover_->gather(ids);
}

void ParamResidency::scatter(const std::vector<at::Tensor>& params, bool write_back) {
  std::vector<tiering::ParamId> ids;
  for (const at::Tensor& p : params) ids.push_back(param_id(p));
  mover_->scatter(ids, write_back);
}

std::vector<at::Tensor> ParamResidency::make_resident(const std::vector<std::size_t>& units) {
  std::vector<at::Tensor> out;
  for (tiering::ParamId id : mover_->make_resident(units)) {
    std::lock_guard<std::mutex> lock(tensors_mutex_);
    const auto it = tensors_.find(id);
    out.push_back(it->second.param);
    tensors_.erase(it);
  }
  return out;
}

at::Tensor ParamResidency::host_copy(const at::Tensor& p) const {
  if (!mover_->offloaded(param_id(p))) return at::Tensor();
  std::lock_guard<std::mutex> lock(tensors_mutex_);
  const auto it = tensors_.find(param_id(p));
  return it == tensors_.end() ? at::Tensor() : it->second.host;
}

at::Tensor ParamResidency::load(const at::Tensor& p) {
  TIERFLOW_EXPECTS(mover_->offloaded(param_id(p)), "ParamResidency::load: not an offloaded parameter");
  if (!mover_->on_nvme(param_id(p))) return host_copy(p);
  // Read into pageable memory, not the pinned pool: a snapshot the caller keeps (state_dict) holds none of it.
  at::Tensor out = at::empty(p.sizes(), p.options().device(at::kCPU).pinned_memory(false));
  mover_->read_nvme(param_id(p), out.data_ptr());
  return out;
}

void ParamResidency::store(const at::Tensor& p, const at::Tensor& value) {
  TIERFLOW_EXPECTS(mover_->offloaded(param_id(p)), "ParamResidency::store: not an offloaded parameter");
  TIERFLOW_EXPECTS(value.is_cpu() && value.is_contiguous() && value.nbytes() == p.nbytes() &&
                       value.scalar_type() == p.scalar_type(),
                   "ParamResidency: a parameter's new value must be a contiguous CPU tensor of its dtype and size");
  mover_->store(param_id(p), value.data_ptr());
}

std::uint64_t param_wait_ns(const Runtime& runtime) noexcept { return tiering::param_wait_total(&runtime); }

}  // namespace tierflow::bindings
