// `python -m tierflow plan`'s decisions, torch-free: the budgets of each tier
// from the command's arguments and settings, and how a plan is shown (text
// lines and a JSON document). bindings/python/tierflow/cli/plan.py keeps the
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

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/step_prediction.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

namespace tierflow::tiering {

/// Where the text of a size setting came from.
enum class SettingSource : std::uint8_t {
  kUnset,     ///< neither given nor set: the default applies (a device budget: the device's total memory)
  kVariable,  ///< the configuration table's value of the TIERFLOW_* variable (set, or its default)
  kFlag,      ///< the command-line flag
};

/// A size setting as the command received it.
struct SettingText {
  std::string text;
  SettingSource source = SettingSource::kUnset;
};

/// What `python -m tierflow plan` gathered: arguments, settings, estimates and measurements.
struct PlanCommandInputs {
  SettingText gpu_memory;        ///< --gpu-memory, TIERFLOW_GPU_MEMORY when set, or unset
  SettingText host_memory;       ///< --host-memory or TIERFLOW_HOST_MEMORY
  SettingText prefetch;          ///< --prefetch or TIERFLOW_PREFETCH_BYTES
  std::optional<std::string> nvme_memory;  ///< --nvme-memory (none: no NVMe tier)
  double nvme_bytes_per_second = 0;        ///< --nvme-gbps in bytes per second (0: not given)
  std::uint64_t device_capacity_bytes = 0;  ///< the device's total memory
  std::uint64_t host_capacity_bytes = 0;    ///< this machine's RAM
  std::string device_name;                  ///< "cuda" or "cpu (emulated device)"
  std::string optimizer;                    ///< the optimizer's placement: none, host or nvme
  StateFormat optimizer_states = StateFormat::kFp32;  ///< --optimizer-states or TIERFLOW_OPTIMIZER_STATES: `state`'s
  std::string offload_params = "none";      ///< --offload-params or TIERFLOW_OFFLOAD_PARAMS: none, host, nvme, auto
  /// --offload-gradients or TIERFLOW_OFFLOAD_GRADIENTS on: each gradient freed on the device once its copy to the
  /// host lands (the CPU optimizer's only; Note [Plan report], Gradients).
  bool offload_gradients = false;
  std::optional<TransformerShape> shape;    ///< the estimated model (none: a recorded profile)
  std::string dtype_name;                   ///< the shape's --dtype, e.g. "bf16"
  std::optional<StateBytes> state;          ///< estimate_training_state of the shape
  std::uint64_t head_bytes = 0;  ///< saved outside the blocks: estimate_head_device_bytes of the shape, or the profile's
  std::uint64_t profile_fixed_device_bytes = 0;  ///< a profile's fixed_device_bytes
  std::string profile_path;                 ///< --profile FILE
  std::string blocks_from;                  ///< the arguments that made the blocks, as errors name them
  Links links;                              ///< given, measured or the profile's; NVMe rates filled in here
  std::optional<double> flops_per_second;   ///< the estimate's compute rate (none: a profile)
  std::vector<std::string> measured;        ///< what was measured on this machine: "tflops", "links"
  bool links_given = false;                 ///< --pcie-gbps was given
  /// --cpu-adam-rate: the CPU AdamW's parameters a second with fp32 states, scaled to `optimizer_states` (0:
  /// unknown, measured here in that format with tierflow's own kernel; Note [Step prediction]).
  double cpu_adam_params_per_second = 0;
};

/// The planner's inputs from PlanCommandInputs, and where they came from.
struct PlanCommandBudgets {
  Budgets budgets;
  Links links;                          ///< the inputs' links with the NVMe rate when there is an NVMe budget
  std::string device_from;              ///< what set the device budget, e.g. "--gpu-memory"
  std::string host_from;                ///< "--host-memory" or "TIERFLOW_HOST_MEMORY"
  std::uint64_t optimizer_host_bytes = 0;  ///< optimizer states on host, taken out of the host budget
  std::uint64_t optimizer_nvme_bytes = 0;  ///< optimizer states on NVMe, taken out of --nvme-memory (when given)
};

/// The budgets of Note [Plan report]. Throws config_error naming the flag or variable (and what to
/// pass) for a size the table refuses, a host or NVMe budget smaller than the optimizer states, NVMe
/// without a rate, or fixed device bytes past 64 bits.
PlanCommandBudgets plan_command_budgets(const PlanCommandInputs& inputs);

/// Bytes of a size ("16GiB") or a percentage of `capacity_bytes` ("90%"); config_error for other text
/// or for a percentage of an unknown (0) capacity.
std::uint64_t budget_bytes(const std::string& text, std::uint64_t capacity_bytes);

inline constexpr double kLeastRate = 1e-6;  ///< the smallest accepted rate argument
inline constexpr double kMostRate = 1e6;    ///< the largest accepted rate argument
inline constexpr double kDecimalGB = 1e9;   ///< link rates are decimal, like the vendors'

/// The shape's flags, in the order errors name them.
const std::vector<std::string>& plan_shape_flags();
/// Throws config_error unless the blocks come from either a whole shape (`given_shape_flags`: those of
/// plan_shape_flags given, e.g. "layers") or --profile (Note [Plan report]).
void check_blocks_source(bool profile, const std::vector<std::string>& given_shape_flags);
/// A rate argument, `value` as parse_decimal read it (none: not a number) and `shown` its text as errors quote
/// it; config_error "<shown> is not valid; accepted: ..." outside [kLeastRate, kMostRate] (or 0 when `zero`).
double check_rate(std::optional<double> value, const std::string& shown, bool zero);
/// A shape argument (--layers, ...): `digits` (the text stripped) a decimal integer from 1 to the field's
/// transformer_shape_limits(); config_error "<shown> is not valid; accepted: ..." otherwise.
std::int64_t shape_argument(std::string_view field, std::string_view digits, const std::string& shown);
/// The links of --pcie-gbps: each way at `gbps` decimal GB/s, both at once at twice it.
Links links_from_pcie_gbps(double gbps) noexcept;
/// The command's line when plan_activations refused: `error` its message (a leading "tierflow: " dropped),
/// `out_of_memory` whether the budgets were too small (else bytes overflowed with the prefetch window).
std::string plan_refusal(const std::string& error, bool out_of_memory, const PlanCommandInputs& inputs,
                         const PlanCommandBudgets& budgets);

/// The device bytes of the gradients (Note [Plan report], Gradients): all of them, or with
/// inputs.offload_gradients the two largest units'; 0 for a profile (its fixed bytes hold them).
std::uint64_t gradient_device_bytes(const PlanCommandInputs& inputs);

/// `blocks` as the step moves them (Note [Plan report], Gradients): a shape's blocks with --optimizer host carry
/// their gradients' device->host bytes (download_bytes = parameter_bytes), other placements none; a profile's
/// blocks as they are. The planner, the report and the fit search plan these.
std::vector<BlockProfile> plan_command_blocks(std::vector<BlockProfile> blocks, const PlanCommandInputs& inputs);

/// The CPU optimizer as the command's inputs describe it (Note [Step prediction]): the shape's parameters, the
/// given rate (--cpu-adam-rate, fp32) scaled to the states' format or the one measured here; NVMe states read and
/// written at --nvme-gbps, stepped in step(); a profile gives no parameters.
OptimizerStepInputs optimizer_inputs(const PlanCommandInputs& inputs, const PlanCommandBudgets& budgets);

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
