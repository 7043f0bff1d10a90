// tierflow._C.Runtime: one training run's tiers, copy engine, saved-tensor
// hooks and optimizer entry points; the transfers and the fault-injection hooks.
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
#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/bindings/param_residency.hpp"
#include "tierflow/bindings/planner_bindings.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
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

namespace {

// Construction, configuration, the saved-tensor hooks and the tiers' budgets and buffers.
void bind_runtime_tiers(py::class_<Runtime, std::shared_ptr<Runtime>>& c) {
  c.def(py::init([](const py::dict& overrides, std::shared_ptr<swap::NvmeFaults> faults,
                       std::shared_ptr<swap::CopyFaults> copy_faults, int rank, int world_size) {
             // The runtime keeps a raw pointer to the NVMe faults: the Python object must outlive it.
             auto* rt = new Runtime(Config::from_environment(to_string_map(overrides)), faults.get(),
                                    std::move(copy_faults), tiering::rank_share(rank, world_size));
             // ~Runtime waits for its optimizer worker, whose jobs may need the GIL to drop tensors.
             return std::shared_ptr<Runtime>(rt, [](Runtime* r) {
               if (PyGILState_Check()) {
                 py::gil_scoped_release release;
                 delete r;
               } else {
                 delete r;
               }
             });
           }),
           py::arg("overrides") = py::dict(), py::arg("nvme_faults") = nullptr,
           py::arg("copy_faults") = nullptr, py::arg("rank") = 0, py::arg("world_size") = 1)
      .def("config", [](const Runtime& rt) { return rt.config().to_strings(); })
      .def("settings", [](const Runtime& rt) { return rt.config(); }, "The settings, typed (_C.Settings).")
      .def_property_readonly("device", [](const Runtime& rt) {
        return std::string(allocator::to_string(rt.device_kind()));
      })
      .def("pack", [](Runtime& rt, const at::Tensor& t) { return rt.activations()->pack(t); })
      .def("pack_to", [](Runtime& rt, const at::Tensor& t, const std::string& target) {
        return rt.activations()->pack(t, tiering::parse_pack_target(target));
      }, "pack() with a block plan's decision: policy, keep, host or nvme.")
      .def_property_readonly("has_nvme_tier", [](Runtime& rt) { return rt.activations()->has_nvme(); })
      .def("device_budget_bytes", [](Runtime& rt) { return rt.tiers().device_budget_bytes(); },
           "TIERFLOW_GPU_MEMORY in bytes on this runtime's device.")
      .def("host_budget_bytes", [](Runtime& rt) { return rt.tiers().host_budget_bytes(); },
           "TIERFLOW_HOST_MEMORY in bytes.")
      .def("measure_nvme", [](Runtime& rt, std::uint64_t bytes) {
        swap::NvmeBandwidth bw;
        {
          py::gil_scoped_release release;
          bw = rt.tiers().measure_nvme(bytes);
        }
        return py::make_tuple(bw.write_bytes_per_second, bw.read_bytes_per_second);
      }, py::arg("bytes"),
         "(write, read) bytes/s of `bytes` through the NVMe engine, every path, O_DIRECT (Note [NVMe probe]).")
      .def("nvme_available_bytes", [](Runtime& rt) { return rt.tiers().nvme_available_bytes(); },
           "Bytes the NVMe tier can still place now (TIERFLOW_NVME_MEMORY, the free space, what is in use); 0 without one.")
      .def("unpack", [](Runtime& rt, const std::shared_ptr<SavedHandle>& h) {
        return rt.activations()->unpack(h);
      })
      .def("begin_forward", [](Runtime& rt) { rt.activations()->begin_forward(); })
      .def("begin_backward", [](Runtime& rt) { rt.activations()->begin_backward(); })
      .def("register_parameters", [](Runtime& rt, const std::vector<at::Tensor>& ps) {
        rt.activations()->register_parameters(ps);
      })
      .def("synchronize", [](Runtime& rt) { rt.activations()->synchronize(); })
      .def("set_activation_window", [](Runtime& rt, std::uint64_t bytes) { rt.activations()->set_window_bytes(bytes); },
           py::arg("bytes"), "The prefetch window and the bound on copies to the host (a plan's).")
      .def("reset_peaks", [](Runtime& rt) { rt.activations()->reset_peaks(); })
      .def("unlink_nvme_files", [](Runtime& rt) { rt.unlink_nvme_files(); },
           "Removes the NVMe swap files' names now (called at exit).")
      .def("host_empty", [](Runtime& rt, const std::vector<std::int64_t>& sizes,
                            const std::string& dtype, bool zero) {
        return rt.host_empty(sizes, dtype_from_name(dtype), zero);
      }, py::arg("sizes"), py::arg("dtype"), py::arg("zero") = false)
      .def("host_moment", [](Runtime& rt, const std::vector<std::int64_t>& like, const std::string& format) {
        const auto f = parse_state_format(format);
        if (!f) throw config_error("host_moment: optimizer state format '" + format +
                                   "'; accepted: fp32, bf16, 8bit (TIERFLOW_OPTIMIZER_STATES)");
        return rt.host_moment(like, *f);
      }, py::arg("like"), py::arg("format"),
           "A zeroed pinned moment in `format` for a parameter of shape `like` (Note [Optimizer state formats]): "
           "float32 or bfloat16 of that shape, or one uint8 buffer of moment_bytes('8bit', numel) bytes.");
}

// The CPU Adam on host tensors, and the copies the Python optimizer path makes.
void bind_runtime_optimizer(py::class_<Runtime, std::shared_ptr<Runtime>>& c) {
  c.def("adam_step", [](Runtime& rt, const py::dict& options, std::int64_t step,
                           const std::vector<at::Tensor>& masters,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<std::optional<at::Tensor>>& max_exp_avg_sqs,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<std::optional<at::Tensor>>& params_out) {
        auto unwrap = [](const std::vector<std::optional<at::Tensor>>& v) {
          std::vector<at::Tensor> out;
          out.reserve(v.size());
          for (const auto& t : v) out.push_back(t ? *t : at::Tensor());
          return out;
        };
        auto opts = adam_options(options);
        auto maxes = unwrap(max_exp_avg_sqs);
        auto outs = unwrap(params_out);
        py::gil_scoped_release release;
        rt.adam_step(opts, step, masters, exp_avgs, exp_avg_sqs, maxes, grads, outs);
      })
      .def("on_device", &Runtime::on_device, "Whether a tensor is on this runtime's device.")
      .def("params_optimizer_refusal", [](const Runtime& rt, bool cpu_optimizer) -> py::object {
        const std::string why = tiering::params_optimizer_refusal(
            rt.config(), rt.device_kind() == allocator::DeviceKind::kCuda, cpu_optimizer);
        return why.empty() ? py::none() : py::cast(why);
      }, py::arg("cpu_optimizer"), "Parameter offload with this optimizer: the refusal, or None.")
      .def("copy_to_host", [](Runtime& rt, const at::Tensor& dst, const at::Tensor& src) {
        return rt.copy_to_host(dst, src);
      }, "Device -> host copy after the current stream's work (Note [Copy ordering]); wait before reading dst.")
      .def("copy_to_device", [](Runtime& rt, const at::Tensor& dst, const at::Tensor& src) {
        py::gil_scoped_release release;  // the emulated compute waits on the host
        return rt.copy_to_device(dst, src);
      }, "Host -> device copy after the current stream's work; the stream waits for it. Keep src alive until ready.")
      .def("fetch_to_device", [](Runtime& rt, const at::Tensor& dst, const at::Tensor& src) {
        return rt.fetch_to_device(dst, src);
      }, "Host -> device copy after the current stream's work; no stream waits for it (a reader waits for the "
         "handle first). Keep src alive until ready.");
}

// Optimizer states on NVMe (Note [Optimizer states on NVMe]).
void bind_runtime_nvme_optimizer(py::class_<Runtime, std::shared_ptr<Runtime>>& c) {
  c.def("nvme_adam_step", [](Runtime& rt, const py::dict& options, std::int64_t step,
                                const std::vector<std::uint64_t>& keys, const std::vector<at::Tensor>& grads,
                                const std::vector<at::Tensor>& outs) {
        std::vector<optimizer::NvmeAdamStore::Item> items(keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
          TIERFLOW_EXPECTS(grads[i].is_cpu() && grads[i].is_contiguous() && outs[i].is_cpu() && outs[i].is_contiguous(),
                           "nvme_adam_step: gradients and outputs must be contiguous CPU tensors");
          TIERFLOW_EXPECTS(static_cast<std::size_t>(grads[i].numel()) == rt.nvme_adam().numel(keys[i]) &&
                               grads[i].numel() == outs[i].numel(),
                           "nvme_adam_step: tensor " + std::to_string(i) + " does not match its parameter's size");
          items[i] = {keys[i], grads[i].data_ptr(), optimizer_type(grads[i].scalar_type(), "nvme_adam_step"), outs[i].data_ptr(),
                      optimizer_type(outs[i].scalar_type(), "nvme_adam_step")};
        }
        auto opts = adam_options(options);
        optimizer::NvmeAdamStore::StepResult r;
        {
          py::gil_scoped_release release;
          r = rt.nvme_adam().step(opts, step, items);
        }
        return py::make_tuple(r.failed, r.first_error, r.lost);
      }, "Steps the items; returns (indices that kept their previous state, first error, indices whose state "
         "could not be read: lost).")
      .def("nvme_adam_reserve", [](Runtime& rt, const std::vector<std::uint64_t>& state_bytes) {
        py::gil_scoped_release release;
        rt.nvme_adam().reserve(state_bytes);
      }, "Grows the NVMe files now for optimizer states of these sizes and a step's new state (Note [NVMe space]).")
      .def("nvme_adam_extents", [](Runtime& rt, std::uint64_t key) {
        py::list out;
        for (const auto& e : rt.nvme_adam().extents(key)) out.append(py::make_tuple(e.file, e.offset, e.bytes));
        return out;
      }, "Where a parameter's NVMe state lies: [(file, offset, bytes)] (tests and diagnostics).")
      .def("nvme_adam_stats", [](Runtime& rt) {
        py::dict d;
        if (!rt.has_nvme()) return d;
        auto s = rt.nvme_adam().stats();
        d["steps"] = s.steps;
        d["bytes_read"] = s.bytes_read;
        d["bytes_written"] = s.bytes_written;
        d["read_wait_ms"] = static_cast<double>(s.read_wait_ns) / 1e6;
        d["write_failures"] = s.write_failures;
        return d;
      });
}

// Parameters between uses on the host tier (Note [Parameter storage]).
void bind_param_residency(py::module_& m) {
  m.def("_autocast_cached_cast", &autocast_cached_cast, py::arg("param"), py::arg("dtype"), py::arg("device_type"),
        "Autocast's cached cast of a parameter (made and cached now when there is none; Note [Parameter casts]).");
  m.def("_drop_cast", &drop_cast, py::arg("cast"), py::arg("why"),
        "A cached cast's memory goes; its tensor stays, and reading it raises `why`.");
  m.def("_refill_cast", &refill_cast, py::arg("cast"), py::arg("param"),
        "A dropped cast's memory back, with the parameter's values cast into it.");
  py::class_<ParamResidency, std::shared_ptr<ParamResidency>>(
      m, "ParamResidency", "The parameters of a model's units between uses (Note [Parameter storage]).")
      .def(py::init([](std::shared_ptr<Runtime> rt, const std::vector<std::vector<at::Tensor>>& units,
                       const std::vector<std::string>& residences, const std::vector<std::string>& names,
                       std::size_t blocks, const std::vector<std::string>& unit_names) {
             std::vector<Tier> tiers;
             for (const std::string& r : residences) {
               const auto t = std::find_if(kAllTiers.begin(), kAllTiers.end(),
                                           [&](Tier x) { return to_string(x) == r; });
               TIERFLOW_EXPECTS(t != kAllTiers.end(), "ParamResidency: residence '" + r + "'; accepted: gpu, host, nvme");
               tiers.push_back(*t);
             }
             py::gil_scoped_release release;  // the first copies wait on the copy engine
             return std::make_shared<ParamResidency>(std::move(rt), units, tiers, names, blocks, unit_names);
           }),
           py::arg("runtime"), py::arg("units"), py::arg("residences"), py::arg("names"), py::arg("blocks"),
           py::arg("unit_names"))
      .def("on_device", &ParamResidency::on_device, py::call_guard<py::gil_scoped_release>())
      .def("gather", &ParamResidency::gather, py::call_guard<py::gil_scoped_release>(),
           "Holds every offloaded parameter of the list on the device (all or none; out_of_memory names the budget).")
      .def("scatter", &ParamResidency::scatter, py::arg("params"), py::arg("write_back"),
           py::call_guard<py::gil_scoped_release>(),
           "Writes each gathered parameter back to its home when write_back, then releases it.")
      .def("make_resident", &ParamResidency::make_resident, py::arg("units"),
           py::call_guard<py::gil_scoped_release>(), "Makes these units resident from now on; returns their parameters.")
      .def("host_copy", [](const ParamResidency& r, const at::Tensor& p) -> py::object {
        at::Tensor h;
        {
          py::gil_scoped_release release;
          h = r.host_copy(p);
        }
        return h.defined() ? py::cast(h) : py::none();
      }, "The host copy of a parameter kept on the host, or None.")
      .def("offloaded", &ParamResidency::offloaded, py::call_guard<py::gil_scoped_release>())
      .def("load", &ParamResidency::load, py::call_guard<py::gil_scoped_release>(),
           "The parameter's current value on the host (its host copy, or read from NVMe).")
      .def("store", &ParamResidency::store, py::call_guard<py::gil_scoped_release>(),
           "Makes a CPU tensor the parameter's value between uses (its host copy, or NVMe).")
      .def("point_at_host", &ParamResidency::point_at_host, py::call_guard<py::gil_scoped_release>())
      .def("materialize", &ParamResidency::materialize, py::arg("param"), py::arg("fetch"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const ParamResidency& r) {
        tiering::ParamScheduleStats s;
        {
          py::gil_scoped_release release;  // the mutex may be held across a wait (a release, a fetch)
          s = r.stats();
        }
        return stat_dict(s, tiering::param_schedule_stat_fields());
      });
}

}  // namespace

namespace tierflow::bindings::pymod {

void bind_runtime(py::module_& m) {
  m.def("one_cuda_device", &tiering::one_cuda_device, py::arg("cuda_indices"), py::arg("current"),
        "Why a model on these CUDA devices cannot be wrapped while `current` is current ('' when it can).");
  py::class_<SavedHandle, std::shared_ptr<SavedHandle>>(m, "SavedHandle",
      "What autograd keeps for one saved tensor while tierflow manages it.");

  py::class_<swap::NvmeFaults, std::shared_ptr<swap::NvmeFaults>>(m, "NvmeFaults",
      "Test hook: makes the next NVMe requests fail, come back short or corrupt.")
      .def(py::init<>())
      .def_property("fail_writes", [](const swap::NvmeFaults& f) { return f.fail_writes.load(); },
                    [](swap::NvmeFaults& f, int n) { f.fail_writes = n; })
      .def_property("fail_reads", [](const swap::NvmeFaults& f) { return f.fail_reads.load(); },
                    [](swap::NvmeFaults& f, int n) { f.fail_reads = n; })
      .def_property("corrupt_reads", [](const swap::NvmeFaults& f) { return f.corrupt_reads.load(); },
                    [](swap::NvmeFaults& f, int n) { f.corrupt_reads = n; })
      .def_property("fail_grows", [](const swap::NvmeFaults& f) { return f.fail_grows.load(); },
                    [](swap::NvmeFaults& f, int n) { f.fail_grows = n; },
                    "The next N grows of a swap file fail with ENOSPC, as on a full disk.");

  py::class_<swap::CopyFaults, std::shared_ptr<swap::CopyFaults>>(m, "CopyFaults",
      "Test hook: delays the emulated device's copies to the host.")
      .def(py::init<>())
      .def_property("d2h_delay_us", [](const swap::CopyFaults& f) { return f.d2h_delay_us.load(); },
                    [](swap::CopyFaults& f, int us) { f.d2h_delay_us = us; })
      .def_property("fail_d2h_copies", [](const swap::CopyFaults& f) { return f.fail_d2h_copies.load(); },
                    [](swap::CopyFaults& f, int n) { f.fail_d2h_copies = n; })
      .def_property("hold_d2h", [](const swap::CopyFaults& f) { return f.hold_d2h.load(); },
                    [](swap::CopyFaults& f, bool on) { f.hold_d2h = on; },
                    "While set, copies to the host do not start (a hung device; Note [Stall timeout]).")
      .def_property("ignore_stream_order", [](const swap::CopyFaults& f) { return f.ignore_stream_order.load(); },
                    [](swap::CopyFaults& f, bool on) { f.ignore_stream_order = on; },
                    "Copies behave as if they named no stream (issue 8's bug), to test the adversarial mode.");

  py::class_<swap::TransferHandle>(m, "Transfer", "The completion of one copy through tierflow's copy engine.")
      .def("ready", &swap::TransferHandle::ready, "True once the copy has completed.")
      .def("wait", [](const swap::TransferHandle& h) {
        py::gil_scoped_release release;
        h.wait();
      }, "Blocks until the copy has completed; raises its error.");

  py::class_<Runtime, std::shared_ptr<Runtime>> runtime(m, "Runtime");
  bind_runtime_tiers(runtime);
  bind_runtime_optimizer(runtime);
  bind_runtime_nvme_optimizer(runtime);
  runtime.def("stats", &runtime_stats);
  bind_param_residency(m);
}


}  // namespace tierflow::bindings::pymod
