// See runtime_stats.hpp.
#include "tierflow/tiering/runtime_stats.hpp"

#include <nlohmann/json.hpp>

namespace tierflow::tiering {
namespace {

using Json = nlohmann::ordered_json;  // the fields in their tables' order

Json stat_json(const StatValues& v) {
  return Json{{"current", v.current}, {"peak", v.peak}, {"allocated", v.allocated}, {"freed", v.freed}};
}

// The fields of `s` its table names: a count as it is, a scaled or measured value as a double.
template <class T>
Json stat_json(const T& s, const std::vector<StatField<T>>& fields) {
  Json out = Json::object();
  for (const auto& f : fields) {
    if (f.count && f.scale == 0.0)
      out[f.name] = s.*(f.count);
    else
      out[f.name] = f.of(s);
  }
  return out;
}

}  // namespace

const std::vector<StatField<CpuOptimizerStats>>& cpu_optimizer_stat_fields() {
  static const std::vector<StatField<CpuOptimizerStats>> fields = {
      {"steps", &CpuOptimizerStats::steps},
      {"elements", &CpuOptimizerStats::elements},
      {"step_ms", &CpuOptimizerStats::step_ns, nullptr, 1e-6},
  };
  return fields;
}

std::string runtime_stats_json(const RuntimeStatsParts& p) {
  Json acts = stat_json(p.activations, saved_tensor_stat_fields());
  acts["nvme"] = stat_json(p.activations, saved_tensor_nvme_stat_fields());
  acts["device_bytes"] = stat_json(p.activations.device_bytes);
  acts["host_bytes"] = stat_json(p.activations.host_bytes);
  acts["nvme_bytes"] = stat_json(p.activations.nvme_bytes);
  Json host = stat_json(p.host_pool, allocator::pinned_pool_stat_fields());
  host["budget_bytes"] = p.host_budget_bytes;
  host["pinned"] = p.host_pinned;
  host["in_use"] = stat_json(p.host_pool.in_use);
  host["reserved"] = stat_json(p.host_pool.reserved);
  Json opt = stat_json(p.optimizer, cpu_optimizer_stat_fields());
  opt["threads"] = p.cpu_threads;
  opt["isa"] = p.cpu_isa;
  Json emu = stat_json(p.emulated, swap::emulated_copy_stat_fields());
  emu["mode"] = p.emulated_mode;
  emu["poisoned_device_memory"] = p.poisoned_device_memory;
  emu["device_late_writes"] = p.device_late_writes;
  Json out = Json::object();
  out["device"] = p.device;
  out["emulated"] = std::move(emu);
  out["activations"] = std::move(acts);
  out["prefetch"] = stat_json(p.activations, saved_tensor_prefetch_stat_fields());
  out["host_pool"] = std::move(host);
  out["links"] = stat_json(p.links, swap::copy_engine_stat_fields());
  out["optimizer"] = std::move(opt);
  return out.dump();
}

}  // namespace tierflow::tiering
