// tierflow._C.StepRecorder (Note [Step stats] in tiering/step_stats.hpp): tiering::StepRecorder with the
// runtime's counters read here, in C++, at each mark; _step_stats.py only says which boundary was crossed. And the
// statistics report's table (tiering/report_text.hpp), which _report.py's Report prints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <type_traits>
#include <utility>

#include "module_parts.hpp"
#include "struct_dict.hpp"
#include "tierflow/bindings/param_residency.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/tiering/report_text.hpp"
#include "tierflow/tiering/step_stats.hpp"

namespace py = pybind11;
using namespace tierflow;
using namespace tierflow::bindings;
using tierflow::tiering::StepCounters;
using tierflow::tiering::StepMark;
using tierflow::tiering::StepRecorder;
using tierflow::tiering::StepStats;
using tierflow::tiering::TierReading;

namespace {

/// The saved activations' device bytes since the previous mark (Note [Window peak]): the registry's window.
std::int64_t device_activations_window(ActivationOffloader& acts) { return acts.take_window_peaks().device; }

/// The runtime's counters now (Note [Step stats]). `cpu_step_ns`: the CPU optimizer's time inside step() as
/// the front end reads it (the gradient stream's wait and redone steps); none: the runtime's CPU Adam time,
/// all of it inside step() when no stream steps during backward.
StepCounters read_counters(Runtime& rt, std::optional<std::uint64_t> cpu_step_ns) {
  StepCounters c;
  const swap::CopyEngineStats links = rt.copy_engine()->stats();
  c.device_to_host_bytes = links.d2h_bytes;
  c.host_to_device_bytes = links.h2d_bytes;
  if (const auto& nvme = rt.nvme_engine()) {
    const swap::NvmeEngineStats s = nvme->stats();
    c.host_to_nvme_bytes = s.bytes_written;
    c.nvme_to_host_bytes = s.bytes_read;
    // Note [Window peak]: the most bytes in use since the previous mark
    c.nvme = {static_cast<std::int64_t>(s.bytes_in_use), TierReading::kNoPeak,
              static_cast<std::int64_t>(nvme->take_in_use_window_peak())};
    if (rt.config().offload_optimizer == OffloadTarget::kNvme) c.nvme_wait_ns = rt.nvme_adam().stats().read_wait_ns;
  } else {
    c.nvme = {0, 0, 0};  // no NVMe tier: nothing to miss
  }
  if (const auto& acts = rt.activations()) {
    const std::int64_t window = device_activations_window(*acts);
    const ActivationOffloaderStats a = acts->stats();
    c.copy_wait_ns = a.offload_wait_ns + a.stall_ns;
    c.device_activations = {a.device_bytes.current, a.device_bytes.peak, window};
  } else {
    c.device_activations = {0, 0, 0};  // no saved activations offloaded: none held
  }
  allocator::PinnedHostPool& host = *rt.host_pool();
  const std::int64_t host_window = host.take_in_use_window_peak();  // Note [Window peak]
  const allocator::PinnedHostPoolStats pool = host.stats();
  c.pinned_host = {pool.in_use.current, pool.in_use.peak, host_window};
  c.param_wait_ns = param_wait_ns(rt);
  c.cpu_step_ns = cpu_step_ns ? *cpu_step_ns : rt.optimizer_stats().step_ns;
  return c;
}

py::dict step_dict(const StepStats& s) {
  py::dict d = pymod::stat_dict(s, tiering::step_stat_fields());
  d["peaks_exact"] = s.peaks_exact;
  return d;
}

py::dict counters_dict(const StepCounters& c) {
  using C = StepCounters;
  return struct_dict<C>(c, {{"device_to_host_bytes", &C::device_to_host_bytes},
                            {"host_to_device_bytes", &C::host_to_device_bytes},
                            {"host_to_nvme_bytes", &C::host_to_nvme_bytes},
                            {"nvme_to_host_bytes", &C::nvme_to_host_bytes},
                            {"copy_wait_ns", &C::copy_wait_ns},
                            {"cpu_step_ns", &C::cpu_step_ns},
                            {"nvme_wait_ns", &C::nvme_wait_ns},
                            {"param_wait_ns", &C::param_wait_ns},
                            {"device_activation_bytes", [](const C& x) { return x.device_activations.current; }},
                            {"pinned_host_bytes", [](const C& x) { return x.pinned_host.current; }},
                            {"nvme_bytes", [](const C& x) { return x.nvme.current; }}});
}

}  // namespace

void bind_step_stats(py::module_& m) {
  py::enum_<StepMark>(m, "StepMark", "A training step's boundary (Note [Step stats]).")
      .value("forward_begin", StepMark::kForwardBegin)
      .value("forward_end", StepMark::kForwardEnd)
      .value("backward_begin", StepMark::kBackwardBegin)
      .value("backward_end", StepMark::kBackwardEnd)
      .value("step_begin", StepMark::kStepBegin)
      .value("step_end", StepMark::kStepEnd);
  py::class_<StepRecorder>(m, "StepRecorder", "Per-step figures from the runtime's counters (Note [Step stats]).")
      .def(py::init<std::size_t, bool>(), py::arg("capacity") = 1000, py::arg("ends_at_step") = true)
      .def("mark", [](StepRecorder& r, StepMark mark, Runtime& rt, std::optional<std::uint64_t> cpu_step_ns) {
        StepCounters c;
        std::uint64_t now = 0;
        {
          py::gil_scoped_release release;  // the offloader's mutex may be held across a wait
          c = read_counters(rt, cpu_step_ns);
          now = now_ns();
        }
        r.mark(mark, now, c);
      }, py::arg("mark"), py::arg("runtime"), py::arg("cpu_step_ns") = py::none(),
         "A boundary crossed now; `cpu_step_ns`: the CPU optimizer's time inside step() so far (None: the "
         "runtime's CPU Adam time).")
      .def_property("ends_at_step", &StepRecorder::ends_at_step, &StepRecorder::set_ends_at_step,
                    "Steps end at step() (an optimizer is watched); else at the next forward after a backward.")
      .def("steps", [](const StepRecorder& r) {
        py::list out;
        for (const StepStats& s : r.steps()) out.append(step_dict(s));
        return out;
      }, "The recorded steps' figures, oldest first.")
      .def("last", [](const StepRecorder& r) -> py::object {
        const auto s = r.last();
        return s ? py::object(step_dict(*s)) : py::object(py::none());
      }, "The newest step's figures, or None.")
      .def("mean_since", [](const StepRecorder& r, std::uint64_t after) -> py::object {
        std::vector<StepStats> steps;
        for (const StepStats& s : r.steps())
          if (s.step > after) steps.push_back(s);
        return steps.empty() ? py::object(py::none()) : py::object(step_dict(tiering::mean_of_steps(steps)));
      }, py::arg("after"), "The steps numbered above `after` summed up (tiering::mean_of_steps), or None.")
      .def_property_readonly("recorded", &StepRecorder::recorded)
      .def_property_readonly("capacity", &StepRecorder::capacity)
      .def_property_readonly("open", &StepRecorder::open)
      .def("clear", &StepRecorder::clear);
  m.def("step_counters", [](Runtime& rt) {
    StepCounters c;
    {
      py::gil_scoped_release release;
      c = read_counters(rt, std::nullopt);
    }
    return counters_dict(c);
  }, py::arg("runtime"), "The counters a StepRecorder reads, now (totals since the runtime began).");
  m.def("report_text", &tiering::report_text, py::arg("report_json"), "The statistics report's table.");
  m.def("report_bytes", &tiering::report_bytes, py::arg("bytes"), "1536 -> '1.50 KiB', as the report prints bytes.");
}
