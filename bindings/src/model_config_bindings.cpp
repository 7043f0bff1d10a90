// A config.json read into a TransformerShape (Note [Model families]) and the head's saved bytes, torch-free, for
// the tests that check the estimate against the model; `python -m tierflow plan --model` reads them through
// tiering::PlanCommand (plan_cli_bindings.cpp). Registered from bind_planner (planner_bindings.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "tierflow/tiering/model_config.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

namespace py = pybind11;

namespace tierflow::bindings {

using namespace tierflow::tiering;

void bind_model_config(py::module_& m) {
  py::class_<ModelConfig>(m, "ModelConfig", "A transformers config.json as the planner reads it (Note [Model "
                                            "families]).")
      .def_readonly("path", &ModelConfig::path)
      .def_readonly("model_type", &ModelConfig::model_type)
      .def_readonly("family", &ModelConfig::family)
      .def_readonly("shape", &ModelConfig::shape)
      .def_readonly("dtype", &ModelConfig::dtype)
      .def_readonly("max_positions", &ModelConfig::max_positions);
  m.def("parse_model_config", &parse_model_config, py::arg("text"), py::arg("path"),
        "A config.json's text read as if from `path`; raises ConfigError.");
  m.def("estimate_head_saved_bytes", &estimate_head_saved_bytes, py::arg("shape"),
        "Of estimate_head_device_bytes, what is saved for backward (final norm, head input, log-softmax output).");
}

}  // namespace tierflow::bindings
