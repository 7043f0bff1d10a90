// `python -m tierflow plan --model`'s torch-free surface: a config.json read into a TransformerShape (Note [Model
// families]), the fields the shape learned for it, the bytes per tier by kind and the settings that would make a
// plan fit (Note [Plan fit]). Registered from bind_planner (planner_bindings.cpp) after TransformerShape's class.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "tierflow/tiering/model_config.hpp"
#include "tierflow/tiering/plan_fit.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

namespace py = pybind11;

namespace tierflow::bindings {

using namespace tierflow::tiering;

void bind_model_config(py::module_& m) {
  // TransformerShape is bound by bind_estimates; the fields a config.json sets are added to its class here.
  auto shape = py::reinterpret_borrow<py::class_<TransformerShape>>(py::type::of<TransformerShape>());
  shape.def_readwrite("kv_heads", &TransformerShape::kv_heads)
      .def_readwrite("head_dim", &TransformerShape::head_dim)
      .def_readwrite("intermediate", &TransformerShape::intermediate)
      .def_readwrite("gated", &TransformerShape::gated)
      .def_readwrite("rms_norm", &TransformerShape::rms_norm)
      .def_readwrite("qkv_bias", &TransformerShape::qkv_bias)
      .def_readwrite("output_bias", &TransformerShape::output_bias)
      .def_readwrite("mlp_bias", &TransformerShape::mlp_bias)
      .def_readwrite("qk_norm", &TransformerShape::qk_norm)
      .def_readwrite("tied", &TransformerShape::tied)
      .def_readwrite("positions", &TransformerShape::positions)
      .def_readwrite("experts", &TransformerShape::experts)
      .def_readwrite("experts_per_token", &TransformerShape::experts_per_token)
      .def_readwrite("expert_intermediate", &TransformerShape::expert_intermediate)
      .def_readwrite("activation_saved", &TransformerShape::activation_saved);

  // --cpu-adam-rate's field (Note [Step prediction]); bound here too so the command sets it whichever binds first.
  auto inputs = py::reinterpret_borrow<py::class_<PlanCommandInputs>>(py::type::of<PlanCommandInputs>());
  inputs.def_readwrite("cpu_adam_params_per_second", &PlanCommandInputs::cpu_adam_params_per_second);

  py::class_<ModelConfig>(m, "ModelConfig", "A transformers config.json as the planner reads it (Note [Model "
                                            "families]).")
      .def_readonly("path", &ModelConfig::path)
      .def_readonly("model_type", &ModelConfig::model_type)
      .def_readonly("family", &ModelConfig::family)
      .def_readonly("shape", &ModelConfig::shape)
      .def_readonly("dtype", &ModelConfig::dtype)
      .def_readonly("max_positions", &ModelConfig::max_positions);
  m.def("load_model_config", &load_model_config, py::arg("path"),
        "The config.json at `path` (or in it, a directory); raises ConfigError naming the file and the field.");
  m.def("parse_model_config", &parse_model_config, py::arg("text"), py::arg("path"),
        "A config.json's text read as if from `path`; raises ConfigError.");
  m.def("model_types", &model_types, "The config.json model_type values --model reads.");
  m.def("default_seq", &default_seq, py::arg("config"), "--seq's default for --model: max positions, at most 4096.");
  m.def("transformer_block_parameters", &transformer_block_parameters, py::arg("shape"),
        "Parameters of one repeated block.");
  m.def("estimate_head_saved_bytes", &estimate_head_saved_bytes, py::arg("shape"),
        "Of estimate_head_device_bytes, what is saved for backward (final norm, head input, log-softmax output).");
  m.def("transformer_block_flops_per_token", &transformer_block_flops_per_token, py::arg("shape"),
        "Forward matmul flops of one block per token.");

  py::class_<MemoryTable>(m, "MemoryTable", "Bytes per tier by kind (Note [Plan fit]).")
      .def_property_readonly("bytes", [](const MemoryTable& t) {
        py::dict out;
        for (std::size_t tier = 0; tier < kMemoryTiers; ++tier) {
          py::dict col;
          for (std::size_t k = 0; k < kMemoryKinds; ++k)
            col[py::str(std::string(to_string(static_cast<MemoryKind>(k))))] = t.bytes[k][tier];
          out[py::str(std::string(to_string(static_cast<MemoryTier>(tier))))] = col;
        }
        return out;
      }, "{tier: {kind: bytes}}: tiers device, pinned host, NVMe (no pageable column: Note [Plan fit]); kinds "
         "parameters, gradients, "
         "optimizer states, activations, workspace.")
      .def("lines", &MemoryTable::lines)
      .def("json", &MemoryTable::json);
  m.def("memory_table", &memory_table, py::arg("plan"), py::arg("blocks"), py::arg("inputs"), py::arg("budgets"),
        "The bytes per tier by kind of a plan of an estimated model.");

  py::class_<FitTried>(m, "FitTried", "One combination of settings the fit search planned.")
      .def_readonly("flags", &FitTried::flags)
      .def_readonly("fits", &FitTried::fits)
      .def_readonly("why", &FitTried::why)
      .def_readonly("step_seconds", &FitTried::step_seconds)
      .def_readonly("device_peak_bytes", &FitTried::device_peak_bytes);
  py::class_<FitSearch>(m, "FitSearch", "What the fit search found (Note [Plan fit]).")
      .def_readonly("tried", &FitSearch::tried)
      .def_readonly("best", &FitSearch::best);
  m.def("search_fitting_settings", [](const std::vector<BlockProfile>& blocks, const PlanCommandInputs& inputs) {
    py::gil_scoped_release release;
    return search_fitting_settings(blocks, inputs);
  }, py::arg("blocks"), py::arg("inputs"), "Plans every combination of Note [Plan fit]; the fastest that fits.");
  m.def("fit_advice", &fit_advice, py::arg("search"), py::arg("command"),
        "What the refusal line adds: the settings that fit and the command line, or that none tried fits.");
  m.def("flags_text", &flags_text, py::arg("flags"), "'--offload-params host --optimizer-states 8bit'.");
}

}  // namespace tierflow::bindings
