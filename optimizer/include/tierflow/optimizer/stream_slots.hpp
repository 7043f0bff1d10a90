// The gradient stream's bookkeeping that needs no tensor (Note [Gradient streaming] in
// bindings/include/tierflow/bindings/grad_stream.hpp): DDP's reduced slots and where each one's gradient lies in
// a reduced bucket, when a backward's end runs, and which parameters the user wrote since tierflow did (Note
// [Weight content]). GradStream names parameters by their TensorImpl (`key`) and reads the facts from torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tierflow/optimizer/step_engine.hpp"

namespace tierflow::optimizer {

/// DDP's slots that stream their reduced gradients (GradStream::set_reduced), by parameter.
class ReducedSlots {
 public:
  /// `slot`, of parameter `key`, streams from the reduction; false (nothing changes) when `key` is in already.
  bool add(const void* key, std::size_t slot);
  bool empty() const noexcept { return slots_.empty(); }
  /// The slots added, in order.
  const std::vector<std::size_t>& slots() const noexcept { return slots_; }

  /// One parameter of a reduced bucket, in the bucket's order.
  struct Member {
    const void* key = nullptr;
    std::size_t numel = 0;
    /// Of the bucket's dtype (a user's hook may return another: not what DDP casts into p.grad).
    bool same_type = true;
  };
  /// The bucket itself: DDP's flat result.
  struct Flat {
    std::int64_t numel = 0;
    std::int64_t dim = 1;
    bool contiguous = true;
  };
  /// Where a reduced slot's gradient lies in the bucket.
  struct Slice {
    std::size_t slot = 0;
    std::size_t offset = 0;  ///< in elements
    std::size_t numel = 0;
  };
  /// The slices of the members added here and of the bucket's dtype (the others step in step()), in bucket order.
  /// Throws logic_error naming the sizes unless `flat` is one contiguous 1-D tensor of the members' elements.
  std::vector<Slice> slices(const std::vector<Member>& members, const Flat& flat) const;

 private:
  std::vector<std::size_t> slots_;
  std::unordered_map<const void*, std::size_t> by_key_;
};

/// When GradStream's end of backward runs (Note [Distributed training]). It is queued as an autograd final
/// callback at a backward's first gradient, once; with reduced slots it queues itself once more from within the
/// final callbacks, which puts it after DDP's finalize_backward (queued at the last gradient), whose write-back
/// into p.grad it then sees.
class BackwardEnds {
 public:
  /// A gradient arrived; `may_queue`: on the autograd thread (a reduction may come on another). True: queue the
  /// end now (no end is queued for this backward yet).
  bool queue(bool may_queue) noexcept;
  /// The end callback runs; `reduced`: some slots stream reduced gradients. True: it was queued once more (the
  /// caller queues it) and returns; false: it ends the backward now.
  bool requeue(bool reduced) noexcept;
  /// The backward's end ran.
  void ended() noexcept { queued_ = false; }
  /// The window was reset: a backward that failed never ran its end.
  void reset() noexcept { queued_ = requeued_ = false; }

 private:
  bool queued_ = false;    // this backward's end is queued
  bool requeued_ = false;  // ... and queued again, after the reduction's write-back
};

/// Note [Weight content]'s record per slot: whether its master is stale, the user having written its parameter
/// since tierflow did (p.data edits); until a step re-reads it, every step of the slot takes the master from p.
class WrittenWeights {
 public:
  /// Slots 0 .. n-1.
  void resize(std::size_t n) { stale_.resize(n, false); }
  bool stale(std::size_t slot) const { return stale_.at(slot); }
  /// The master of `slot` was read from its parameter (a state set, a step that re-read it).
  void reread(std::size_t slot) { stale_.at(slot) = false; }
  /// At step(): `differs[i]`, tierflow's last write of slot i is known and the bytes now differ. Those masters go
  /// stale; returns every stale slot, and an early step of one (it read the old master) is stepped again (the
  /// ledger's state_set).
  std::vector<std::size_t> judge(const std::vector<bool>& differs, StepLedger& ledger);

 private:
  std::vector<bool> stale_;
};

/// TIERFLOW_OFFLOAD_GRADIENTS: the released slots whose device gradient waits for its copy to the host (rule 3
/// of Note [Copy ordering]); the front end holds that gradient's last reference until then.
class ReleasedGrads {
 public:
  /// `slot`'s gradient was released (p.grad set to None); counted in the engine's grads_released.
  void add(StepEngine& engine, std::size_t slot);
  /// The slots whose copy is seen complete (without blocking): their gradient may go now. Slots restored
  /// (no longer released in the ledger) or no longer held (`holds` false) leave the list; the others stay.
  std::vector<std::size_t> take_landed(const StepEngine& engine, const std::function<bool(std::size_t)>& holds);
  /// Waits for every listed copy and empties the list. Note [Stall timeout]: the slots whose copy stalled (it may
  /// still read the device gradient: kept for good by the caller) and the first stall, rethrown by the caller once
  /// the window is reset; any other failure is logged (its window is discarded).
  struct Waited {
    std::vector<std::size_t> stalled;
    std::exception_ptr stall;
  };
  Waited wait_all(const StepEngine& engine);

 private:
  std::vector<std::size_t> slots_;
};

/// The user's clip writes gradients in place (Note [Clip picked up]): per device, the gradient copy of
/// `candidates` (slot, device) sent last, which the device's compute stream waits for; copies in one direction
/// complete in submission order (Note [Copy ordering]). Devices in order of first appearance.
std::vector<std::pair<DeviceId, std::size_t>> last_copied(
    const StepEngine& engine, const std::vector<std::pair<std::size_t, DeviceId>>& candidates);

}  // namespace tierflow::optimizer
