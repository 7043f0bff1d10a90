// tierflow._C.GradStream (Note [Gradient streaming]) and the bucket and GPU-share
// sizing functions the Python optimizer calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <torch/python.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <map>
#include <string>

#include "module_parts.hpp"
#include "struct_dict.hpp"
#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/allocator/device.hpp"
#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/bindings/emulated_device_memory.hpp"
#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/bindings/planner_bindings.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/optimizer/cuda_adam.hpp"
#include "tierflow/optimizer/grad_buckets.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/swap/nvme_probe.hpp"

namespace py = pybind11;
using namespace tierflow;
using namespace tierflow::bindings;
using namespace tierflow::bindings::pymod;

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



// Construction, the parameters, groups and states it carries, its callbacks.
void bind_stream_setup(py::class_<PyGradStream, std::shared_ptr<PyGradStream>>& c) {
  c.def(py::init([](std::shared_ptr<Runtime> rt, std::size_t bucket_bytes, int accumulation,
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
      .def("add_fed_parameter", [](PyGradStream& g, const at::Tensor& shard, const at::Tensor& owner, int group) {
        std::size_t slot;
        {
          py::gil_scoped_release release;
          slot = g.stream->add_fed_parameter(shard, owner, group);
        }
        g.states.resize(slot + 1, py::none());
        return slot;
      }, "FSDP2: a DTensor parameter's local tensor, fed through on_reduced only")
      .def("exclude", [](PyGradStream& g, std::size_t slot) {
        {
          py::gil_scoped_release release;
          g.stream->exclude(slot);
        }
        if (slot < g.states.size()) g.states[slot] = py::none();  // its state dict too: whoever steps it keeps it
      })
      .def("set_home", [](PyGradStream& g, std::size_t slot, const std::optional<at::Tensor>& home) {
        g.stream->set_home(slot, home.value_or(at::Tensor()));
      },
           py::call_guard<py::gil_scoped_release>(), "The slot's parameter lives on the host: its weights go there.")
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
      .def("set_reduced", [](PyGradStream& g, const std::vector<std::size_t>& slots) { g.stream->set_reduced(slots); },
           py::call_guard<py::gil_scoped_release>(),
           "DDP: these slots stream their reduced gradients (on_reduced), not their local ones")
      .def("on_reduced", [](PyGradStream& g, const std::vector<at::Tensor>& params, const at::Tensor& flat) {
        g.stream->on_reduced(params, flat);
      }, py::call_guard<py::gil_scoped_release>(),
           "DDP's comm hook, once a bucket is reduced: flat holds the reduced gradients of params, in order")
      .def("queue_backward_end", [](PyGradStream& g) { g.stream->queue_backward_end(); },
           py::call_guard<py::gil_scoped_release>(),
           "FSDP2: from the feed's final callback, the end of this backward after every callback queued so far")
      .def("add_module", [](PyGradStream& g, const std::vector<std::size_t>& slots) {
        return g.stream->add_module(slots);
      }, py::call_guard<py::gil_scoped_release>());
}

// What step() and zero_grad() ask of it.
void bind_stream_step(py::class_<PyGradStream, std::shared_ptr<PyGradStream>>& c) {
  c.def("wait_worker", [](PyGradStream& g) {
        py::gil_scoped_release release;
        g.stream->wait_worker();
      })
      .def("prepare_finish", [](PyGradStream& g, double scale, bool stale, bool frugal) {
             return g.stream->prepare_finish(scale, stale, frugal);
           }, py::arg("scale"), py::arg("stale"), py::arg("frugal") = false,
           py::call_guard<py::gil_scoped_release>(),
           "Note [Atomic step]: step()'s part that can fail, changing no weight or state; the slots left to the caller.")
      .def("weights_changed", [](PyGradStream& g) { return g.stream->weights_changed(); },
           "Note [Weight content]: slots whose parameter the user wrote since tierflow did (their masters go stale).")
      .def("note_written", [](PyGradStream& g, const std::vector<std::size_t>& slots) { g.stream->note_written(slots); },
           py::call_guard<py::gil_scoped_release>(), "The caller wrote these slots' parameters (Note [Weight content]).")
      .def("commit_finish", [](PyGradStream& g) {
        GradStream::Finish f;
        {
          py::gil_scoped_release release;
          f = g.stream->commit_finish();
        }
        g.commit_into_states(f.committed);
        return f.unhandled;
      }, "Note [Atomic step]: step()'s part that cannot fail (after prepare_finish).")
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
      .def("has_unconfirmed", [](PyGradStream& g) { return g.stream->has_unconfirmed(); }, py::call_guard<py::gil_scoped_release>());
}

// The user's clip, the next forward's waits for the weights, the counters and the timeline.
void bind_stream_waits(py::class_<PyGradStream, std::shared_ptr<PyGradStream>>& c) {
  c.def("begin_clip", [](PyGradStream& g) { g.stream->begin_clip(); }, py::call_guard<py::gil_scoped_release>(),
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
        return stat_dict(s, grad_stream_stat_fields());
      })
      .def("last_window", [](PyGradStream& g) {
        WindowTimeline w;
        {
          py::gil_scoped_release release;
          w = g.stream->last_window();
        }
        py::list buckets;
        using B = BucketTimes;
        for (const B& b : w.buckets) {
          buckets.append(struct_dict<B>(b, {{"bucket", &B::bucket}, {"grad_bytes", &B::grad_bytes},
                                            {"launched_ms", &B::launched_ms}, {"picked_ms", &B::picked_ms},
                                            {"landed_ms", &B::landed_ms}, {"stepped_ms", &B::stepped_ms}}));
        }
        using W = WindowTimeline;
        py::dict out = struct_dict<W>(w, {{"backward_end_ms", &W::backward_end_ms}, {"step_ms", &W::step_ms},
                                          {"worker_done_ms", &W::worker_done_ms}});
        out["buckets"] = buckets;
        return out;
      }, "The last finished window's times (Note [Stream timeline] in optimizer/step_engine.hpp); no buckets before one.");
}

}  // namespace

namespace tierflow::bindings::pymod {

namespace {

// The moments handed to or from an NVMe state of key `key`: of one format (their dtype), fp32 or the state's,
// contiguous on the CPU and of its size (Note [Optimizer states on NVMe]).
optimizer::StateFormat nvme_moments(Runtime& rt, std::uint64_t key, const at::Tensor& m, const at::Tensor& v,
                                    const char* what) {
  const auto f = optimizer::moments_format(rt.nvme_adam().numel(key), state_array_facts(m), state_array_facts(v));
  TIERFLOW_EXPECTS(f, std::string(what) + ": the moments must be contiguous CPU tensors of one format (float32, "
                       "bfloat16, or 8bit's uint8 buffer) of the state's size");
  return *f;
}

// Optimizer states on NVMe in a format (Note [Optimizer states on NVMe], Note [Optimizer state formats]):
// what runtime_bindings.cpp's fp32 nvme_adam_* do, with the format.
void bind_nvme_state_formats(py::module_& m) {
  m.def("nvme_optimizer_state_bytes", [](std::size_t numel, bool amsgrad, const std::string& format) {
    return optimizer::NvmeAdamStore::state_bytes(numel, amsgrad, optimizer::state_format_named(format));
  }, py::arg("numel"), py::arg("amsgrad"), py::arg("format"),
        "Bytes of one parameter's state on NVMe: fp32 master, both moments in `format`, fp32 vmax with amsgrad.");
  m.def("nvme_adam_add_in", [](Runtime& rt, const at::Tensor& master, bool amsgrad, const std::string& format) {
    TIERFLOW_EXPECTS(master.is_cpu() && master.is_contiguous() && master.scalar_type() == at::kFloat,
                     "nvme_adam_add_in: the master must be a contiguous float32 CPU tensor");
    const optimizer::StateFormat f = optimizer::state_format_named(format);
    py::gil_scoped_release release;
    return rt.nvme_adam().add(static_cast<std::size_t>(master.numel()), amsgrad, master.data_ptr<float>(), nullptr,
                              nullptr, nullptr, f);
  }, py::arg("runtime"), py::arg("master"), py::arg("amsgrad"), py::arg("format"),
        "A new NVMe state with zero moments kept in `format` (fp32, bf16, 8bit); returns its key.");
  m.def("nvme_adam_format", [](Runtime& rt, std::uint64_t key) {
    return std::string(to_string(rt.nvme_adam().format(key)));
  }, py::arg("runtime"), py::arg("key"), "The format an NVMe state's moments are kept in.");
  m.def("nvme_adam_read_in", [](Runtime& rt, std::uint64_t key, at::Tensor master, at::Tensor mo, at::Tensor v,
                                std::optional<at::Tensor> vmax) {
    const optimizer::StateFormat f = nvme_moments(rt, key, mo, v, "nvme_adam_read_in");
    py::gil_scoped_release release;
    rt.nvme_adam().read(key, master.data_ptr<float>(), mo.data_ptr(), v.data_ptr(),
                        vmax ? vmax->data_ptr<float>() : nullptr, f);
  }, py::arg("runtime"), py::arg("key"), py::arg("master"), py::arg("m"), py::arg("v"), py::arg("vmax"),
        "Reads an NVMe state; the moments come in their tensors' format: fp32 (decoded) or the state's own.");
  m.def("nvme_adam_write_in", [](Runtime& rt, std::uint64_t key, at::Tensor master, at::Tensor mo, at::Tensor v,
                                 std::optional<at::Tensor> vmax) {
    const optimizer::StateFormat f = nvme_moments(rt, key, mo, v, "nvme_adam_write_in");
    py::gil_scoped_release release;
    rt.nvme_adam().write(key, master.data_ptr<float>(), mo.data_ptr(), v.data_ptr(),
                         vmax ? vmax->data_ptr<float>() : nullptr, f);
  }, py::arg("runtime"), py::arg("key"), py::arg("master"), py::arg("m"), py::arg("v"), py::arg("vmax"),
        "Replaces an NVMe state; the moments are given in fp32 (encoded) or the state's own format.");
}

}  // namespace

void bind_grad_stream(py::module_& m) {
  bind_nvme_state_formats(m);
  m.def("measured_grad_bucket_bytes", [](double backward_s, double link, double cpu, std::size_t total) {
    return optimizer::measured_grad_bucket_bytes({backward_s, link, cpu, total});
  }, "TIERFLOW_GRAD_BUCKET_BYTES=auto from measured speeds (bytes/s), see optimizer/grad_buckets.hpp.");

  py::class_<PyGradStream, std::shared_ptr<PyGradStream>> stream(
      m, "GradStream", "Gradients to the CPU optimizer in buckets during backward (Note [Gradient streaming]).");
  bind_stream_setup(stream);
  bind_stream_step(stream);
  bind_stream_waits(stream);
}

}  // namespace tierflow::bindings::pymod
