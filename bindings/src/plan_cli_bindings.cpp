// `python -m tierflow plan` past its parser (tiering/plan_cli.hpp), torch-free, in tierflow._core: argparse's
// arguments in, the refusals raised as ConfigError, the plan's text or JSON out. Registered from core_module.cpp
// after bind_planner (Links' class).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "init_from_kwargs.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/tiering/plan_cli.hpp"

namespace py = pybind11;

namespace tierflow::bindings {

using namespace tierflow::tiering;

void bind_plan_cli(py::module_& m) {
  py::class_<PlanArguments> args(m, "PlanArguments", "The plan command's arguments as its parser read them.");
  args.def(py::init<>())
      .def_readwrite("layers", &PlanArguments::layers)
      .def_readwrite("hidden", &PlanArguments::hidden)
      .def_readwrite("heads", &PlanArguments::heads)
      .def_readwrite("seq", &PlanArguments::seq)
      .def_readwrite("batch", &PlanArguments::batch)
      .def_readwrite("vocab", &PlanArguments::vocab)
      .def_readwrite("ffn_mult", &PlanArguments::ffn_mult)
      .def_readwrite("dtype", &PlanArguments::dtype)
      .def_readwrite("model", &PlanArguments::model)
      .def_readwrite("model_repr", &PlanArguments::model_repr)
      .def_readwrite("model_shown", &PlanArguments::model_shown)
      .def_readwrite("profile", &PlanArguments::profile)
      .def_readwrite("profile_repr", &PlanArguments::profile_repr)
      .def_readwrite("tflops", &PlanArguments::tflops)
      .def_readwrite("pcie_gbps", &PlanArguments::pcie_gbps)
      .def_readwrite("gpu_memory", &PlanArguments::gpu_memory)
      .def_readwrite("host_memory", &PlanArguments::host_memory)
      .def_readwrite("nvme_memory", &PlanArguments::nvme_memory)
      .def_readwrite("prefetch", &PlanArguments::prefetch)
      .def_readwrite("nvme_gbps", &PlanArguments::nvme_gbps)
      .def_readwrite("cpu_adam_rate", &PlanArguments::cpu_adam_rate)
      .def_readwrite("optimizer", &PlanArguments::optimizer)
      .def_readwrite("optimizer_states", &PlanArguments::optimizer_states)
      .def_readwrite("offload_params", &PlanArguments::offload_params)
      .def_readwrite("offload_gradients", &PlanArguments::offload_gradients)
      .def_readwrite("json", &PlanArguments::json);
  init_from_kwargs(args);
  py::class_<PlanCommand>(m, "PlanCommand", "One run of the plan command past its parser (tiering/plan_cli.hpp).")
      .def(py::init<PlanArguments, const Config&, std::optional<std::string>>(), py::arg("arguments"),
           py::arg("settings"), py::arg("nvme_memory_variable"),
           "The arguments checked before anything is measured; raises ConfigError with the refusal.")
      .def_property_readonly("needs_links", &PlanCommand::needs_links, "The caller measures the links.")
      .def_property_readonly("needs_flops", &PlanCommand::needs_flops, "The caller measures the matmul rate.")
      .def("run", [](const PlanCommand& c, bool cuda, std::uint64_t device_capacity_bytes,
                     std::uint64_t host_capacity_bytes, std::optional<Links> links, std::optional<double> flops,
                     std::optional<std::string> profile_text, std::string command_line) {
        return c.run({cuda, device_capacity_bytes, host_capacity_bytes, links, flops, std::move(profile_text),
                      std::move(command_line)});
      }, py::arg("cuda"), py::arg("device_capacity_bytes"), py::arg("host_capacity_bytes"), py::arg("links"),
         py::arg("flops_per_second"), py::arg("profile_text"), py::arg("command_line"),
         "The plan's text or JSON; raises ConfigError with the refusal (Note [Plan fit]'s advice added).");
  m.def("check_params_rate", &check_params_rate, py::arg("value"), py::arg("shown"),
        "--cpu-adam-rate within 1 to 1e15, or ConfigError saying what is accepted.");
}

}  // namespace tierflow::bindings
