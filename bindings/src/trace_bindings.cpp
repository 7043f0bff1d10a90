// _C's trace functions (Note [Trace] in core/trace.hpp): what bindings/python/tierflow/_trace.py and the
// activation runner record with.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tierflow/core/trace.hpp"

namespace py = pybind11;

using namespace tierflow;

// Called from python_module.cpp, which declares it where it calls it.
void bind_trace(py::module_& m);
void bind_trace(py::module_& m) {
  py::enum_<trace::Lane>(m, "TraceLane", "A lane of the trace (its Chrome tid)")
      .value("forward", trace::Lane::kForward)
      .value("backward", trace::Lane::kBackward)
      .value("replay", trace::Lane::kReplay)
      .value("device_to_host", trace::Lane::kDeviceToHost)
      .value("host_to_device", trace::Lane::kHostToDevice)
      .value("nvme_write", trace::Lane::kNvmeWrite)
      .value("nvme_read", trace::Lane::kNvmeRead)
      .value("cpu_adam", trace::Lane::kCpuAdam)
      .value("other", trace::Lane::kOther)
      .value("steps", trace::Lane::kSteps);
  m.def("trace_on", &trace::on, "Whether the trace records now (TIERFLOW_TRACE or tierflow.trace)");
  m.def("trace_start", &trace::start, "Starts recording (one more recorder)");
  m.def("trace_stop", &trace::stop, "One recorder less: recording stops when none is left");
  m.def(
      "trace_complete",
      [](trace::Lane lane, std::string name, std::uint64_t start_ns, std::uint64_t end_ns,
         std::vector<std::pair<std::string, std::int64_t>> args) {
        trace::complete_args(lane, std::move(name), start_ns, end_ns, std::move(args));
      },
      py::arg("lane"), py::arg("name"), py::arg("start_ns"), py::arg("end_ns"),
      py::arg("args") = std::vector<std::pair<std::string, std::int64_t>>{},
      "A complete event on `lane` (times on the steady clock: time.monotonic_ns())");
  m.def("trace_path_refusal", &trace::path_refusal, py::arg("path"), py::arg("who"),
        "Why `path` cannot take a trace file, after `who`; '' when it can");
  m.def("trace_sample", &trace::sample, "A 'bytes per tier' counter event from every runtime's meters");
  m.def("trace_write", &trace::write, py::arg("path"), py::arg("since_ns") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "Writes the trace (the events ending at or after since_ns; 0: all) to `path` as Chrome trace JSON");
}
