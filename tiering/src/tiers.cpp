// See Note [Tiers from the configuration] in tiers.hpp.
#include "tierflow/tiering/tiers.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/tiering/tier_table.hpp"

namespace tierflow::tiering {
namespace {

void refuse_unimplemented(const Config& c) {
  if (c.offload_activations == OffloadTarget::kNvme && c.nvme_paths.empty())
    throw config_error("TIERFLOW_OFFLOAD_ACTIVATIONS='nvme' needs TIERFLOW_NVME_PATHS: a comma-separated "
                       "list of directories on NVMe file systems");
  if (c.offload_optimizer == OffloadTarget::kNvme && c.nvme_paths.empty())
    throw config_error("TIERFLOW_OFFLOAD_OPTIMIZER='nvme' needs TIERFLOW_NVME_PATHS: a comma-separated "
                       "list of directories on NVMe file systems");
  if (c.offload_params == OffloadTarget::kNvme && c.nvme_paths.empty())
    throw config_error("TIERFLOW_OFFLOAD_PARAMS='nvme' needs TIERFLOW_NVME_PATHS: a comma-separated "
                       "list of directories on NVMe file systems");
  if (std::string why = params_offload_refusal(c); !why.empty()) throw config_error(why);
}

// The smallest free space among the NVMe paths; each must be an accessible directory.
std::uint64_t smallest_free_bytes(const std::vector<std::string>& paths) {
  std::uint64_t smallest = ~std::uint64_t{0};
  for (const auto& p : paths) {
    struct statvfs fs {};
    if (statvfs(p.c_str(), &fs) != 0)
      throw config_error("TIERFLOW_NVME_PATHS: '" + p + "' is not an accessible directory: " + std::strerror(errno));
    smallest = std::min<std::uint64_t>(smallest, static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize);
  }
  return smallest;
}

}  // namespace

std::string params_offload_refusal(const Config& config) {
  const std::string setting = "TIERFLOW_OFFLOAD_PARAMS='" + std::string(to_string(config.offload_params)) + "'";
  switch (config.offload_params) {
    case OffloadTarget::kNone: return {};
    case OffloadTarget::kHost:
    case OffloadTarget::kNvme:
    case OffloadTarget::kAuto: {
      // snprintf, not a stringstream: this was the only iostream in the library, and the likeliest suspect of
      // the segfault every Runtime with parameter offload met on a GPU node (the torch wheel's libraries bring
      // their own iostream symbols; docs/gpu.md#what-has-run-on-a-gpu).
      char fraction[32];
      std::snprintf(fraction, sizeof fraction, "%g", config.gpu_optimizer_fraction);
      if (!config.gpu_optimizer_fraction_auto && config.gpu_optimizer_fraction > 0.0)
        return setting + " with TIERFLOW_GPU_OPTIMIZER_FRACTION=" + fraction +
               ": the GPU share steps parameters on the device, and these live off it between uses; "
               "accepted: TIERFLOW_GPU_OPTIMIZER_FRACTION=0 or auto (which takes 0 with parameter offload)";
      if (config.offload_params == OffloadTarget::kAuto && config.offload_activations != OffloadTarget::kAuto)
        return setting + " with TIERFLOW_OFFLOAD_ACTIVATIONS='" + std::string(to_string(config.offload_activations)) +
               "': which blocks keep their parameters is planned with the activations; accepted: "
               "TIERFLOW_OFFLOAD_ACTIVATIONS=auto, or TIERFLOW_OFFLOAD_PARAMS=host or nvme";
      return {};
    }
    default:
      return setting + " is not a tier for parameters; accepted: none, host, nvme, auto";
  }
}

std::string fsdp_settings_refusal(const Config& config, bool cpu_optimizer, bool cpu_offload_policy) {
  std::string why;
  if (config.offload_params != OffloadTarget::kNone) {
    why = "TIERFLOW_OFFLOAD_PARAMS='" + std::string(to_string(config.offload_params)) +
          "' would move the parameters FSDP2 shards and gathers itself";
  } else if (cpu_optimizer && config.offload_gradients) {
    why = "TIERFLOW_OFFLOAD_GRADIENTS='on' frees gradients during backward, where FSDP2 reduce-scatters them itself";
  } else if (cpu_optimizer && !config.gpu_optimizer_fraction_auto && config.gpu_optimizer_fraction > 0.0) {
    char fraction[32];
    std::snprintf(fraction, sizeof fraction, "%g", config.gpu_optimizer_fraction);
    why = std::string("TIERFLOW_GPU_OPTIMIZER_FRACTION=") + fraction +
          " would step part of FSDP2's shards on the GPU, which the GPU share does not take yet";
  } else if (cpu_optimizer && cpu_offload_policy) {
    why = "TIERFLOW_OFFLOAD_OPTIMIZER='" + std::string(to_string(config.offload_optimizer)) +
          "' beside FSDP2's shards kept in host memory (fully_shard's offload_policy=CPUOffloadPolicy): both would "
          "own the shards' host copies (FSDP2 copies the gradients there asynchronously, which tierflow's step has "
          "not been verified against); "
          "for states on the host, shard without offload_policy and let tierflow's CPU AdamW keep them, or keep "
          "FSDP2's CPUOffloadPolicy with TIERFLOW_OFFLOAD_OPTIMIZER=none";
  }
  if (why.empty()) return why;
  return why +
         "; accepted with FSDP2: TIERFLOW_OFFLOAD_OPTIMIZER=host (tierflow's CPU AdamW steps each rank's shard, "
         "during backward: one copy of the states on the node), nvme (the same in step(), each rank's states in its "
         "own swap files) or none (your optimizer steps the shards), TIERFLOW_OFFLOAD_PARAMS=none, "
         "TIERFLOW_OFFLOAD_GRADIENTS=off, TIERFLOW_GPU_OPTIMIZER_FRACTION=auto or 0, and any "
         "TIERFLOW_OFFLOAD_ACTIVATIONS";
}

std::string params_optimizer_refusal(const Config& config, bool cuda, bool cpu_optimizer) {
  if (config.offload_params == OffloadTarget::kNone || cpu_optimizer || !cuda) return {};
  return "TIERFLOW_OFFLOAD_PARAMS='" + std::string(to_string(config.offload_params)) +
         "' with TIERFLOW_OFFLOAD_OPTIMIZER='none' on CUDA: a torch optimizer would step parameters whose "
         "values live on the host while their gradients are on the GPU; accepted: TIERFLOW_OFFLOAD_OPTIMIZER=host "
         "or nvme (tierflow's CPU AdamW steps the host copies)";
}

allocator::DeviceKind device_kind(const Config& c) {
  if (c.device == DeviceChoice::kCuda && !allocator::cuda_available())
    throw config_error(std::string("TIERFLOW_DEVICE='cuda': ") +
                       (allocator::cuda_compiled() ? "no CUDA GPU is usable on this machine"
                                                   : "tierflow was built without the CUDA backend") +
                       "; accepted here: auto, emulated");
  const bool cuda = c.device == DeviceChoice::kCuda || (c.device == DeviceChoice::kAuto && allocator::cuda_available());
  return cuda ? allocator::DeviceKind::kCuda : allocator::DeviceKind::kEmulated;
}


RankShare rank_share(int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw config_error("rank " + std::to_string(rank) + " of a process group of " + std::to_string(world_size) +
                       "; accepted: a rank from 0 to the group's size - 1");
  RankShare r;
  r.rank = rank;
  r.local_ranks = world_size;
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local && *local) {
    const auto n = parse_uint(local, 1u << 20);
    if (!n || *n == 0)
      throw config_error(std::string("LOCAL_WORLD_SIZE=") + local +
                         " is not valid; accepted: the number of processes on this machine (torchrun sets it), 1 or more");
    r.local_ranks = static_cast<int>(*n);
  }
  return r;
}

namespace {
// A budget that is a share of the machine is divided among its ranks; a size is each rank's own.
std::uint64_t per_rank(const Budget& b, std::uint64_t capacity, const RankShare& ranks) {
  const std::uint64_t bytes = b.resolve(capacity);
  return b.is_fraction ? bytes / static_cast<std::uint64_t>(ranks.local_ranks) : bytes;
}
}  // namespace

TierSettings tier_settings(const Config& config, swap::NvmeFaults* nvme_faults, RankShare ranks) {
  refuse_unimplemented(config);
  TierSettings s;
  s.device = device_kind(config);
  s.adversarial = s.device == allocator::DeviceKind::kEmulated &&
                  config.emulated_device == EmulationMode::kAdversarial;
  s.pool.budget_bytes = per_rank(config.host_memory, allocator::host_capacity_bytes(), ranks);
  s.pool.slab_bytes = config.pinned_slab_bytes;
  s.pool.cuda_pinned = s.device == allocator::DeviceKind::kCuda;
  s.pool.poison_freed = s.adversarial;
  s.copies.adversarial = s.adversarial;
  s.copies.seed = config.emulated_seed;
  s.schedule.target = config.offload_activations;
  s.schedule.prefetch_bytes = config.prefetch_bytes;
  s.schedule.keep_tail_bytes = config.prefetch_bytes;
  s.min_offload_bytes = config.min_offload_bytes;
  // Planned activations (auto, recompute) may use the NVMe tier when it is configured.
  const bool planned = config.offload_activations == OffloadTarget::kAuto ||
                       config.offload_activations == OffloadTarget::kRecompute;
  s.activations_on_nvme = config.offload_activations == OffloadTarget::kNvme || (planned && !config.nvme_paths.empty());
  s.nvme = s.activations_on_nvme || config.offload_optimizer == OffloadTarget::kNvme ||
           config.offload_params == OffloadTarget::kNvme;
  if (s.nvme) {
    swap::NvmeEngineOptions& no = s.nvme_options;
    no.paths = config.nvme_paths;
    no.bytes_per_path = per_rank(config.nvme_memory, smallest_free_bytes(no.paths), ranks);
    if (ranks.local_ranks > 1 || ranks.rank > 0) no.name_tag = "rank" + std::to_string(ranks.rank) + "-";
    no.block_bytes = config.aio_block_size;
    no.queue_depth = static_cast<unsigned>(config.aio_queue_depth);
    no.checksums = config.nvme_checksum;
    no.faults = nvme_faults;
  }
  return s;
}

Tiers::Tiers(const Config& config, swap::NvmeFaults* nvme_faults, std::shared_ptr<const swap::CopyFaults> copy_faults,
             RankShare ranks)
    : config_(config), settings_(tier_settings(config, nvme_faults, ranks)) {
  pool_ = std::make_shared<allocator::PinnedHostPool>(settings_.pool);
  engine_ = std::shared_ptr<swap::CopyEngine>(swap::make_copy_engine(settings_.device, std::move(copy_faults),
                                                                     settings_.copies));
  if (settings_.nvme) nvme_ = std::make_shared<swap::NvmeEngine>(settings_.nvme_options);
}

std::string one_cuda_device(std::vector<int> cuda, int current) {
  std::sort(cuda.begin(), cuda.end());
  cuda.erase(std::unique(cuda.begin(), cuda.end()), cuda.end());
  if (cuda.size() > 1) {
    std::string on;
    for (int i : cuda) on += (on.empty() ? "cuda:" : ", cuda:") + std::to_string(i);
    return "tierflow.wrap: the model's parameters and buffers are on " + on +
           ": tierflow drives one GPU per process; put the model on one device, and use one process per GPU "
           "(DistributedDataParallel) for more";
  }
  if (!cuda.empty() && cuda[0] != current) {
    const std::string d = std::to_string(cuda[0]);
    return "tierflow.wrap: the model is on cuda:" + d + " but the current CUDA device is cuda:" +
           std::to_string(current) +
           ": tierflow makes its copy streams on the current device, so its copies would be ordered on the wrong "
           "GPU; call torch.cuda.set_device(" + d + ") before tierflow.wrap (or run the process with "
           "CUDA_VISIBLE_DEVICES=" + d + ")";
  }
  return {};
}

std::uint64_t Tiers::device_budget_bytes() const {
  return gpu_budget_bytes(config_.gpu_memory, config_.given.count("TIERFLOW_GPU_MEMORY") > 0,
                          allocator::device_capacity_bytes(settings_.device), UnsetGpuBudget::kTableDefault);
}

std::uint64_t Tiers::host_budget_bytes() const { return settings_.pool.budget_bytes; }

std::uint64_t Tiers::nvme_available_bytes() const { return nvme_ ? nvme_->available_bytes() : 0; }

swap::NvmeBandwidth Tiers::measure_nvme(std::uint64_t bytes) const {
  if (!nvme_) throw config_error("Runtime.measure_nvme: no NVMe tier; set TIERFLOW_NVME_PATHS");
  allocator::AlignedBuffer buffer(bytes);
  return swap::measure_bandwidth(*nvme_, buffer.data(), bytes);
}

}  // namespace tierflow::tiering
