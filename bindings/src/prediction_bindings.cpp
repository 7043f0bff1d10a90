// The whole-step prediction's Python surface (Note [Step prediction]), torch-free: the CPU AdamW's rate measured
// with tierflow's own kernel, and what the front end measured of each term (tiering/measured_terms.hpp).
// Registered from bind_planner (planner_bindings.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "init_from_kwargs.hpp"
#include "state_format_setting.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/state_format.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/tiering/measured_terms.hpp"
#include "tierflow/tiering/plan_driver.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/step_prediction.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
namespace {

using namespace tierflow::tiering;

// What the plan command measures when --cpu-adam-rate is not given: every core, about 60 ms.
double measured_for_plan(StateFormat states) { return optimizer::measure_cpu_adam_rate(states).params_per_second; }

}  // namespace

void bind_prediction(py::module_& m) {
  set_cpu_adam_rate_source(&measured_for_plan);
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
  // tiering/measured_terms.hpp: the front end's counters, and each term's measurement beside its prediction.
  py::class_<WaitCounters> counters(m, "WaitCounters", "What the runtime counts of the step's waits, cumulative.");
  counters.def_readwrite("forwards", &WaitCounters::forwards)
      .def_readwrite("optimizer_steps", &WaitCounters::optimizer_steps)
      .def_readwrite("param_wait_ms", &WaitCounters::param_wait_ms)
      .def_readwrite("activation_wait_ms", &WaitCounters::activation_wait_ms)
      .def_readwrite("step_wait_ms", &WaitCounters::step_wait_ms)
      .def_readwrite("grad_copy_wait_ms", &WaitCounters::grad_copy_wait_ms)
      .def_readwrite("kernel_ms", &WaitCounters::kernel_ms)
      .def_readwrite("kernel_grad_bytes", &WaitCounters::kernel_grad_bytes)
      .def_readwrite("streaming", &WaitCounters::streaming)
      .def_readwrite("python_step_ms", &WaitCounters::python_step_ms)
      .def_readwrite("adam_elements", &WaitCounters::adam_elements);
  init_from_kwargs(counters);
  m.def(
      "measured_compute",
      [](const std::string& report, const std::vector<std::optional<double>>& replays) {
        const MeasuredCompute c = measured_compute(report, replays);
        return std::make_pair(c.seconds, c.over);
      },
      py::arg("report"), py::arg("replays"), "(seconds or None, what it is over): the blocks' measured compute.");
  m.def("measured_terms_json", &measured_terms_json, py::arg("report"), py::arg("replays"), py::arg("now"),
        py::arg("then"), "Each term's measurement and what it is over, as JSON (Note [Step prediction]).");
  m.def(
      "timed_optimizer_inputs",
      [](const WaitCounters& before, const WaitCounters& after, std::uint64_t parameters, std::size_t element_bytes,
         const std::string& states) {
        return timed_optimizer_inputs(before, after, parameters, element_bytes, state_format_of(states));
      },
      py::arg("before"), py::arg("after"), py::arg("parameters"), py::arg("element_bytes"), py::arg("states"),
      "The CPU optimizer as the timed step measured it (Note [Step prediction]).");
  m.def("timed_optimizer_wait_seconds", &timed_optimizer_wait_seconds, py::arg("before"), py::arg("after"),
        "step()'s wait for the CPU optimizer in the timed step, its Python path's steps included.");
}

}  // namespace tierflow::bindings
