#include "tierflow/optimizer/partition.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace tierflow::optimizer {

std::vector<int> partition_parameters(const std::vector<std::uint64_t>& elements, int world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("partition_parameters: world_size must be at least 1, got " +
                                std::to_string(world_size));
  }
  std::vector<std::size_t> order(elements.size());
  std::iota(order.begin(), order.end(), 0);
  // Largest first; equal sizes in the order given.
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return elements[a] > elements[b]; });
  std::vector<std::uint64_t> load(static_cast<std::size_t>(world_size), 0);
  std::vector<int> owners(elements.size(), 0);
  for (std::size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());  // the first of the least loaded
    owners[i] = static_cast<int>(least - load.begin());
    *least += elements[i];
  }
  return owners;
}

std::vector<std::uint64_t> owned_elements(const std::vector<int>& owners, const std::vector<std::uint64_t>& elements,
                                          int world_size) {
  std::vector<std::uint64_t> out(static_cast<std::size_t>(std::max(world_size, 0)), 0);
  for (std::size_t i = 0; i < owners.size() && i < elements.size(); ++i) {
    if (owners[i] >= 0 && owners[i] < world_size) out[static_cast<std::size_t>(owners[i])] += elements[i];
  }
  return out;
}

std::string loaded_partition_refusal(const std::vector<int>& owners, const std::vector<bool>& has_state, int rank,
                                     int world_size) {
  std::size_t mine = 0, others = 0;
  std::vector<bool> seen(static_cast<std::size_t>(std::max(world_size, 0)), false);
  for (std::size_t i = 0; i < owners.size() && i < has_state.size(); ++i) {
    if (!has_state[i]) continue;
    if (owners[i] == rank) {
      ++mine;
    } else {
      ++others;
      if (owners[i] >= 0 && owners[i] < world_size) seen[static_cast<std::size_t>(owners[i])] = true;
    }
  }
  if (mine > 0 || others == 0) return "";
  std::string whose;
  for (int r = 0; r < world_size; ++r) {
    if (!seen[static_cast<std::size_t>(r)]) continue;
    whose += (whose.empty() ? "" : ", ") + std::to_string(r);
  }
  return "tierflow's CPU optimizer, partitioned across " + std::to_string(world_size) +
         " ranks (TIERFLOW_PARTITION_OPTIMIZER=on: each rank keeps the states of its own parameters): this state "
         "dict holds the states of " + std::to_string(others) + " parameters of rank " + whose + " and none of rank " +
         std::to_string(rank) + "'s, so loading it would leave rank " + std::to_string(rank) +
         "'s parameters with fresh moments; accepted: each rank loads the state dict it saved itself "
         "(torch.save(optimizer.state_dict(), f'optimizer-rank{rank}.pt') on every rank), or a whole one "
         "saved without partitioning";
}

std::string step_agreement_refusal(bool this_rank_failed, int failed_ranks, int skipped_ranks, int world_size) {
  if (this_rank_failed) return {};  // the caller raises its own error
  if (failed_ranks > 0)
    return "tierflow's partitioned CPU optimizer: another rank's step() failed (its error says why); this rank "
           "stepped its own parameters but no new weights were exchanged, so the replicas differ now: resume from the "
           "last checkpoint";
  if (skipped_ranks > 0 && skipped_ranks < world_size)
    return "tierflow's partitioned CPU optimizer: " + std::to_string(skipped_ranks) + " of " +
           std::to_string(world_size) +
           " ranks skipped this step (TIERFLOW_SKIP_NONFINITE: a gradient not finite on those ranks only, one DDP "
           "does not reduce) and the others stepped, so the replicas differ now: resume from the last checkpoint, or "
           "keep every parameter's gradient reduced by DDP";
  return {};
}

std::string partition_layout_refusal(const PartitionLayout& saved, const PartitionLayout& mine) {
  if (!saved.partitioned()) return "";
  const std::string what = "this optimizer state dict holds rank " + std::to_string(saved.rank) + "'s share of a CPU "
                           "optimizer partitioned across " + std::to_string(saved.world_size) +
                           " ranks (TIERFLOW_PARTITION_OPTIMIZER=on: each rank keeps the states of its own "
                           "parameters)";
  const std::string accepted = "; accepted: each rank loads the state dict it saved itself, into the same model "
                               "and parameter groups on as many ranks with TIERFLOW_PARTITION_OPTIMIZER=on";
  if (!mine.partitioned()) {
    return what + ", and this optimizer is not partitioned, so the other ranks' parameters would start with fresh "
                  "moments" + accepted;
  }
  if (saved.world_size != mine.world_size || saved.owners != mine.owners) {
    return what + ", and this optimizer is partitioned differently (" + std::to_string(mine.world_size) +
           " ranks" + (saved.world_size == mine.world_size ? ", other owners" : "") +
           "), so some of its parameters' states are in another rank's file" + accepted;
  }
  if (saved.rank != mine.rank) {
    return what + ", and this is rank " + std::to_string(mine.rank) + ", whose parameters would start with fresh "
                  "moments" + accepted;
  }
  return "";
}

}  // namespace tierflow::optimizer
