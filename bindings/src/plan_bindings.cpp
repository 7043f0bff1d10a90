// tierflow._C's view of the activation planner (tiering/planner.hpp): plain
// dicts and lists in, a dict out, so that profiles read from JSON
// (TIERFLOW_PROFILE, `python -m tierflow plan --profile`) pass straight through.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/saved_actions.hpp"

namespace py = pybind11;

namespace tierflow::bindings {
namespace {

template <typename T>
T field(const py::dict& d, const char* name, T fallback) {
  return d.contains(name) ? d[name].cast<T>() : fallback;
}

tiering::BlockProfile to_profile(const py::dict& d) {
  tiering::BlockProfile p;
  p.forward_seconds = field(d, "forward_seconds", 0.0);
  p.backward_seconds = field(d, "backward_seconds", 2.0 * p.forward_seconds);
  p.input_bytes = field<std::uint64_t>(d, "input_bytes", 0);
  p.whole_bytes = field<std::uint64_t>(d, "whole_bytes", 0);
  p.split_bytes = field<std::uint64_t>(d, "split_bytes", 0);
  p.split_recompute_seconds = field(d, "split_recompute_seconds", 0.0);
  p.cheap_bytes = field<std::uint64_t>(d, "cheap_bytes", 0);
  p.cheap_recompute_seconds = field(d, "cheap_recompute_seconds", 0.0);
  p.splittable = field(d, "splittable", true);
  p.transient_bytes = field<std::uint64_t>(d, "transient_bytes", 0);
  return p;
}

std::vector<tiering::BlockProfile> to_profiles(const py::list& blocks) {
  std::vector<tiering::BlockProfile> out;
  for (const auto& b : blocks) out.push_back(to_profile(b.cast<py::dict>()));
  return out;
}

tiering::Links to_links(const py::dict& d) {
  tiering::Links l;
  l.d2h = field(d, "d2h", 0.0);
  l.h2d = field(d, "h2d", 0.0);
  l.duplex = field(d, "duplex", l.d2h + l.h2d);
  l.nvme_write = field(d, "nvme_write", 0.0);
  l.nvme_read = field(d, "nvme_read", 0.0);
  return l;
}

tiering::Budgets to_budgets(const py::dict& d) {
  tiering::Budgets b;
  b.device_bytes = field<std::uint64_t>(d, "device_bytes", 0);
  b.fixed_device_bytes = field<std::uint64_t>(d, "fixed_device_bytes", 0);
  b.host_bytes = field<std::uint64_t>(d, "host_bytes", 0);
  b.nvme_bytes = field<std::uint64_t>(d, "nvme_bytes", 0);
  b.prefetch_bytes = field<std::uint64_t>(d, "prefetch_bytes", 0);
  return b;
}

py::dict to_dict(const tiering::Plan& plan) {
  py::list blocks, lines;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    py::dict d;
    d["mode"] = std::string(tiering::to_string(b.mode));
    d["alpha"] = b.alpha;
    d["tier"] = std::string(tiering::to_string(b.tier));
    d["keep"] = b.keep;
    d["swap"] = b.swap;
    d["recompute"] = b.recompute;
    d["swap_bytes"] = b.swap_bytes;
    d["forward_seconds"] = b.forward_seconds;
    d["backward_seconds"] = b.backward_seconds;
    blocks.append(d);
    lines.append(plan.block_line(i));
  }
  py::dict out;
  out["blocks"] = blocks;
  out["lines"] = lines;
  out["summary"] = plan.summary();
  out["predicted_device_peak_bytes"] = plan.predicted_device_peak_bytes;
  out["predicted_step_seconds"] = plan.predicted_step_seconds;
  out["keep_all_step_seconds"] = plan.keep_all_step_seconds;
  out["host_bytes"] = plan.host_bytes;
  out["nvme_bytes"] = plan.nvme_bytes;
  out["fits"] = plan.fits;
  return out;
}

tiering::SavedClass to_class(const std::string& s) {
  for (auto c : {tiering::SavedClass::kExternal, tiering::SavedClass::kInput, tiering::SavedClass::kAttention,
                 tiering::SavedClass::kSplit, tiering::SavedClass::kCheap})
    if (tiering::to_string(c) == s) return c;
  throw config_error("saved-tensor class '" + s + "'; accepted: external, input, attention, split, cheap");
}

tiering::BlockMode to_mode(const std::string& s) {
  if (s == "keep") return tiering::BlockMode::kKeep;
  if (s == "swap") return tiering::BlockMode::kSwap;
  if (s == "split") return tiering::BlockMode::kSplit;
  if (s == "recompute") return tiering::BlockMode::kRecompute;
  throw config_error("block mode '" + s + "'; accepted: keep, swap, split, recompute");
}

}  // namespace

void bind_activation_planner(py::module_& m) {
  m.def("plan_activations_json", [](const py::list& blocks, const py::dict& links, const py::dict& budgets) {
    return to_dict(tiering::plan_activations(to_profiles(blocks), to_links(links), to_budgets(budgets)));
  }, py::arg("blocks"), py::arg("links"), py::arg("budgets"),
     "The activation plan (Note [Activation planner]) for block profiles, links and budgets given as dicts.");
  m.def("forced_plan_json", [](const py::list& blocks, const py::dict& links, const py::dict& budgets,
                          const std::string& mode) {
    return to_dict(tiering::forced_plan(to_profiles(blocks), to_links(links), to_budgets(budgets), to_mode(mode)));
  }, py::arg("blocks"), py::arg("links"), py::arg("budgets"), py::arg("mode"),
     "Every block in one mode (keep, swap, split, recompute), with the planner's predictions.");
  m.def("saved_actions", [](const std::string& mode, const std::vector<std::string>& classes,
                            const std::vector<bool>& exact) {
    if (classes.size() != exact.size()) throw config_error("saved_actions: one exact flag per class");
    std::vector<std::string> out;
    const auto md = to_mode(mode);
    for (std::size_t i = 0; i < classes.size(); ++i)
      out.emplace_back(tiering::to_string(tiering::saved_action(md, to_class(classes[i]), exact[i])));
    return out;
  }, "tiering::saved_action for each saved tensor of a block (Note [Activation plans]).");
  m.def("split_rows", &tiering::split_rows, py::arg("alpha"), py::arg("rows"), py::arg("granule"),
        "Rows of a split matmul output swapped for alpha (tiering::split_rows).");
}

}  // namespace tierflow::bindings
