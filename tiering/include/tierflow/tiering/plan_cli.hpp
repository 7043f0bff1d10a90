// `python -m tierflow plan` past its argument parser, torch-free: the arguments checked against each other and the
// settings, --model read, the blocks made (from --profile's text or the shape's estimate), the budgets, the plan
// and its report, each refusal one line naming what was wrong (Note [Plan report], Arguments; Note [Plan fit]).
// Python's argparse parses argv into PlanArguments, and measures what this asks for (the links and the matmul
// rate: torch); the rest is here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/model_config.hpp"
#include "tierflow/tiering/plan_command.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// The plan command's arguments as its parser read them; none: not given.
struct PlanArguments {
  std::optional<std::int64_t> layers, hidden, heads, seq, batch, vocab, ffn_mult;  ///< the shape (shape_argument)
  std::optional<std::string> dtype;     ///< fp32, bf16 or fp16
  std::optional<std::string> model;     ///< --model PATH
  std::string model_repr;               ///< --model as Python's repr shows it (the blocks' flags)
  std::string model_shown;              ///< the same cut to a readable length (a refusal's)
  std::optional<std::string> profile;   ///< --profile FILE, as the report names it
  std::string profile_repr;             ///< --profile as Python's repr shows it
  std::optional<double> tflops;         ///< --tflops (check_rate)
  std::optional<double> pcie_gbps;      ///< --pcie-gbps (check_rate)
  std::optional<std::string> gpu_memory, host_memory, nvme_memory, prefetch;  ///< sizes, as given
  double nvme_gbps = 0;                 ///< --nvme-gbps (0: not given)
  std::optional<double> cpu_adam_rate;  ///< --cpu-adam-rate (check_params_rate)
  std::optional<std::string> optimizer;         ///< none, host or nvme
  std::optional<std::string> optimizer_states;  ///< as given: parsed as TIERFLOW_OPTIMIZER_STATES
  std::optional<std::string> offload_params;    ///< none, host, nvme or auto
  std::optional<std::string> offload_gradients; ///< as given: parsed as TIERFLOW_OFFLOAD_GRADIENTS
  bool json = false;                    ///< --json
};

/// --cpu-adam-rate: `value` as parse_decimal read it (none: not a number), `shown` its text as errors quote it;
/// config_error "<shown> is not valid; accepted: parameters a second, ..." outside [1, 1e15].
double check_params_rate(std::optional<double> value, const std::string& shown);

/// What the machine gives the command: whether it plans for CUDA, the tiers' capacities, what was measured.
struct PlanMachine {
  bool cuda = false;
  std::uint64_t device_capacity_bytes = 0;
  std::uint64_t host_capacity_bytes = 0;
  std::optional<Links> links;              ///< measured (PlanCommand::needs_links)
  std::optional<double> flops_per_second;  ///< measured (PlanCommand::needs_flops)
  std::optional<std::string> profile_text; ///< --profile's contents, read by the caller
  std::string command_line;                ///< "python -m tierflow plan ..." as a shell reads it (the fit advice's)
};

/// One run of the plan command after its parser: made from the arguments (checked before anything is measured),
/// then run with what the machine measured.
class PlanCommand {
 public:
  /// The arguments checked against each other and `settings` (the refusals of Note [Plan report], Arguments),
  /// --model read with its defaults, --optimizer-states parsed; `nvme_memory_variable` is TIERFLOW_NVME_MEMORY's
  /// text (--nvme-memory's default when set and not auto). Throws config_error with the refusal's line.
  PlanCommand(PlanArguments args, const Config& settings, std::optional<std::string> nvme_memory_variable);

  /// Neither --pcie-gbps nor --profile gives the links: the caller measures them.
  bool needs_links() const noexcept { return !args_.pcie_gbps && !args_.profile; }
  /// A shape (or --model) without --tflops: the caller measures the matmul rate.
  bool needs_flops() const noexcept { return !args_.profile && !args_.tflops; }
  const PlanArguments& arguments() const noexcept { return args_; }

  /// The plan's text (or JSON with --json); config_error with the refusal's line (the fit advice added where
  /// the budgets refused an estimated model, Note [Plan fit]).
  std::string run(const PlanMachine& machine) const;

  /// The arguments that made the blocks, as errors name them: the shape's flags, --model's or --profile.
  std::string blocks_from() const;

 private:
  struct Source;
  void check_flags();
  void read_model();
  Source profile_source(const PlanMachine& machine) const;
  Source estimated_source(const PlanMachine& machine) const;
  PlanCommandInputs inputs(const PlanMachine& machine, const Source& source) const;
  std::string model_report(const struct PlanReport& report, const Plan& plan, const std::vector<BlockProfile>& blocks,
                           const PlanCommandInputs& inputs, const PlanCommandBudgets& command) const;

  PlanArguments args_;
  Config settings_;
  std::string optimizer_;       ///< --optimizer, else TIERFLOW_OFFLOAD_OPTIMIZER
  StateFormat states_ = StateFormat::kFp32;
  std::optional<ModelConfig> model_;
};

}  // namespace tierflow::tiering
