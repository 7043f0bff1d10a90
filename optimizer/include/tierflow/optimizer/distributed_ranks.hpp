// Note [Rank decisions under DDP]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What tierflow decides when DistributedDataParallel (DDP) trains the model,
// torch-free (Note [Distributed training] in bindings/python/tierflow/
// _distributed.py tells the whole story; _distributed.py, _ddp_feed.py and
// optim/partition.py only gather torch's facts, call torch.distributed and
// apply what these functions return):
//
// - The partition (Note [Partitioned optimizer] in partition.hpp): a
//   parameter DDP reduces (it needs a gradient and DDP holds it) gets one
//   owner rank (partition_parameters); any other one (frozen, ignored by DDP,
//   outside the DDP module) has no reduced gradient on its owner, so every
//   rank steps it itself (PartitionLayout::kEveryRank). step() broadcasts
//   each partitioned parameter's new weights from its owner, in the
//   optimizer's order (the same on every rank, fixed when the partition is
//   made), one broadcast per parameter; a parameter every rank steps is never
//   sent.
// - DDP's bucket reduction in tierflow's communication hook is DDP's own:
//   each gradient divided by the world size in place with
//   gradient_as_bucket_view=True, times 1 / world size otherwise, then one
//   all-reduce sum per bucket.
// - The refusals and warnings, each naming the setting and what is accepted:
//   TIERFLOW_OFFLOAD_GRADIENTS=on under DDP, join(divide_by_initial_world_size
//   =False) beside the hook, join() beside the partition, a built-in hook or a
//   second hook after tierflow's, and why the steps during backward go off
//   (a hook registered before tierflow saw DDP, DDP's Python reducer, or every
//   early step redone in a multi-process run: a hand-written all-reduce).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/optimizer/partition.hpp"

namespace tierflow::optimizer {

/// One parameter of the optimizer, in its order, as the partition sees it.
struct RankParameter {
  std::uint64_t elements = 0;       // numel
  std::uint64_t element_bytes = 0;  // bytes of one element
  bool reduced = false;             // it needs a gradient and DDP reduces it: it can have one owner
};

/// This rank's share of a partitioned optimizer (Note [Rank decisions under DDP]).
struct RankPartition {
  int rank = 0;
  int world_size = 1;
  std::vector<int> owners;              // per parameter: its owner, or PartitionLayout::kEveryRank
  std::vector<std::size_t> broadcasts;  // the partitioned parameters, in the order step() broadcasts them
  std::uint64_t elements = 0;           // of every parameter
  std::uint64_t owned_elements = 0;     // of those this rank steps (its own and those every rank steps)
  std::size_t owned_parameters = 0;
  std::uint64_t broadcast_bytes = 0;    // sent or received per step() (the partitioned parameters' bytes)
  /// Whether this rank keeps parameter `i`'s states and steps it (out of range: not the optimizer's, yes).
  bool owns(std::size_t i) const noexcept;
  /// What a state dict of this rank's share records.
  PartitionLayout layout() const;
};

/// The partition of `params` on `rank` of `world_size` ranks; throws std::invalid_argument for a rank outside it.
RankPartition partition_ranks(const std::vector<RankParameter>& params, int rank, int world_size);

/// Loading a state dict into `mine`: `saved` is the layout it recorded (nullopt: none recorded, as
/// torch.distributed.checkpoint drops it; then which parameters `has_state` tells whose share it is). The refusal,
/// or "" to load it.
std::string loaded_share_refusal(const RankPartition& mine, const std::optional<PartitionLayout>& saved,
                                 const std::vector<bool>& has_state);

/// step() of a partitioned optimizer after DDP's join() was entered (`join_enabled`): the refusal, or "".
std::string partitioned_join_refusal(bool join_enabled);

/// How tierflow's communication hook scales one of DDP's buckets before the all-reduce sum, as DDP does.
struct BucketScaling {
  bool divide = false;    // in place by the world size (gradient_as_bucket_view=True)
  double factor = 1.0;    // the divisor when `divide`, else the multiplier 1 / world size
};
BucketScaling ddp_bucket_scaling(bool gradient_as_bucket_view, int world_size);

/// DDP's join(divide_by_initial_world_size=False) beside tierflow's hook: the refusal, or "".
std::string ddp_join_divisor_refusal(bool join_enabled, bool divide_by_initial_world_size);

/// Why tierflow cannot feed DDP's reduced gradients to its CPU optimizer, or "" (it can): `registered_hook` names a
/// communication hook on the DDP module already ("": none), `ours` says it is tierflow's own (an earlier session's),
/// `python_reducer` that DDP runs its Python reducer (compiled autograd).
std::string ddp_feed_refusal(const std::string& registered_hook, bool ours, bool python_reducer);

/// TIERFLOW_OFFLOAD_GRADIENTS=on under DDP (`how` DDP was seen): the refusal, or "" when gradients stay.
std::string ddp_offload_gradients_refusal(bool gradients_offloaded, const std::string& how);

/// The warning when the steps during backward go off under DDP (`how` it was seen, `why`: ddp_feed_refusal).
std::string ddp_steps_after_backward_warning(const std::string& how, const std::string& why);

/// After step() confirmed the early steps: every one `redone`, none `committed`, unscaled (`scale` 1), in a run
/// of `world_size` > 1 processes means the gradients are all-reduced behind tierflow's back: the warning that
/// turns the steps during backward off, or "".
std::string redone_steps_warning(std::int64_t redone, std::int64_t committed, double scale, int world_size);

/// A built-in DDP hook (`hook_type`) registered after tierflow's: the refusal.
std::string ddp_builtin_hook_refusal(const std::string& hook_type);

/// A second hook registered through DDP's register_comm_hook after `registered` (the first): the error.
std::string ddp_second_hook_refusal(const std::string& registered);

}  // namespace tierflow::optimizer
