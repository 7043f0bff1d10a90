// See Note [C++ CpuAdamW faults] in partial_step.hpp.
#include "tierflow/optimizer/partial_step.hpp"

#include <algorithm>

#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {

void StepRetryMarks::mark(std::size_t slot, GradIdentity grad) {
  TIERFLOW_EXPECTS(grad.defined(), "StepRetryMarks: a slot steps with a gradient");
  if (slot >= marks_.size()) marks_.resize(slot + 1);
  marks_[slot] = grad;
}

bool StepRetryMarks::stepped_with(std::size_t slot, GradIdentity grad) const noexcept {
  if (slot >= marks_.size() || !grad.defined()) return false;
  const GradIdentity& m = marks_[slot];
  return m.id == grad.id && m.version == grad.version;
}

void StepRetryMarks::clear() noexcept { marks_.clear(); }

std::size_t StepRetryMarks::marked() const noexcept {
  std::size_t n = 0;
  for (const auto& m : marks_) n += m.defined() ? 1 : 0;
  return n;
}

namespace {

// As c10 prints an IntArrayRef: "[300, 70]".
std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string unstepped_message(const std::vector<UnsteppedParameter>& unstepped, std::string_view first_error) {
  std::string which;
  for (std::size_t i = 0; i < unstepped.size() && i < kUnsteppedNamed; ++i) {
    which += (i ? ", " : "") + std::string("group ") + std::to_string(unstepped[i].group) + " parameter " +
             std::to_string(unstepped[i].index) + " " + shape_text(unstepped[i].shape);
  }
  if (unstepped.size() > kUnsteppedNamed) which += " and " + std::to_string(unstepped.size() - kUnsteppedNamed) + " more";
  return "tierflow CpuAdamW: " + std::to_string(unstepped.size()) +
         " parameters did not step and kept their state and weights (" + which +
         "); the others stepped. Call step() again once the cause is fixed: it steps only those. First error: " +
         std::string(first_error);
}

std::vector<StepGroup> groups_by_next_step(const std::vector<std::int64_t>& steps_taken) {
  std::vector<std::int64_t> next(steps_taken.size());
  for (std::size_t i = 0; i < steps_taken.size(); ++i) next[i] = steps_taken[i] + 1;
  std::vector<StepGroup> groups = group_by_step(next);
  std::sort(groups.begin(), groups.end(), [](const StepGroup& a, const StepGroup& b) { return a.step < b.step; });
  return groups;
}

}  // namespace tierflow::optimizer
