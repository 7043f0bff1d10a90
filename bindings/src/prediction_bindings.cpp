// The whole-step prediction's Python surface (Note [Step prediction]), torch-free: the CPU AdamW's rate measured
// with tierflow's own kernel, PlanCommandInputs.cpu_adam_params_per_second, and predict_step. Registered from
// bind_planner (planner_bindings.cpp), after PlanCommandInputs' class.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "init_from_kwargs.hpp"
#include "state_format_setting.hpp"
#include "struct_dict.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/state_format.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/tiering/plan_driver.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/step_prediction.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
namespace {

using namespace tierflow::tiering;

// What the plan command measures when --cpu-adam-rate is not given: every core, about 60 ms.
double measured_for_plan(StateFormat states) { return optimizer::measure_cpu_adam_rate(states).params_per_second; }

py::dict prediction_dict(const StepPrediction& p) {
  py::dict terms;
  for (const auto& [name, seconds] : step_terms(p)) terms[py::str(name)] = seconds;
  py::dict out;
  out["terms_seconds"] = terms;
  using P = StepPrediction;
  return struct_dict<P>(p, {{"blocks_seconds", &P::blocks_seconds},
                            {"backward_seconds", &P::backward_seconds},
                            {"optimizer_kernel_seconds", [](const P& x) { return x.optimizer.kernel_seconds; }},
                            {"optimizer_busy_seconds", [](const P& x) { return x.optimizer.busy_seconds; }},
                            {"optimizer_nvme_read_seconds", [](const P& x) { return x.optimizer.nvme_read_seconds; }},
                            {"optimizer_nvme_write_seconds", [](const P& x) { return x.optimizer.nvme_write_seconds; }}},
                        out);
}

}  // namespace

void bind_prediction(py::module_& m) {
  set_cpu_adam_rate_source(&measured_for_plan);
  // PlanCommandInputs' class is bind_plan_command's; its rate field is this file's (issue 41).
  auto inputs = py::reinterpret_borrow<py::class_<PlanCommandInputs>>(m.attr("PlanCommandInputs"));
  inputs.def_readwrite("cpu_adam_params_per_second", &PlanCommandInputs::cpu_adam_params_per_second,
                       "--cpu-adam-rate: the CPU AdamW's parameters a second with fp32 states (0: measured here).");

  m.def(
      "measure_cpu_adam_rate",
      [](const std::string& states, double seconds, std::size_t parameters, int threads) {
        return optimizer::measure_cpu_adam_rate(state_format_of(states), seconds, parameters, threads).params_per_second;
      },
      py::arg("states") = "fp32", py::arg("seconds") = 0.06, py::arg("parameters") = std::size_t{1} << 22,
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "The CPU AdamW's parameters a second on this machine with moments in `states` (fp32, bf16, 8bit): tierflow's "
      "kernel timed for about `seconds` (Note [Step prediction]).");
  m.def("cpu_adam_step_bytes_per_param",
        [](const std::string& states, int dtype_bytes) {
          return cpu_adam_step_bytes_per_param(state_format_of(states), dtype_bytes);
        },
        py::arg("states"), py::arg("dtype_bytes"), "Bytes a parameter one CPU AdamW step moves (Note [Step prediction]).");

  py::class_<OptimizerStepInputs> optimizer(m, "OptimizerStepInputs", "The CPU optimizer as the step prediction sees it.");
  optimizer.def_readwrite("on_cpu", &OptimizerStepInputs::on_cpu)
      .def_readwrite("parameters", &OptimizerStepInputs::parameters)
      .def_readwrite("params_per_second", &OptimizerStepInputs::params_per_second)
      .def_property(
          "states", [](const OptimizerStepInputs& o) { return std::string(to_string(o.states)); },
          [](OptimizerStepInputs& o, const std::string& text) { o.states = state_format_of(text); },
          "The moments' format: fp32, bf16 or 8bit (TIERFLOW_OPTIMIZER_STATES' values).")
      .def_readwrite("steps_during_backward", &OptimizerStepInputs::steps_during_backward)
      .def_readwrite("nvme_state_bytes", &OptimizerStepInputs::nvme_state_bytes)
      .def_readwrite("nvme_read", &OptimizerStepInputs::nvme_read)
      .def_readwrite("nvme_write", &OptimizerStepInputs::nvme_write);
  init_from_kwargs(optimizer);
  // TimedStepMeasures is _C's (plan_driver_bindings.cpp, loaded after this module); autoplan.py hands its class
  // here once to add the CPU optimizer's fields (the extensions share pybind11's type registry).
  m.def(
      "add_timed_step_optimizer_fields",
      [](py::object cls) {
        auto measures = py::reinterpret_borrow<py::class_<TimedStepMeasures>>(cls);
        if (py::hasattr(measures, "optimizer_wait_seconds")) return;
        measures.def_readwrite("optimizer_wait_seconds", &TimedStepMeasures::optimizer_wait_seconds)
            .def_readwrite("optimizer", &TimedStepMeasures::optimizer);
      },
      py::arg("cls"), "Adds TimedStepMeasures' CPU optimizer fields (Note [Step prediction]) to its class.");
  m.def(
      "predict_step",
      [](const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
         const OptimizerStepInputs& optimizer, double rest_seconds) {
        return prediction_dict(predict_step(plan, blocks, links, budgets, optimizer, rest_seconds));
      },
      py::arg("plan"), py::arg("blocks"), py::arg("links"), py::arg("budgets"), py::arg("optimizer"),
      py::arg("rest_seconds") = 0.0, "The whole step term by term (Note [Step prediction]), as a dict.");
}

}  // namespace tierflow::bindings
