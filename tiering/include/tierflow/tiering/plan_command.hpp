// `python -m tierflow plan`'s inputs and budgets, torch-free: what the command
// gathered (arguments, settings, estimates, measurements), the budgets of each
// tier from them, and the checks of its arguments; see Note [Plan report] in
// plan_report.hpp (Budgets, Arguments, Gradients).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
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
  /// The largest single one of them, for a profile: its outside_largest_bytes (0: not measured). A shape's is
  /// estimated instead (the fp32 logits, tokens x vocab x 4; Budgets::outside_largest_bytes).
  std::uint64_t outside_largest_bytes = 0;
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
  /// The CPU AdamW's pinned host memory (optimizer_pinned_bytes), taken out of the host budget.
  std::uint64_t optimizer_host_bytes = 0;
  std::uint64_t optimizer_nvme_bytes = 0;  ///< optimizer states on NVMe, taken out of --nvme-memory (when given)
};

/// The runtime's pinned pool rule, optimizer::state_pool_need, for parameters of these elements, each moving
/// `element_bytes` a step (on the device), with moments in `format`, the states on NVMe or not. The optimizer
/// layer sits above this one: the bindings register it when the module loads (and tests that want it).
using PinnedPoolRule = std::function<std::uint64_t(const std::vector<std::uint64_t>& numels, int element_bytes,
                                                   StateFormat format, bool nvme)>;
/// Registers `rule` for optimizer_pinned_bytes (none registered: the states' host bytes alone).
void set_pinned_pool_rule(PinnedPoolRule rule);

/// The pinned host memory tierflow's CPU AdamW (--optimizer host or nvme) asks of the pool for a shape's
/// parameters: optimizer::state_pool_need, the rule wrap refuses a smaller TIERFLOW_HOST_MEMORY by (the states,
/// or on NVMe two buffers of the largest parameter's state, and one step's gradients and new weights in pinned
/// staging); a profile's (no tensors known): its states' host bytes; 0 for --optimizer none.
std::uint64_t optimizer_pinned_bytes(const PlanCommandInputs& inputs);

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

}  // namespace tierflow::tiering
