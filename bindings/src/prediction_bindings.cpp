// The whole-step prediction's Python surface (Note [Step prediction]), torch-free: the CPU AdamW's rate measured
// with tierflow's own kernel, PlanCommandInputs.cpu_adam_params_per_second, and predict_step. Registered from
// bind_planner (planner_bindings.cpp), after PlanCommandInputs' class.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

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

// The format TIERFLOW_OPTIMIZER_STATES names `text`; ConfigError naming the variable and the accepted values.
StateFormat states_of(const std::string& text) {
  return *parse_state_format(parse_setting("TIERFLOW_OPTIMIZER_STATES", text));
}

// What the plan command measures when --cpu-adam-rate is not given: every core, about 60 ms.
double measured_for_plan(StateFormat states) { return optimizer::measure_cpu_adam_rate(states).params_per_second; }

py::dict prediction_dict(const StepPrediction& p) {
  py::dict terms;
  for (const auto& [name, seconds] : step_terms(p)) terms[py::str(name)] = seconds;
  py::dict out;
  out["terms_seconds"] = terms;
  out["blocks_seconds"] = p.blocks_seconds;
  out["backward_seconds"] = p.backward_seconds;
  out["optimizer_kernel_seconds"] = p.optimizer.kernel_seconds;
  out["optimizer_busy_seconds"] = p.optimizer.busy_seconds;
  out["optimizer_nvme_read_seconds"] = p.optimizer.nvme_read_seconds;
  out["optimizer_nvme_write_seconds"] = p.optimizer.nvme_write_seconds;
  return out;
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
        return optimizer::measure_cpu_adam_rate(states_of(states), seconds, parameters, threads).params_per_second;
      },
      py::arg("states") = "fp32", py::arg("seconds") = 0.06, py::arg("parameters") = std::size_t{1} << 22,
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "The CPU AdamW's parameters a second on this machine with moments in `states` (fp32, bf16, 8bit): tierflow's "
      "kernel timed for about `seconds` (Note [Step prediction]).");
  m.def("cpu_adam_step_bytes_per_param",
        [](const std::string& states, int dtype_bytes) {
          return cpu_adam_step_bytes_per_param(states_of(states), dtype_bytes);
        },
        py::arg("states"), py::arg("dtype_bytes"), "Bytes a parameter one CPU AdamW step moves (Note [Step prediction]).");

  py::class_<OptimizerStepInputs> optimizer(m, "OptimizerStepInputs", "The CPU optimizer as the step prediction sees it.");
  optimizer
      .def(py::init([](bool on_cpu, std::uint64_t parameters, double params_per_second, const std::string& states,
                       bool steps_during_backward, std::uint64_t nvme_state_bytes, double nvme_read,
                       double nvme_write) {
             OptimizerStepInputs o;
             o.on_cpu = on_cpu;
             o.parameters = parameters;
             o.params_per_second = params_per_second;
             o.states = states_of(states);
             o.steps_during_backward = steps_during_backward;
             o.nvme_state_bytes = nvme_state_bytes;
             o.nvme_read = nvme_read;
             o.nvme_write = nvme_write;
             return o;
           }),
           py::kw_only(), py::arg("on_cpu") = false, py::arg("parameters") = 0, py::arg("params_per_second") = 0.0,
           py::arg("states") = "fp32", py::arg("steps_during_backward") = true, py::arg("nvme_state_bytes") = 0,
           py::arg("nvme_read") = 0.0, py::arg("nvme_write") = 0.0)
      .def_readwrite("on_cpu", &OptimizerStepInputs::on_cpu)
      .def_readwrite("parameters", &OptimizerStepInputs::parameters)
      .def_readwrite("params_per_second", &OptimizerStepInputs::params_per_second)
      .def_readwrite("steps_during_backward", &OptimizerStepInputs::steps_during_backward)
      .def_readwrite("nvme_state_bytes", &OptimizerStepInputs::nvme_state_bytes)
      .def_readwrite("nvme_read", &OptimizerStepInputs::nvme_read)
      .def_readwrite("nvme_write", &OptimizerStepInputs::nvme_write);
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
