// The planner's Python surface: the structs of tiering/planner.hpp as classes with read-write fields (keyword
// constructors), and its functions, registered in the torch-free tierflow._core (Note [Two extensions] in
// core_module.cpp); the plan driver, which logs at run time, is _C's (plan_driver_bindings.cpp).
#include "tierflow/bindings/planner_bindings.hpp"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "tierflow/allocator/device.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/state_format.hpp"
#include "tierflow/optimizer/state_tier.hpp"
#include "tierflow/tiering/auto_plan.hpp"
#include "tierflow/tiering/block_finder.hpp"
#include "tierflow/tiering/block_table.hpp"
#include "tierflow/tiering/plan_driver.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/profile_file.hpp"
#include "tierflow/tiering/replay_rule.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/saved_actions.hpp"
#include "tierflow/tiering/tiers.hpp"
#include "tierflow/tiering/transformer_profile.hpp"
#include "init_from_kwargs.hpp"
#include "state_format_setting.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
namespace {

using namespace tierflow::tiering;

// The measured block and the budgets' inputs (Note [Auto plan phases]): what the front end hands the driver.
void bind_auto_plan(py::module_& m) {
  py::class_<BlockRecord> record(m, "BlockRecord", "What a recorded block saves and computes, per class.");
  record.def(py::init<>())
      .def_readwrite("input_bytes", &BlockRecord::input_bytes)
      .def_readwrite("attention_bytes", &BlockRecord::attention_bytes)
      .def_readwrite("split_bytes", &BlockRecord::split_bytes)
      .def_readwrite("cheap_bytes", &BlockRecord::cheap_bytes)
      .def_readwrite("split_flops", &BlockRecord::split_flops)
      .def_readwrite("attention_flops", &BlockRecord::attention_flops)
      .def_readwrite("total_flops", &BlockRecord::total_flops)
      .def_readwrite("has_split_ops", &BlockRecord::has_split_ops)
      .def_readwrite("replayable", &BlockRecord::replayable)
      .def_readwrite("forward_seconds", &BlockRecord::forward_seconds)
      .def_readwrite("backward_seconds", &BlockRecord::backward_seconds)
      .def_readwrite("parameter_bytes", &BlockRecord::parameter_bytes);
  init_from_kwargs(record);
  m.def("measured_block_profile", [](const BlockRecord& r) { return measured_block_profile(r); }, py::arg("record"),
        "The BlockProfile of a measured block without the optimizer's traffic (Note [Auto plan phases]).");
  py::class_<SessionBudgetInputs> inputs(m, "SessionBudgetInputs", "What session_budgets is computed from.");
  inputs.def(py::init<>())
      .def_readwrite("device_budget_bytes", &SessionBudgetInputs::device_budget_bytes)
      .def_readwrite("host_budget_bytes", &SessionBudgetInputs::host_budget_bytes)
      .def_readwrite("host_in_use_bytes", &SessionBudgetInputs::host_in_use_bytes)
      .def_readwrite("nvme_available_bytes", &SessionBudgetInputs::nvme_available_bytes)
      .def_readwrite("parameter_bytes", &SessionBudgetInputs::parameter_bytes)
      .def_readwrite("params", &SessionBudgetInputs::params)
      .def_readwrite("param_tier", &SessionBudgetInputs::param_tier)
      .def_readwrite("rest_parameter_bytes", &SessionBudgetInputs::rest_parameter_bytes)
      .def_readwrite("measured_parameter_peak_bytes", &SessionBudgetInputs::measured_parameter_peak_bytes)
      .def_readwrite("sharded_unit_bytes", &SessionBudgetInputs::sharded_unit_bytes)
      .def_readwrite("sharded_root_bytes", &SessionBudgetInputs::sharded_root_bytes);
  init_from_kwargs(inputs);
  m.attr("TABLES_KEPT_PER_BLOCK") = kTablesKeptPerBlock;
  m.attr("REPLAN_MARGIN") = kReplanMargin;
  m.def("outside_swap_seconds", &outside_swap_seconds, py::arg("links"), py::arg("bytes"),
        "What is saved outside the blocks, to the host and back (Note [Activation planner]).");
  // The probes' sizes and a runner's median: the front end measures.
  m.def("link_probe_bytes", &link_probe_bytes, py::arg("host_budget_bytes"), py::arg("host_in_use_bytes"),
        py::arg("most") = kLinkProbeBytes, "The link probe's buffer size for the host room left.");
  m.def("median_seconds", &median_seconds, py::arg("seconds"), "The median, as statistics.median (0 for none).");
  m.def("nvme_probe_bytes", &nvme_probe_bytes, py::arg("available_bytes"), "The NVMe probe's first block size.");
  m.def("next_nvme_probe_bytes", &next_nvme_probe_bytes, py::arg("bytes"),
        "The next NVMe probe size when the free space is in pieces (0: give up).");
}

// tiering::BlockTable (Note [Block table]): kinds, classes, modes and actions as the strings Python uses.
void bind_block_table(py::module_& m) {
  py::class_<BlockTable>(m, "BlockTable", "What one block's forward does, and the decisions over it.")
      .def(py::init<>())
      .def("add_op", [](BlockTable& t, const std::string& kind, double flops, std::int64_t rows,
                        std::vector<std::int64_t> output_elements) {
        return t.add_op(RecordedOp{parse_op_kind(kind), flops, rows, std::move(output_elements)});
      }, py::arg("kind"), py::arg("flops"), py::arg("rows"), py::arg("output_elements"),
         "Records the next op (output_elements: -1 for an output that is not a tensor); returns its index.")
      .def("add_saved", [](BlockTable& t, const std::string& cls, std::uint64_t nbytes, bool first) {
        return t.add_saved(parse_saved_class(cls), nbytes, first);
      }, py::arg("cls"), py::arg("nbytes"), py::arg("first"), "A saved external or input tensor.")
      .def("add_produced", &BlockTable::add_produced, py::arg("op"), py::arg("out"), py::arg("nbytes"),
           py::arg("first"), py::arg("mutated"), "A saved tensor an op of the block produced.")
      .def("finish", &BlockTable::finish, "Which attention ops are restorable and which matmuls split.")
      .def("probe", &BlockTable::probe, py::arg("alpha"), py::arg("granule"), py::arg("exact"),
           "Sets the exact first rows of each split op; exact(op, r0) probes on the device.")
      .def("actions", [](const BlockTable& t, const std::string& mode) {
        std::vector<std::string> out;
        for (auto a : t.actions(parse_block_mode(mode))) out.emplace_back(tiering::to_string(a));
        return out;
      }, py::arg("mode"), "tiering::saved_action of every saved tensor in mode.")
      .def("classes", [](const BlockTable& t) {
        std::vector<std::string> out;
        for (const auto& s : t.saved()) out.emplace_back(tiering::to_string(s.cls));
        return out;
      }, "The class of every saved tensor.")
      .def("restorable", &BlockTable::restorable, "Attention ops whose every non-empty output is saved.")
      .def("split_ops", &BlockTable::split_ops, "Matmuls with a saved split output, not mutated.")
      .def("mutated_ops", &BlockTable::mutated_ops, "Matmuls whose saved output was written in place.")
      .def("exact_rows", &BlockTable::exact_rows, "Split op -> its first rows, probed exact.")
      .def("record", &BlockTable::record, py::arg("forward_seconds"), "The planner's BlockRecord of this block.");
  m.attr("SPLIT_ROW_GRANULE") = kSplitRowGranule;
  // The recorder's rules (Note [Block table]): torch reads the numbers, tiering decides.
  m.def("attention_op", [](double dropout_p, std::int64_t q_elements, std::int64_t key_length, bool causal) {
    return py::make_tuple(std::string(to_string(attention_kind(dropout_p))),
                          attention_flops(q_elements, key_length, causal));
  }, py::arg("dropout_p"), py::arg("q_elements"), py::arg("key_length"), py::arg("causal"),
        "(kind, flops) of a recorded attention op.");
  m.def("row_matmul", [](std::vector<std::int64_t> m1_sizes, std::vector<std::int64_t> m1_strides, bool m1_params,
                         std::vector<std::int64_t> m2_sizes, bool m2_params, bool output_contiguous_at_zero) {
    const auto r = row_matmul({std::move(m1_sizes), std::move(m1_strides), m1_params}, {std::move(m2_sizes), {}, m2_params},
                              output_contiguous_at_zero);
    return py::make_tuple(std::string(to_string(r.kind)), r.flops, r.rows);
  }, py::arg("m1_sizes"), py::arg("m1_strides"), py::arg("m1_parameter_derived"), py::arg("m2_sizes"),
        py::arg("m2_parameter_derived"), py::arg("output_contiguous_at_zero"), "(kind, flops, rows) of mm/addmm.");
  m.def("batched_matmul_flops", &batched_matmul_flops, py::arg("a_elements"), py::arg("b_last"), "FLOPs of bmm/matmul.");
  // Note [Finding blocks]: the module tree as (class number, container, holds parameters, children) per module.
  m.def("find_blocks", [](const std::vector<std::tuple<std::size_t, bool, bool, std::vector<std::size_t>>>& tree) {
    std::vector<ModuleNode> modules;
    for (const auto& [type, container, params, children] : tree) modules.push_back({type, container, params, children});
    return find_blocks(modules);
  }, py::arg("modules"), "The indices of the model's repeated blocks in model.modules()' list (tiering::find_blocks).");
}

// The profile file (Note [Profile file]).
void bind_profile_file(py::module_& m) {
  py::class_<ProfileFile>(m, "ProfileFile", "A recorded profile: blocks, links, fixed device bytes.")
      .def_readwrite("blocks", &ProfileFile::blocks)
      .def_readwrite("links", &ProfileFile::links)
      .def_readwrite("fixed_device_bytes", &ProfileFile::fixed_device_bytes)
      .def_readwrite("outside_saved_bytes", &ProfileFile::outside_saved_bytes)
      .def_readwrite("outside_largest_bytes", &ProfileFile::outside_largest_bytes);
  m.attr("PROFILE_FORMAT") = std::string(kProfileFormat);
  m.attr("PROFILE_VERSION") = kProfileVersion;
  auto names = [](const std::vector<std::string_view>& v) {
    py::list out;
    for (auto n : v) out.append(std::string(n));
    return py::tuple(out);
  };
  m.attr("PROFILE_BLOCK_FIELDS") = names(profile_block_fields());
  m.attr("PROFILE_LINK_FIELDS") = names(profile_link_fields());
  m.def("profile_to_json", &profile_to_json, py::arg("blocks"), py::arg("links"), py::arg("fixed_device_bytes"),
        "The profile file's text.");
  m.def("profile_from_json", [](const std::string& text) { return profile_from_json(text); }, py::arg("text"),
        "Parses a profile file's text; raises ConfigError saying what is wrong.");
  m.def("profile_for_model", [](const std::string& path, const std::string& text, std::size_t blocks) {
    return profile_for_model(path, text, blocks);
  }, py::arg("path"), py::arg("text"), py::arg("blocks"), "A TIERFLOW_PROFILE read back for a model of `blocks` blocks.");
  m.def("not_a_profile", [](const std::string& path, const std::string& why) { return not_a_profile(path, why); },
        py::arg("path"), py::arg("why"), "The error text of a TIERFLOW_PROFILE that is not a profile.");
}

void bind_estimates(py::module_& m) {
  py::class_<TransformerShape> shape(m, "TransformerShape", "The shape of a GPT-2-style decoder.");
  shape.def(py::init<>())
      .def_readwrite("layers", &TransformerShape::layers)
      .def_readwrite("hidden", &TransformerShape::hidden)
      .def_readwrite("heads", &TransformerShape::heads)
      .def_readwrite("seq", &TransformerShape::seq)
      .def_readwrite("batch", &TransformerShape::batch)
      .def_readwrite("dtype_bytes", &TransformerShape::dtype_bytes)
      .def_readwrite("vocab", &TransformerShape::vocab)
      .def_readwrite("ffn_mult", &TransformerShape::ffn_mult);
  init_from_kwargs(shape);

  py::class_<StateBytes>(m, "StateBytes", "Bytes of training state per tier.")
      .def_readonly("device", &StateBytes::device)
      .def_readonly("host", &StateBytes::host)
      .def_readonly("nvme", &StateBytes::nvme)
      .def_readonly("parameter_bytes", &StateBytes::parameter_bytes)
      .def_readonly("gradient_bytes", &StateBytes::gradient_bytes)
      .def_readonly("optimizer_bytes", &StateBytes::optimizer_bytes);

  m.def("estimate_transformer", &estimate_transformer, py::arg("shape"), py::arg("flops_per_second"),
        "One estimated BlockProfile per layer (Note [Transformer estimate]).");
  m.def("transformer_parameters", &transformer_parameters, py::arg("shape"), "Parameters of the model.");
  m.def("estimate_training_state", [](const TransformerShape& s, const std::string& optimizer,
                                      const std::string& states) {
    return estimate_training_state(s, parse_optimizer_placement(optimizer), state_format_of(states));
  }, py::arg("shape"), py::arg("optimizer"), py::arg("optimizer_states") = "fp32",
        "Parameters, gradients and optimizer states per tier for optimizer placement none, host or nvme, the "
        "CPU AdamW's moments in optimizer_states fp32, bf16 or 8bit (Note [Transformer estimate]).");
  m.def("cpu_optimizer_bytes_per_param", [](const std::string& states, int dtype_bytes) {
    return cpu_optimizer_bytes_per_param(state_format_of(states), dtype_bytes);
  }, py::arg("optimizer_states"), py::arg("dtype_bytes"),
        "Bytes the CPU AdamW keeps a parameter (fp32 master and m, v in fp32, bf16 or 8bit): 12, 8, 6.03 for bf16.");
  m.def("parse_decimal", [](const std::string& text) { return parse_decimal(text); }, py::arg("text"),
        "A finite decimal number (1, -0.5, 2e-3; no hex, inf or nan), or None (core/size.hpp's parse_decimal).");
  m.def("transformer_shape_limits", [] {
    py::dict out;
    for (const auto& l : transformer_shape_limits()) out[py::str(std::string(l.field))] = l.max;
    return out;
  }, "The largest accepted value of each TransformerShape field (the smallest is 1).");
  m.def("device_capacity_bytes", [](bool cuda) {
    return allocator::device_capacity_bytes(cuda ? allocator::DeviceKind::kCuda : allocator::DeviceKind::kEmulated);
  }, py::arg("cuda"), "Total memory of the GPU tier: the current GPU's, or physical RAM when emulated.");
  m.def("device_is_cuda", [](const std::map<std::string, std::string>& config) {
    return device_kind(Config::parse({}, config)) == allocator::DeviceKind::kCuda;
  }, py::arg("config"), "Whether these TIERFLOW_* texts run on CUDA (tiering::device_kind); raises ConfigError.");
  m.def("host_capacity_bytes", &allocator::host_capacity_bytes, "Physical RAM of this machine.");
  m.def("format_bytes", &format_bytes, py::arg("bytes"), "Human-readable size, e.g. '1.50 GiB'.");
}

// `python -m tierflow plan`'s inputs and budgets (Note [Plan report]); the command itself is plan_cli_bindings.cpp's.
void bind_plan_command(py::module_& m) {
  py::enum_<SettingSource>(m, "SettingSource", "Where the text of a size setting came from.")
      .value("unset", SettingSource::kUnset)
      .value("variable", SettingSource::kVariable)
      .value("flag", SettingSource::kFlag);
  py::class_<SettingText> text(m, "SettingText", "A size setting as the plan command received it.");
  text.def(py::init<>())
      .def_readwrite("text", &SettingText::text)
      .def_readwrite("source", &SettingText::source);
  init_from_kwargs(text);
  py::class_<PlanCommandInputs> inputs(m, "PlanCommandInputs", "What the plan command gathered.");
  // The runtime's pinned pool rule for the plan command (optimizer_pinned_bytes): the one wrap refuses a smaller
  // TIERFLOW_HOST_MEMORY by.
  set_pinned_pool_rule([](const std::vector<std::uint64_t>& numels, int element_bytes, StateFormat format,
                          bool nvme) {
    std::vector<optimizer::ParamStateShape> params;
    params.reserve(numels.size());
    for (const std::uint64_t n : numels)
      params.push_back({static_cast<std::size_t>(n), false, static_cast<std::size_t>(element_bytes), format});
    return optimizer::state_pool_need(params, nvme).bytes;
  });
  // The fields a test sets (the plan command itself fills them in C++: plan_cli_bindings.cpp).
  inputs.def(py::init<>())
      .def_readwrite("host_memory", &PlanCommandInputs::host_memory)
      .def_readwrite("prefetch", &PlanCommandInputs::prefetch)
      .def_readwrite("device_capacity_bytes", &PlanCommandInputs::device_capacity_bytes)
      .def_readwrite("host_capacity_bytes", &PlanCommandInputs::host_capacity_bytes)
      .def_readwrite("optimizer", &PlanCommandInputs::optimizer)
      .def_readwrite("shape", &PlanCommandInputs::shape)
      .def_readwrite("state", &PlanCommandInputs::state)
      .def_readwrite("blocks_from", &PlanCommandInputs::blocks_from);
  init_from_kwargs(inputs);
  py::class_<PlanCommandBudgets>(m, "PlanCommandBudgets", "The planner's inputs and where they came from.")
      .def_readonly("optimizer_host_bytes", &PlanCommandBudgets::optimizer_host_bytes);
  m.def("plan_command_budgets", &plan_command_budgets, py::arg("inputs"),
        "The plan command's budgets (Note [Plan report]); raises ConfigError naming the flag or variable.");
  m.def("check_rate", &check_rate, py::arg("value"), py::arg("shown"), py::arg("zero"),
        "A rate argument within its range, or ConfigError saying what is accepted (Note [Plan report]).");
  m.def("shape_argument", [](const std::string& field, const std::string& digits, const std::string& shown) {
    return shape_argument(field, digits, shown);
  }, py::arg("field"), py::arg("digits"), py::arg("shown"), "A shape argument within its limits, or ConfigError.");
}

// The planner's enums.
void bind_planner_enums(py::module_& m) {
  py::enum_<BlockMode>(m, "BlockMode", "What happens to a block's saved bytes.")
      .value("keep", BlockMode::kKeep)
      .value("swap", BlockMode::kSwap)
      .value("split", BlockMode::kSplit)
      .value("recompute", BlockMode::kRecompute);
  py::enum_<Tier>(m, "Tier", "A memory tier.")
      .value("gpu", Tier::kGpu)
      .value("host", Tier::kHost)
      .value("nvme", Tier::kNvme);
  py::enum_<ParamPolicy>(m, "ParamPolicy", "Whether blocks' parameters may leave the device between uses.")
      .value("resident", ParamPolicy::kResident)
      .value("auto", ParamPolicy::kAuto)
      .value("fetch_all", ParamPolicy::kFetchAll);
  py::enum_<SwapTier>(m, "SwapTier", "Where swapped bytes go.")
      .value("host", SwapTier::kHost)
      .value("nvme", SwapTier::kNvme);
}

// The planner's structs (tiering/planner.hpp) as classes with read-write fields.
void bind_planner_structs(py::module_& m) {
  bind_planner_enums(m);

  py::class_<BlockProfile> profile(m, "BlockProfile", "Measured or estimated costs of one repeated block.");
  profile.def(py::init<>())
      .def_readwrite("forward_seconds", &BlockProfile::forward_seconds)
      .def_readwrite("backward_seconds", &BlockProfile::backward_seconds)
      .def_readwrite("input_bytes", &BlockProfile::input_bytes)
      .def_readwrite("whole_bytes", &BlockProfile::whole_bytes)
      .def_readwrite("split_bytes", &BlockProfile::split_bytes)
      .def_readwrite("split_recompute_seconds", &BlockProfile::split_recompute_seconds)
      .def_readwrite("cheap_bytes", &BlockProfile::cheap_bytes)
      .def_readwrite("cheap_recompute_seconds", &BlockProfile::cheap_recompute_seconds)
      .def_readwrite("splittable", &BlockProfile::splittable)
      .def_readwrite("replayable", &BlockProfile::replayable)
      .def_readwrite("transient_bytes", &BlockProfile::transient_bytes)
      .def_readwrite("upload_bytes", &BlockProfile::upload_bytes)
      .def_readwrite("download_bytes", &BlockProfile::download_bytes)
      .def_readwrite("parameter_bytes", &BlockProfile::parameter_bytes)
      .def("saved_bytes", &BlockProfile::saved_bytes);
  init_from_kwargs(profile);

  py::class_<Links> links(m, "Links", "Link bandwidths in bytes per second (0: absent).");
  links.def(py::init<>())
      .def_readwrite("d2h", &Links::d2h)
      .def_readwrite("h2d", &Links::h2d)
      .def_readwrite("duplex", &Links::duplex)
      .def_readwrite("nvme_write", &Links::nvme_write)
      .def_readwrite("nvme_read", &Links::nvme_read)
      .def_readwrite("compute_share_during_copies", &Links::compute_share_during_copies)
      .def_readwrite("copy_share_during_cpu_step", &Links::copy_share_during_cpu_step);
  init_from_kwargs(links);

  py::class_<Budgets> budgets(m, "Budgets", "Memory the plan may use, bytes.");
  budgets.def(py::init<>())
      .def_readwrite("device_bytes", &Budgets::device_bytes)
      .def_readwrite("fixed_device_bytes", &Budgets::fixed_device_bytes)
      .def_readwrite("host_bytes", &Budgets::host_bytes)
      .def_readwrite("nvme_bytes", &Budgets::nvme_bytes)
      .def_readwrite("prefetch_bytes", &Budgets::prefetch_bytes)
      .def_readwrite("params", &Budgets::params)
      .def_readwrite("param_tier", &Budgets::param_tier)
      .def_readwrite("rest_parameter_bytes", &Budgets::rest_parameter_bytes)
      .def_readwrite("outside_saved_bytes", &Budgets::outside_saved_bytes)
      .def_readwrite("outside_largest_bytes", &Budgets::outside_largest_bytes);
  init_from_kwargs(budgets);

  py::class_<BlockPlan> block_plan(m, "BlockPlan", "The decision and the predictions for one block.");
  block_plan.def(py::init<>())
      .def_readwrite("mode", &BlockPlan::mode)
      .def_readwrite("alpha", &BlockPlan::alpha)
      .def_readwrite("tier", &BlockPlan::tier)
      .def_readwrite("keep", &BlockPlan::keep)
      .def_readwrite("swap", &BlockPlan::swap)
      .def_readwrite("recompute", &BlockPlan::recompute)
      .def_readwrite("swap_bytes", &BlockPlan::swap_bytes)
      .def_readwrite("forward_seconds", &BlockPlan::forward_seconds)
      .def_readwrite("backward_seconds", &BlockPlan::backward_seconds)
      .def_readwrite("params", &BlockPlan::params);
  init_from_kwargs(block_plan);

  py::class_<Plan>(m, "Plan", "A plan for every block, with its predictions (Note [Activation planner]).")
      .def_readonly("blocks", &Plan::blocks)
      .def_readonly("predicted_device_peak_bytes", &Plan::predicted_device_peak_bytes)
      .def_readonly("predicted_step_seconds", &Plan::predicted_step_seconds)
      .def_readonly("host_bytes", &Plan::host_bytes)
      .def_readonly("nvme_bytes", &Plan::nvme_bytes)
      .def_readonly("keep_all_step_seconds", &Plan::keep_all_step_seconds)
      .def_readonly("device_budget_bytes", &Plan::device_budget_bytes)
      .def_readonly("fits", &Plan::fits)
      .def_readonly("rest_params", &Plan::rest_params)
      .def_readonly("proven_optimal", &Plan::proven_optimal)
      .def_readonly("outside_kept", &Plan::outside_kept)
      .def_readonly("outside_tier", &Plan::outside_tier)  // kGpu kept, kHost or kNvme (Note [Activation planner])
      .def_readonly("outside_bytes", &Plan::outside_bytes)
      .def_readonly("outside_swap_seconds", &Plan::outside_swap_seconds)
      .def_readonly("outside_staging_bytes", &Plan::outside_staging_bytes)  // in host_bytes (outside_tier nvme)
      .def("summary", &Plan::summary)
      .def("block_line", &Plan::block_line);
}

}  // namespace

void bind_planner(py::module_& m) {
  bind_planner_structs(m);

  m.def("plan_activations", &plan_activations, py::arg("blocks"), py::arg("links"), py::arg("budgets"),
        py::call_guard<py::gil_scoped_release>(),
        "The plan of least predicted step time within the budgets; raises OutOfMemoryError saying what is needed.");
  m.def("forced_plan", &forced_plan, py::arg("blocks"), py::arg("links"), py::arg("budgets"), py::arg("mode"),
        "Every block in `mode` (split: MEMO's link rule for alpha), with the same predictions.");

  // Note [Replay side effects]: which forwards may be replayed.
  m.def(
      "replay_refusal",
      [](std::vector<std::string> foreign_hooks, std::vector<std::string> unrestorable_state) {
        return replay_refusal(BlockSideEffects{std::move(foreign_hooks), std::move(unrestorable_state)});
      },
      py::arg("foreign_hooks"), py::arg("unrestorable_state"),
      "Why a block's forward may not be replayed (empty when it may; Note [Replay side effects]).");
  m.def("replay_mode", &replay_mode, py::arg("planned"), py::arg("replayable"),
        "The mode a block runs in: swap where a block that may not be replayed is planned to split or recompute.");

  bind_auto_plan(m);
  bind_block_table(m);
  bind_estimates(m);
  bind_plan_command(m);
  { void bind_prediction(py::module_&); bind_prediction(m); }  // prediction_bindings.cpp: Note [Step prediction]
  { void bind_model_config(py::module_&); bind_model_config(m); }  // model_config_bindings.cpp: --model
  bind_profile_file(m);
}

}  // namespace tierflow::bindings
