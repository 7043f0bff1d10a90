// What happens to each saved activation, and when it comes back.
//
// Note [Recorded-order prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Training repeats: step N+1 saves the same tensors in the same order as
// step N and backward reads them in the same order. So the schedule records
// the order of first reads (unpacks) in each backward and, in the next
// backward, prefetches in that order: when backward starts and after every
// read it tops up a window of at most `prefetch_bytes` of offloaded blocks
// that have been requested but not yet read. With no usable record (the
// first step, or a step that saved a different number of blocks) it assumes
// reverse save order, which is what autograd does for a chain of layers.
// A read that was not the one expected is counted as an order miss.
#pragma once

#include <cstdint>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/block_registry.hpp"

namespace tierflow::tiering {

/// Settings of an ActivationSchedule.
struct ActivationScheduleOptions {
  /// none keeps every block; host, nvme, recompute and auto offload the
  /// blocks nobody directed otherwise (auto and recompute: the tensors saved
  /// outside the planned blocks, Note [Activation plans]).
  OffloadTarget target = OffloadTarget::kHost;
  std::uint64_t prefetch_bytes = 64ULL << 20;   ///< window of offloaded bytes fetched ahead
  std::uint64_t keep_tail_bytes = 0;            ///< nvme: last-saved bytes kept on the device
};

/// What the caller of on_pack() asks for one block. kPolicy follows the
/// target; the planner's decisions for a block arrive as kKeep or kOffload.
enum class PackDirective : std::uint8_t { kPolicy, kKeep, kOffload };

/// The decision for one saved block.
struct PackDecision {
  BlockId id;    ///< the block's id in this forward
  bool offload;  ///< true: copy to host and drop the device copy
};

/// Counters of the schedule since creation.
struct ActivationScheduleStats {
  std::uint64_t forwards = 0;          ///< forward passes seen
  std::uint64_t backwards = 0;         ///< backward passes seen
  std::uint64_t recorded_orders_used = 0;  ///< backwards that prefetched from a recorded order
  std::uint64_t order_misses = 0;      ///< reads that were not the next expected block
  std::uint64_t offloaded_blocks = 0;  ///< blocks sent to the host
  std::uint64_t kept_blocks = 0;       ///< blocks kept on the device
};

/// Per-step policy and ordering for saved activations; see Note [Recorded-order prefetch].
/// Not thread-safe: called from the thread that runs autograd hooks.
class ActivationSchedule {
 public:
  explicit ActivationSchedule(ActivationScheduleOptions options);

  /// Starts a forward pass: archives the last backward's read order.
  void begin_forward();
  /// Registers a newly saved block. `eligible` is false for blocks that must
  /// stay on the device (too small, or inside a no-offload region).
  PackDecision on_pack(std::size_t bytes, bool eligible, PackDirective directive = PackDirective::kPolicy);
  /// Backward has started: returns the offloaded blocks to prefetch now.
  std::vector<BlockId> begin_backward();
  /// Backward read block `id`: records it and returns the blocks to prefetch next.
  std::vector<BlockId> on_unpack(BlockId id);
  /// Whether `id` was already read in this backward.
  bool consumed(BlockId id) const { return id < consumed_.size() && consumed_[id]; }

  /// The registry of this step's blocks.
  BlockRegistry& registry() noexcept { return registry_; }
  /// The registry of this step's blocks.
  const BlockRegistry& registry() const noexcept { return registry_; }
  /// Counters.
  const ActivationScheduleStats& stats() const noexcept { return stats_; }
  /// Settings.
  const ActivationScheduleOptions& options() const noexcept { return options_; }
  /// A new prefetch window from the next read on (a plan's; Note [Overlap window] in auto_plan.hpp); > 0.
  void set_prefetch_bytes(std::uint64_t bytes);
  /// The order backward is expected to read this step's blocks in.
  const std::vector<BlockId>& expected_order() const noexcept { return expected_; }

 private:
  std::vector<BlockId> fill_window();
  bool in_resident_tail(std::size_t bytes) const;

  ActivationScheduleOptions options_;
  BlockRegistry registry_;
  ActivationScheduleStats stats_;
  std::vector<bool> offloaded_;        // per block of this forward
  std::vector<bool> requested_;        // prefetch requested in this backward
  std::vector<bool> consumed_;         // read in this backward
  std::vector<BlockId> read_order_;    // first reads of this backward
  std::vector<BlockId> recorded_;      // read order of the previous backward
  std::vector<std::size_t> packed_bytes_;           // sizes saved in this forward, in order
  std::vector<std::size_t> previous_packed_bytes_;  // the same for the previous forward
  std::size_t recorded_blocks_ = 0;    // blocks saved in the step `recorded_` came from
  std::size_t last_forward_blocks_ = 0;
  std::vector<BlockId> expected_;
  std::size_t cursor_ = 0;             // first position in expected_ not yet read
  std::uint64_t window_bytes_ = 0;     // requested, not yet read
  bool in_backward_ = false;
  BlockId first_block_ = 0;            // first block of the current forward
};

}  // namespace tierflow::tiering
