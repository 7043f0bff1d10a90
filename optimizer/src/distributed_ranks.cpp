#include "tierflow/optimizer/distributed_ranks.hpp"

#include <stdexcept>

namespace tierflow::optimizer {

bool RankPartition::owns(std::size_t i) const noexcept {
  if (i >= owners.size()) return true;
  return owners[i] == rank || owners[i] == PartitionLayout::kEveryRank;
}

PartitionLayout RankPartition::layout() const { return PartitionLayout{rank, world_size, owners}; }

RankPartition partition_ranks(const std::vector<RankParameter>& params, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("partition_ranks: rank " + std::to_string(rank) + " of " +
                                std::to_string(world_size) + " ranks");
  }
  RankPartition out;
  out.rank = rank;
  out.world_size = world_size;
  std::vector<std::uint64_t> shared_elements;
  std::vector<std::size_t> shared;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].reduced) continue;
    shared.push_back(i);
    shared_elements.push_back(params[i].elements);
  }
  const std::vector<int> owned = partition_parameters(shared_elements, world_size);
  out.owners.assign(params.size(), PartitionLayout::kEveryRank);
  for (std::size_t k = 0; k < shared.size(); ++k) out.owners[shared[k]] = owned[k];
  out.broadcasts = shared;  // the optimizer's order: the same on every rank
  for (std::size_t i = 0; i < params.size(); ++i) {
    out.elements += params[i].elements;
    if (out.owns(i)) {
      out.owned_elements += params[i].elements;
      ++out.owned_parameters;
    }
  }
  for (std::size_t i : shared) out.broadcast_bytes += params[i].elements * params[i].element_bytes;
  return out;
}

std::string loaded_share_refusal(const RankPartition& mine, const std::optional<PartitionLayout>& saved,
                                 const std::vector<bool>& has_state) {
  std::string why = partition_layout_refusal(saved.value_or(PartitionLayout{}), mine.layout());
  if (!why.empty() || saved.has_value()) return why;
  std::vector<int> owners = mine.owners;  // one every rank steps: this rank's own state
  for (int& o : owners) {
    if (o == PartitionLayout::kEveryRank) o = mine.rank;
  }
  return loaded_partition_refusal(owners, has_state, mine.rank, mine.world_size);
}

std::string partitioned_join_refusal(bool join_enabled) {
  if (!join_enabled) return {};
  return "tierflow's CPU optimizer is partitioned across the DDP ranks (TIERFLOW_PARTITION_OPTIMIZER=on: "
         "each rank steps its own parameters and broadcasts their new weights in step()), and DDP's join() "
         "was entered on this DDP module (its join configuration stays on after the join block): a rank "
         "that ran out of inputs skips step(), so its parameters would not be stepped and the others would "
         "wait for their weights; accepted with join(): TIERFLOW_PARTITION_OPTIMIZER=off "
         "(partition_optimizer='off', the default: every rank steps every parameter)";
}

BucketScaling ddp_bucket_scaling(bool gradient_as_bucket_view, int world_size) {
  if (world_size < 1) throw std::invalid_argument("ddp_bucket_scaling: world size " + std::to_string(world_size));
  // DDP divides in place with gradient_as_bucket_view=True and multiplies by 1 / n otherwise (reducer.cpp).
  if (gradient_as_bucket_view) return {true, static_cast<double>(world_size)};
  return {false, 1.0 / static_cast<double>(world_size)};
}

std::string ddp_join_divisor_refusal(bool join_enabled, bool divide_by_initial_world_size) {
  if (!join_enabled || divide_by_initial_world_size) return {};
  return "tierflow: DistributedDataParallel.join(divide_by_initial_world_size=False) under tierflow: DDP then "
         "divides each gradient by the number of ranks that have not joined, which it tells its own reduction "
         "only, and tierflow reduces through a DDP communication hook (to step during backward from the reduced "
         "gradients), which divides by the world size; accepted: join() with divide_by_initial_world_size=True "
         "(the default), or TIERFLOW_OVERLAP_STEP=off (overlap_step='off'; DDP then reduces by itself)";
}

std::string ddp_feed_refusal(const std::string& registered_hook, bool ours, bool python_reducer) {
  if (ours) return {};  // an earlier session's hook: it feeds the new optimizer
  if (!registered_hook.empty()) {
    return "a DDP communication hook is registered on it already (" + registered_hook +
           "; DDP's mixed_precision and optimizer-in-backward register one too), and DDP takes one only; register "
           "yours after tierflow.wrap has seen the DDP module (tierflow then runs it and steps from what it returns)";
  }
  if (python_reducer) return "DDP runs its Python reducer (compiled autograd), which calls hooks per parameter";
  return {};
}

std::string ddp_offload_gradients_refusal(bool gradients_offloaded, const std::string& how) {
  if (!gradients_offloaded) return {};
  return "tierflow: TIERFLOW_OFFLOAD_GRADIENTS=on does not work under torch.nn.parallel.DistributedDataParallel "
         "(DDP; " + how + "): it sets p.grad to None during backward, while DDP still has to all-reduce that "
         "gradient; accepted under DDP: TIERFLOW_OFFLOAD_GRADIENTS=off (offload_gradients='off')";
}

std::string ddp_steps_after_backward_warning(const std::string& how, const std::string& why) {
  return "tierflow: the model is trained with torch.nn.parallel.DistributedDataParallel (DDP) (" + how +
         "), and tierflow cannot feed its CPU optimizer the reduced gradients during backward: " + why +
         ". So under this DDP tierflow's CPU optimizer steps after backward, in step(), from the reduced gradients, "
         "instead of stepping each parameter during backward (from the local gradient, step() would have to redo "
         "every such step). The results are the same; what is lost is the overlap of the CPU step with backward. "
         "TIERFLOW_OVERLAP_STEP=off (overlap_step='off') asks for this and silences this warning.";
}

std::string redone_steps_warning(std::int64_t redone, std::int64_t committed, double scale, int world_size) {
  if (redone <= 0 || committed != 0 || scale != 1.0 || world_size <= 1) return {};
  return "tierflow: in this " + std::to_string(world_size) +
         "-process run, every parameter that tierflow's CPU optimizer stepped during backward had to be stepped "
         "again in step(), because what it stepped from changed after backward (its gradient, as an all-reduce of "
         "the gradients does: DDP's, or one written by hand between backward() and step()); from now on the "
         "optimizer steps after backward, in step() only, instead of doing every step twice. The results are the "
         "same; what is lost is the overlap of the CPU step with backward (under DDP tierflow steps from the reduced "
         "gradients itself). TIERFLOW_OVERLAP_STEP=off (overlap_step='off') asks for this and silences this "
         "warning.";
}

std::string ddp_builtin_hook_refusal(const std::string& hook_type) {
  return "DistributedDataParallel._register_builtin_comm_hook(" + hook_type +
         ") after tierflow.wrap: tierflow registered its own DDP communication hook, which streams the reduced "
         "gradients to its CPU optimizer, and DDP takes one only; accepted: a Python hook through "
         "ddp.register_comm_hook(state, hook) (tierflow runs it in place of its all-reduce), or a built-in hook "
         "registered before tierflow.wrap (tierflow's CPU optimizer then steps after backward)";
}

std::string ddp_second_hook_refusal(const std::string& registered) {
  return "register_comm_hook or register_builtin_comm_hook can only be called once (a hook is registered already: " +
         registered + ")";
}

}  // namespace tierflow::optimizer
