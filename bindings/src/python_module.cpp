// tierflow._C: the pybind11 surface over bindings/. The Python package is a
// thin layer over these functions; the logic lives in C++.
#include <pybind11/pybind11.h>

#include <chrono>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/bindings/planner_bindings.hpp"
#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/swap/nvme_probe.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace py = pybind11;
using namespace tierflow;
using namespace tierflow::bindings;

namespace {

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

py::dict runtime_stats(const Runtime& rt) {
  rt.host_pool()->reap();
  auto a = rt.activations()->stats();
  auto pool = rt.host_pool()->stats();
  auto link = rt.copy_engine()->stats();
  auto opt = rt.optimizer_stats();
  py::dict acts;
  acts["packs"] = a.packs;
  acts["skipped_parameters"] = a.skipped_parameters;
  acts["skipped_unmanaged"] = a.skipped_unmanaged;
  acts["dedup_hits"] = a.dedup_hits;
  acts["kept_small"] = a.kept_small;
  acts["kept_region"] = a.kept_region;
  acts["host_fallbacks"] = a.host_fallbacks;
  acts["offloaded_blocks"] = a.offloaded_blocks;
  acts["offloaded_bytes"] = a.offloaded_bytes;
  acts["offload_waits"] = a.offload_waits;
  py::dict nv;
  nv["writes"] = a.nvme_writes;
  nv["write_bytes"] = a.nvme_write_bytes;
  nv["reads"] = a.nvme_reads;
  nv["forwarded"] = a.nvme_forwarded;
  nv["write_failures"] = a.nvme_write_failures;
  nv["full"] = a.nvme_full;
  nv["staging_waits"] = a.staging_waits;
  acts["nvme"] = nv;
  acts["offload_wait_ms"] = static_cast<double>(a.offload_wait_ns) / 1e6;
  acts["unpacks"] = a.unpacks;
  acts["device_bytes"] = stat_dict(a.device_bytes);
  acts["host_bytes"] = stat_dict(a.host_bytes);
  py::dict prefetch;
  prefetch["prefetched_blocks"] = a.prefetched_blocks;
  prefetch["hits"] = a.prefetch_hits;
  prefetch["forwarded"] = a.forwarded;
  prefetch["stalls"] = a.stalls;
  prefetch["stall_ms"] = static_cast<double>(a.stall_ns) / 1e6;
  prefetch["unprefetched"] = a.unprefetched;
  py::dict host;
  host["budget_bytes"] = rt.host_pool()->budget_bytes();
  host["pinned"] = rt.host_pool()->cuda_pinned();
  host["in_use"] = stat_dict(pool.in_use);
  host["reserved"] = stat_dict(pool.reserved);
  host["slab_allocations"] = pool.slab_allocations;
  host["block_allocations"] = pool.block_allocations;
  host["failed_allocations"] = pool.failed_allocations;
  py::dict links;
  links["gpu_to_host_bytes"] = link.d2h_bytes;
  links["host_to_gpu_bytes"] = link.h2d_bytes;
  links["gpu_to_host_ops"] = link.d2h_ops;
  links["host_to_gpu_ops"] = link.h2d_ops;
  py::dict optd;
  optd["steps"] = opt.steps;
  optd["elements"] = opt.elements;
  optd["step_ms"] = static_cast<double>(opt.step_ns) / 1e6;
  optd["threads"] = rt.cpu_threads();
  optd["isa"] = std::string(optimizer::to_string(rt.cpu_isa()));
  host["fenced_frees"] = pool.fenced_frees;
  host["fence_waits"] = pool.fence_waits;
  host["late_writes"] = pool.late_writes;
  py::dict emu;
  emu["mode"] = rt.device_kind() == allocator::DeviceKind::kEmulated
                    ? std::string(to_string(rt.config().emulated_device)) : std::string("n/a");
  const auto es = swap::emulated_copy_stats(*rt.copy_engine());
  emu["unordered_copies"] = es.unordered_copies;
  emu["delayed_copies"] = es.delayed_copies;
  if (rt.adversarial()) check_device_memory_quarantine();
  const auto ms = emulated_device_memory_stats();
  emu["poisoned_device_memory"] = ms.installed;
  emu["device_late_writes"] = ms.late_writes;
  py::dict out;
  out["device"] = std::string(allocator::to_string(rt.device_kind()));
  out["emulated"] = emu;
  out["activations"] = acts;
  out["prefetch"] = prefetch;
  out["host_pool"] = host;
  out["links"] = links;
  out["optimizer"] = optd;
  return out;
}

std::map<std::string, std::string> to_string_map(const py::dict& d) {
  std::map<std::string, std::string> m;
  for (auto item : d) m.emplace(py::str(item.first), py::str(item.second));
  return m;
}

}  // namespace

namespace tierflow::bindings {
void bind_activation_planner(pybind11::module_& m);  // plan_bindings.cpp
}

namespace {

// A Python callable that C++ may call from autograd's threads and drop anywhere:
// it takes the GIL for both (Note [Gradient streaming]).
std::shared_ptr<py::object> gil_safe(py::object f) {
  return std::shared_ptr<py::object>(new py::object(std::move(f)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

/// tierflow._C.GradStream: GradStream plus the Python state dicts it commits into.
struct PyGradStream {
  std::shared_ptr<GradStream> stream;
  std::vector<py::object> states;  // slot -> the optimizer's state dict of that parameter

  PyGradStream() = default;
  PyGradStream(const PyGradStream&) = delete;
  PyGradStream& operator=(const PyGradStream&) = delete;
  // GradStream's destructor waits for its worker, which may need the GIL to drop a
  // gradient's last reference or to call back into Python: it runs without the GIL
  // (held here when the garbage collector or the interpreter's exit drops the last
  // reference), so the two never wait on each other.
  ~PyGradStream() {
    if (stream && Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      stream.reset();
    }
  }

  void commit_into_states(const std::vector<std::size_t>& committed) {
    static const char* kNames[] = {"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    for (std::size_t i : committed) {
      if (i >= states.size() || states[i].is_none()) continue;
      auto tensors = stream->state_of(i);
      py::dict d = states[i];
      for (int k = 0; k < 4; ++k)
        if (tensors[k].defined()) d[kNames[k]] = tensors[k];
    }
  }
};

py::dict grad_stream_stats(const GradStreamStats& s) {
  py::dict d;
  d["early_steps"] = s.early_steps;
  d["committed"] = s.committed;
  d["redone"] = s.redone;
  d["taken_back"] = s.taken_back;
  d["held"] = s.held;
  d["buckets"] = s.buckets;
  d["bucket_count"] = s.bucket_count;
  d["bucket_bytes"] = s.bucket_bytes;
  d["speculation_stops"] = s.speculation_stops;
  d["clips_picked_up"] = s.clips_picked_up;
  d["grad_bytes_to_host"] = s.grad_bytes_to_host;
  d["weight_bytes_to_device"] = s.weight_bytes_to_device;
  d["grads_released"] = s.grads_released;
  d["grad_bytes_freed"] = s.grad_bytes_freed;
  d["grads_restored"] = s.grads_restored;
  d["kernel_grad_bytes"] = s.kernel_grad_bytes;
  d["sized_link_bytes_per_s"] = s.sized_link_bytes_per_s;
  d["sized_cpu_grad_bytes_per_s"] = s.sized_cpu_grad_bytes_per_s;
  d["sized_backward_ms"] = s.sized_backward_s * 1e3;
  d["kernel_ms"] = static_cast<double>(s.kernel_ns) / 1e6;
  d["step_kernel_ms"] = static_cast<double>(s.step_kernel_ns) / 1e6;
  d["step_wait_ms"] = static_cast<double>(s.step_wait_ns) / 1e6;
  d["weight_wait_ms"] = static_cast<double>(s.weight_wait_ns) / 1e6;
  d["last_backward_ms"] = static_cast<double>(s.last_backward_ns) / 1e6;
  d["last_partial_norm"] = s.last_partial_norm;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tierflow's C++ runtime";

  auto base = py::register_exception<logic_error>(m, "TierflowError", PyExc_RuntimeError);
  py::register_exception<config_error>(m, "ConfigError", PyExc_ValueError);
  py::register_exception<out_of_memory>(m, "OutOfMemoryError", PyExc_MemoryError);
  py::register_exception<io_error>(m, "IOError", PyExc_OSError);
  py::register_exception<cuda_error>(m, "CudaError", PyExc_RuntimeError);

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
  m.def("resolve_config", [](const py::dict& overrides) {
    return Config::from_environment(to_string_map(overrides)).to_strings();
  }, "The configuration the environment plus `overrides` give; raises ConfigError.");
  m.def("cuda_compiled", &allocator::cuda_compiled, "Whether the CUDA backend was compiled in.");
  m.def("cuda_available", &allocator::cuda_available, "Whether a CUDA GPU is usable.");
  m.def("push_no_offload", &push_no_offload);
  m.def("cuda_adam_step", [](const py::dict& options, std::int64_t step, const std::vector<at::Tensor>& masters,
                             const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                             const std::vector<std::optional<at::Tensor>>& vmaxes,
                             const std::vector<at::Tensor>& grads,
                             const std::vector<std::optional<at::Tensor>>& outs) {
    // The GPU share: in-place step of CUDA tensors on the current stream.
    std::vector<optimizer::AdamTensor> ts(masters.size());
    void* stream = nullptr;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      for (const at::Tensor* t : {&masters[i], &ms[i], &vs[i], &grads[i]}) {
        TIERFLOW_EXPECTS(t->is_cuda() && t->is_contiguous(), "cuda_adam_step: every tensor must be a contiguous CUDA tensor");
      }
      ts[i].numel = static_cast<std::size_t>(masters[i].numel());
      ts[i].master = masters[i].data_ptr<float>();
      ts[i].exp_avg = ms[i].data_ptr<float>();
      ts[i].exp_avg_sq = vs[i].data_ptr<float>();
      if (vmaxes[i]) ts[i].max_exp_avg_sq = vmaxes[i]->data_ptr<float>();
      ts[i].grad = grads[i].data_ptr();
      ts[i].grad_type = optimizer_type(grads[i].scalar_type(), "cuda_adam_step");
      if (outs[i]) {
        ts[i].param_out = outs[i]->data_ptr();
        ts[i].param_type = optimizer_type(outs[i]->scalar_type(), "cuda_adam_step");
      }
      if (i == 0) {
        const auto* impl = c10::impl::getDeviceGuardImpl(masters[0].device().type());
        stream = impl->getStream(masters[0].device()).native_handle();
      }
    }
    optimizer::cuda_adam_step(adam_options(options), step, ts, stream);
  }, "One Adam/AdamW step of CUDA tensors on the current stream (the GPU optimizer share).");
  m.def("adam_traffic", [](const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& ms,
                           const std::vector<at::Tensor>& vs, const std::vector<at::Tensor>& grads,
                           const std::vector<std::optional<at::Tensor>>& outs, int threads, int repeats) {
    // Benchmark roofline: see optimizer/roofline.hpp. Returns the best time in seconds.
    std::vector<optimizer::AdamTensor> ts(masters.size());
    for (std::size_t i = 0; i < ts.size(); ++i) {
      ts[i].numel = static_cast<std::size_t>(masters[i].numel());
      ts[i].master = masters[i].data_ptr<float>();
      ts[i].exp_avg = ms[i].data_ptr<float>();
      ts[i].exp_avg_sq = vs[i].data_ptr<float>();
      ts[i].grad = grads[i].data_ptr();
      ts[i].grad_type = optimizer_type(grads[i].scalar_type(), "adam_traffic_step");
      if (outs[i]) {
        ts[i].param_out = outs[i]->data_ptr();
        ts[i].param_type = optimizer_type(outs[i]->scalar_type(), "adam_traffic_step");
      }
    }
    py::gil_scoped_release release;
    optimizer::AdamTrafficKernel k(threads);
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      k.run(ts);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  }, "Times the Adam-traffic roofline kernel over these arrays (overwrites them).");
  m.def("pop_no_offload", &pop_no_offload);
  tierflow::bindings::bind_activation_planner(m);
  m.def("no_offload_depth", &no_offload_depth, "Depth of tierflow.no_offload() regions open on this thread.");
  m.def("log", [](const std::string& level, const std::string& message) {
    LogLevel l = LogLevel::kInfo;
    if (level == "error") l = LogLevel::kError;
    else if (level == "warn") l = LogLevel::kWarn;
    else if (level == "debug") l = LogLevel::kDebug;
    else if (level != "info") throw config_error("log: level '" + level + "'; accepted: error, warn, info, debug");
    log(l, message);
  }, "A line on stderr through tierflow's log (TIERFLOW_LOG_LEVEL filters it).");

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
      .def_property("ignore_stream_order", [](const swap::CopyFaults& f) { return f.ignore_stream_order.load(); },
                    [](swap::CopyFaults& f, bool on) { f.ignore_stream_order = on; },
                    "Copies behave as if they named no stream (issue 8's bug), to test the adversarial mode.");

  py::class_<swap::TransferHandle>(m, "Transfer", "The completion of one copy through tierflow's copy engine.")
      .def("ready", &swap::TransferHandle::ready, "True once the copy has completed.")
      .def("wait", [](const swap::TransferHandle& h) {
        py::gil_scoped_release release;
        h.wait();
      }, "Blocks until the copy has completed; raises its error.");

  py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime")
      .def(py::init([](const py::dict& overrides, std::shared_ptr<swap::NvmeFaults> faults,
                       std::shared_ptr<swap::CopyFaults> copy_faults) {
             // The runtime keeps a raw pointer to the NVMe faults: the Python object must outlive it.
             auto* rt = new Runtime(Config::from_environment(to_string_map(overrides)), faults.get(),
                                    std::move(copy_faults));
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
           py::arg("copy_faults") = nullptr)
      .def("config", [](const Runtime& rt) { return rt.config().to_strings(); })
      .def_property_readonly("device", [](const Runtime& rt) {
        return std::string(allocator::to_string(rt.device_kind()));
      })
      .def("pack", [](Runtime& rt, const at::Tensor& t) { return rt.activations()->pack(t); })
      .def("pack_to", [](Runtime& rt, const at::Tensor& t, const std::string& target) {
        PackTarget to = PackTarget::kPolicy;
        if (target == "keep") to = PackTarget::kKeep;
        else if (target == "host") to = PackTarget::kHost;
        else if (target == "nvme") to = PackTarget::kNvme;
        else if (target != "policy")
          throw config_error("Runtime.pack_to: target '" + target + "'; accepted: policy, keep, host, nvme");
        return rt.activations()->pack(t, to);
      }, "pack() with a block plan's decision: policy, keep, host or nvme.")
      .def_property_readonly("has_nvme_tier", [](Runtime& rt) { return rt.activations()->has_nvme(); })
      .def("device_budget_bytes", [](Runtime& rt) {
        return rt.config().gpu_memory.resolve(allocator::device_capacity_bytes(rt.device_kind()));
      }, "TIERFLOW_GPU_MEMORY in bytes on this runtime's device.")
      .def("host_budget_bytes", [](Runtime& rt) {
        return rt.config().host_memory.resolve(allocator::host_capacity_bytes());
      }, "TIERFLOW_HOST_MEMORY in bytes.")
      .def("measure_nvme", [](Runtime& rt, std::uint64_t bytes) {
        if (!rt.nvme_engine()) throw config_error("Runtime.measure_nvme: no NVMe tier; set TIERFLOW_NVME_PATHS");
        allocator::AlignedBuffer buffer(bytes);
        swap::NvmeBandwidth bw;
        {
          py::gil_scoped_release release;
          bw = swap::measure_bandwidth(*rt.nvme_engine(), buffer.data(), bytes);
        }
        return py::make_tuple(bw.write_bytes_per_second, bw.read_bytes_per_second);
      }, py::arg("bytes"),
         "(write, read) bytes/s of `bytes` through the NVMe engine, every path, O_DIRECT (Note [NVMe probe]).")
      .def("nvme_available_bytes", [](Runtime& rt) -> std::uint64_t {
        return rt.nvme_engine() ? rt.nvme_engine()->available_bytes() : 0;
      }, "Bytes the NVMe tier can still place now (TIERFLOW_NVME_MEMORY, the free space, what is in use); 0 without one.")
      .def("unpack", [](Runtime& rt, const std::shared_ptr<SavedHandle>& h) {
        return rt.activations()->unpack(h);
      })
      .def("begin_forward", [](Runtime& rt) { rt.activations()->begin_forward(); })
      .def("begin_backward", [](Runtime& rt) { rt.activations()->begin_backward(); })
      .def("register_parameters", [](Runtime& rt, const std::vector<at::Tensor>& ps) {
        rt.activations()->register_parameters(ps);
      })
      .def("synchronize", [](Runtime& rt) { rt.activations()->synchronize(); })
      .def("reset_peaks", [](Runtime& rt) { rt.activations()->reset_peaks(); })
      .def("unlink_nvme_files", [](Runtime& rt) { rt.unlink_nvme_files(); },
           "Removes the NVMe swap files' names now (called at exit).")
      .def("host_empty", [](Runtime& rt, const std::vector<std::int64_t>& sizes,
                            const std::string& dtype, bool zero) {
        return rt.host_empty(sizes, dtype_from_name(dtype), zero);
      }, py::arg("sizes"), py::arg("dtype"), py::arg("zero") = false)
      .def("adam_step", [](Runtime& rt, const py::dict& options, std::int64_t step,
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
      .def("adam_step_async", [](Runtime& rt, const py::dict& options, std::int64_t step,
                                 std::vector<at::Tensor> masters, std::vector<at::Tensor> exp_avgs,
                                 std::vector<at::Tensor> exp_avg_sqs,
                                 const std::vector<std::optional<at::Tensor>>& max_exp_avg_sqs,
                                 std::vector<at::Tensor> grads,
                                 const std::vector<std::optional<at::Tensor>>& params_out,
                                 std::vector<at::Tensor> masters_out, std::vector<at::Tensor> exp_avgs_out,
                                 std::vector<at::Tensor> exp_avg_sqs_out,
                                 const std::vector<std::optional<at::Tensor>>& max_exp_avg_sqs_out) {
        auto unwrap = [](const std::vector<std::optional<at::Tensor>>& v) {
          std::vector<at::Tensor> out;
          for (const auto& t : v) out.push_back(t ? *t : at::Tensor());
          return out;
        };
        Runtime::AdamOutputs outs{std::move(masters_out), std::move(exp_avgs_out),
                                  std::move(exp_avg_sqs_out), unwrap(max_exp_avg_sqs_out)};
        rt.adam_step_async(adam_options(options), step, std::move(masters), std::move(exp_avgs),
                           std::move(exp_avg_sqs), unwrap(max_exp_avg_sqs), std::move(grads),
                           unwrap(params_out), std::move(outs));
      }, "Queues a step with out-of-place outputs on the optimizer worker thread.")
      .def("on_device", &Runtime::on_device, "Whether a tensor is on this runtime's device.")
      .def("copy_to_host", [](Runtime& rt, const at::Tensor& dst, const at::Tensor& src) {
        return rt.copy_to_host(dst, src);
      }, "Device -> host copy after the current stream's work (Note [Copy ordering]); wait before reading dst.")
      .def("copy_to_device", [](Runtime& rt, const at::Tensor& dst, const at::Tensor& src) {
        py::gil_scoped_release release;  // the emulated compute waits on the host
        return rt.copy_to_device(dst, src);
      }, "Host -> device copy after the current stream's work; the stream waits for it. Keep src alive until ready.")
      .def("adam_wait", [](Runtime& rt) {
        py::gil_scoped_release release;
        rt.adam_wait();
      }, "Waits for every queued step; raises the first failure.")
      .def("nvme_adam_add", [](Runtime& rt, const at::Tensor& master, bool amsgrad) {
        TIERFLOW_EXPECTS(master.is_cpu() && master.is_contiguous() && master.scalar_type() == at::kFloat,
                         "nvme_adam_add: the master must be a contiguous float32 CPU tensor");
        return rt.nvme_adam().add(static_cast<std::size_t>(master.numel()), amsgrad, master.data_ptr<float>());
      })
      .def("nvme_adam_read", [](Runtime& rt, std::uint64_t key, at::Tensor master, at::Tensor m, at::Tensor v,
                                std::optional<at::Tensor> vmax) {
        py::gil_scoped_release release;
        rt.nvme_adam().read(key, master.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                            vmax ? vmax->data_ptr<float>() : nullptr);
      })
      .def("nvme_adam_write", [](Runtime& rt, std::uint64_t key, at::Tensor master, at::Tensor m, at::Tensor v,
                                 std::optional<at::Tensor> vmax) {
        py::gil_scoped_release release;
        rt.nvme_adam().write(key, master.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                             vmax ? vmax->data_ptr<float>() : nullptr);
      })
      .def("nvme_adam_numel", [](Runtime& rt, std::uint64_t key) { return rt.nvme_adam().numel(key); })
      .def("nvme_adam_step", [](Runtime& rt, const py::dict& options, std::int64_t step,
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
      })
      .def("stats", &runtime_stats);
  bind_planner(m);

  m.def("measured_grad_bucket_bytes", [](double backward_s, double link, double cpu, std::size_t total) {
    return optimizer::measured_grad_bucket_bytes({backward_s, link, cpu, total});
  }, "TIERFLOW_GRAD_BUCKET_BYTES=auto from measured speeds (bytes/s), see optimizer/grad_buckets.hpp.");

  m.def("choose_gpu_fraction", [](double cpu_rate, double gpu_rate, double backward_s, std::size_t elements,
                                  std::size_t bytes_per_element, std::size_t free_bytes) {
    optimizer::SplitInputs in;
    in.cpu_elements_per_second = cpu_rate;
    in.gpu_elements_per_second = gpu_rate;
    in.backward_seconds = backward_s;
    in.elements = elements;
    in.gpu_bytes_per_element = bytes_per_element;
    in.gpu_free_bytes = free_bytes;
    return optimizer::choose_gpu_fraction(in);
  }, "TIERFLOW_GPU_OPTIMIZER_FRACTION=auto: the GPU share that makes the CPU step end with backward.");

  py::class_<PyGradStream, std::shared_ptr<PyGradStream>>(
      m, "GradStream", "Gradients to the CPU optimizer in buckets during backward (Note [Gradient streaming]).")
      .def(py::init([](std::shared_ptr<Runtime> rt, std::size_t bucket_bytes, int accumulation,
                       double max_grad_norm, bool skip_nonfinite, bool weights_in_forward,
                       bool offload_gradients) {
        GradStreamOptions o;
        o.bucket_bytes = bucket_bytes;
        o.accumulation_steps = accumulation;
        o.max_grad_norm = max_grad_norm;
        o.skip_nonfinite = skip_nonfinite;
        o.weights_in_forward = weights_in_forward;
        o.offload_gradients = offload_gradients;
        auto p = std::make_shared<PyGradStream>();
        p->stream = GradStream::create(std::move(rt), o);
        return p;
      }), py::arg("runtime"), py::arg("bucket_bytes"), py::arg("accumulation"), py::arg("max_grad_norm"),
           py::arg("skip_nonfinite"), py::arg("weights_in_forward"), py::arg("offload_gradients") = false)
      // Every call into the stream that takes its lock drops the GIL first: the
      // stream may let go of a tensor with a Python object (which takes the
      // GIL) while it holds that lock, on the worker or autograd thread.
      .def("add_parameter", [](PyGradStream& g, const at::Tensor& p, int group) {
        std::size_t slot;
        {
          py::gil_scoped_release release;
          slot = g.stream->add_parameter(p, group);
        }
        g.states.resize(slot + 1, py::none());
        return slot;
      })
      .def("exclude", [](PyGradStream& g, std::size_t slot) { g.stream->exclude(slot); }, py::call_guard<py::gil_scoped_release>())
      .def("set_group", [](PyGradStream& g, int group, const py::dict& options) {
        const auto o = adam_options(options);
        py::gil_scoped_release release;
        g.stream->set_group(group, o);
      })
      .def("set_state", [](PyGradStream& g, std::size_t slot, py::dict state) {
        auto get = [&](const char* k) {
          return state.contains(k) && !state[k].is_none() ? state[k].cast<at::Tensor>() : at::Tensor();
        };
        at::Tensor flat[4];
        const char* names[] = {"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
        for (int k = 0; k < 4; ++k) {
          at::Tensor t = get(names[k]);
          flat[k] = t.defined() ? t.view(-1) : t;  // views share the storage the state dict holds
        }
        at::Tensor step = get("step");
        {
          py::gil_scoped_release release;
          g.stream->set_state(slot, flat[0], flat[1], flat[2], flat[3], step);
        }
        if (slot >= g.states.size()) g.states.resize(slot + 1, py::none());
        g.states[slot] = state;
      })
      .def("set_callbacks", [](PyGradStream& g, py::object on_begin, py::object init_state) {
        auto begin = gil_safe(std::move(on_begin));
        auto init = gil_safe(std::move(init_state));
        g.stream->set_callbacks(
            [begin] {
              py::gil_scoped_acquire gil;
              (*begin)();
            },
            [init](std::size_t slot) {
              py::gil_scoped_acquire gil;
              (*init)(slot);
            });
      })
      .def("set_enabled", [](PyGradStream& g, bool on) { g.stream->set_enabled(on); }, py::call_guard<py::gil_scoped_release>())
      .def("add_module", [](PyGradStream& g, const std::vector<std::size_t>& slots) {
        return g.stream->add_module(slots);
      }, py::call_guard<py::gil_scoped_release>())
      .def("wait_worker", [](PyGradStream& g) {
        py::gil_scoped_release release;
        g.stream->wait_worker();
      })
      .def("finish", [](PyGradStream& g, double scale, bool stale) {
        GradStream::Finish f;
        {
          py::gil_scoped_release release;
          f = g.stream->finish(scale, stale);
        }
        g.commit_into_states(f.committed);
        return f.unhandled;
      }, "step(): commits or redoes the streamed steps and sends weights back; returns the slots left to the caller.")
      .def("discard_all", [](PyGradStream& g) { g.stream->discard_all(); }, py::call_guard<py::gil_scoped_release>())
      .def("size_buckets", [](PyGradStream& g, double link) { return g.stream->size_buckets(link); }, py::call_guard<py::gil_scoped_release>(),
           "TIERFLOW_GRAD_BUCKET_BYTES=auto from the measured step and this device -> host rate; the size in force.")
      .def("restore_grads", [](PyGradStream& g) {
        py::gil_scoped_release release;
        g.stream->restore_grads();
      }, "Puts released gradients back on the device as p.grad (TIERFLOW_OFFLOAD_GRADIENTS).")
      .def("released_norms", [](PyGradStream& g) {
        std::vector<std::pair<std::size_t, at::Tensor>> norms;
        {
          py::gil_scoped_release release;
          norms = g.stream->released_norms();
        }
        py::dict d;
        for (auto& [slot, norm] : norms) d[py::int_(slot)] = norm;
        return d;
      }, "slot -> clip_grad_norm_'s per-tensor norm of each released gradient.")
      .def("end_window", [](PyGradStream& g) {
        py::gil_scoped_release release;
        g.stream->end_window();
      })
      .def("has_unconfirmed", [](PyGradStream& g) { return g.stream->has_unconfirmed(); }, py::call_guard<py::gil_scoped_release>())
      .def("begin_clip", [](PyGradStream& g) { g.stream->begin_clip(); }, py::call_guard<py::gil_scoped_release>(),
           "Before the user's clip_grad_norm_ (Note [Clip picked up]).")
      .def("end_clip", [](PyGradStream& g, double max_norm, double coefficient) { g.stream->end_clip(max_norm, coefficient); },
           py::call_guard<py::gil_scoped_release>(), py::arg("max_norm"), py::arg("coefficient"),
           "After it: its max_norm and the coefficient it scaled the gradients by.")
      .def("wait_step_uploads", [](PyGradStream& g) { g.stream->wait_step_uploads(); },
           py::call_guard<py::gil_scoped_release>(),
           "TIERFLOW_WEIGHTS_RETURN=step: the current stream waits for the weights still on their way.")
      .def("wait_module", [](PyGradStream& g, std::size_t module) {
        py::gil_scoped_release release;
        g.stream->wait_module(module);
      })
      .def("synchronize", [](PyGradStream& g) {
        py::gil_scoped_release release;
        g.stream->synchronize();
      })
      .def("stats", [](PyGradStream& g) {
        GradStreamStats s;
        {
          py::gil_scoped_release release;
          s = g.stream->stats();
        }
        return grad_stream_stats(s);
      })
      .def("__len__", [](PyGradStream& g) { return g.stream->size(); }, py::call_guard<py::gil_scoped_release>());
  (void)base;
}
