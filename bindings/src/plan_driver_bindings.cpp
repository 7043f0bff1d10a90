// tierflow._C's part of the planner: tiering::PlanDriver (Note [Plan driver]) and what it takes in and gives out.
// Torch-free, but bound in _C, not _core: the driver logs the plan in force, which must follow the level the
// Runtime sets in _C's copy of core (Note [Two extensions] in core_module.cpp). The types it uses from the rest of
// the planner (Plan, Links, BlockProfile, Settings) are _core's, registered once.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "init_from_kwargs.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/tiering/auto_plan.hpp"
#include "tierflow/tiering/measured_terms.hpp"
#include "tierflow/tiering/plan_driver.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/profile_file.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
namespace {

using namespace tierflow::tiering;

// tiering::PlanDriver's front end, overridden in Python (AutoPlanner): the driver decides, it measures and applies.
// A front end's Python error the driver handles as its own: _C.OutOfMemoryError and _C.ConfigError (a plan that
// cannot be applied or measured) come back as out_of_memory and config_error, which refuse a batch's growth or a
// re-plan and keep the plan in force as they do when the planner raises them; any other error goes on to the user.
template <class F>
auto translated(F&& call) -> decltype(call()) {
  try {
    return call();
  } catch (py::error_already_set& e) {
    py::gil_scoped_acquire gil;
    const py::module_ c = py::module_::import("tierflow._C");
    if (e.matches(c.attr("OutOfMemoryError"))) throw out_of_memory(py::str(e.value()).cast<std::string>());
    if (e.matches(c.attr("ConfigError"))) throw config_error(py::str(e.value()).cast<std::string>());
    throw;
  }
}

class PyPlanFrontEnd : public PlanFrontEnd {
 public:
  SessionBudgetInputs budget_inputs() override {
    return translated([&]() -> SessionBudgetInputs {
      PYBIND11_OVERRIDE_PURE(SessionBudgetInputs, PlanFrontEnd, budget_inputs);
    });
  }
  std::vector<std::size_t> inexact_splits(const std::vector<BlockPlan>& blocks) override {
    return translated([&]() -> std::vector<std::size_t> {
      PYBIND11_OVERRIDE_PURE(std::vector<std::size_t>, PlanFrontEnd, inexact_splits, blocks);
    });
  }
  std::optional<std::uint64_t> apply(const DrivenPlan& plan) override {
    return translated([&]() -> std::optional<std::uint64_t> {
      PYBIND11_OVERRIDE_PURE_NAME(std::optional<std::uint64_t>, PlanFrontEnd, "apply_plan", apply, plan);
    });
  }
  void start_timing() override {
    translated([&]() -> void { PYBIND11_OVERRIDE_PURE(void, PlanFrontEnd, start_timing); });
  }
  TimedStepMeasures measure_timed_step() override {
    return translated([&]() -> TimedStepMeasures {
      PYBIND11_OVERRIDE_PURE(TimedStepMeasures, PlanFrontEnd, measure_timed_step);
    });
  }
  std::uint64_t first_step_saved_bytes() override {
    return translated([&]() -> std::uint64_t {
      PYBIND11_OVERRIDE_PURE(std::uint64_t, PlanFrontEnd, first_step_saved_bytes);
    });
  }
  void write_profile(const AutoProfile& profile) override {
    translated([&]() -> void { PYBIND11_OVERRIDE_PURE(void, PlanFrontEnd, write_profile, profile); });
  }
  double now_seconds() override {
    return translated([&]() -> double { PYBIND11_OVERRIDE_PURE(double, PlanFrontEnd, now_seconds); });
  }
};

// What the driver decided: what applying a plan needs, the rest as JSON (plan_json, PlanDriver::report_json).
void bind_plan_driver_results(py::module_& m) {
  py::class_<DrivenPlan>(m, "DrivenPlan", "The plan in force, typed (plan_json: as the session reads it).")
      .def_readonly("plan", &DrivenPlan::plan)
      .def_readonly("keep_all", &DrivenPlan::keep_all)
      .def_readonly("outside_kept", &DrivenPlan::outside_kept)
      .def_readonly("window_bytes", &DrivenPlan::window_bytes);
  m.def("plan_json", &plan_json, py::arg("plan"), "The plan as the session and the report read it (JSON).");
  m.def("auto_profile_json", &auto_profile_json, py::arg("profile"),
        "The profile as its file holds it (JSON, Note [Profile file]).");
}

// What the driver takes in and gives out (Note [Plan driver]).
void bind_plan_driver_values(py::module_& m) {
  // Opaque: Python reads and writes it as its file's JSON (Note [Profile file]).
  py::class_<AutoProfile>(m, "AutoProfile", "A profile as auto measures, writes and reads it (Note [Profile file]).");
  m.def("auto_profile_from_json", [](const std::string& text) { return auto_profile_from_json(text); },
        py::arg("text"), "A profile from its file's JSON or auto_profile_json's; raises ConfigError saying what.");
  py::class_<TimedStepMeasures> measures(m, "TimedStepMeasures", "What the timed step measured (the front end's).");
  measures.def(py::init<>())
      .def_readwrite("blocks", &TimedStepMeasures::blocks)
      .def_readwrite("links", &TimedStepMeasures::links)
      .def_readwrite("outside_saved_bytes", &TimedStepMeasures::outside_saved_bytes)
      .def_readwrite("outside_largest_bytes", &TimedStepMeasures::outside_largest_bytes)
      .def_property("intervals", [](const TimedStepMeasures&) { return py::none(); },
                    [](TimedStepMeasures& t, const std::vector<std::tuple<bool, std::size_t, double, double, double>>& v) {
                      t.intervals.clear();
                      for (const auto& [backward, block, start, end, wait] : v)
                        t.intervals.push_back({backward, block, start, end, wait});
                    }, "(backward, block, start, end, wait_before) of each timed interval (write-only).")
      .def_readwrite("blocks_forward_seconds", &TimedStepMeasures::blocks_forward_seconds)
      .def_readwrite("blocks_backward_seconds", &TimedStepMeasures::blocks_backward_seconds)
      .def_readwrite("blocks_replay_seconds", &TimedStepMeasures::blocks_replay_seconds)
      .def_readwrite("blocks_input_swap_seconds", &TimedStepMeasures::blocks_input_swap_seconds)
      .def_readwrite("peak_bytes", &TimedStepMeasures::peak_bytes)
      .def_readwrite("reserved_peak_bytes", &TimedStepMeasures::reserved_peak_bytes)
      .def_readwrite("beside_bytes", &TimedStepMeasures::beside_bytes);
  init_from_kwargs(measures);
  bind_plan_driver_results(m);
}

// tiering::PlanDriver (Note [Plan driver]).
void bind_plan_driver(py::module_& m) {
  bind_plan_driver_values(m);
  m.attr("REST_CALIBRATION_STEPS") = kRestCalibrationSteps;  // Note [Rest calibration]
  m.attr("REST_CALIBRATION_SKIP") = kRestCalibrationSkip;
  py::class_<PlanFrontEnd, PyPlanFrontEnd>(m, "PlanFrontEnd",
                                           "What the driver asks of its front end: override every method.")
      .def(py::init<>());
  py::class_<PlanDriverSettings>(m, "PlanDriverSettings", "The settings a driver runs under.")
      .def(py::init([](const Config& settings, std::size_t blocks) {  // typed (Note [Typed settings])
        return PlanDriverSettings::of(settings, blocks);
      }), py::arg("settings"), py::arg("blocks"))
      .def(py::init([](const std::map<std::string, std::string>& config, std::size_t blocks) {
        return PlanDriverSettings::of(Config::parse({}, config), blocks);
      }), py::arg("config"), py::arg("blocks"))
      .def_readonly("forced", &PlanDriverSettings::forced);
  py::class_<PlanDriver>(m, "PlanDriver", "auto's phases, re-plan and batch growth for one session.")
      .def(py::init<PlanDriverSettings, std::optional<AutoProfile>>(), py::arg("settings"), py::arg("loaded"))
      .def("before_forward", [](PlanDriver& d, const InputElements& inputs, PlanFrontEnd& front) {
        d.before_forward(inputs, front);  // the front end learns what happened from its calls and plan
      }, py::arg("inputs"), py::arg("front"))
      .def("forward_refused", &PlanDriver::forward_refused)
      .def("settle", &PlanDriver::settle, py::arg("why"))
      .def("budgets", &PlanDriver::budgets, py::arg("profile"), py::arg("front"))
      .def_property_readonly("forwards", [](const PlanDriver& d) { return d.phases().forwards(); })
      .def_property_readonly("may_replan", [](const PlanDriver& d) { return d.phases().may_replan(); })
      .def_property_readonly("plan", [](const PlanDriver& d) { return d.plan(); })
      .def_property_readonly("revision", &PlanDriver::revision)
      .def_property_readonly("profile", [](const PlanDriver& d) { return d.profile(); })
      .def("report_json", &PlanDriver::report_json, py::arg("plan_text"))
      .def("measured_beside_predicted_json", [](const PlanDriver& d, std::optional<std::uint64_t> reserved,
                                                std::optional<std::uint64_t> allocated, std::optional<double> predicted) {
        return measured_beside_predicted_json(d.measured_beside_predicted(reserved), reserved, allocated, predicted);
      }, py::arg("peak_reserved_bytes"), py::arg("peak_allocated_bytes"), py::arg("predicted_peak_bytes"),
         "The plan's predictions beside the steps since, as the report shows them (JSON).");
}

}  // namespace

void bind_plan_driver_api(py::module_& m) { bind_plan_driver(m); }

}  // namespace tierflow::bindings
