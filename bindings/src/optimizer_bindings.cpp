// tierflow._C's Adam kernels called from Python: the CUDA AdamW of the GPU share
// and the Adam-traffic roofline the optimizer benchmark times; and the CPU
// AdamW's torch-free decisions (optimizer/: state_tier.hpp, cpu_adam.hpp's
// group_by_step, grad_buckets.hpp's GPU share, step_plan.hpp) that optim/ calls.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "module_parts.hpp"
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
#include "tierflow/optimizer/partition.hpp"
#include "tierflow/optimizer/roofline.hpp"
#include "tierflow/optimizer/state_format.hpp"
#include "tierflow/optimizer/state_tier.hpp"
#include "tierflow/optimizer/step_plan.hpp"
#include "tierflow/swap/nvme_probe.hpp"

namespace py = pybind11;
using namespace tierflow;
using namespace tierflow::bindings;
using namespace tierflow::bindings::pymod;

namespace tierflow::bindings::pymod {

namespace {

using optimizer::state_format_named;  // a format's name, or config_error naming what is accepted

// Note [Optimizer state formats]: conversions between fp32 moments and the packed formats.
void bind_state_formats(py::module_& m) {
  m.def("moment_bytes", [](const std::string& format, std::size_t numel) {
    return optimizer::moment_bytes(state_format_named(format), numel);
  }, py::arg("format"), py::arg("numel"), "Bytes of one moment of `numel` elements in `format` (fp32, bf16, 8bit).");
  m.def("moment_layout", [](std::size_t numel) {
    return std::make_pair(optimizer::absmax_offset(numel), optimizer::quant_blocks(numel));
  }, py::arg("numel"),
        "An 8-bit moment buffer of `numel` elements: (byte offset of its fp32 scales, number of scales); the codes "
        "are its first `numel` bytes.");
  m.def("moment_format", [](const at::Tensor& t) -> py::object {
    const auto f = moment_format(t);
    return f ? py::cast(std::string(to_string(*f))) : py::none();
  }, py::arg("moment"), "The format of a moment tensor (its dtype): 'fp32', 'bf16', '8bit', or None.");
  m.def("encode_moments", [](const std::string& format, const at::Tensor& m, const at::Tensor& v,
                             std::optional<at::Tensor> m_out, std::optional<at::Tensor> v_out) {
    const StateFormat f = state_format_named(format);
    const auto shape = moment_shape(f, m.sizes());
    const auto opts = at::TensorOptions().dtype(moment_dtype(f)).device(at::kCPU);
    at::Tensor mo = m_out ? *m_out : at::zeros(shape, opts), vo = v_out ? *v_out : at::zeros(shape, opts);  // zero padding
    {
      py::gil_scoped_release release;
      encode_moments(f, m, v, mo, vo);
    }
    return std::make_pair(mo, vo);
  }, py::arg("format"), py::arg("m"), py::arg("v"), py::arg("m_out") = py::none(), py::arg("v_out") = py::none(),
        "(m, v) encoded into `format` as a step stores them (into m_out and v_out when given).");
  m.def("decode_moments", [](const at::Tensor& m, const at::Tensor& v, std::size_t numel) {
    const auto f = moment_format(m);
    const auto shape = f == StateFormat::k8bit ? std::vector<std::int64_t>{static_cast<std::int64_t>(numel)}
                                               : m.sizes().vec();
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
    at::Tensor mo = at::empty(shape, opts), vo = at::empty(shape, opts);
    {
      py::gil_scoped_release release;
      decode_moments(m, v, numel, mo, vo);
    }
    return std::make_pair(mo, vo);
  }, py::arg("m"), py::arg("v"), py::arg("numel"),
        "fp32 (m, v) of moments in the format of their dtype (8bit: one dimension of `numel`; else m's shape).");
}

// The gradient buckets' link probe and sizing schedule, and the GPU share's choice (grad_buckets.hpp,
// Note [Steady step]).
void bind_gpu_share(py::module_& m) {
  using namespace tierflow::optimizer;
  using Candidates = std::vector<std::tuple<std::size_t, bool, bool>>;  // (numel, streamed, 16-bit)
  const auto candidates = [](const Candidates& in) {
    std::vector<ShareCandidate> cs;
    for (const auto& [numel, streamed, is_16bit] : in) cs.push_back({numel, streamed, is_16bit});
    return cs;
  };
  m.def("grad_link_probe_bytes", &grad_link_probe_bytes, py::arg("total_grad_bytes"),
        "Bytes of the copy that measures the link for the gradient bucket size.");
  m.def("gpu_share_room", &gpu_share_room, py::arg("free_bytes"), py::arg("budget_bytes"),
        py::arg("first_step_peak_bytes"), py::arg("planned_peak_bytes") = 0,
        "Device bytes the GPU share's states may take.");
  py::class_<GpuShareChoice>(m, "GpuShareChoice", "TIERFLOW_GPU_OPTIMIZER_FRACTION (grad_buckets.hpp).")
      .def(py::init<const std::string&>(), py::arg("setting"))
      .def_property_readonly("pending", &GpuShareChoice::pending)
      .def_property_readonly("fraction", &GpuShareChoice::fraction)
      .def("assign", &GpuShareChoice::assign, py::arg("numels"))
      .def("choose_now", &GpuShareChoice::choose_now, py::arg("streamed"), py::arg("backward_ms"), py::arg("pool_grew"))
      .def("due", [](GpuShareChoice& c, const std::tuple<bool, double, bool>& seen, const PlanRoom& room) {
        return share_due(c, {std::get<0>(seen), std::get<1>(seen), std::get<2>(seen)}, room);
      }, py::arg("seen"), py::arg("room"), "auto chooses now: a steady step (WindowWatch's), the plan in force.")
      .def("choose", [candidates](GpuShareChoice& c, const Candidates& cs, double cpu_elements, double cpu_step_ms,
                                  double backward_ms, std::int64_t free_bytes, std::int64_t budget_bytes,
                                  std::int64_t peak_bytes, std::int64_t planned_peak_bytes) {
        return c.choose(candidates(cs), {cpu_elements, cpu_step_ms, backward_ms, free_bytes, budget_bytes, peak_bytes,
                                         planned_peak_bytes});
      }, py::arg("candidates"), py::arg("cpu_elements"), py::arg("cpu_step_ms"), py::arg("backward_ms"),
         py::arg("free_bytes"), py::arg("budget_bytes"), py::arg("peak_bytes"), py::arg("planned_peak_bytes") = 0,
         "[(numel, streamed, 16-bit)] and the measurements -> which step on the GPU.");
  m.def("gpu_share_format_note", [](std::size_t parameters, const std::string& format) {
    return gpu_share_format_note(parameters, state_format_named(format));
  }, py::arg("parameters"), py::arg("format"), "The share's info line beside packed host moments, or ''.");
  m.def("gpu_share_took_bytes", [candidates](const Candidates& cs, const std::vector<bool>& on_gpu) {
    return share_took_bytes(candidates(cs), on_gpu);
  }, py::arg("candidates"), py::arg("on_gpu"), "Device bytes the chosen streamed candidates' states take.");
  py::class_<BucketSizingSchedule>(m, "BucketSizingSchedule", "When auto measures the bucket size (grad_buckets.hpp).")
      .def(py::init<bool>(), py::arg("auto_size"))
      .def_property_readonly("pending", &BucketSizingSchedule::pending)
      .def("due", &BucketSizingSchedule::due, py::arg("carries_parameters"), py::arg("streamed"),
           py::arg("last_backward_ms"), py::arg("pool_grew"));
}

// Note [Step plan]: the CPU AdamW's plan, its steps' paths and Note [Steady step]'s window (step_plan.hpp).
void bind_step_plan(py::module_& m) {
  using namespace tierflow::optimizer;
  py::enum_<StepPath>(m, "StepPath").value("skipped", StepPath::kSkipped).value("streamed", StepPath::kStreamed)
      .value("host", StepPath::kHost).value("nvme", StepPath::kNvme);
  py::enum_<ParamRoute>(m, "ParamRoute").value("step_in_step", ParamRoute::kStepInStep)
      .value("stream", ParamRoute::kStream).value("feed", ParamRoute::kFeed);
  py::enum_<WeightTarget>(m, "WeightTarget").value("home", WeightTarget::kHome)
      .value("parameter", WeightTarget::kParameter).value("staging", WeightTarget::kStaging);
  py::class_<PlanRoom>(m, "PlanRoom", "The activation plan as the GPU share sees it, a value (step_plan.hpp).")
      .def(py::init([](bool in_force, std::int64_t peak) { return PlanRoom{in_force, peak}; }),
           py::arg("in_force") = true, py::arg("predicted_peak_bytes") = 0)
      .def_readonly("in_force", &PlanRoom::in_force)
      .def_readonly("predicted_peak_bytes", &PlanRoom::predicted_peak_bytes)
      .def(py::self == py::self);
  m.def("shards_refusal", &shards_refusal, py::arg("settings"), py::arg("sharded"), py::arg("params"),
        py::arg("plain"), py::arg("host_shards"), "A CPU AdamW over FSDP2's shards: the refusal, or ''.");
  m.def("plan_room", &plan_room, py::arg("forced"), py::arg("has_plan"), py::arg("predicted_peak_bytes"));
  py::class_<WindowWatch>(m, "WindowWatch", "What each step()'s window showed (Note [Steady step]).")
      .def(py::init<std::uint64_t>(), py::arg("pinned_slabs"))
      .def("seen", [](WindowWatch& w, bool carries, std::uint64_t kernel_grad_bytes, std::uint64_t slabs,
                      double backward_ms) {
        const StepWindow s = w.seen(carries, kernel_grad_bytes, slabs, backward_ms);
        return std::make_tuple(s.streamed, s.backward_ms, s.pool_grew);
      }, py::arg("carries"), py::arg("kernel_grad_bytes"), py::arg("pinned_slabs"), py::arg("last_backward_ms"),
         "(streamed, backward ms, pool grew) of the window a step() ends.");
  py::class_<StepPlan>(m, "StepPlan", "Note [Step plan] (optimizer/step_plan.hpp).")
      .def(py::init<const Config&, const std::optional<std::string>&, bool>(), py::arg("settings"),
           py::arg("optimizer_states"), py::arg("sharded"))
      .def_property_readonly("format", [](const StepPlan& p) { return std::string(to_string(p.format())); })
      .def_property_readonly("states_on_nvme", &StepPlan::states_on_nvme)
      .def_property_readonly("tier", &StepPlan::tier_name)
      .def_property_readonly("sharded", &StepPlan::sharded)
      .def("check_group_sharding", &StepPlan::check_group_sharding, py::arg("group_sharded"))
      .def_property_readonly("overlap", &StepPlan::overlap)
      .def_property_readonly("steps_after_backward", [](const StepPlan& p) -> py::object {
        return p.steps_after_backward().empty() ? py::none() : py::cast(p.steps_after_backward());
      })
      .def_property_readonly("gpu_share_setting", &StepPlan::gpu_share_setting)
      .def("check_amsgrad", &StepPlan::check_amsgrad, py::arg("amsgrad"), py::arg("group"))
      .def("steps_during_backward", &StepPlan::steps_during_backward, py::arg("master_stale") = false)
      .def("stop_steps_during_backward", &StepPlan::stop_steps_during_backward, py::arg("why"))
      .def("stream_shards", &StepPlan::stream_shards)
      .def("route", [](const StepPlan& p, bool requires_grad, bool carried, bool on_device, bool contiguous,
                       bool kernel_dtype, bool in_gpu_share) {
        return p.route({requires_grad, carried, on_device, contiguous, kernel_dtype, in_gpu_share});
      }, py::arg("requires_grad"), py::arg("carried"), py::arg("on_device"), py::arg("contiguous"),
         py::arg("kernel_dtype"), py::arg("in_gpu_share"))
      .def("path", &StepPlan::path, py::arg("streaming"), py::arg("finite"))
      .def_static("weight_target", &StepPlan::weight_target, py::arg("has_home"), py::arg("in_host_memory"),
                  py::arg("contiguous"));
}

void bind_optimizer_policy(py::module_& m) {
  using namespace tierflow::optimizer;
  bind_state_formats(m);
  m.attr("LOST_STATE_KEY") = kLostStateKey;
  m.attr("STEADY_STEP_LIMIT") = kSteadyStepLimit;  // Note [Steady step]
  m.def("optimizer_state_bytes", [](std::size_t numel, bool amsgrad, const std::string& format) {
    return state_bytes({numel, amsgrad, 0, state_format_named(format)});
  }, py::arg("numel"), py::arg("amsgrad"), py::arg("format") = "fp32",
        "Bytes of one parameter's optimizer state: the fp32 master and the moments in `format`.");
  m.def("check_optimizer_state_pool", [](const std::vector<std::tuple<std::size_t, bool, std::size_t>>& states, bool nvme,
                                         std::uint64_t pool_budget_bytes, const std::string& host_memory,
                                         const std::string& format) {
    const StateFormat f = state_format_named(format);
    std::vector<ParamStateShape> shapes;
    for (const auto& [numel, amsgrad, moved] : states) shapes.push_back({numel, amsgrad, moved, f});
    check_state_pool(shapes, nvme, pool_budget_bytes, host_memory);
  }, py::arg("states"), py::arg("nvme"), py::arg("pool_budget_bytes"), py::arg("host_memory"),
        py::arg("format") = "fp32",
        "Raises OutOfMemoryError when the pinned pool cannot hold one step of these (numel, amsgrad, moved element "
        "bytes) states with moments in `format` (state_tier.hpp).");
  m.def("describe_parameter", &describe_parameter, py::arg("name"), py::arg("group_and_index"), py::arg("shape"),
        "A parameter as a user knows it, for error messages.");
  m.def("nvme_step_error", [](const std::vector<std::tuple<std::string, bool, std::string>>& problems) {
    std::vector<StepProblem> ps;
    for (const auto& [parameter, lost, reason] : problems) ps.push_back({parameter, lost, reason});
    return nvme_step_error(ps);
  }, "The error text for (description, lost?, reason) of the parameters a step could not step.");
  m.def("lost_states_refusal", &lost_states_refusal, py::arg("parameters"),
        "load_state_dict's refusal of states marked lost, naming these (described) parameters.");
  m.def("unfilled_lost_states", &unfilled_lost_states, py::arg("keys"),
        "fill_lost_states' refusal for these state dict keys (as printed).");
  m.def("grad_scaler_refusal", &grad_scaler_refusal, "step()'s refusal of GradScaler with offloaded gradients.");
  m.def("owned_elements", &owned_elements, py::arg("owners"), py::arg("elements"), py::arg("world_size"),
        "Elements each rank owns under partition_parameters' owners.");
  using Layout = std::optional<std::tuple<int, int, std::vector<int>>>;  // None: the whole; else (rank, world, owners)
  m.def("partition_layout_refusal", [](const Layout& saved, const Layout& mine) -> std::optional<std::string> {
    const auto layout = [](const Layout& l) {
      return l ? PartitionLayout{std::get<0>(*l), std::get<1>(*l), std::get<2>(*l)} : PartitionLayout{};
    };
    std::string why = partition_layout_refusal(layout(saved), layout(mine));
    return why.empty() ? std::nullopt : std::optional<std::string>(std::move(why));
  }, py::arg("saved"), py::arg("mine"),
        "Note [Partitioned optimizer]: loading a state dict saved with layout `saved` into an optimizer kept as "
        "`mine` (each None for the whole, or (rank, world_size, owners) with -1 for every rank): the refusal, or None.");
  m.def("step_agreement_refusal", [](bool this_rank_failed, int failed_ranks, int skipped_ranks,
                                     int world_size) -> std::optional<std::string> {
    std::string why = step_agreement_refusal(this_rank_failed, failed_ranks, skipped_ranks, world_size);
    return why.empty() ? std::nullopt : std::optional<std::string>(std::move(why));
  }, py::arg("this_rank_failed"), py::arg("failed_ranks"), py::arg("skipped_ranks"), py::arg("world_size"),
        "Note [Partitioned optimizer]: how the ranks' step() went, agreed: the error this rank raises, or None.");
  m.def("group_by_step", [](const std::vector<std::int64_t>& steps) {
    std::vector<std::pair<std::int64_t, std::vector<std::size_t>>> out;
    for (auto& g : group_by_step(steps)) out.emplace_back(g.step, std::move(g.members));
    return out;
  }, "[(step, [indices])]: one kernel call per step number, in order of first appearance.");
  bind_gpu_share(m);
  bind_step_plan(m);
}

}  // namespace

void bind_optimizer_kernels(py::module_& m) {
  bind_optimizer_policy(m);
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
      // Moments in the format of their dtype (Note [Optimizer state formats]): packed ones move their own bytes.
      const auto f = moment_format(ms[i]);
      TIERFLOW_EXPECTS(f && moment_format(vs[i]) == f, "adam_traffic: exp_avg and exp_avg_sq take one format: "
                                                       "float32, bfloat16 or uint8 (8bit)");
      ts[i].state_format = *f;
      if (*f == StateFormat::kFp32) {
        ts[i].exp_avg = ms[i].data_ptr<float>();
        ts[i].exp_avg_sq = vs[i].data_ptr<float>();
      } else if (*f == StateFormat::kBf16) {
        ts[i].m = {ms[i].data_ptr(), nullptr};
        ts[i].v = {vs[i].data_ptr(), nullptr};
      } else {
        ts[i].m = optimizer::packed_8bit(ms[i].data_ptr(), ts[i].numel);
        ts[i].v = optimizer::packed_8bit(vs[i].data_ptr(), ts[i].numel);
      }
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
}

}  // namespace tierflow::bindings::pymod
