// `python -m tierflow plan`'s decisions, torch-free: the budgets of each tier
// from the command's arguments and settings (plan_command.hpp), and how a plan
// is shown (text lines and a JSON document). bindings/python/tierflow/cli/plan.py keeps the
// arguments and the measurements through torch.
//
// Note [Plan report]
// ~~~~~~~~~~~~~~~~~~
// Budgets. The device budget is --gpu-memory, else TIERFLOW_GPU_MEMORY when
// it was set, else the device's total memory; the host budget (--host-memory
// or TIERFLOW_HOST_MEMORY) less the optimizer states the estimate puts on
// host is what swapped activations may use; NVMe is --nvme-memory (a size,
// never a percentage: there is no capacity to take it of) and needs
// --nvme-gbps, less the optimizer states the estimate puts on NVMe (--optimizer
// nvme) when it is given; the states' bytes a parameter are those of
// --optimizer-states or TIERFLOW_OPTIMIZER_STATES (Note [Transformer
// estimate], Optimizer states), and a budget too small for them names the
// format that would fit more; the prefetch window is --prefetch or TIERFLOW_PREFETCH_BYTES.
// Sizes are parsed as the configuration table parses the variable standing
// for the flag, and every error names the flag or the variable it came from.
// The fixed device bytes are the estimate's training state on the device (or
// the profile's fixed_device_bytes); the activations outside the blocks are
// Budgets::outside_saved_bytes, which the plan keeps on the device or swaps to
// the host (Note [Activation planner], Outside the blocks).
//
// Arguments. The blocks come from a whole shape (--layers, --hidden, --heads,
// --seq, --batch) or from --profile, never both; --pcie-gbps is each way's
// rate in decimal GB/s, both at once at twice it; a rate (--tflops,
// --pcie-gbps, --nvme-gbps) is a number from kLeastRate to kMostRate, so that
// every predicted time stays finite (--nvme-gbps: or 0 for none). A plan the
// planner refuses is one line: too small budgets name what set the device
// budget (and --gpu-memory when it was not given), bytes that overflow with
// the prefetch window name the arguments that made the blocks.
//
// Why each block's action won. For each block, every action the planner did
// not choose (keep; swap, on the block's tier; split at MEMO's link-rule alpha,
// for a splittable block not already split; recompute) is priced by
// evaluate_alternative: the plan's step and usage had that block alone taken
// it. An alternative either breaks a budget, or is no faster than the chosen
// action (the search is exact for the model), unless the search stopped at
// its node limit. The fixed device bytes are broken down into parameters,
// gradients and optimizer states, each with the setting that would move it off
// the device, beside the activations outside the blocks where the plan keeps
// them (it swaps them itself when that is faster); a profile gives only the
// sum of the fixed ones. Workspace is not in the fixed bytes: each block's transient bytes
// are in its working set (Note [Activation planner]).
//
// Parameters. --offload-params (or TIERFLOW_OFFLOAD_PARAMS) none keeps them
// in the fixed bytes; host or nvme fetches every unit from that tier
// (ParamPolicy::kFetchAll; nvme needs --nvme-memory), auto lets the planner
// choose per block from the host (kAuto). Then the parameters leave the
// fixed bytes: each block's are the estimate's per-layer parameters, the
// rest unit's are the remainder (embeddings, final norm, head). A profile
// gives no parameter bytes per block: with --profile only none is accepted.
// The command prints which blocks fetch, the rest unit's residence, and the
// parameter bytes per tier (device: resident and the window of fetched ones).
//
// The whole step (issue 41). After the blocks' forward + backward, the text
// and the JSON ("step") give the whole step term by term (Note [Step
// prediction]): the blocks' compute, the exposed activation copies, parameter
// fetches and gradient copies (--optimizer host: each block's gradients go
// device->host in its backward, which a shape's estimate leaves out of the
// blocks), and the CPU AdamW's step beyond backward: its rate is
// --cpu-adam-rate (PlanCommandInputs::cpu_adam_params_per_second, with fp32
// states, scaled to --optimizer-states' format) or, when not given, measured
// here in that format (about 60 ms); --optimizer nvme reads and writes the
// states at --nvme-gbps in step(), after backward.
//
// Gradients. --offload-gradients (TIERFLOW_OFFLOAD_GRADIENTS, parsed by the
// table's parser) off keeps every gradient on the device until zero_grad:
// the fixed bytes hold them all. on (the CPU optimizer's only: with
// --optimizer none no gradient is copied to the host, refused naming the
// flag) frees each unit's gradients once their copy to the host lands: the
// device holds the two largest units' (the one backward makes, the one
// copying; a unit is a block or the rest: embeddings, final norm, head),
// gradient_device_bytes. With --optimizer host each block's gradients go
// device->host during its backward (TIERFLOW_OVERLAP_STEP's path): a shape's
// blocks carry them as download_bytes (plan_command_blocks) before the
// planner runs, so the plan is chosen with that traffic and the prediction's
// gradient term is the same plan's (no second count); --optimizer nvme steps
// in step(), after backward, and a measured profile has its own traffic.
//
// Identical blocks. In the text, consecutive blocks whose lines are the same
// (the plan's line, and each block's reasons) are one line, "blocks 0-31 (32
// identical): ..." (group_block_lines); the JSON keeps an entry per block.
#pragma once

#include <string>
#include <vector>

#include "tierflow/tiering/plan_command.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// A plan as the command prints it.
struct PlanReport {
  std::vector<std::string> lines;  ///< the text output, one entry per line
  std::string json;                ///< the --json output (nlohmann::json, keys in a fixed order)
};

/// Why each block's action won, one line per block: the plan's step and device peak had that block alone
/// taken each rejected action, and why it lost (the same lines as the command's; auto logs them).
std::vector<std::string> explain_plan(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                                      const Budgets& budgets);

/// Runs of consecutive lines "<indent>block <i>: <text>" with the same indent and text (identical blocks) as one
/// line "<indent>blocks <first>-<last> (<n> identical): <text>"; every other line as it is.
std::vector<std::string> group_block_lines(const std::vector<std::string>& lines);

/// The text and JSON of `plan`, made by plan_activations from `blocks` and `budgets`; see Note [Plan report].
PlanReport describe_plan(const Plan& plan, const std::vector<BlockProfile>& blocks, const PlanCommandInputs& inputs,
                         const PlanCommandBudgets& budgets);

}  // namespace tierflow::tiering
