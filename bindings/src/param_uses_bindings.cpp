// tierflow._C.ParamUses: tiering::ParamUses (Note [Parameter uses]) sending its events to a ParamResidency's
// ParamMover, the parameters known by their TensorImpl. The schedule's events wait without the GIL, as
// _C.ParamResidency's own do; a call record dropped meanwhile (a _Call's __del__ on another thread) waits for the
// next drop outside them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/python.h>

#include <memory>
#include <vector>

#include "tierflow/bindings/param_residency.hpp"
#include "tierflow/tiering/param_uses.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
namespace {

using tiering::ParamId;
using tiering::UnitId;

ParamId id_of(const at::Tensor& p) {
  return static_cast<ParamId>(reinterpret_cast<std::uintptr_t>(p.unsafeGetTensorImpl()));
}

class ResidencyHost : public tiering::ParamUsesHost {
 public:
  explicit ResidencyHost(std::shared_ptr<ParamResidency> residency)
      : residency_(std::move(residency)), mover_(residency_->mover()) {}
  void begin_forward(UnitId u, std::uint64_t x) override { released([&] { mover_.begin_forward(u, x); }); }
  void end_forward(UnitId u, std::uint64_t x) override { released([&] { mover_.end_forward(u, x); }); }
  void begin_backward(UnitId u, std::uint64_t x) override { released([&] { mover_.begin_backward(u, x); }); }
  void end_backward(UnitId u, std::uint64_t x) override { released([&] { mover_.end_backward(u, x); }); }
  void end_phase() override { released([&] { mover_.end_phase(); }); }
  bool offloaded(ParamId p) override { return mover_.offloaded(p); }
  void hold(ParamId p) override { released([&] { mover_.hold(p); }); }
  void unhold(ParamId p, const std::string& why) override { released([&] { mover_.unhold(p, why); }); }
  void attach(UnitId u, ParamId p) override { released([&] { mover_.attach(u, p); }); }

  int waiting = 0;                        // events in progress without the GIL
  std::vector<tiering::CallId> dropped;   // records to drop once none is

 private:
  template <class F>
  void released(F f) {
    struct Done { int& n; ~Done() { --n; } } done{++waiting};  // after the GIL is back
    py::gil_scoped_release release;
    f();
  }
  std::shared_ptr<ParamResidency> residency_;  // (keeps the mover)
  tiering::ParamMover& mover_;
};

std::vector<std::vector<ParamId>> ids_of(const std::vector<std::vector<at::Tensor>>& units) {
  std::vector<std::vector<ParamId>> out(units.size());
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const at::Tensor& p : units[u]) out[u].push_back(id_of(p));
  }
  return out;
}

// The uses with their host (the host, a base, is made first).
struct OwnedUses : ResidencyHost, tiering::ParamUses {
  OwnedUses(std::shared_ptr<ParamResidency> residency, const std::vector<std::vector<at::Tensor>>& units,
            std::size_t blocks, const std::vector<std::string>& names, const std::string& tier)
      : ResidencyHost(std::move(residency)),
        ParamUses(ids_of(units), blocks, names, tier, static_cast<ResidencyHost&>(*this)) {}
};

}  // namespace
}  // namespace tierflow::bindings

// Called from python_module.cpp, which declares it where it calls it.
void bind_param_uses(py::module_& m);
void bind_param_uses(py::module_& m) {
  using tierflow::bindings::OwnedUses;
  using U = tierflow::tiering::ParamUses;
  py::class_<OwnedUses>(m, "ParamUses", "The uses of a model's offloaded parameters (Note [Parameter uses]).")
      .def(py::init<std::shared_ptr<tierflow::bindings::ParamResidency>, const std::vector<std::vector<at::Tensor>>&,
                    std::size_t, const std::vector<std::string>&, const std::string&>(),
           py::arg("residency"), py::arg("units"), py::arg("blocks"), py::arg("names"), py::arg("tier"))
      .def("units", &U::units)
      .def("in_backward", &U::in_backward)
      .def("begin_forward", &U::begin_forward, py::arg("unit"), py::arg("extra_bytes"), py::arg("call") = 0)
      .def("pop_forward", [](OwnedUses& s, std::optional<std::size_t> u) {  // (unit, extra_bytes, token, call)
        const auto f = u ? s.pop_forward(*u) : s.pop_forward();
        return f ? std::optional(std::make_tuple(f->unit, f->extra_bytes, f->token, f->call)) : std::nullopt;
      }, py::arg("unit") = py::none())
      .def("end_forward", [](OwnedUses& s, std::size_t u, std::uint64_t extra) {
        static_cast<U&>(s).end_forward({u, extra});  // (a lambda's self is the bound type, not its base)
      })
      .def("end_phase", &U::end_phase)
      .def("new_call", &U::new_call)
      .def("drop_call", [](OwnedUses& s, tierflow::tiering::CallId c) {
        s.dropped.push_back(c);
        if (s.waiting > 0) return;  // another thread's event waits: not in the middle of it
        for (auto d : s.dropped) static_cast<U&>(s).drop_call(d);
        s.dropped.clear();
      })
      .def("watched", &U::watched)
      .def("unbegun", &U::unbegun)
      .def("begin_call", &U::begin_call)
      .def("expect_ends", &U::expect_ends)
      .def("edge_ran", &U::edge_ran)
      .def("end_call", &U::end_call)
      .def("recompute_opens", &U::recompute_opens)
      .def("recompute_begins", &U::recompute_begins)
      .def("recompute_ends", &U::recompute_ends)
      .def("begin_backward", &U::begin_backward)
      .def("close_backward", &U::close_backward)
      .def("model_begins", &U::model_begins)
      .def("model_ends", &U::model_ends)
      .def("read", [](OwnedUses& s, const at::Tensor& p) {  // whether it was attached to a block or held
        return s.read(tierflow::bindings::id_of(p), torch::autograd::get_current_graph_task_id() != -1) !=
               tierflow::tiering::ReadVerdict::kNothing;
      })
      .def("release_held", &U::release_held, py::arg("backward_ended") = false)
      .def("forget", [](OwnedUses& s, const std::vector<at::Tensor>& params) {
        std::vector<tierflow::tiering::ParamId> ids;
        for (const at::Tensor& p : params) ids.push_back(tierflow::bindings::id_of(p));
        s.forget(ids);
      });
  using G = tierflow::tiering::ParamGathers;
  py::class_<G>(m, "ParamGathers", "The parameters tierflow.gathered() holds (Note [Parameter uses], Gathered).")
      .def(py::init<>())
      .def("fresh", &G::fresh)
      .def("enter", &G::enter, py::arg("params"), py::arg("modify"), py::arg("versions"))
      .def("exit", [](G& g, const std::vector<std::uint64_t>& params, const std::vector<std::int64_t>& versions) {
        G::Release r = g.exit(params, versions);  // (write back, discard, edited without modify)
        return std::make_tuple(std::move(r.write_back), std::move(r.discard), std::move(r.edited));
      })
      .def("held", &G::held)
      .def("any", &G::any)
      .def("forward_begins", &G::forward_begins, py::arg("grad_enabled"), py::arg("model"))
      .def("forward_ends", &G::forward_ends)
      .def("check_outside_passes", &G::check_outside_passes, py::arg("in_backward"), py::arg("model"));
  // The refusals of Note [Parameter state], in their words.
  m.def("_gathered_edited_error", &tierflow::tiering::gathered_edited_error, py::arg("names"));
  m.def("_gathered_step_refusal", &tierflow::tiering::gathered_step_refusal, py::arg("optimizer"));
  m.def("_assign_refusal", &tierflow::tiering::assign_refusal, py::arg("name"), py::arg("tier"));
  m.def("_conversion_refusal", &tierflow::tiering::conversion_refusal, py::arg("module"), py::arg("call"),
        py::arg("name"), py::arg("was"), py::arg("becomes"), py::arg("tier"));
}
