// Note [Sharded models]
// ~~~~~~~~~~~~~~~~~~~~~
// What tierflow decides about a model whose parameters are sharded across
// ranks, torch-free (Note [Distributed training] in bindings/python/tierflow/
// _distributed.py; that file only finds the FSDP2 modules, the DTensor
// parameters and their sizes, and raises what these functions return):
//
// - Which settings and models are refused, at wrap and at the first forward
//   (fully_shard after wrap): FSDP2 with settings it cannot train (the rule:
//   fsdp_settings_refusal in tiers.hpp), FSDP2 after a wrap that made the CPU
//   optimizer, DTensor parameters without an FSDP2 module (tensor
//   parallelism), and an optimizer holding DTensors of another model. Each
//   refusal names the modules or parameters (three, then a count) and says
//   what to do instead.
// - Which parameters are a unit's own: a fully_shard module's parameters
//   outside the fully_shard modules within it (FSDP2 gathers and reduces them
//   together); a parameter listed under several units belongs to the last in
//   module order (the innermost).
// - This rank's bytes of the parameters (what TIERFLOW_OFFLOAD_ACTIVATIONS=auto
//   budgets): a DTensor's local shard; a parameter FSDP2 holds gathered at the
//   moment as the dim-0 chunk FSDP2 keeps of it (Shard(0): ceil(rows / world)
//   rows per rank, the last ones short); any other parameter whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tierflow/core/config.hpp"

namespace tierflow::tiering {

/// A model's sharded parts, by name, as found: its FSDP2 modules ("" for the model itself) and DTensor parameters.
struct ShardedModel {
  std::vector<std::string> fsdp_modules;
  std::vector<std::string> dtensor_parameters;
};

/// The DTensors an optimizer holds: how many of its `parameters` are DTensors, and the first one's shape.
struct OptimizerDTensors {
  std::size_t dtensors = 0;
  std::size_t parameters = 0;
  std::vector<std::int64_t> first_shape;
};

/// The first three `names`, quoted, and how many more ("'a', 'b', 'c' and 2 more").
std::string some_names(const std::vector<std::string>& names);

/// tierflow.wrap of `model` under `config`: the refusal, or "". `replacing`: tierflow's CPU optimizer replaces the
/// optimizer; `cpu_offload_policy`: a unit was sharded with FSDP2's CPUOffloadPolicy; `optimizer`: the DTensors of
/// the optimizer handed to wrap (none: zeros).
std::string sharded_wrap_refusal(const Config& config, const ShardedModel& model, bool replacing,
                                 bool cpu_offload_policy, const OptimizerDTensors& optimizer);

/// The wrapped model's first forward found `model` sharded after wrap: the refusal, or "" (FSDP2 trains it).
/// `cpu_optimizer`: wrap made tierflow's CPU optimizer (for the parameters before sharding).
std::string sharded_later_refusal(const Config& config, const ShardedModel& model, bool cpu_optimizer);

/// Each unit's own parameters: `unit_parameters` lists, in module order, the parameters (numbered in the order they
/// first appear) under each FSDP2 module; a parameter belongs to the last unit listing it. Each unit's own, in
/// ascending number.
std::vector<std::vector<std::size_t>> fsdp_unit_parameters(const std::vector<std::vector<std::size_t>>& unit_parameters);

/// One parameter of a model, as this rank holds it.
struct ParameterShard {
  bool dtensor = false;             // a DTensor: `elements` are its local shard's
  bool gathered = false;            // of an FSDP2 unit, held gathered now
  std::int64_t rows = -1;           // its size along dim 0 (-1: no dim)
  std::uint64_t elements = 0;
  std::uint64_t element_bytes = 0;
};

/// This rank's bytes of `params` (Note [Sharded models]); `rank` of `world_size` on the units' mesh, used only when
/// some parameter is a DTensor.
std::uint64_t rank_shard_bytes(const std::vector<ParameterShard>& params, int rank, int world_size);

}  // namespace tierflow::tiering
