#include "tierflow/tiering/distributed_sharding.hpp"

#include <algorithm>

#include "tierflow/tiering/tiers.hpp"

namespace tierflow::tiering {
namespace {

const char* const kTensorParallelAdvice =
    "use torch.distributed.fsdp.fully_shard (FSDP2) or DistributedDataParallel (DDP) instead, or train on one "
    "process";

/// The FSDP2 modules named, the model itself as such, with the verb their number takes.
std::string fsdp_modules_are(const std::vector<std::string>& modules) {
  std::vector<std::string> names;
  for (const auto& n : modules) names.push_back(n.empty() ? "(the model itself)" : n);
  return some_names(names) + (modules.size() == 1 ? " is an FSDPModule" : " are FSDPModules");
}

}  // namespace

std::string some_names(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 3) out += " and " + std::to_string(names.size() - 3) + " more";
  return out;
}

std::string sharded_wrap_refusal(const Config& config, const ShardedModel& model, bool replacing,
                                 bool cpu_offload_policy, const OptimizerDTensors& optimizer) {
  if (!model.fsdp_modules.empty()) {  // its DTensors are FSDP2's shards
    const std::string why = fsdp_settings_refusal(config, replacing, cpu_offload_policy);
    if (why.empty()) return {};
    return "tierflow.wrap: the model is sharded by torch.distributed.fsdp.fully_shard (FSDP2): " +
           fsdp_modules_are(model.fsdp_modules) + ", and " + why;
  }
  if (!model.dtensor_parameters.empty()) {
    return "tierflow.wrap: " + std::to_string(model.dtensor_parameters.size()) +
           " of the model's parameters are DTensors (" + some_names(model.dtensor_parameters) +
           ") and no module of it is an FSDP2 module (fully_shard), as tensor parallelism makes them; tierflow does "
           "not support tensor parallelism; " + kTensorParallelAdvice;
  }
  if (optimizer.dtensors == 0) return {};
  std::string shape = "[";
  for (std::size_t i = 0; i < optimizer.first_shape.size(); ++i)
    shape += (i ? ", " : "") + std::to_string(optimizer.first_shape[i]);
  return "tierflow.wrap: " + std::to_string(optimizer.dtensors) + " of the optimizer's " +
         std::to_string(optimizer.parameters) + " parameters are DTensors (the first has shape " + shape +
         "]), but the model has no FSDP2 module (fully_shard) and no DTensor parameter: the optimizer is another "
         "model's; pass the optimizer of the model you wrap";
}

std::string sharded_later_refusal(const Config& config, const ShardedModel& model, bool cpu_optimizer) {
  std::string what, advice;
  if (!model.fsdp_modules.empty()) {
    std::string why = fsdp_settings_refusal(config, false);  // ends with what FSDP2 accepts; cpu_optimizer below
    if (why.empty() && cpu_optimizer) {
      why = "tierflow's CPU optimizer, made at wrap, holds the parameters as they were before sharding; call "
            "fully_shard before tierflow.wrap";
    }
    if (why.empty()) return {};
    what = "torch.distributed.fsdp.fully_shard (FSDP2) was applied to the model after tierflow.wrap (" +
           fsdp_modules_are(model.fsdp_modules) + "), and " + why;
  } else if (!model.dtensor_parameters.empty()) {
    what = std::to_string(model.dtensor_parameters.size()) +
           " of the model's parameters became DTensors after tierflow.wrap (" + some_names(model.dtensor_parameters) +
           ") and no module of it is an FSDP2 module, as tensor parallelism makes them; tierflow does not support "
           "tensor parallelism";
    advice = std::string(kTensorParallelAdvice) + "; ";
  } else {
    return {};
  }
  return "tierflow: " + what + " (this forward was stopped before tierflow saved anything); " + advice +
         "or call tierflow.unwrap(model) to train it without tierflow";
}

std::vector<std::vector<std::size_t>> fsdp_unit_parameters(
    const std::vector<std::vector<std::size_t>>& unit_parameters) {
  std::size_t count = 0;
  for (const auto& params : unit_parameters)
    for (std::size_t p : params) count = std::max(count, p + 1);
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::vector<std::size_t> owner(count, kNone);
  for (std::size_t u = 0; u < unit_parameters.size(); ++u)  // an inner unit comes later and takes them
    for (std::size_t p : unit_parameters[u]) owner[p] = u;
  std::vector<std::vector<std::size_t>> own(unit_parameters.size());
  for (std::size_t p = 0; p < count; ++p)
    if (owner[p] != kNone) own[owner[p]].push_back(p);
  return own;
}

std::uint64_t rank_shard_bytes(const std::vector<ParameterShard>& params, int rank, int world_size) {
  const bool sharded = std::any_of(params.begin(), params.end(), [](const ParameterShard& p) { return p.dtensor; });
  std::uint64_t total = 0;
  for (const auto& p : params) {
    if (sharded && !p.dtensor && p.gathered && p.rows >= 0 && world_size > 0) {
      // FSDP2's Shard(0) chunk of a gathered parameter: ceil(rows / world) rows per rank, the last ones short.
      const std::int64_t chunk = (p.rows + world_size - 1) / world_size;
      const std::int64_t mine = std::max<std::int64_t>(0, std::min(p.rows, (rank + 1) * chunk) - rank * chunk);
      const std::uint64_t per_row = p.elements / static_cast<std::uint64_t>(std::max<std::int64_t>(p.rows, 1));
      total += static_cast<std::uint64_t>(mine) * per_row * p.element_bytes;
    } else {
      total += p.elements * p.element_bytes;
    }
  }
  return total;
}

}  // namespace tierflow::tiering
