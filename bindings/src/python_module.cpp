// tierflow._C: the pybind11 surface over bindings/. The Python package is a
// thin layer over these functions; the logic lives in C++. This file defines
// the module (exceptions, configuration, logging) and the converters the parts
// share; each part binds one area (module_parts.hpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <map>
#include <set>
#include <string>

#include "module_parts.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/bindings/grad_content.hpp"
#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/bindings/planner_bindings.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/swap/nvme_probe.hpp"
#include "tierflow/tiering/tiers.hpp"

namespace py = pybind11;
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

namespace {

// The exported fields of the runtime's statistics (Note [Stat fields]), one
// table per dict of tierflow.report(): a name is written once, here.
const std::vector<StatField<OptimizerStats>> kOptimizerFields = {
    {"steps", &OptimizerStats::steps},
    {"elements", &OptimizerStats::elements},
    {"step_ms", &OptimizerStats::step_ns, nullptr, 1e-6},
};
}  // namespace

py::dict runtime_stats(const Runtime& rt) {
  rt.host_pool()->reap();
  const auto a = rt.activations()->stats();
  const auto pool = rt.host_pool()->stats();
  py::dict acts = stat_dict(a, tiering::saved_tensor_stat_fields());
  acts["nvme"] = stat_dict(a, tiering::saved_tensor_nvme_stat_fields());
  acts["device_bytes"] = stat_dict(a.device_bytes);
  acts["host_bytes"] = stat_dict(a.host_bytes);
  acts["nvme_bytes"] = stat_dict(a.nvme_bytes);
  py::dict host = stat_dict(pool, allocator::pinned_pool_stat_fields());
  host["budget_bytes"] = rt.host_pool()->budget_bytes();
  host["pinned"] = rt.host_pool()->cuda_pinned();
  host["in_use"] = stat_dict(pool.in_use);
  host["reserved"] = stat_dict(pool.reserved);
  py::dict optd = stat_dict(rt.optimizer_stats(), kOptimizerFields);
  optd["threads"] = rt.cpu_threads();
  optd["isa"] = std::string(optimizer::to_string(rt.cpu_isa()));
  py::dict emu = stat_dict(swap::emulated_copy_stats(*rt.copy_engine()), swap::emulated_copy_stat_fields());
  emu["mode"] = rt.device_kind() == allocator::DeviceKind::kEmulated
                    ? std::string(to_string(rt.config().emulated_device)) : std::string("n/a");
  if (rt.adversarial()) check_device_memory_quarantine();
  const auto ms = emulated_device_memory_stats();
  emu["poisoned_device_memory"] = ms.installed;
  emu["device_late_writes"] = ms.late_writes;
  py::dict out;
  out["device"] = std::string(allocator::to_string(rt.device_kind()));
  out["emulated"] = emu;
  out["activations"] = acts;
  out["prefetch"] = stat_dict(a, tiering::saved_tensor_prefetch_stat_fields());
  out["host_pool"] = host;
  out["links"] = stat_dict(rt.copy_engine()->stats(), swap::copy_engine_stat_fields());
  out["optimizer"] = optd;
  return out;
}

std::map<std::string, std::string> to_string_map(const py::dict& d) {
  std::map<std::string, std::string> m;
  for (auto item : d) m.emplace(py::str(item.first), py::str(item.second));
  return m;
}

}  // namespace tierflow::bindings::pymod

namespace {

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
    return Config::from_environment(to_string_map(overrides));
  }, py::arg("overrides") = py::dict(), "The settings the environment plus `overrides` give, typed; raises ConfigError.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tierflow's C++ runtime";

  auto base = py::register_exception<logic_error>(m, "TierflowError", PyExc_RuntimeError);
  py::register_exception<config_error>(m, "ConfigError", PyExc_ValueError);
  py::register_exception<out_of_memory>(m, "OutOfMemoryError", PyExc_MemoryError);
  py::register_exception<io_error>(m, "IOError", PyExc_OSError);
  py::register_exception<cuda_error>(m, "CudaError", PyExc_RuntimeError);
  py::register_exception<stall_error>(m, "StallError", PyExc_TimeoutError);  // Note [Stall timeout]

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
    return Config::from_environment(to_string_map(overrides)).to_strings();
  }, "The configuration the environment plus `overrides` give; raises ConfigError.");
  m.def("config_given", [](const py::dict& overrides) {
    const auto given = Config::from_environment(to_string_map(overrides)).given;
    return std::vector<std::string>(given.begin(), given.end());
  }, "The TIERFLOW_* variables the environment plus `overrides` set (the others hold the table's defaults).");
  m.def("ignored_settings", [](const py::dict& config, const std::vector<std::string>& given, bool cuda) {
    Config c = Config::parse(to_string_map(config));
    c.given = std::set<std::string>(given.begin(), given.end());
    const IgnoredSettings r = ignored_settings(c, ModelFacts{cuda});
    return py::make_tuple(r.refusal.empty() ? py::object(py::none()) : py::object(py::cast(r.refusal)), r.warnings);
  }, py::arg("config"), py::arg("given"), py::arg("cuda"),
     "Note [Settings a mode ignores]: (the refusal of a given setting these settings (a Runtime's config()) ignore, "
     "or None; the warning lines of those let through), for a model on a CUDA GPU or not.");
  m.def("ignored_settings", [](const Config& settings, bool cuda) {
    const IgnoredSettings r = ignored_settings(settings, ModelFacts{cuda});
    return py::make_tuple(r.refusal.empty() ? py::object(py::none()) : py::object(py::cast(r.refusal)), r.warnings);
  }, py::arg("settings"), py::arg("cuda"), "The same for typed settings (a Runtime's settings(), their own given).");
  m.def("fsdp_settings_refusal", [](const Config& settings, bool cpu_optimizer, bool cpu_offload_policy) -> py::object {
    const std::string why = tiering::fsdp_settings_refusal(settings, cpu_optimizer, cpu_offload_policy);
    return why.empty() ? py::none() : py::cast(why);
  }, py::arg("settings"), py::arg("cpu_optimizer"), py::arg("cpu_offload_policy") = false,
     "The same for typed settings (a Runtime's settings()).");
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
    LogLevel l = LogLevel::kInfo;
    if (level == "error") l = LogLevel::kError;
    else if (level == "warn") l = LogLevel::kWarn;
    else if (level == "debug") l = LogLevel::kDebug;
    else if (level != "info") throw config_error("log: level '" + level + "'; accepted: error, warn, info, debug");
    log(l, message);
  }, "A line on stderr through tierflow's log (TIERFLOW_LOG_LEVEL filters it).");

  bind_planner(m);
  bind_optimizer_kernels(m);
  bind_runtime(m);
  bind_grad_stream(m);
  { void bind_distributed(py::module_&); bind_distributed(m); }  // distributed_bindings.cpp: _C.distributed
  { void bind_step_stats(py::module_&); bind_step_stats(m); }  // step_stats_bindings.cpp: _C.StepRecorder
  { void bind_param_uses(py::module_&); bind_param_uses(m); }  // param_uses_bindings.cpp: _C.ParamUses
  (void)base;
}

