// "Will it fit": the plan command's bytes per tier by kind, and, when the
// plan does not fit, the settings that would make it fit, tried by the planner.
//
// Note [Plan fit]
// ~~~~~~~~~~~~~~~
// Bytes per tier by kind. A plan of an estimated model (a shape or a
// config.json, Note [Model families]) puts, per tier:
//   device         parameters (all, or the resident ones and the window of
//                  fetched ones), gradients (all, or with --offload-gradients
//                  on the two largest units', Note [Plan report]), torch's AdamW states (--optimizer
//                  none), activations (the kept blocks, the largest block's
//                  saved bytes coming back, what is saved outside the blocks
//                  when kept) and workspace (the largest block's transient
//                  bytes, and the prefetch window when anything swaps)
//   pinned host    fetched parameters (--offload-params host or auto), the CPU
//                  AdamW's states (--optimizer host) and swapped activations:
//                  the host pool of TIERFLOW_HOST_MEMORY
//   NVMe           parameters, optimizer states and activations on NVMe
// and the device column adds up to the plan's predicted device peak. There is
// no pageable host column: every host byte the plan places is in the pinned
// pool (the CPU AdamW's states and its staging, Note [Pinned host pool] and
// optimizer/state_tier.cpp's state_pool_need; fetched parameters; swapped
// activations), so such a column would always read 0; what a run holds in
// pageable memory (torch's own, a state_dict's snapshot) is not the plan's.
//
// Settings that would make it fit. When the budgets refuse the plan (the
// device, or a host or NVMe budget too small for the optimizer states), the
// command tries, with everything else as given, every combination of:
// --offload-params host / auto (nvme with an NVMe budget), --optimizer none or host
// (nvme with an NVMe budget), --optimizer-states bf16 / 8bit (with the CPU
// optimizer), --offload-gradients on (with the CPU optimizer), and a smaller --prefetch (a quarter and a sixteenth of the
// given one, at least 1 MiB). Each is planned as the command would plan it
// (plan_command_budgets, plan_activations), and the one of least predicted
// whole step (Note [Step prediction]: the CPU optimizer's exposed time
// included; ties: fewer flags changed) is printed with the whole command line.
// A fit that keeps the optimizer's states in the given format comes first: a
// narrower format (bf16, 8bit) changes the training's numerics, so it is
// suggested only when nothing else fits, and otherwise named after the advice
// when it would be faster ("faster, with other numerics: ...").
// A combination the planner refuses is not suggested: nothing is guessed.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// The kinds of bytes, in the table's row order.
enum class MemoryKind : std::uint8_t { kParameters, kGradients, kOptimizerStates, kActivations, kWorkspace };
/// The tiers, in the table's column order.
enum class MemoryTier : std::uint8_t { kDevice, kPinnedHost, kNvme };
inline constexpr std::size_t kMemoryKinds = 5, kMemoryTiers = 3;

/// Bytes per tier by kind (Note [Plan fit]).
struct MemoryTable {
  std::array<std::array<std::uint64_t, kMemoryTiers>, kMemoryKinds> bytes{};  ///< [kind][tier]
  std::uint64_t at(MemoryKind kind, MemoryTier tier) const noexcept {
    return bytes[static_cast<std::size_t>(kind)][static_cast<std::size_t>(tier)];
  }
  std::uint64_t tier_total(MemoryTier tier) const noexcept;
  /// The table as the command prints it: a header, one line per kind, the totals.
  std::vector<std::string> lines() const;
  /// {"device": {"parameters": n, ...}, "pinned_host": {...}, ...} (nlohmann::json text, fixed key order).
  std::string json() const;
};

std::string_view to_string(MemoryKind kind) noexcept;
std::string_view to_string(MemoryTier tier) noexcept;

/// The table of `plan`, made from `blocks` and `budgets` for `inputs` (an estimated model: inputs.state set).
MemoryTable memory_table(const Plan& plan, const std::vector<BlockProfile>& blocks, const PlanCommandInputs& inputs,
                         const PlanCommandBudgets& budgets);

/// One flag and its value, e.g. {"--offload-params", "host"}.
using FlagValue = std::pair<std::string, std::string>;

/// One combination the fit search tried.
struct FitTried {
  std::vector<FlagValue> flags;  ///< the flags changed from the command's
  bool fits = false;
  std::string why;               ///< the refusal (empty when it fits)
  double step_seconds = 0;       ///< predicted (when it fits)
  std::uint64_t device_peak_bytes = 0;
  bool narrower_states = false;  ///< the optimizer's states in fewer bits than given: other numerics
};

/// What the fit search found (Note [Plan fit]).
struct FitSearch {
  std::vector<FitTried> tried;
  std::optional<std::size_t> best;  ///< index in `tried` of the fastest that fits with the given numerics (else
                                    ///< the fastest that fits)
  std::optional<std::size_t> faster_narrower;  ///< a fit faster than `best` that narrows the states, if any
  bool nvme_given = false;  ///< the command gave an NVMe tier (--nvme-memory): the advice does not ask for one
};

/// A plan's step as the command ranks the combinations (default: the whole step, the CPU optimizer's exposed time
/// included, Note [Step prediction]).
using StepOf = std::function<double(const Plan&, const std::vector<BlockProfile>&, const PlanCommandInputs&,
                                    const PlanCommandBudgets&)>;

/// Tries the combinations of Note [Plan fit] for the estimated model of `inputs` (inputs.shape set), blocks
/// `blocks`. config_error without a shape (a profile).
FitSearch search_fitting_settings(const std::vector<BlockProfile>& blocks, const PlanCommandInputs& inputs,
                                  const StepOf& step_of = {});

/// "--offload-params host --optimizer-states 8bit".
std::string flags_text(const std::vector<FlagValue>& flags);

/// What the refusal line adds (Note [Plan fit]): "; it fits with --offload-params host (step 1.2 s, device peak
/// 15.1 GiB): <command> --offload-params host", or that none of the N combinations tried fits.
std::string fit_advice(const FitSearch& search, const std::string& command);

/// `command` (shlex.join's words) with each of `flags` set: a flag it gives (--flag value, --flag=value) takes the
/// new value in place, the others are appended; no flag given twice.
std::string command_with(const std::string& command, const std::vector<FlagValue>& flags);

}  // namespace tierflow::tiering
