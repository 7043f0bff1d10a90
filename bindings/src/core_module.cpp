// tierflow._core: the torch-free extension. It links core, tiering and the other torch-free layers but not
// libtorch, so `python -m tierflow plan` with the figures given answers without loading torch (Note [Two
// extensions]). tierflow._C imports it and re-exports every name, so `_C.X` keeps working.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tierflow/bindings/planner_bindings.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/trace_file.hpp"
#include "tierflow/tiering/wrap_checks.hpp"

namespace py = pybind11;
using namespace tierflow;

// Note [Two extensions]
// ~~~~~~~~~~~~~~~~~~~~~
// tierflow is two pybind11 extensions. tierflow._core (core_module.cpp) is torch-free: the exceptions, the
// configuration table and typed settings, and the planner's types and pure functions (planner_bindings.cpp's
// bind_planner, and what registers from it: predictions, model configs). tierflow._C (python_module.cpp) links
// libtorch: the runtime, the kernels, the plan driver. _C imports _core first and copies its names, so every
// `_C.X` of before still works and is the same object as `_core.X`.
//
// Each type is registered once, in one of them (pybind11 refuses a second registration of a C++ type), as a
// global type: the two share pybind11's internals (same pybind11, compiler and build), so a _core.Settings or
// _core.Plan passes to a _C function and back. The exceptions are _core's Python classes; _C registers its own
// translator into those classes (python_module.cpp), so an error thrown by _C's code is the same
// tierflow.ConfigError as one thrown by _core's.
//
// Each extension links its own copy of the static layers (hidden visibility, cmake/install.cmake), so state in
// them is per copy. The one that matters is core's log level: the Runtime sets _C's from TIERFLOW_LOG_LEVEL and
// wrap's keyword; _core's is set from TIERFLOW_LOG_LEVEL when it loads. So code that logs at run time (the plan
// driver) is bound in _C, and _core holds what the command line needs: what only parses, plans and reports.
//
// The package keeps torch out until it is needed: tierflow/__init__.py imports _core and the torch-free Python
// modules, and loads the rest (torch first, then _C) on first use of a name that needs them (PEP 562).

namespace tierflow::bindings {
void bind_plan_cli(py::module_& m);
}  // namespace tierflow::bindings

namespace {

std::map<std::string, std::string> string_map(const py::dict& d) {
  std::map<std::string, std::string> m;
  for (auto item : d) m.emplace(py::str(item.first), py::str(item.second));
  return m;
}

// Note [Typed settings]: core::Config as Python sees it: each TIERFLOW_* setting typed, read once by the table
// (sizes as ints of bytes, switches as bools, choices as the table's names, budgets as their text: a percentage
// is of a capacity only the runtime knows, Runtime.device_budget_bytes() and host_budget_bytes() resolve them).
// Python reads these instead of comparing the strings of Runtime.config(), which stays for reports and old code.
void bind_settings(py::module_& m) {
  auto text = [](auto field) { return [field](const Config& c) { return std::string(to_string(c.*field)); }; };
  py::class_<Config>(m, "Settings", "Every TIERFLOW_* setting, typed (Note [One configuration table]).")
      .def_property_readonly("gpu_memory", [](const Config& c) { return c.gpu_memory.to_string(); },
                             "TIERFLOW_GPU_MEMORY as written (a size or a percentage); bytes: Runtime.device_budget_bytes()")
      .def_property_readonly("host_memory", [](const Config& c) { return c.host_memory.to_string(); },
                             "TIERFLOW_HOST_MEMORY as written; bytes: Runtime.host_budget_bytes()")
      .def_property_readonly("nvme_paths", [](const Config& c) { return c.nvme_paths; }, "TIERFLOW_NVME_PATHS")
      .def_property_readonly("nvme_memory", [](const Config& c) { return c.to_strings().at("TIERFLOW_NVME_MEMORY"); },
                             "TIERFLOW_NVME_MEMORY as written (auto, a size or a percentage)")
      .def_readonly("aio_block_size", &Config::aio_block_size, "TIERFLOW_AIO_BLOCK_SIZE, bytes")
      .def_readonly("aio_queue_depth", &Config::aio_queue_depth, "TIERFLOW_AIO_QUEUE_DEPTH")
      .def_readonly("nvme_checksum", &Config::nvme_checksum, "TIERFLOW_NVME_CHECKSUM")
      .def_property_readonly("offload_activations", text(&Config::offload_activations),
                             "TIERFLOW_OFFLOAD_ACTIVATIONS: none, host, nvme, auto or recompute")
      .def_property_readonly("offload_params", text(&Config::offload_params),
                             "TIERFLOW_OFFLOAD_PARAMS: none, host, nvme or auto")
      .def_property_readonly("offload_optimizer", text(&Config::offload_optimizer),
                             "TIERFLOW_OFFLOAD_OPTIMIZER: none, host or nvme")
      .def_readonly("cpu_threads", &Config::cpu_threads, "TIERFLOW_CPU_THREADS; 0: all cores (auto)")
      .def_readonly("cpu_isa", &Config::cpu_isa, "TIERFLOW_CPU_ISA: auto, avx512, avx2 or portable")
      .def_property_readonly("optimizer_states", text(&Config::optimizer_states),
                             "TIERFLOW_OPTIMIZER_STATES: fp32, bf16 or 8bit")
      .def_property_readonly("log_level", text(&Config::log_level), "TIERFLOW_LOG_LEVEL")
      .def_readonly("stall_timeout", &Config::stall_timeout_seconds, "TIERFLOW_STALL_TIMEOUT, seconds (0: none)")
      .def_readonly("report", &Config::report_path, "TIERFLOW_REPORT; empty: no file")
      .def_readonly("trace", &Config::trace_path, "TIERFLOW_TRACE; empty: no trace (Note [Trace])")
      .def_readonly("profile", &Config::profile_path, "TIERFLOW_PROFILE; empty: measure every run")
      .def_readonly("replan", &Config::replan, "TIERFLOW_REPLAN")
      .def_readonly("min_offload_bytes", &Config::min_offload_bytes, "TIERFLOW_MIN_OFFLOAD_BYTES")
      .def_readonly("prefetch_bytes", &Config::prefetch_bytes, "TIERFLOW_PREFETCH_BYTES")
      .def_readonly("pinned_slab_bytes", &Config::pinned_slab_bytes, "TIERFLOW_PINNED_SLAB_BYTES")
      .def_readonly("mimalloc", &Config::mimalloc, "TIERFLOW_MIMALLOC")
      .def_property_readonly("device", text(&Config::device), "TIERFLOW_DEVICE: auto, cuda or emulated")
      .def_property_readonly("emulated_device", text(&Config::emulated_device),
                             "TIERFLOW_EMULATED_DEVICE: polite or adversarial")
      .def_readonly("emulated_seed", &Config::emulated_seed, "TIERFLOW_EMULATED_SEED")
      .def_readonly("overlap_step", &Config::overlap_step, "TIERFLOW_OVERLAP_STEP")
      .def_readonly("partition_optimizer", &Config::partition_optimizer, "TIERFLOW_PARTITION_OPTIMIZER")
      .def_readonly("grad_accumulation_steps", &Config::grad_accumulation_steps, "TIERFLOW_GRAD_ACCUMULATION_STEPS")
      .def_property_readonly("max_grad_norm", [](const Config& c) -> py::object {
        return c.max_grad_norm > 0 ? py::cast(c.max_grad_norm) : py::none();
      }, "TIERFLOW_MAX_GRAD_NORM; None: no clip")
      .def_readonly("skip_nonfinite", &Config::skip_nonfinite, "TIERFLOW_SKIP_NONFINITE")
      .def_property_readonly("gpu_optimizer_fraction", [](const Config& c) -> py::object {
        return c.gpu_optimizer_fraction_auto ? py::none() : py::cast(c.gpu_optimizer_fraction);
      }, "TIERFLOW_GPU_OPTIMIZER_FRACTION; None: auto")
      .def_property_readonly("grad_bucket_bytes", [](const Config& c) -> py::object {
        return c.grad_bucket_bytes == 0 ? py::none() : py::cast(c.grad_bucket_bytes);
      }, "TIERFLOW_GRAD_BUCKET_BYTES; None: auto")
      .def_readonly("weights_return_in_forward", &Config::weights_return_in_forward,
                    "TIERFLOW_WEIGHTS_RETURN=forward")
      .def_readonly("offload_gradients", &Config::offload_gradients, "TIERFLOW_OFFLOAD_GRADIENTS")
      .def_property_readonly("given", [](const Config& c) { return c.given; },
                             "The TIERFLOW_* variables set (environment or keywords); the others hold their defaults")
      .def("to_strings", &Config::to_strings, "Every setting as text, keyed by variable (Runtime.config())")
      .def("__repr__", [](const Config& c) {
        std::string out = "Settings(";
        for (const auto& [name, value] : c.to_strings()) out += name.substr(9) + "=" + value + ", ";
        return out.substr(0, out.size() - 2) + ")";
      });
  m.def("resolve_settings", [](const py::dict& overrides) {
    return Config::from_environment(string_map(overrides));
  }, py::arg("overrides") = py::dict(), "The settings the environment plus `overrides` give, typed; raises ConfigError.");
}

void bind_config(py::module_& m) {
  m.def("config_table", [] {
    py::list rows;
    for (const auto& e : config_table()) {
      py::dict r;
      r["name"] = std::string(e.name);
      r["default"] = std::string(e.default_value);
      r["accepted"] = std::string(e.accepted);
      r["doc"] = std::string(e.doc);
      rows.append(r);
    }
    return rows;
  }, "Every TIERFLOW_* variable: name, default, accepted forms, meaning.");
  bind_settings(m);
  m.def("resolve_config", [](const py::dict& overrides) {
    return Config::from_environment(string_map(overrides)).to_strings();
  }, "The configuration the environment plus `overrides` give; raises ConfigError.");
  m.def("collection_value_refusal", &collection_value_refusal, py::arg("key"), py::arg("sequence"),
        py::arg("type_name"), py::arg("value_repr"), "Why a keyword cannot take this list, set or dict; '' when it can.");
  m.def("config_given", [](const py::dict& overrides) {
    const auto given = Config::from_environment(string_map(overrides)).given;
    return std::vector<std::string>(given.begin(), given.end());
  }, "The TIERFLOW_* variables the environment plus `overrides` set (the others hold the table's defaults).");
}

// A trace file read back, merged, cut to one step (Note [Trace file]): `python -m tierflow timeline`'s, as JSON text.
void bind_trace_file(py::module_& m) {
  m.def("trace_load_file", &trace::load_file, py::arg("path"), "The Chrome trace at `path`, as JSON text");
  m.def("trace_merge", &trace::merge, py::arg("tierflow_json"), py::arg("torch_json"),
        "A tierflow trace and torch.profiler's as one trace on one clock (JSON text)");
  m.def("trace_merge_files", &trace::merge_files, py::arg("tierflow_path"), py::arg("torch_path"), py::arg("out_path"),
        "trace_merge of two files, written to `out_path`; returns the merged text");
  m.def("trace_one_step", &trace::one_step, py::arg("trace_json"), py::arg("step") = -1,
        "One step of a trace (-1 the last): its spans, counters and times, as JSON text");
}

// What tierflow.wrap refuses (Note [Wrap refusals]): each "" or the refusal's words.
void bind_wrap_checks(py::module_& m) {
  m.def("device_budget_refusal", [](const Config& settings, std::uint64_t budget, std::uint64_t weights,
                                    std::uint64_t trainable) {
    return tiering::device_budget_refusal(settings, budget, {weights, trainable});
  }, py::arg("settings"), py::arg("budget_bytes"), py::arg("weight_bytes"), py::arg("trainable_bytes"));
  m.def("meta_refusal", &tiering::meta_refusal, py::arg("count"), py::arg("first_name"), py::arg("first_shape"));
  m.def("foreign_parameters_refusal", &tiering::foreign_parameters_refusal, py::arg("foreign"), py::arg("held"),
        py::arg("first_shape"));
  m.def("wrapper_refusal", &tiering::wrapper_refusal, py::arg("wrapper"), py::arg("optimizer"), py::arg("attribute"));
  m.def("deepcopy_refusal", &tiering::deepcopy_refusal);
}

// _core's copy of core's log level (Note [Two extensions]): TIERFLOW_LOG_LEVEL's when it names a level; a
// malformed value is the Runtime's error to report, so it is left at the default here.
void log_level_from_environment() {
  const char* value = std::getenv("TIERFLOW_LOG_LEVEL");
  if (value == nullptr) return;
  if (const std::optional<LogLevel> level = parse_log_level(value)) set_log_level(*level);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tierflow's torch-free C++ core: settings, errors and the planner (Note [Two extensions])";

  // In this order: pybind11 tries the translator registered last first, so the subclasses come after their base.
  py::register_exception<logic_error>(m, "TierflowError", PyExc_RuntimeError);
  py::register_exception<config_error>(m, "ConfigError", PyExc_ValueError);
  py::register_exception<out_of_memory>(m, "OutOfMemoryError", PyExc_MemoryError);
  py::register_exception<io_error>(m, "IOError", PyExc_OSError);
  py::register_exception<cuda_error>(m, "CudaError", PyExc_RuntimeError);
  py::register_exception<stall_error>(m, "StallError", PyExc_TimeoutError);  // Note [Stall timeout]

  log_level_from_environment();
  bind_config(m);
  bind_trace_file(m);
  bind_wrap_checks(m);
  bindings::bind_planner(m);
  bindings::bind_plan_cli(m);  // plan_cli_bindings.cpp: the plan command past its parser
}
