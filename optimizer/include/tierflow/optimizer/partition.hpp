// Note [Partitioned optimizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ZeRO-Offload's data-parallel design under DDP (TIERFLOW_PARTITION_OPTIMIZER,
// Note [Distributed training] in bindings/python/tierflow/_distributed.py):
// every rank holds the whole model and DDP all-reduces every gradient, but
// each parameter has one owner rank, and only its owner keeps its fp32
// master and moments and steps it; after the step each owner broadcasts its
// parameters' new weights to the others. So a node of N ranks holds one copy
// of the optimizer states instead of N, and each rank's CPU steps 1/N of the
// parameters; what it adds is the broadcast of the weights (parameter bytes,
// once a step), which the CPU step does not overlap.
//
// Owners are whole parameters (a parameter's states never span ranks, so
// every kernel call, checkpoint entry and error names one rank's tensors),
// assigned largest first to the rank that holds the fewest elements so far
// (ties: the parameter listed first, the lowest rank): no rank holds more
// than the balanced share plus the largest parameter. Every rank computes
// the same assignment from the same list, so nothing is exchanged.
//
// A state dict of a partitioned optimizer holds its own rank's states; each
// rank saves and loads its own. Loading a state dict that holds states of
// other ranks' parameters and none of this rank's is refused
// (loaded_partition_refusal): it is another rank's partition, and loading it
// would leave this rank's parameters with fresh moments.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tierflow::optimizer {

/// The owner rank of each parameter (`elements`: each one's numel, in the optimizer's order) among
/// `world_size` ranks (Note [Partitioned optimizer]). Throws for world_size < 1.
std::vector<int> partition_parameters(const std::vector<std::uint64_t>& elements, int world_size);

/// Elements each rank owns under `owners` (partition_parameters' result) among `world_size` ranks.
std::vector<std::uint64_t> owned_elements(const std::vector<int>& owners, const std::vector<std::uint64_t>& elements,
                                          int world_size);

/// Note [Partitioned optimizer]: loading a state dict on `rank` whose parameters' owners are `owners`
/// and of which `has_state` holds a state: the refusal (another rank's partition), or "" to load it
/// (this rank's, a whole one, or one with no states).
std::string loaded_partition_refusal(const std::vector<int>& owners, const std::vector<bool>& has_state, int rank,
                                     int world_size);

/// Where a state dict's states came from, or where an optimizer's are kept: one rank's share of a partition
/// (`rank` of `world_size`, each parameter's owner in `owners`, kEveryRank for one every rank steps), or the
/// whole (world_size 0).
struct PartitionLayout {
  static constexpr int kEveryRank = -1;
  int rank = 0;
  int world_size = 0;
  std::vector<int> owners;
  bool partitioned() const noexcept { return world_size > 0; }
};

/// Note [Partitioned optimizer]: loading a state dict saved with layout `saved` into an optimizer whose states are
/// kept as `mine`: the refusal, or "" to load it. A whole state dict loads anywhere (a partitioned optimizer keeps
/// its share); one rank's share loads only into the same rank of the same partition (same world size, same owners).
std::string partition_layout_refusal(const PartitionLayout& saved, const PartitionLayout& mine);

/// Note [Partitioned optimizer]: before the owners' weights move, every rank of `world_size` says how its step()
/// went (one all-reduce of two counts: `failed_ranks`, `skipped_ranks`, this rank's own included). The error this
/// rank raises so that no rank waits in a broadcast another will not join, or "": nothing when this rank failed
/// (its own error is raised) or when every rank stepped or every rank skipped (TIERFLOW_SKIP_NONFINITE).
std::string step_agreement_refusal(bool this_rank_failed, int failed_ranks, int skipped_ranks, int world_size);

}  // namespace tierflow::optimizer
