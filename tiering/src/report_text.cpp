// The statistics report's table (report_text.hpp).
#include "tierflow/tiering/report_text.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "tierflow/tiering/detail/plan_report_parts.hpp"
#include "tierflow/tiering/profile_file.hpp"

namespace tierflow::tiering {
namespace {

using detail::format;
using Json = nlohmann::ordered_json;
using Row = std::pair<std::string, std::string>;

// Python's json.dumps writes NaN, Infinity and -Infinity bare; JSON has no such tokens: the strings "nan", "inf"
// and "-inf" in their place (Python's str() of each), which `number` reads back and `truthy` finds true, as Python.
std::string without_nonfinite(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const auto& [token, as] : {std::pair<const char*, const char*>{"NaN", "\"nan\""},
                                    {"-Infinity", "\"-inf\""}, {"Infinity", "\"inf\""}}) {
      const std::size_t n = std::char_traits<char>::length(token);
      if (text.compare(i, n, token) == 0) {
        out += as;
        i += n - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

// Python's truth of a value: null, false, 0, "" and empty containers are false.
bool truthy(const Json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string() || v.is_array() || v.is_object()) return !v.empty();
  return true;
}

// v[key], null when v is not an object or lacks it (Python's dict.get).
const Json& get(const Json& v, const char* key) {
  static const Json none;
  if (!v.is_object()) return none;
  const auto it = v.find(key);
  return it == v.end() ? none : *it;
}

// A value as Python's str() shows it ("{x}" in an f-string).
std::string text(const Json& v) {
  switch (v.type()) {
    case Json::value_t::number_integer: return std::to_string(v.get<std::int64_t>());
    case Json::value_t::number_unsigned: return std::to_string(v.get<std::uint64_t>());
    case Json::value_t::number_float: return python_float_repr(v.get<double>());
    case Json::value_t::string: return v.get<std::string>();
    case Json::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case Json::value_t::null: return "None";
    default: return v.dump();
  }
}

double number(const Json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string() && (v == "inf" || v == "-inf")) return v == "inf" ? HUGE_VAL : -HUGE_VAL;  // without_nonfinite's
  return std::numeric_limits<double>::quiet_NaN();
}
std::string bytes(const Json& v) { return report_bytes(number(v)); }
std::string fixed(const char* fmt, const Json& v) { return format(fmt, number(v)); }

std::vector<Row> tier_rows(const Json& r) {
  const Json &a = r.at("activations"), &p = r.at("prefetch"), &h = r.at("host_pool"), &link = r.at("links"),
             &o = r.at("optimizer");
  std::vector<Row> rows{
      {"GPU tier (" + text(r.at("device")) + ")", ""},
      {"  saved activations held, peak", bytes(a.at("device_bytes").at("peak"))},
      {"  saved activations held, now", bytes(a.at("device_bytes").at("current"))},
      {std::string("host tier (pinned pool") + (truthy(h.at("pinned")) ? "" : ", emulated: not page-locked") + ")",
       ""},
      {"  budget", bytes(h.at("budget_bytes"))},
      {"  in use, peak", bytes(h.at("in_use").at("peak"))},
      {"  reserved in slabs, peak",
       bytes(h.at("reserved").at("peak")) + " (" + text(h.at("slab_allocations")) + " slab allocations)"},
      {"  saved activations held, peak", bytes(a.at("host_bytes").at("peak"))},
      {"links", ""},
      {"  gpu -> host", bytes(link.at("gpu_to_host_bytes")) + " in " + text(link.at("gpu_to_host_ops")) + " copies"},
      {"  host -> gpu", bytes(link.at("host_to_gpu_bytes")) + " in " + text(link.at("host_to_gpu_ops")) + " copies"},
      {"saved tensors", ""},
      {"  saved / read", text(a.at("packs")) + " / " + text(a.at("unpacks"))},
      {"  offloaded", text(a.at("offloaded_blocks")) + " storages, " + bytes(a.at("offloaded_bytes"))},
      {"  forward waited for the copy window",
       text(a.at("offload_waits")) + " times (" + fixed("%.2f", a.at("offload_wait_ms")) + " ms)"},
      {"  not copied: parameters / duplicates", text(a.at("skipped_parameters")) + " / " + text(a.at("dedup_hits"))},
      {"  kept: small / no_offload / pool full",
       text(a.at("kept_small")) + " / " + text(a.at("kept_region")) + " / " + text(a.at("host_fallbacks"))},
      {"prefetch", ""},
      {"  prefetched ahead", text(p.at("prefetched_blocks"))},
      {"  hits / forwarded", text(p.at("hits")) + " / " + text(p.at("forwarded"))},
      {"  stalls", text(p.at("stalls")) + " (" + fixed("%.2f", p.at("stall_ms")) + " ms waiting, " +
                       text(p.at("unprefetched")) + " never prefetched)"},
      {"CPU optimizer", ""},
      {"  steps", text(o.at("steps")) + " (" + fixed("%.1f", o.at("step_ms")) + " ms, " + text(o.at("elements")) +
                      " element updates, " + (truthy(o.at("threads")) ? text(o.at("threads")) : "all") +
                      " threads, " + (o.contains("isa") ? text(o.at("isa")) : "?") + ")"},
  };
  const auto before = [&rows](const std::string& label) {
    return std::find_if(rows.begin(), rows.end(), [&](const Row& row) { return row.first == label; });
  };
  if (truthy(a.at("nvme_bytes").at("peak")))  // Note [Block residences]: blocks whose only copy was on NVMe
    rows.insert(before("links"), {"  saved activations on NVMe only, peak", bytes(a.at("nvme_bytes").at("peak"))});
  const Json& pp = get(r, "params");
  if (truthy(pp)) {
    const auto host_tier = std::find_if(rows.begin(), rows.end(),
                                        [](const Row& row) { return row.first.rfind("host tier", 0) == 0; });
    rows.insert(host_tier, {"  parameters on the device, peak",
                            bytes(pp.at("device_peak_bytes")) + " (between uses: host " + bytes(pp.at("host_bytes")) +
                                ", NVMe " + bytes(pp.at("nvme_bytes")) + "; " + text(pp.at("fetches")) +
                                " fetches, " + text(pp.at("prefetch_hits")) + " prefetched, " +
                                text(pp.at("stalls")) + " stalls)"});
  }
  return rows;
}

void optimizer_rows(const Json& o, std::vector<Row>& rows) {
  const Json& sts = get(o, "states");
  if (truthy(sts) && truthy(sts.at("elements")))
    rows.emplace_back("  states (master, moments)",
                      bytes(sts.at("bytes")) + " on the " + text(sts.at("tier")) + " for " + text(sts.at("elements")) +
                          " elements, " + text(sts.at("format")) + " moments (" +
                          format("%.2f", number(sts.at("bytes")) / number(sts.at("elements"))) + " bytes each)");
  const Json& part = get(o, "partition");
  if (truthy(part))
    rows.emplace_back("  partitioned across ranks",
                      "rank " + text(part.at("rank")) + " of " + text(part.at("world_size")) + ": " +
                          text(part.at("owned_parameters")) + " of " + text(part.at("parameters")) + " parameters, " +
                          text(part.at("owned_elements")) + " of " + text(part.at("elements")) + " elements; " +
                          text(part.at("broadcasts")) + " weight broadcasts (" + bytes(part.at("broadcast_bytes")) +
                          ", " + fixed("%.1f", part.at("broadcast_host_ms")) + " ms on the host)");
  if (truthy(get(o, "steps_during_backward_off")))
    rows.emplace_back("  steps during backward", "off: " + text(o.at("steps_during_backward_off")));
  const Json& ov = get(o, "overlap");
  if (truthy(ov))
    rows.emplace_back("  stepped during backward", text(ov.at("early_steps")) + " (committed " +
                                                       text(ov.at("committed")) + ", redone " + text(ov.at("redone")) +
                                                       ", taken back " + text(ov.at("taken_back")) + ", held " +
                                                       text(ov.at("held")) + ")");
  const Json& st = get(o, "streaming");
  if (!truthy(st)) return;
  rows.emplace_back("  gradient buckets", text(st.at("buckets")) + " of " + bytes(st.at("bucket_bytes")) + " (" +
                                              text(st.at("bucket_count")) + " per backward), " +
                                              bytes(st.at("grad_bytes_to_host")) + " down, " +
                                              bytes(st.at("weight_bytes_to_device")) + " of weights up");
  if (truthy(get(st, "sized_link_bytes_per_s")))
    rows.emplace_back("  bucket size from",
                      format("link %.1f GB/s, CPU AdamW %.1f GB/s of gradients, backward %.1f ms",
                             number(st.at("sized_link_bytes_per_s")) / 1e9,
                             number(st.at("sized_cpu_grad_bytes_per_s")) / 1e9, number(st.at("sized_backward_ms"))));
  if (truthy(get(st, "grads_released")))
    rows.emplace_back("  gradients freed on the device", bytes(st.at("grad_bytes_freed")) + " once on the host (" +
                                                             text(st.at("grads_restored")) + " put back)");
  rows.emplace_back("  CPU step during backward / in step()",
                    format("%.1f ms / %.1f ms (step() waited %.1f ms, weights waited %.1f ms)",
                           number(st.at("kernel_ms")), number(st.at("step_kernel_ms")), number(st.at("step_wait_ms")),
                           number(st.at("weight_wait_ms"))));
}

}  // namespace

std::string report_bytes(double n) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  for (const char* unit : kUnits) {
    if (std::fabs(n) < 1024.0 || unit == kUnits[4]) {
      if (unit == kUnits[0]) return std::to_string(static_cast<long long>(n)) + " B";
      return format("%.2f ", n) + unit;
    }
    n /= 1024.0;
  }
  return format("%.2f TiB", n);
}

std::string report_text(const std::string& report_json) {
  const Json r = Json::parse(without_nonfinite(report_json));
  std::vector<Row> rows = tier_rows(r);
  optimizer_rows(r.at("optimizer"), rows);
  const Json& not_replayed = get(get(r, "plan"), "not_replayed");
  if (truthy(not_replayed)) {  // Note [Replay side effects]: blocks swapped instead of recomputed, and why
    rows.emplace_back("blocks not recomputed (side effects)", "");
    std::vector<std::pair<long long, std::string>> blocks;  // by block index (Python's int keys)
    for (const auto& [key, why] : not_replayed.items()) blocks.emplace_back(std::atoll(key.c_str()), text(why));
    std::sort(blocks.begin(), blocks.end());
    for (const auto& [index, why] : blocks) rows.emplace_back("  block " + std::to_string(index), why);
  }
  std::size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  width += 2;
  std::string out = "tierflow report";
  for (const auto& [label, value] : rows)
    out += "\n" + (value.empty() ? label : label + std::string(width - label.size(), ' ') + value);
  return out;
}

}  // namespace tierflow::tiering
