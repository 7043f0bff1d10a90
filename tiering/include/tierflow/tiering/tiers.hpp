// The tiers of one run, built from the configuration: which device, the
// pinned host pool and its budget, the copy engine, and the NVMe engine when
// a target needs one.
//
// Note [Tiers from the configuration]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Everything a run's tiers are is decided here, once, from a validated
// Config, torch-free (bindings/'s Runtime only adds torch's tensors on top):
//  - the device: TIERFLOW_DEVICE=cuda needs a usable GPU (an error names why
//    not and what is accepted); auto takes CUDA when there is a GPU, else the
//    emulated device, whose TIERFLOW_EMULATED_DEVICE mode turns the pool, the
//    copy engine and the device memory hostile together (Note [Adversarial
//    emulated device]);
//  - the host tier: the pinned pool's budget is TIERFLOW_HOST_MEMORY of this
//    machine's RAM, pinned with cudaHostAlloc only on CUDA;
//  - the NVMe tier: an engine exists when activations go to NVMe (nvme, or a
//    planned mode, auto or recompute, with TIERFLOW_NVME_PATHS set) or the
//    optimizer states do. Each path must be an accessible directory; each
//    swap file may grow to TIERFLOW_NVME_MEMORY of the smallest free space
//    among the paths (auto: while the file system keeps some free, Note [NVMe
//    space]). The planner's NVMe budget is what that engine can still place
//    (nvme_available_bytes), and its probe runs through that engine (Note
//    [NVMe probe]);
//  - the GPU tier's budget: TIERFLOW_GPU_MEMORY of the device's memory
//    (Note [GPU budget]). The device's memory itself is torch's caching
//    allocator; the budget is the number the planner and the GPU share plan
//    within.
// Settings this version cannot serve are refused here, naming the variable.
//
// Note [Ranks on one machine]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under torch.distributed several processes (ranks) run on one machine and
// share its RAM and its NVMe paths. A budget given as a share of a machine's
// resource is divided among them: TIERFLOW_HOST_MEMORY=50% gives each of 4
// local ranks 12.5% of the RAM, and a percentage of TIERFLOW_NVME_MEMORY
// gives each rank that part of the smallest free space; a budget given as a
// size is each rank's own (TIERFLOW_HOST_MEMORY=16GiB: 16 GiB per rank).
// TIERFLOW_NVME_MEMORY=auto is not divided: every rank's files grow on
// demand while the file system keeps kNvmeAutoKeepFree free, judged at each
// grow, so the ranks share what is free as they need it. The ranks on this
// machine are torchrun's LOCAL_WORLD_SIZE and LOCAL_RANK when set, else the
// whole process group (the processes of a group started without torchrun are
// taken to share one machine: the cautious reading). Each rank's swap files
// carry its rank in their names (Note [Stale swap files]). The GPU budget is
// not divided: each rank drives its own GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tierflow/allocator/device.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/nvme_probe.hpp"
#include "tierflow/tiering/activation_schedule.hpp"

namespace tierflow::tiering {

/// This process's place among the processes of a run (Note [Ranks on one machine]).
struct RankShare {
  int rank = 0;         ///< in the process group (0 without one)
  int local_ranks = 1;  ///< processes sharing this machine's RAM and NVMe paths
};

/// The share of a process group's rank `rank` of `world_size` (1: none):
/// the local ranks from LOCAL_WORLD_SIZE when set, else `world_size`.
/// config_error for a rank outside [0, world_size) or a malformed LOCAL_WORLD_SIZE.
RankShare rank_share(int rank, int world_size);

/// What the configuration makes of the tiers (Note [Tiers from the configuration]).
struct TierSettings {
  allocator::DeviceKind device = allocator::DeviceKind::kEmulated;
  bool adversarial = false;                  ///< the emulated device's adversarial mode
  allocator::PinnedHostPoolOptions pool;     ///< the host tier
  swap::EmulatedCopyOptions copies;          ///< the emulated copy engine's behaviour
  ActivationScheduleOptions schedule;        ///< TIERFLOW_OFFLOAD_ACTIVATIONS and the prefetch window
  std::uint64_t min_offload_bytes = 0;       ///< TIERFLOW_MIN_OFFLOAD_BYTES
  bool nvme = false;                         ///< an NVMe engine is built
  bool activations_on_nvme = false;          ///< ... and saved activations may use it
  swap::NvmeEngineOptions nvme_options;      ///< its paths and sizes (when `nvme`)
};

/// What parameter offload (Note [Parameter residency]) cannot serve with the other settings: the refusal
/// text, or empty when `config` may run. An explicit GPU optimizer share is refused (auto takes 0 with
/// parameter offload), and auto without TIERFLOW_OFFLOAD_ACTIVATIONS=auto (the plan that decides which
/// blocks keep their parameters). tier_settings throws it. TIERFLOW_OFFLOAD_PARAMS='nvme' without
/// TIERFLOW_NVME_PATHS is a configuration error before that.
std::string params_offload_refusal(const Config& config);
/// Parameter offload with the optimizer the user trains with: refused (the text) for a torch optimizer
/// (`cpu_optimizer` false) on CUDA, whose gradients are on the device while the values are on the host;
/// empty otherwise (on the emulated device a torch optimizer steps the host copies in place).
std::string params_optimizer_refusal(const Config& config, bool cuda, bool cpu_optimizer);

/// What FSDP2 (torch's fully_shard: the parameters are each rank's DTensor shards, gathered and reduce-scattered
/// by FSDP2 itself) cannot train with `config` (Note [Distributed training]): the refusal, ending with what FSDP2
/// accepts, or empty. `cpu_optimizer`: tierflow's CPU AdamW steps the shards (an optimizer was replaced, or made
/// for them); `cpu_offload_policy`: FSDP2 keeps the shards in host memory (a unit sharded with its
/// CPUOffloadPolicy: the shards and their gradients on the host, the gradients copied there asynchronously). Parameter offload is refused always (it
/// would move what FSDP2 shards and gathers); with the CPU optimizer, gradients freed during backward (FSDP2
/// reduce-scatters them), an explicit GPU optimizer share, and FSDP2's own CPU offload (two owners of the host
/// copies; its asynchronous gradient copies are unverified beside the streamed step).
std::string fsdp_settings_refusal(const Config& config, bool cpu_optimizer, bool cpu_offload_policy = false);

/// The device `config` asks for (TIERFLOW_DEVICE; auto: CUDA when a GPU is usable); config_error naming why
/// cuda cannot be served and what is accepted here (Note [Tiers from the configuration]).
allocator::DeviceKind device_kind(const Config& config);

/// The tiers `config` asks for; throws config_error for a setting this
/// machine or version cannot serve. `nvme_faults` (tests only) goes to the
/// NVMe engine. Reads the free space of each NVMe path.
/// `ranks`: this process's share of the machine (Note [Ranks on one machine]).
TierSettings tier_settings(const Config& config, swap::NvmeFaults* nvme_faults = nullptr, RankShare ranks = {});

/// Why a model whose CUDA parameters and buffers are on devices
/// `cuda_indices` cannot be driven while CUDA device `current` is current
/// (empty when it can). The runtime makes its copy streams on the current
/// device and orders each copy after the stream of the tensor's device: a
/// model on another GPU would have its copies ordered on the wrong GPU's
/// streams, and a model across GPUs has no one device for them.
std::string one_cuda_device(std::vector<int> cuda_indices, int current);

/// The tiers of one run: the pinned host pool, the copy engine and the NVMe engine.
class Tiers {
 public:
  /// Builds them from `config` (tier_settings); `copy_faults` (tests only) goes to the emulated copy engine.
  explicit Tiers(const Config& config, swap::NvmeFaults* nvme_faults = nullptr,
                 std::shared_ptr<const swap::CopyFaults> copy_faults = nullptr, RankShare ranks = {});

  const TierSettings& settings() const noexcept { return settings_; }
  allocator::DeviceKind device() const noexcept { return settings_.device; }
  const std::shared_ptr<allocator::PinnedHostPool>& host_pool() const noexcept { return pool_; }
  const std::shared_ptr<swap::CopyEngine>& copy_engine() const noexcept { return engine_; }
  /// Null unless a target is NVMe.
  const std::shared_ptr<swap::NvmeEngine>& nvme_engine() const noexcept { return nvme_; }

  /// TIERFLOW_GPU_MEMORY in bytes on this device (gpu_budget_bytes, the table's default when not given).
  std::uint64_t device_budget_bytes() const;
  /// TIERFLOW_HOST_MEMORY in bytes.
  std::uint64_t host_budget_bytes() const;
  /// Bytes the NVMe tier can still place now; 0 without one.
  std::uint64_t nvme_available_bytes() const;
  /// Write and read bandwidth of `bytes` through the NVMe engine, every path,
  /// O_DIRECT (Note [NVMe probe]); config_error without an NVMe tier.
  swap::NvmeBandwidth measure_nvme(std::uint64_t bytes) const;

 private:
  Config config_;
  TierSettings settings_;
  std::shared_ptr<allocator::PinnedHostPool> pool_;
  std::shared_ptr<swap::CopyEngine> engine_;
  std::shared_ptr<swap::NvmeEngine> nvme_;
};

}  // namespace tierflow::tiering
