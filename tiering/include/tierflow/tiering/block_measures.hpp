// What a C++ trainer's block calls measure while no activation plan is in force (Note [C++ auto activations] in
// bindings/include/tierflow/bindings/block_offload.hpp): each block's record (its input, what its rerun leaves
// saved, its parameters, its forward and backward) and the timed step's sums, which calls start a forward pass,
// and the parameter bytes the budgets count. Torch-free: the bindings' BlockAutoPlan times and measures the calls
// and hands the figures here; the plan driver (Note [Plan driver]) reads them as a front end's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tierflow/tiering/auto_plan.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace tierflow::tiering {

/// The blocks' measures of a C++ trainer's BlockOffload under auto. Not thread-safe: the caller's lock.
class BlockMeasures {
 public:
  /// Block `block` is called with a graph: true when the call starts a forward pass (the first call, or a block
  /// index not above the previous call's, as BlockCalls counts them).
  bool starts_forward(std::size_t block) noexcept;
  /// Block `block`'s forward (autograd off) took `seconds` on `input_bytes` with `parameter_bytes`.
  void forward(std::size_t block, std::uint64_t input_bytes, std::uint64_t parameter_bytes, double seconds);
  /// Its rerun in backward (a kept forward) left `saved_bytes` for its backward, which took `backward_seconds`:
  /// everything it saves beyond its input is one class, swapped whole or recomputed with the block (C++ has no
  /// split).
  void rerun(std::size_t block, std::uint64_t saved_bytes, double backward_seconds);
  /// The timed step begins: the sums start from 0.
  void start_timing() noexcept;
  /// The timed step's blocks and sums (the rerun's forward is the replay; its backward the block's own); the
  /// links and the rest are the caller's.
  TimedStepMeasures timed_step() const;
  /// The parameter bytes the budgets count: every parameter on the device (ParamPolicy::kResident), the
  /// model's (`model_bytes`; 0: not given) or the blocks' own, the larger.
  std::uint64_t parameter_bytes(std::uint64_t model_bytes) const noexcept;

 private:
  struct Block {
    BlockRecord record;
    double forward_seconds_sum = 0, backward_seconds_sum = 0;  // in the timed step
  };
  Block& at(std::size_t block);

  std::vector<Block> blocks_;
  bool started_ = false;
  std::size_t last_block_ = 0;
};

/// The split blocks of `blocks`: every split is inexact for a front end without a split action (C++; its records
/// say has_split_ops = false, so none is planned).
std::vector<std::size_t> split_blocks(const std::vector<BlockPlan>& blocks);

}  // namespace tierflow::tiering
