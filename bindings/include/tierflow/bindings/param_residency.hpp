// The parameters of an unchanged PyTorch model between their uses, on the
// host or NVMe tier: the torch side of tiering::ParamSchedule for the Python
// path (TIERFLOW_OFFLOAD_PARAMS=host|nvme). The module hooks that call the events live
// in bindings/python/tierflow/params.py.
//
// Note [Parameter storage]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// An unchanged model's autograd graph saves its weights as the parameter
// itself or as views of it (w.t() for a linear layer), each pointing at the
// parameter's storage. Releasing a parameter by pointing it at another tensor
// (set_data) would free nothing: the views keep the storage. So a released
// parameter keeps its tensor and its storage object, and only the storage's
// memory goes (its bytes set to 0); a fetch gives the same storage new device
// memory (the device's allocator, on the compute stream) and copies the host
// copy into it. Every view autograd saved sees the weights again, and the
// parameter's identity (TensorImpl, StorageImpl: how the saved-tensor hooks
// recognise it, Note [Saved-tensor decisions]) never changes. PyTorch's FSDP1
// frees its unsharded parameters the same way.
//
// What a released parameter can and cannot do. Its shape, dtype, device,
// storage size and gradient are intact (AccumulateGrad reads only its
// metadata; a view of it can be made); its values are not there, and any
// read or write of them raises an error that names the parameter and says
// what to do (c10's data-pointer check on the storage: the one FakeTensor
// uses), never a crash nor a read of freed memory. The Python side serves
// the reads it can see (Note [Parameter hooks]: a weight read where no
// module of its own runs, tierflow.gathered; state_dict and load_state_dict
// go through the host copies; an optimizer steps the host copies).
//
// What moves when, the fetches' order and the NVMe blocks' lifecycle: Note [Parameter moves]
// (tiering/param_mover.hpp), whose ParamMoverHost this class implements on the storages.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/core/tier.hpp"
#include "tierflow/tiering/param_mover.hpp"

namespace tierflow::bindings {

class Runtime;

// Note [Parameter casts] (bindings/python/tierflow/_param_casts.py): autocast's cached 16-bit casts of offloaded
// weights keep their tensors in autocast's cache (so every use in one autocast region shares one cast, and one
// autograd node, as without tierflow) and their memory only during their unit's uses.
/// Autocast's cached cast of `p` to `dtype` on `device_type` (made and cached now when there is none).
at::Tensor autocast_cached_cast(const at::Tensor& p, at::ScalarType dtype, const std::string& device_type);
/// The cast's memory goes; its tensor stays (in autocast's cache), and any access to its data raises `why`.
void drop_cast(const at::Tensor& cast, const std::string& why);
/// The cast's memory back, with `p`'s values cast into it (the same bits as the cast: aten::_to_copy copies into a
/// new tensor the same way; the cast's version does not move).
void refill_cast(const at::Tensor& cast, const at::Tensor& p);

/// The time compute waited for parameter fetches to land (ParamScheduleStats::stall_ns) under every
/// ParamResidency of `runtime` so far, those gone included: a total that only grows, read at each step's
/// boundary (exposed_param_wait_s, Note [Step stats]).
std::uint64_t param_wait_ns(const Runtime& runtime) noexcept;

/// Parameters of units (repeated blocks, then the rest unit) kept on the host between uses (Note [Parameter
/// storage]): a tiering::ParamMover over their tensors. Thread-safe: forward events come from the Python
/// thread, backward events from autograd's.
class ParamResidency : private tiering::ParamMoverHost {
 public:
  /// `units[u]`: unit u's parameters (blocks first, the rest unit last); `residences[u]`: kGpu (stays) or
  /// kHost. Copies every fetched parameter to a pinned host copy and releases its device memory. Throws
  /// config_error naming a parameter that cannot be offloaded (not a leaf of the runtime's device, not
  /// contiguous, sharing its storage with another tensor) before anything changes.
  /// `blocks`: units 0..blocks-1 are the repeated blocks (expected in order before any record);
  /// `unit_names`: what errors call each unit. The device budget (TIERFLOW_GPU_MEMORY) bounds the fetched
  /// parameters' device bytes (Note [Parameter residency], Budget).
  ParamResidency(std::shared_ptr<Runtime> runtime, const std::vector<std::vector<at::Tensor>>& units,
                 const std::vector<Tier>& residences, const std::vector<std::string>& names, std::size_t blocks,
                 const std::vector<std::string>& unit_names);
  ~ParamResidency();

  // tiering::ParamMover's gathers and residence changes (each documented there), the parameters known by their
  // tensors; its events, holds and attachments come from _C.ParamUses, by id (mover()).
  bool on_device(const at::Tensor& p) const;
  void gather(const std::vector<at::Tensor>& params);
  void scatter(const std::vector<at::Tensor>& params, bool write_back);
  std::vector<at::Tensor> make_resident(const std::vector<std::size_t>& units);

  /// The host copy of `p` on the host tier (what the optimizer steps in place), undefined when `p` stays on
  /// the device or lives on NVMe.
  at::Tensor host_copy(const at::Tensor& p) const;
  /// Whether `p` lives on the host or NVMe between uses.
  bool offloaded(const at::Tensor& p) const;
  /// `p`'s current value on the host: its host copy, or a fresh read from NVMe into pageable memory (a snapshot
  /// kept holds none of the pinned pool). Throws for a parameter that is not offloaded.
  at::Tensor load(const at::Tensor& p);
  /// Makes `value` (a contiguous CPU tensor of p's dtype and size) p's value between uses: into its host
  /// copy, or written to NVMe (waited for). The next fetch copies it.
  void store(const at::Tensor& p, const at::Tensor& value);
  /// Points every offloaded parameter at its host copy (true) or back at its released device storage
  /// (false): for a torch optimizer stepping on the emulated device, whose device tensors are CPU tensors.
  void point_at_host(bool on_host);
  void materialize(const at::Tensor& p, bool fetch);  // (ParamMover::materialize)

  tiering::ParamScheduleStats stats() const;
  /// The parameters by id (ParamUses sends its events there).
  tiering::ParamMover& mover() { return *mover_; }

 private:
  struct Tensors {
    at::Tensor param;    // the model's parameter
    at::Tensor device;   // a tensor over the parameter's storage: what fetches fill and releases empty
    at::Tensor host;     // its pinned host copy (host tier; undefined on NVMe)
    at::Tensor staging;  // the mover's staging (ParamMoverHost::stage)
  };
  Tensors& entry(tiering::ParamId id);
  // ParamMoverHost (called under the mover's lock)
  void drop(tiering::ParamId id, const std::string& why) override;
  bool has_memory(tiering::ParamId id) override;
  swap::TransferHandle fetch(tiering::ParamId id, const swap::TransferHandle& read) override;
  void await_on_device(tiering::ParamId id, const swap::TransferHandle& fetch) override;
  void* stage(tiering::ParamId id) override;
  void unstage(tiering::ParamId id) noexcept override;
  void keep_stalled(tiering::ParamId id, const std::string& why, const std::string& name) noexcept override;
  void make_host_copy(tiering::ParamId id) override;
  swap::TransferHandle copy_to_host_copy(tiering::ParamId id) override;
  void* host_copy(tiering::ParamId id) override;
  void free_host_copy(tiering::ParamId id) override;
  void upload(tiering::ParamId id, tiering::ParamView from) override;
  void download(tiering::ParamId id) override;
  void point(tiering::ParamId id, tiering::ParamView view) override;

  std::shared_ptr<Runtime> runtime_;
  mutable std::mutex tensors_mutex_;  // the map's structure: make_resident erases while others look up
  std::unordered_map<tiering::ParamId, Tensors> tensors_;
  std::unique_ptr<tiering::ParamMover> mover_;  // (calls the above: goes first, in the destructor)
};

}  // namespace tierflow::bindings
