// The bookkeeping of an optimizer step that fails for some parameters and not
// others, torch-free: which parameters already stepped, the error's text, and
// the kernel calls of a group whose step counts disagree.
//
// Note [C++ CpuAdamW faults]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With states on NVMe a step can fail for some parameters (a full disk, a
// failed write, a corrupt state) and not others: the store steps every item it
// can (Note [NVMe optimizer faults] in state_tier.hpp has the Python
// CPUAdamW's side of the same rule).
// Each parameter that stepped takes its new step count and weight (copied
// back to the device as usual) and remembers the gradient it stepped with
// (its identity and version: StepRetryMarks); the others keep their step
// count, state and weight. step() then throws one io_error naming the
// parameters that did not step (group, index, shape: unstepped_message).
// Calling step() again with the same gradients steps only those, so every
// parameter steps once; a new gradient (after zero_grad and backward) is a
// new step for all. A step() that completes clears the marks.
// Since a step count moves only once its parameter has stepped, the
// parameters of one group can be at different step numbers after a partial
// step: each step number is one kernel call (groups_by_next_step), the
// lowest first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/step_ledger.hpp"

namespace tierflow::optimizer {

/// Which parameters ("slots") stepped, and with which gradient, in a step()
/// that failed for others; see Note [C++ CpuAdamW faults].
class StepRetryMarks {
 public:
  /// `slot` stepped with `grad` (a defined gradient).
  void mark(std::size_t slot, GradIdentity grad);
  /// True when `slot` stepped with `grad` (same tensor at the same version)
  /// since the last clear(): a retry with that gradient skips it.
  bool stepped_with(std::size_t slot, GradIdentity grad) const noexcept;
  /// A step() completed: no slot is marked.
  void clear() noexcept;
  /// Slots marked now.
  std::size_t marked() const noexcept;

 private:
  std::vector<GradIdentity> marks_;  // by slot; undefined: not marked
};

/// A parameter that did not step: its param group, its index in the group and its shape.
struct UnsteppedParameter {
  std::size_t group = 0;
  std::size_t index = 0;
  std::vector<std::int64_t> shape;
};

/// How many unstepped parameters the error names one by one; the rest are counted.
inline constexpr std::size_t kUnsteppedNamed = 8;

/// The text of CpuAdamW's error after a step() that failed for `unstepped`
/// (not empty); `first_error` is the first cause the store reported.
std::string unstepped_message(const std::vector<UnsteppedParameter>& unstepped, std::string_view first_error);

/// group_by_step over the step numbers the candidates take next
/// (`steps_taken[i] + 1`), in ascending step order (CpuAdamW's kernel calls,
/// and so the order its error names the parameters in); each group keeps the
/// candidates' order.
std::vector<StepGroup> groups_by_next_step(const std::vector<std::int64_t>& steps_taken);

}  // namespace tierflow::optimizer
