// Internals of `python -m tierflow plan`'s report shared by plan_report.cpp (the text), plan_report_json.cpp
// (the JSON document) and plan_command.cpp (the budgets); see Note [Plan report].
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tierflow/tiering/plan_report.hpp"

namespace tierflow::tiering::detail {

/// printf into a std::string.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

/// "--optimizer-states fp32": the CPU AdamW's states as errors and the report name their format.
std::string states_named(const PlanCommandInputs& in);

/// Each rejected action of one block, priced by evaluate_alternative (Note [Plan report], Why each block's
/// action won).
struct BlockWhy {
  std::vector<AlternativeCost> rejected;
};

/// evaluate_alternative for every block; blocks of one profile with one choice share their figures.
std::vector<BlockWhy> why_of_blocks(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                                    const Budgets& budgets);
/// Why an alternative lost: the budgets it breaks, or its speed against the plan's.
std::string why_rejected(const AlternativeCost& a, const Plan& plan);

/// A part of the fixed device bytes (Note [Plan report], Why each block's action won).
struct FixedPart {
  const char* name;       ///< JSON "part"
  const char* label;      ///< text
  std::uint64_t bytes;
  std::string freed_by;   ///< the setting that would move it off the device ("" none)
};

/// The fixed device bytes by part: parameters, gradients, optimizer states, the activations outside the blocks.
std::vector<FixedPart> fixed_parts(const PlanCommandInputs& in, const Budgets& budgets, const Plan& plan);

/// The --json document of Note [Plan report].
std::string plan_json(const Plan& plan, const PlanCommandInputs& in, const PlanCommandBudgets& pb,
                      const std::vector<BlockWhy>& why, const std::vector<FixedPart>& parts,
                      const StepPrediction& step, const OptimizerStepInputs& optimizer);

}  // namespace tierflow::tiering::detail
