// tierflow._C.ParamUses: tiering::ParamUses (Note [Parameter uses]) sending its events to a ParamResidency, the
// parameters known by their TensorImpl. The GIL stays held: the hooks' thread is the only caller, and a call
// record's owner going (ParamUses::drop_call, from a __del__) must not run in the middle of another call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/python.h>

#include <memory>
#include <unordered_map>

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

class ResidencyHost final : public tiering::ParamUsesHost {
 public:
  ResidencyHost(std::shared_ptr<ParamResidency> residency, const std::vector<std::vector<at::Tensor>>& units)
      : residency_(std::move(residency)) {
    for (const auto& u : units) {
      for (const at::Tensor& p : u) tensors_.emplace(id_of(p), p);
    }
  }
  void begin_forward(UnitId u, std::uint64_t extra) override { residency_->begin_forward(u, extra); }
  void end_forward(UnitId u, std::uint64_t extra) override { residency_->end_forward(u, extra); }
  void begin_backward(UnitId u, std::uint64_t extra) override { residency_->begin_backward(u, extra); }
  void end_backward(UnitId u, std::uint64_t extra) override { residency_->end_backward(u, extra); }
  void end_phase() override { residency_->end_phase(); }
  bool offloaded(ParamId p) override { return residency_->offloaded(tensors_.at(p)); }
  void hold(ParamId p) override { residency_->hold(tensors_.at(p)); }
  void unhold(ParamId p, const std::string& why) override { residency_->unhold(tensors_.at(p), why); }
  void attach(UnitId u, ParamId p) override { residency_->attach(u, tensors_.at(p)); }

 private:
  std::shared_ptr<ParamResidency> residency_;
  std::unordered_map<ParamId, at::Tensor> tensors_;
};

std::vector<std::vector<ParamId>> ids_of(const std::vector<std::vector<at::Tensor>>& units) {
  std::vector<std::vector<ParamId>> out;
  for (const auto& u : units) {
    out.emplace_back();
    for (const at::Tensor& p : u) out.back().push_back(id_of(p));
  }
  return out;
}

// A host and the uses over it.
struct PyParamUses {
  PyParamUses(std::shared_ptr<ParamResidency> residency, const std::vector<std::vector<at::Tensor>>& units,
              std::size_t blocks, const std::vector<std::string>& names, const std::string& tier)
      : host(std::move(residency), units), uses(ids_of(units), blocks, name_map(units, names), tier, host) {}
  static std::unordered_map<ParamId, std::string> name_map(const std::vector<std::vector<at::Tensor>>& units,
                                                           const std::vector<std::string>& names) {
    std::unordered_map<ParamId, std::string> out;
    std::size_t i = 0;
    for (const auto& u : units) {
      for (const at::Tensor& p : u) out.emplace(id_of(p), i < names.size() ? names[i++] : "?");
    }
    return out;
  }
  ResidencyHost host;
  tiering::ParamUses uses;
};

py::object forward_use(const std::optional<tiering::ForwardUse>& f) {
  if (!f) return py::none();
  return py::make_tuple(f->unit, f->extra_bytes, f->token, f->call);
}

}  // namespace

}  // namespace tierflow::bindings

// Called from python_module.cpp, which declares it where it calls it.
void bind_param_uses(py::module_& m);
void bind_param_uses(py::module_& m) {
  using namespace tierflow;
  using namespace tierflow::bindings;
  using tiering::CallId;
  py::class_<PyParamUses>(m, "ParamUses", "The uses of a model's offloaded parameters (Note [Parameter uses]).")
      .def(py::init<std::shared_ptr<ParamResidency>, const std::vector<std::vector<at::Tensor>>&, std::size_t,
                    const std::vector<std::string>&, const std::string&>(),
           py::arg("residency"), py::arg("units"), py::arg("blocks"), py::arg("names"), py::arg("tier"))
      .def("units", [](const PyParamUses& s) { return s.uses.units(); })
      .def("open", [](const PyParamUses& s, UnitId u) { return s.uses.open(u); })
      .def("forward_open", [](const PyParamUses& s) { return s.uses.forward_open(); })
      .def("in_backward", [](const PyParamUses& s) { return s.uses.in_backward(); })
      .def("begin_forward", [](PyParamUses& s, UnitId u, std::uint64_t extra, CallId call) {
        return s.uses.begin_forward(u, extra, call);
      }, py::arg("unit"), py::arg("extra_bytes"), py::arg("call") = 0, "Returns the use's token.")
      .def("pop_forward", [](PyParamUses& s, std::optional<UnitId> u) {
        return forward_use(u ? s.uses.pop_forward(*u) : s.uses.pop_forward());
      }, py::arg("unit") = py::none(), "(unit, extra_bytes, token, call) of the innermost open use, or None.")
      .def("end_forward", [](PyParamUses& s, UnitId u, std::uint64_t extra) {
        s.uses.end_forward({u, extra, 0, 0});
      })
      .def("end_phase", [](PyParamUses& s) { s.uses.end_phase(); })
      .def("new_call", [](PyParamUses& s, UnitId u, std::uint64_t extra) { return s.uses.new_call(u, extra); })
      .def("drop_call", [](PyParamUses& s, CallId c) { s.uses.drop_call(c); })
      .def("watched", [](PyParamUses& s, CallId c) { s.uses.watched(c); })
      .def("unbegun", [](const PyParamUses& s, UnitId u) { return s.uses.unbegun(u); })
      .def("begin_call", [](PyParamUses& s, CallId c) { return s.uses.begin_call(c); })
      .def("expect_ends", [](PyParamUses& s, CallId c, std::size_t left) { s.uses.expect_ends(c, left); })
      .def("edge_ran", [](PyParamUses& s, CallId c) { s.uses.edge_ran(c); })
      .def("end_call", [](PyParamUses& s, CallId c) { s.uses.end_call(c); })
      .def("recompute_opens", [](const PyParamUses& s, UnitId u) { return s.uses.recompute_opens(u); })
      .def("recompute_begins", [](PyParamUses& s, CallId c, bool t) { s.uses.recompute_begins(c, t); })
      .def("recompute_ends", [](PyParamUses& s, UnitId u) -> py::object {
        const auto r = s.uses.recompute_ends(u);
        return r ? py::object(py::make_tuple(r->first, r->second)) : py::object(py::none());
      })
      .def("begin_backward", [](PyParamUses& s, bool grad) { return s.uses.begin_backward(grad); })
      .def("close_backward", [](PyParamUses& s) { s.uses.close_backward(); })
      .def("model_begins", [](PyParamUses& s) { s.uses.model_begins(); })
      .def("model_ends", [](PyParamUses& s, bool graph) { s.uses.model_ends(graph); })
      .def("read", [](PyParamUses& s, const at::Tensor& p) {
        const bool in_autograd = torch::autograd::get_current_graph_task_id() != -1;
        return s.uses.read(id_of(p), in_autograd) != tiering::ReadVerdict::kNothing;
      }, "A read of a parameter in a forward or backward: whether it was attached to a block or held.")
      .def("release_held", [](PyParamUses& s, bool backward_ended) { s.uses.release_held(backward_ended); },
           py::arg("backward_ended") = false)
      .def("held", [](const PyParamUses& s, const at::Tensor& p) { return s.uses.held(id_of(p)); })
      .def("forget", [](PyParamUses& s, const std::vector<at::Tensor>& params) {
        std::vector<ParamId> ids;
        for (const at::Tensor& p : params) ids.push_back(id_of(p));
        s.uses.forget(ids);
      });
}
