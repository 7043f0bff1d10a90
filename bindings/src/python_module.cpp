// tierflow._C: the pybind11 surface over bindings/. The Python package is a
// thin layer over these functions; the logic lives in C++. This file defines
// the module (it re-exports tierflow._core's settings, errors and planner, Note
// [Two extensions] in core_module.cpp; logging) and the converters the parts
// share; each part binds one area (module_parts.hpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <map>
#include <string>

#include "module_parts.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/bindings/grad_content.hpp"
#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/swap/nvme_probe.hpp"
#include "tierflow/tiering/runtime_stats.hpp"
#include "tierflow/tiering/tiers.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
void bind_plan_driver_api(pybind11::module_& m);  // plan_driver_bindings.cpp (Note [Two extensions])
}  // namespace tierflow::bindings

using namespace tierflow;
using namespace tierflow::bindings;
using namespace tierflow::bindings::pymod;

namespace tierflow::bindings::pymod {

py::dict stat_dict(const StatValues& v) {
  py::dict d;
  d["current"] = v.current;
  d["peak"] = v.peak;
  d["allocated"] = v.allocated;
  d["freed"] = v.freed;
  return d;
}

at::ScalarType dtype_from_name(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float64") return at::kDouble;
  throw config_error("host_empty: dtype '" + name + "' is not supported; accepted: float32, "
                     "bfloat16, float16, float64");
}

optimizer::AdamOptions adam_options(const py::dict& d) {
  optimizer::AdamOptions o;
  o.lr = d["lr"].cast<double>();
  o.beta1 = d["beta1"].cast<double>();
  o.beta2 = d["beta2"].cast<double>();
  o.eps = d["eps"].cast<double>();
  o.weight_decay = d["weight_decay"].cast<double>();
  o.amsgrad = d["amsgrad"].cast<bool>();
  o.maximize = d["maximize"].cast<bool>();
  o.decoupled_weight_decay = d["decoupled_weight_decay"].cast<bool>();
  if (d.contains("grad_scale")) o.grad_scale = d["grad_scale"].cast<double>();
  return o;
}

// The runtime's statistics (tiering/runtime_stats.hpp builds them), read off its parts.
py::dict runtime_stats(const Runtime& rt) {
  rt.host_pool()->reap();
  if (rt.adversarial()) check_device_memory_quarantine();
  const auto memory = emulated_device_memory_stats();
  tiering::RuntimeStatsParts p;
  p.device = std::string(allocator::to_string(rt.device_kind()));
  p.activations = rt.activations()->stats();
  p.host_pool = rt.host_pool()->stats();
  p.host_budget_bytes = rt.host_pool()->budget_bytes();
  p.host_pinned = rt.host_pool()->cuda_pinned();
  p.optimizer = rt.optimizer_stats();
  p.cpu_threads = rt.cpu_threads();
  p.cpu_isa = std::string(optimizer::to_string(rt.cpu_isa()));
  p.emulated = swap::emulated_copy_stats(*rt.copy_engine());
  p.emulated_mode = rt.device_kind() == allocator::DeviceKind::kEmulated
                        ? std::string(to_string(rt.config().emulated_device)) : std::string("n/a");
  p.poisoned_device_memory = memory.installed;
  p.device_late_writes = memory.late_writes;
  p.links = rt.copy_engine()->stats();
  return py::module_::import("json").attr("loads")(tiering::runtime_stats_json(p));
}

std::map<std::string, std::string> to_string_map(const py::dict& d) {
  std::map<std::string, std::string> m;
  for (auto item : d) m.emplace(py::str(item.first), py::str(item.second));
  return m;
}

}  // namespace tierflow::bindings::pymod

namespace {

// _core's exception classes for what _C's code throws (Note [Two extensions]): _C links its own copy of core, so
// it translates its own errors, into the classes _core made; the most derived first where types are related.
void translate_into(const py::module_& core) {
  // Held for good (released references): a translator may run until the interpreter ends.
  static PyObject* tierflow_error = py::object(core.attr("TierflowError")).release().ptr();
  static PyObject* config = py::object(core.attr("ConfigError")).release().ptr();
  static PyObject* oom = py::object(core.attr("OutOfMemoryError")).release().ptr();
  static PyObject* io = py::object(core.attr("IOError")).release().ptr();
  static PyObject* cuda = py::object(core.attr("CudaError")).release().ptr();
  static PyObject* stall = py::object(core.attr("StallError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const stall_error& e) {
      PyErr_SetString(stall, e.what());
    } catch (const cuda_error& e) {
      PyErr_SetString(cuda, e.what());
    } catch (const io_error& e) {
      PyErr_SetString(io, e.what());
    } catch (const out_of_memory& e) {
      PyErr_SetString(oom, e.what());
    } catch (const config_error& e) {
      PyErr_SetString(config, e.what());
    } catch (const logic_error& e) {
      PyErr_SetString(tierflow_error, e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tierflow's C++ runtime";

  // torch before anything of torch's is used: `import tierflow._C` alone works too (the package imports torch
  // first, Note [Two extensions]).
  py::module_::import("torch");
  // The torch-free names: settings, errors, the planner (Note [Two extensions]); `_C.X` is `_core.X`.
  const py::module_ core = py::module_::import("tierflow._core");
  const py::dict names = core.attr("__dict__");
  for (auto item : names) {
    const auto name = item.first.cast<std::string>();
    if (name.rfind("__", 0) != 0) m.attr(item.first) = item.second;
  }
  translate_into(core);

  m.def("ignored_settings", [](const Config& settings, bool cuda) {
    const IgnoredSettings r = ignored_settings(settings, ModelFacts{cuda});
    return py::make_tuple(r.refusal.empty() ? py::object(py::none()) : py::object(py::cast(r.refusal)), r.warnings);
  }, py::arg("settings"), py::arg("cuda"),
     "Note [Settings a mode ignores]: (the refusal of a given setting these typed settings (a Runtime's settings(), "
     "their own given) ignore, or None; the warning lines of those let through), for a model on a CUDA GPU or not.");
  m.def("fsdp_settings_refusal", [](const py::dict& config, bool cpu_optimizer, bool cpu_offload_policy) -> py::object {
    const std::string why =
        tiering::fsdp_settings_refusal(Config::parse(to_string_map(config)), cpu_optimizer, cpu_offload_policy);
    return why.empty() ? py::none() : py::cast(why);
  }, py::arg("config"), py::arg("cpu_optimizer"), py::arg("cpu_offload_policy") = false,
     "What FSDP2 cannot train with these settings (a Runtime's config()), ending with what it accepts; or None.");
  m.def("cuda_compiled", &allocator::cuda_compiled, "Whether the CUDA backend was compiled in.");
  m.def("cuda_available", &allocator::cuda_available, "Whether a CUDA GPU is usable.");
  m.def("_queued_transfers_in_process", &swap::queued_transfers_in_process,
        "Copies on the emulated device and NVMe requests queued in this process so far (the test suite's tiers).");
  // Note [Gradient content]: the pair where the tensor lives (the host's pass, or a GPU's kernel), for the tests
  // that hold them equal.
  m.def("_grad_content", [](const at::Tensor& grad) {
    const optimizer::GradContent c = ContentProbe::of(grad).get();
    return py::make_tuple(c.sum, c.weighted, c.known);
  });
  m.def("push_no_offload", &push_no_offload);
  m.def("pop_no_offload", &pop_no_offload);
  m.def("no_offload_depth", &no_offload_depth, "Depth of tierflow.no_offload() regions open on this thread.");
  m.def("log", [](const std::string& level, const std::string& message) {
    const std::optional<LogLevel> l = parse_log_level(level);
    if (!l) throw config_error("log: level '" + level + "'; accepted: error, warn, info, debug");
    log(*l, message);
  }, "A line on stderr through tierflow's log (TIERFLOW_LOG_LEVEL filters it).");

  bind_plan_driver_api(m);  // plan_driver_bindings.cpp: PlanDriver (the rest of the planner is _core's)
  bind_optimizer_kernels(m);
  bind_runtime(m);
  bind_grad_stream(m);
  { void bind_distributed(py::module_&); bind_distributed(m); }  // distributed_bindings.cpp: _C.distributed
  { void bind_step_stats(py::module_&); bind_step_stats(m); }  // step_stats_bindings.cpp: _C.StepRecorder
  { void bind_param_uses(py::module_&); bind_param_uses(m); }  // param_uses_bindings.cpp: _C.ParamUses
  { void bind_trace(py::module_&); bind_trace(m); }  // trace_bindings.cpp: _C.trace_* (Note [Trace])
}
