// `python -m tierflow plan` past its argument parser: the arguments' refusals, --model, the blocks, the budgets, the
// plan and its report (plan_cli.hpp; Note [Plan report], Arguments; Note [Plan fit]).
#include "tierflow/tiering/plan_cli.hpp"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/detail/plan_report_parts.hpp"
#include "tierflow/tiering/plan_fit.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/profile_file.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

namespace tierflow::tiering {
namespace {

using detail::format;
using Json = nlohmann::ordered_json;  // the report's keys in the order written, ours after them

// The bytes of an element of --dtype.
int dtype_bytes(const std::string& dtype) { return dtype == "fp32" ? 4 : 2; }

// "1,234,568": a number rounded to an integer with thousands separators (Python's format ",.0f").
std::string with_thousands(double value) {
  if (!std::isfinite(value)) return std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf");
  std::string digits = format("%.0f", value);
  const std::size_t first = digits[0] == '-' ? 1 : 0;
  for (std::size_t at = digits.size(); at > first + 3; at -= 3) digits.insert(at - 3, ",");
  return digits;
}

// Whether plan_command_budgets refused the budgets (the optimizer states do not fit), not an argument.
bool budget_refusal(const std::string& message) {
  return message.find("cannot hold the optimizer states") != std::string::npos ||
         message.find("cannot hold the optimizer's pinned staging") != std::string::npos;
}

// A size setting for tiering's budgets: the flag's text, else the table's value of its variable (when set).
SettingText setting(const std::optional<std::string>& flag_text, const std::string& variable_text, bool set) {
  if (flag_text) return {*flag_text, SettingSource::kFlag};
  if (set) return {variable_text, SettingSource::kVariable};
  return {"", SettingSource::kUnset};
}

}  // namespace

// Where the plan's blocks came from: a recorded profile (--profile) or a shape's estimate.
struct PlanCommand::Source {
  std::vector<BlockProfile> blocks;
  Links links;
  std::uint64_t head_bytes = 0;             // the saved tensors outside the blocks (the head's, or auto's measurement)
  std::uint64_t fixed_device_bytes = 0;     // the profile's
  std::uint64_t outside_largest_bytes = 0;  // the profile's largest of them (0 for a shape: estimated instead)
  std::optional<TransformerShape> shape;    // the estimate's
  std::optional<StateBytes> state;          // the estimate's training state (none: from a profile)
  std::optional<double> flops;              // the estimate's
  std::vector<std::string> measured;        // what the machine measured for these blocks
};

double check_params_rate(std::optional<double> value, const std::string& shown) {
  if (value && *value >= 1 && *value <= 1e15) return *value;
  throw config_error(shown + " is not valid; accepted: parameters a second, a number from 1 to 1e15 (e.g. 2.5e9)");
}

PlanCommand::PlanCommand(PlanArguments args, const Config& settings, std::optional<std::string> nvme_memory_variable)
    : args_(std::move(args)), settings_(settings) {
  read_model();  // --model: the config read, and --seq, --batch and --dtype resolved
  optimizer_ = args_.optimizer ? *args_.optimizer : std::string(to_string(settings_.offload_optimizer));
  // --nvme-memory defaults to TIERFLOW_NVME_MEMORY when that is set (as --gpu-memory and --host-memory to theirs).
  if (!args_.nvme_memory && settings_.given.count("TIERFLOW_NVME_MEMORY") && nvme_memory_variable &&
      !nvme_memory_variable->empty() && *nvme_memory_variable != "auto")
    args_.nvme_memory = nvme_memory_variable;
  check_flags();  // before anything is measured
  if (!model_) {  // a whole shape or --profile (Note [Plan report]), and the shape's defaults
    std::vector<std::string> given;  // of plan_shape_flags()
    for (const auto& [flag, value] : {std::pair{"layers", &args_.layers}, {"hidden", &args_.hidden},
                                      {"heads", &args_.heads}, {"seq", &args_.seq}, {"batch", &args_.batch}})
      if (value->has_value()) given.emplace_back(flag);
    check_blocks_source(args_.profile.has_value(), given);
    if (!args_.dtype) args_.dtype = "bf16";
    if (!args_.vocab) args_.vocab = 50304;
    if (!args_.ffn_mult) args_.ffn_mult = 4;
  }
  // Parsed as the table parses TIERFLOW_OPTIMIZER_STATES, errors naming the flag.
  states_ = args_.optimizer_states
                ? *parse_state_format(parse_setting("TIERFLOW_OPTIMIZER_STATES", *args_.optimizer_states,
                                                    "--optimizer-states"))
                : settings_.optimizer_states;
}

void PlanCommand::read_model() {
  if (!args_.model) return;
  std::string shape_given;
  for (const auto& [flag, value] : {std::pair{"--layers", &args_.layers}, {"--hidden", &args_.hidden},
                                    {"--heads", &args_.heads}})
    if (value->has_value()) shape_given += (shape_given.empty() ? "" : " ") + std::string(flag);
  if (args_.profile || !shape_given.empty())
    throw config_error("--model " + args_.model_shown + " with " + (shape_given.empty() ? "--profile" : shape_given) +
                       ": the blocks come from one of them; accepted: --model PATH (with --seq, --batch, --dtype), a "
                       "shape (--layers --hidden --heads --seq --batch) or --profile FILE");
  if (args_.vocab || args_.ffn_mult)
    throw config_error("--vocab and --ffn-mult come from the config with --model; accepted: --model PATH with --seq, "
                       "--batch, --dtype");
  try {
    model_ = load_model_config(*args_.model);
  } catch (const config_error& e) {  // names the file and the field
    throw config_error(std::string("--model ") + e.what());
  }
  if (!args_.seq) args_.seq = default_seq(*model_);
  if (!args_.batch) args_.batch = 1;
  if (!args_.dtype) args_.dtype = model_->dtype.value_or("bf16");
}

void PlanCommand::check_flags() {
  // --nvme-gbps without an NVMe budget, which nothing would use.
  if (args_.nvme_gbps != 0 && !args_.nvme_memory)
    throw config_error("--nvme-gbps " + format("%g", args_.nvme_gbps) + " without an NVMe budget: the rate is the "
                       "NVMe tier's, and no --nvme-memory (nor TIERFLOW_NVME_MEMORY) gives one; accepted: --nvme-gbps "
                       "with --nvme-memory SIZE, or neither");
  const std::string placed = args_.optimizer ? "--optimizer " + optimizer_ : "TIERFLOW_OFFLOAD_OPTIMIZER=" + optimizer_;
  // --optimizer nvme without an NVMe budget: the states would be counted nowhere and the plan printed as if they
  // fit (the fit search tries nvme only with a budget, Note [Plan fit]).
  if (optimizer_ == "nvme" && !args_.nvme_memory)
    throw config_error(placed + " keeps the optimizer's states on NVMe, and no NVMe budget was given: the plan "
                       "cannot fit them; accepted: --nvme-memory SIZE with --nvme-gbps GBPS (the NVMe tier for the "
                       "states and swapped activations), or --optimizer host or none");
  // --cpu-adam-rate with the optimizer on the device (torch's AdamW): no CPU step to rate.
  if (args_.cpu_adam_rate && optimizer_ == "none")
    throw config_error("--cpu-adam-rate " + format("%g", *args_.cpu_adam_rate) + " with " + placed + ": the rate is "
                       "the CPU AdamW's, and with the optimizer on the device (torch's AdamW) nothing steps on the "
                       "CPU; accepted: --cpu-adam-rate with --optimizer host or nvme, or --optimizer none without "
                       "--cpu-adam-rate");
}

std::string PlanCommand::blocks_from() const {
  if (args_.profile) return "--profile " + args_.profile_repr;
  const auto n = [](const std::optional<std::int64_t>& v) { return std::to_string(v.value_or(0)); };
  const std::string tail = " --seq " + n(args_.seq) + " --batch " + n(args_.batch);
  if (args_.model) return "--model " + args_.model_repr + tail + " --dtype " + args_.dtype.value_or("");
  return "--layers " + n(args_.layers) + " --hidden " + n(args_.hidden) + " --heads " + n(args_.heads) + tail +
         " --vocab " + n(args_.vocab) + " --ffn-mult " + n(args_.ffn_mult) + " --dtype " + args_.dtype.value_or("");
}

PlanCommand::Source PlanCommand::profile_source(const PlanMachine& machine) const {
  ProfileFile profile;
  try {
    profile = profile_from_json(machine.profile_text.value_or(""));
  } catch (const config_error& e) {
    throw config_error("--profile " + args_.profile_repr + ": " + e.what());
  }
  if (!machine.links) {  // the profile's: a missing or zero rate would plan every swap at inf s
    std::string missing;
    for (const auto& [name, rate] : {std::pair{"d2h", profile.links.d2h}, {"h2d", profile.links.h2d},
                                     {"duplex", profile.links.duplex}})
      if (!(rate > 0)) missing += (missing.empty() ? "" : ", ") + std::string(name);
    if (!missing.empty())
      throw config_error("--profile " + args_.profile_repr + ": links has no positive " + missing + " (bytes/s); "
                         "accepted: a profile whose links d2h, h2d and duplex are positive rates (as TIERFLOW_PROFILE "
                         "writes them), or --pcie-gbps to give the link");
  }
  Source s;
  s.links = machine.links.value_or(profile.links);
  s.head_bytes = profile.outside_saved_bytes;  // auto's measurement: the plan keeps or swaps them
  s.fixed_device_bytes = profile.fixed_device_bytes;
  s.outside_largest_bytes = profile.outside_largest_bytes;
  s.blocks = std::move(profile.blocks);
  return s;
}

PlanCommand::Source PlanCommand::estimated_source(const PlanMachine& machine) const {
  Source s;
  s.links = machine.links.value_or(Links{});  // given (--pcie-gbps) or measured
  TransformerShape shape;
  if (model_) {
    shape = model_->shape;
  } else {
    shape.layers = static_cast<int>(*args_.layers);
    shape.hidden = static_cast<int>(*args_.hidden);
    shape.heads = static_cast<int>(*args_.heads);
    shape.vocab = *args_.vocab;
    shape.ffn_mult = static_cast<int>(*args_.ffn_mult);
  }
  shape.seq = *args_.seq;
  shape.batch = *args_.batch;
  shape.dtype_bytes = dtype_bytes(*args_.dtype);
  if (args_.tflops) {
    s.flops = *args_.tflops * 1e12;
  } else {
    s.flops = machine.flops_per_second.value_or(0);
    s.measured.push_back("tflops");
  }
  try {
    check_transformer_shape(shape);  // before building a profile per layer
    s.blocks = estimate_transformer(shape, *s.flops);
    s.state = estimate_training_state(shape, parse_optimizer_placement(optimizer_), states_);
    s.head_bytes = estimate_head_device_bytes(shape);
  } catch (const config_error& e) {  // a shape the estimate refuses
    throw config_error(blocks_from() + ": " + e.what());
  }
  s.shape = shape;
  return s;
}

PlanCommandInputs PlanCommand::inputs(const PlanMachine& machine, const Source& source) const {
  PlanCommandInputs in;
  in.gpu_memory = setting(args_.gpu_memory, settings_.gpu_memory.to_string(),
                          settings_.given.count("TIERFLOW_GPU_MEMORY") > 0);
  in.host_memory = setting(args_.host_memory, settings_.host_memory.to_string(), true);
  in.prefetch = setting(args_.prefetch, std::to_string(settings_.prefetch_bytes), true);
  in.nvme_memory = args_.nvme_memory;
  in.nvme_bytes_per_second = args_.nvme_gbps * kDecimalGB;
  in.device_capacity_bytes = machine.device_capacity_bytes;
  in.host_capacity_bytes = machine.host_capacity_bytes;
  in.device_name = machine.cuda ? "cuda" : "cpu (emulated device)";
  in.optimizer = optimizer_;
  in.optimizer_states = states_;
  in.offload_params = args_.offload_params ? *args_.offload_params
                                           : std::string(to_string(settings_.offload_params));
  if (source.state) in.shape = source.shape;
  in.dtype_name = args_.dtype.value_or("");
  in.state = source.state;
  in.head_bytes = source.head_bytes;
  in.profile_path = args_.profile.value_or("");
  in.profile_fixed_device_bytes = source.fixed_device_bytes;
  in.outside_largest_bytes = source.outside_largest_bytes;
  in.blocks_from = blocks_from();
  in.links = source.links;
  in.flops_per_second = source.flops;
  if (needs_links()) in.measured.push_back("links");
  in.measured.insert(in.measured.end(), source.measured.begin(), source.measured.end());
  if (source.state && optimizer_ != "none" && !args_.cpu_adam_rate)
    in.measured.push_back("cpu_adam_rate");  // the CPU AdamW's rate, measured with its own kernel
  in.links_given = args_.pcie_gbps.has_value();
  // Parsed as the table parses TIERFLOW_OFFLOAD_GRADIENTS, errors naming the flag (Note [Plan report], Gradients).
  in.offload_gradients = args_.offload_gradients ? parse_setting("TIERFLOW_OFFLOAD_GRADIENTS",
                                                                 *args_.offload_gradients, "--offload-gradients") == "on"
                                                 : settings_.offload_gradients;
  if (args_.cpu_adam_rate) in.cpu_adam_params_per_second = *args_.cpu_adam_rate;
  return in;
}

std::string PlanCommand::run(const PlanMachine& machine) const {
  PlanMachine given = machine;
  if (args_.pcie_gbps) given.links = links_from_pcie_gbps(*args_.pcie_gbps);
  const Source source = args_.profile ? profile_source(given) : estimated_source(given);
  const PlanCommandInputs in = inputs(given, source);
  // The settings that would make it fit, tried by the planner (Note [Plan fit]), for an estimated model.
  const auto advice = [&] { return fit_advice(search_fitting_settings(source.blocks, in), machine.command_line); };
  PlanCommandBudgets command;
  try {
    command = plan_command_budgets(in);
  } catch (const config_error& e) {  // a budget the optimizer states do not fit, a bad size
    if (!source.state || !budget_refusal(e.what())) throw;
    throw config_error(e.what() + advice());
  }
  // The fit search takes the estimate's blocks (each combination moves its own gradients); the plan takes these.
  const std::vector<BlockProfile> blocks = plan_command_blocks(source.blocks, in);
  std::optional<Plan> plan;
  std::optional<std::string> refusal;
  try {
    plan = plan_activations(blocks, command.links, command.budgets);
  } catch (const out_of_memory& e) {  // the budgets are too small
    refusal = plan_refusal(e.what(), true, in, command) + (source.state ? advice() : "");
  } catch (const config_error& e) {  // the profile's or the shape's bytes with the prefetch window overflow
    refusal = plan_refusal(e.what(), false, in, command);
  }
  if (refusal) throw config_error(*refusal);
  const PlanReport report = describe_plan(*plan, blocks, in, command);
  if (!model_) {
    if (args_.json) return report.json;
    std::string text;
    for (const auto& line : report.lines) text += (text.empty() ? "" : "\n") + line;
    return text;
  }
  return model_report(report, *plan, blocks, in, command);
}

std::string PlanCommand::model_report(const PlanReport& report, const Plan& plan,
                                      const std::vector<BlockProfile>& blocks, const PlanCommandInputs& in,
                                      const PlanCommandBudgets& command) const {
  const MemoryTable table = memory_table(plan, blocks, in, command);
  Json doc = Json::parse(report.json);
  // The whole step (Note [Step prediction]: the CPU optimizer's exposed time included), else the blocks'.
  double step = 0;
  if (doc.contains("step") && doc["step"].contains("terms_seconds")) {
    const Json& total = doc["step"]["terms_seconds"].value("total", Json());
    if (total.is_number()) step = total.get<double>();
  }
  if (step == 0) step = plan.predicted_step_seconds;
  const std::int64_t tokens = *args_.seq * *args_.batch;
  const double rate = step > 0 ? static_cast<double>(tokens) / step : std::numeric_limits<double>::infinity();
  const TransformerShape& shape = *in.shape;
  const std::uint64_t params = transformer_parameters(shape);
  const std::string& dtype = *args_.dtype;
  if (args_.json) {
    doc["model"] = Json{{"family", model_->family}, {"model_type", model_->model_type}, {"path", model_->path},
                        {"parameters", params}, {"seq", *args_.seq}, {"batch", *args_.batch}, {"dtype", dtype}};
    doc["bytes_per_tier"] = Json::parse(table.json());
    doc["tokens_per_second"] = rate;
    return doc.dump();
  }
  std::string text = "config: " + model_->family + " (" + model_->model_type + ") from " + model_->path +
                     format(": %.3gB parameters, %d layers, hidden %d, heads %d/%d kv",
                            static_cast<double>(params) / 1e9, shape.layers, shape.hidden, shape.heads,
                            shape.kv_heads ? shape.kv_heads : shape.heads);
  if (shape.experts) text += format(", %d experts (%d a token)", shape.experts, shape.experts_per_token);
  text += format("; --seq %lld --batch %lld --dtype ", static_cast<long long>(*args_.seq),
                 static_cast<long long>(*args_.batch)) + dtype;
  for (const auto& line : report.lines) text += "\n" + line;
  for (const auto& line : table.lines()) text += "\n" + line;
  return text + "\ntokens/s: " + with_thousands(rate) +
         format(" (%lld tokens a step, predicted whole step %.4g s)", static_cast<long long>(tokens), step);
}

}  // namespace tierflow::tiering
