// What happens to each tensor a planned block saves for backward: the
// per-tensor half of the policy whose per-block half is tiering::plan_activations
// (Note [Activation planner]); bindings/ only carries it out (Note [Activation plans]).
#pragma once

#include <cstdint>
#include <string_view>

#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// What a saved tensor of a block is, from the op that produced its storage.
enum class SavedClass : std::uint8_t {
  kExternal,   ///< parameters, buffers, tensors made before the block
  kInput,      ///< a tensor argument of the block
  kAttention,  ///< an output of an attention op (output, softmax statistics)
  kSplit,      ///< the output of a row-wise matmul of an activation by parameters
  kCheap,      ///< anything else the block computes (norms, pointwise, masks)
};

/// What happens to it between forward and backward.
enum class SavedAction : std::uint8_t {
  kReference,  ///< autograd keeps the tensor itself (it stays where it is)
  kSwap,       ///< the whole storage goes to the block's tier
  kSwapRows,   ///< the first rows go to the tier; the others are recomputed
  kRecompute,  ///< dropped; the block's replay rebuilds it
};

/// The action for one saved tensor of a block in `mode`. `exact` says, for
/// kAttention, that the op's every output is saved (so the replay can restore
/// the op instead of running it) and, for kSplit, that a row split of this
/// matmul was probed exact with at least one row to swap. Without it the
/// tensor is recomputed: a split never changes what the block computes.
SavedAction saved_action(BlockMode mode, SavedClass cls, bool exact) noexcept;

/// Rows of a split matmul's output that are swapped for a block's alpha: the
/// largest multiple of `granule` not above alpha * rows, or all rows when
/// alpha is 1 (a whole output swapped needs no probe).
std::int64_t split_rows(double alpha, std::int64_t rows, std::int64_t granule) noexcept;
/// The granule of a recorded block's split: whole cache lines of a row-major output.
inline constexpr std::int64_t kSplitRowGranule = 8;

std::string_view to_string(SavedClass c) noexcept;
/// The class named `text` (to_string's names); config_error naming it and the accepted names.
SavedClass parse_saved_class(std::string_view text);
std::string_view to_string(SavedAction a) noexcept;

}  // namespace tierflow::tiering
