// Which blocks may be replayed in backward, and what a replay restores first.
//
// Note [Replay side effects]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A block that is recomputed (recompute, a token-wise split, auto's two profiling steps; every action of the
// C++ BlockOffload but kKeep) runs its forward twice: once in forward and once in backward, to rebuild what it
// saved. Whatever else that forward does happens twice too. Three kinds of it were met:
//
// 1. State written in place: BatchNorm's running_mean, running_var and num_batches_tracked (the replay updated
//    them again: 6 batches counted after 3 steps, the running means 2e-2 off, so evaluation changed),
//    spectral_norm's power-iteration vectors u and v (torch.nn.utils.spectral_norm's buffers weight_u/weight_v,
//    parametrizations.spectral_norm's _u/_v: the replay iterated from the forward's result, another sigma,
//    gradients 1.9e-2 off), torch.ao's observers' min/max. All are the block's parameters and buffers (its
//    submodules' included), and small. So they are restored: the bindings keep each written tensor's value
//    from before the forward (found while the block is recorded: a write into the storage of one of its
//    parameters or buffers; later forwards keep the ones their recording found, and compare version counters
//    and identities before and after), and a replay sets those values, runs, and puts back what was there
//    (the forward's result, or a later forward's: a block called twice in a step is replayed in reverse), the
//    version counters as they were. A buffer rebound to a new tensor (`self.ema = self.ema * m + ...`) is
//    rebound the same way. The replay then runs on the very state its forward ran on, and leaves the state as
//    it found it: bit for bit the baseline's, running statistics included.
// 2. A forward that writes such state its recording did not (data-dependent): there is nothing to restore from,
//    so that forward is not replayed: what it saved is swapped whole (Note [Data-dependent blocks]), and later
//    forwards keep that tensor's value too.
// 3. Forward hooks and pre-hooks that are a user's (a counter, statistics collected in Python, anything that
//    reaches outside the block): nothing can restore them in general. A block carrying one, on itself or on a
//    submodule, or under a global module hook, is not replayed: it runs as swap (its saved tensors to its
//    tier), whatever the plan or TIERFLOW_OFFLOAD_ACTIVATIONS=recompute says, and auto plans it as keep or
//    swap only (BlockProfile::replayable). Hooks that are not a user's: tierflow's own (its runners, the
//    session's, the parameter fetches), and torch's own (torch.nn.utils.spectral_norm's and weight_norm's
//    pre-hooks, pruning, torch.ao's observers, FSDP2's): these compute from the module's state, so the
//    comparison of 1. covers what they write. A torch hook writing anything else would be missed; none does.
//
// Each refusal is said once per block and reason, named, and is in the report (plan.not_replayed); what was
// restored is counted (plan.replay_restored). The decision is here; the bindings measure the facts it is made
// from (which hooks, what was written) and carry it out.
//
// The C++ BlockOffload (Note [C++ block offload] in bindings/include/tierflow/bindings/block_offload.hpp) reruns
// a block's forward in backward, and the same holds: the rerun would write the block's state again (BatchNorm's
// running statistics, which native_batch_norm writes without bumping a version counter; a power iteration's
// vectors) and compute from the forward's result instead of what the forward started from. The trainer hands
// in the tensors a block may write beside its parameters, and BlockWrites keeps per block which of them any
// call wrote: on a block's first call every one of them and of its parameters is copied before the forward and
// compared after (by value for the state, by version counter for the parameters); the ones it wrote are copied
// before each later call. The rerun sets those copies, runs, and puts back what the tensors held (the forward's
// result, or a later call's), version counters as they were. A later call that writes a tensor its first call
// did not (its version counter moved) had no copy taken: replay_refusal says why, once, and the block is kept
// (kKeep) from its next call on (block_call_action). C++ modules have no forward hooks, so the other refusal
// does not arise there.
#pragma once

#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// What one forward of a block did besides computing its outputs (Note [Replay side effects]).
struct BlockSideEffects {
  std::vector<std::string> foreign_hooks;       ///< forward hooks and pre-hooks neither tierflow's nor torch's own
  std::vector<std::string> unrestorable_state;  ///< parameters and buffers it wrote with no value from before kept
};

/// Why the forward may not be replayed ("" when it may): a user's hook, or state it wrote that cannot be
/// restored (Note [Replay side effects]).
std::string replay_refusal(const BlockSideEffects& effects);

/// The mode a block runs in: one that may not be replayed swaps where `planned` would replay (split,
/// recompute); keep and swap stay.
BlockMode replay_mode(BlockMode planned, bool replayable) noexcept;

/// What the C++ BlockOffload's blocks write in place in their forwards, and what a rerun restores (Note [Replay
/// side effects], 1. and 2.; Note [C++ block offload], What a rerun restores): per block, which of its tracked
/// tensors (its state tensors first, then its parameters) any call wrote, whether its first call was compared by
/// value, and why it is no longer rerun. The bindings clone, compare and restore the tensors. Not thread-safe:
/// the caller holds its lock.
class BlockWrites {
 public:
  /// Before a call of a block over `tracked` tensors: which to keep a value of from before the forward.
  struct Before {
    bool compared = false;    ///< its first call was compared already: only version counters tell a write now
    std::vector<bool> known;  ///< written by an earlier call
    std::vector<bool> keep;   ///< keep a value from before: every one on the first call, later the known ones
  };
  Before before(std::size_t block, std::size_t tracked) const;

  /// After the call.
  struct After {
    std::vector<bool> restore;  ///< what its rerun restores: kept, and written now or by an earlier call
    std::string refused_now;    ///< why the block is not rerun from its next call on, the first time (else "")
  };
  /// `wrote[i]`: tracked tensor i was written (the first `state_count` are state tensors) by the call `before`
  /// was taken for. A write with no value kept refuses the block's reruns from its next call on.
  After after(std::size_t block, std::size_t state_count, const Before& before, const std::vector<bool>& wrote);

  /// Why the block is no longer rerun ("" while it is).
  std::string refusal(std::size_t block) const;

 private:
  struct Block {
    bool compared = false;
    std::vector<bool> written;  // state, then parameters
    std::string refused;
  };
  std::unordered_map<std::size_t, Block> blocks_;
};

}  // namespace tierflow::tiering
