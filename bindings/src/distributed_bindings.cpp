// tierflow._C.distributed: the torch-free rules for torch.distributed runs (Note [Rank decisions under DDP] in
// optimizer/distributed_ranks.hpp, Note [Sharded models] in tiering/distributed_sharding.hpp), for _distributed.py,
// _ddp_feed.py and optim/partition.py. A refusal or warning comes back as its text, or None.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tierflow/core/config.hpp"
#include "tierflow/optimizer/distributed_ranks.hpp"
#include "tierflow/tiering/distributed_sharding.hpp"

namespace py = pybind11;
using namespace tierflow;
using namespace tierflow::optimizer;
using namespace tierflow::tiering;

namespace {
py::object text_or_none(const std::string& s) { return s.empty() ? py::object(py::none()) : py::object(py::cast(s)); }
template <class... A>
auto refusal(std::string (*f)(A...)) {
  return [f](A... a) { return text_or_none(f(a...)); };
}
}  // namespace

void bind_distributed(py::module_& parent) {
  auto m = parent.def_submodule("distributed", "Rules for torch.distributed runs (partition, DDP, FSDP2), torch-free");
  py::class_<RankPartition>(m, "RankPartition", "This rank's share of a partitioned CPU optimizer.")
      .def_readonly("rank", &RankPartition::rank).def_readonly("world_size", &RankPartition::world_size)
      .def_readonly("owners", &RankPartition::owners).def_readonly("broadcasts", &RankPartition::broadcasts)
      .def_readonly("elements", &RankPartition::elements).def_readonly("owned_elements", &RankPartition::owned_elements)
      .def_readonly("owned_parameters", &RankPartition::owned_parameters)
      .def_readonly("broadcast_bytes", &RankPartition::broadcast_bytes)
      .def("owns", &RankPartition::owns)
      .def_property_readonly("layout", [](const RankPartition& p) { return py::make_tuple(p.rank, p.world_size, p.owners); });
  m.def("partition_ranks", [](const std::vector<std::tuple<std::uint64_t, std::uint64_t, bool>>& params, int rank,
                              int world_size) {
    std::vector<RankParameter> ps;
    for (const auto& [elements, bytes, reduced] : params) ps.push_back({elements, bytes, reduced});
    return partition_ranks(ps, rank, world_size);
  }, py::arg("params"), py::arg("rank"), py::arg("world_size"), "[(numel, element bytes, reduced by DDP)] -> share.");
  m.def("loaded_share_refusal", [](const RankPartition& mine, const std::optional<std::tuple<int, int, std::vector<int>>>& saved,
                                   const std::vector<bool>& has_state) {
    std::optional<PartitionLayout> layout;
    if (saved) layout = PartitionLayout{std::get<0>(*saved), std::get<1>(*saved), std::get<2>(*saved)};
    return text_or_none(loaded_share_refusal(mine, layout, has_state));
  }, py::arg("mine"), py::arg("saved"), py::arg("has_state"));
  m.def("partitioned_join_refusal", refusal(&partitioned_join_refusal));
  m.def("ddp_bucket_scaling", [](bool as_view, int world) {
    const BucketScaling s = ddp_bucket_scaling(as_view, world);
    return py::make_tuple(s.divide, s.factor);
  }, "(divide in place?, divisor or multiplier)");
  m.def("ddp_join_divisor_refusal", refusal(&ddp_join_divisor_refusal));
  m.def("ddp_feed_refusal", refusal(&ddp_feed_refusal));
  m.def("ddp_offload_gradients_refusal", refusal(&ddp_offload_gradients_refusal));
  m.def("ddp_steps_after_backward_warning", &ddp_steps_after_backward_warning);
  m.def("redone_steps_warning", refusal(&redone_steps_warning));
  m.def("ddp_builtin_hook_refusal", &ddp_builtin_hook_refusal);
  m.def("ddp_second_hook_refusal", &ddp_second_hook_refusal);
  m.def("sharded_wrap_refusal", [](const Config& c, const std::vector<std::string>& modules,
                                   const std::vector<std::string>& params, bool replacing, bool offload_policy,
                                   std::size_t dtensors, std::size_t held, const std::vector<std::int64_t>& shape) {
    return text_or_none(sharded_wrap_refusal(c, {modules, params}, replacing, offload_policy, {dtensors, held, shape}));
  });
  m.def("sharded_later_refusal", [](const Config& c, const std::vector<std::string>& modules,
                                    const std::vector<std::string>& params, bool cpu_optimizer) {
    return text_or_none(sharded_later_refusal(c, {modules, params}, cpu_optimizer));
  });
  m.def("fsdp_unit_parameters", &fsdp_unit_parameters);
  m.def("rank_shard_bytes", [](const std::vector<std::tuple<bool, bool, std::int64_t, std::uint64_t, std::uint64_t>>& params,
                               int rank, int world) {
    std::vector<ParameterShard> ps;
    for (const auto& [dtensor, gathered, rows, elements, bytes] : params) ps.push_back({dtensor, gathered, rows, elements, bytes});
    return rank_shard_bytes(ps, rank, world);
  }, "[(DTensor?, gathered?, rows or -1, numel, element bytes)] -> this rank's bytes");
}
