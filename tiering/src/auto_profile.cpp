// A profile as auto writes and reads it (Note [Profile file]): the file's blocks, links and fixed bytes, and the
// timed step's figures beside them, to JSON and back (tiering::AutoProfile).
#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace tierflow::tiering {

namespace {
using Json = nlohmann::ordered_json;  // keeps the order of batch_tensor_elements (call order)

template <class T>
void read_optional(const Json& data, const char* key, std::optional<T>& field) {
  const auto it = data.find(key);
  if (it != data.end() && it->is_number()) field = it->get<T>();
}
}  // namespace

std::string auto_profile_json(const AutoProfile& p) {
  const Json file = Json::parse(profile_to_json(p.file.blocks, p.file.links, p.file.fixed_device_bytes));
  Json out = {{"format", file["format"]}, {"version", file["version"]}, {"blocks", file["blocks"]},
              {"links", file["links"]}};
  if (p.batch_tensor_elements) {
    Json sizes = Json::object();
    for (const auto& [place, n] : *p.batch_tensor_elements) sizes[place] = n;
    out["batch_tensor_elements"] = std::move(sizes);
  }
  out["batch_elements"] = p.batch_elements;
  if (p.outside_measured) {
    out["outside_saved_bytes"] = p.file.outside_saved_bytes;
    out["outside_largest_bytes"] = p.file.outside_largest_bytes;  // 0: not measured
  }
  const std::pair<const char*, const std::optional<double>*> seconds[] = {
      {"host_gaps_seconds", &p.host_gaps_seconds}, {"timed_step_seconds", &p.timed_step_seconds},
      {"rest_of_step_seconds", &p.rest_of_step_seconds}};
  for (const auto& [k, v] : seconds)
    if (*v) out[k] = **v;
  const std::pair<const char*, const std::optional<std::uint64_t>*> bytes[] = {
      {"measured_beside_bytes", &p.measured_beside_bytes}, {"measured_peak_bytes", &p.measured_peak_bytes},
      {"measured_reserved_peak_bytes", &p.measured_reserved_peak_bytes}};
  for (const auto& [k, v] : bytes)
    if (*v) out[k] = **v;
  out["fixed_device_bytes"] = p.file.fixed_device_bytes;
  if (p.calibrated) {
    out["calibrated"] = {{"link_factor", p.calibrated->link_factor},
                         {"compute_factor", p.calibrated->compute_factor}, {"why", p.calibrated->why}};
  }
  return out.dump();
}

AutoProfile auto_profile_from_json(std::string_view text) {
  AutoProfile p;
  p.file = profile_from_json(text);  // checked: blocks, links, fixed and outside bytes, batch sizes
  const Json data = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded()) throw config_error("a profile that is not JSON: " + std::string(text.substr(0, 40)));
  // A block without backward_seconds gets the planner's estimate from its forward (Note [Auto plan phases]).
  const Json& blocks = data["blocks"];
  for (std::size_t i = 0; i < p.file.blocks.size(); ++i) {
    if (blocks[i].contains("backward_seconds")) continue;
    BlockRecord forward_only;
    forward_only.forward_seconds = p.file.blocks[i].forward_seconds;
    p.file.blocks[i].backward_seconds = measured_block_profile(forward_only).backward_seconds;
  }
  // Links without duplex: both directions at their sum.
  if (!data.contains("links") || !data["links"].contains("duplex")) p.file.links.duplex = p.file.links.d2h + p.file.links.h2d;
  if (data.contains("batch_tensor_elements")) {
    InputElements sizes;
    for (const auto& [place, n] : data["batch_tensor_elements"].items()) sizes.emplace_back(place, n.get<std::uint64_t>());
    p.batch_tensor_elements = std::move(sizes);
  }
  if (data.contains("batch_elements") && data["batch_elements"].is_number())
    p.batch_elements = data["batch_elements"].get<std::uint64_t>();
  if (data.contains("batch_ratio") && data["batch_ratio"].is_number() && data["batch_ratio"].get<double>() != 0)
    p.batch_ratio = data["batch_ratio"].get<double>();
  // A file from before the tensors outside the blocks were measured has no outside_saved_bytes: not counted.
  p.outside_measured = data.contains("outside_saved_bytes");
  if (!p.outside_measured) p.file.outside_saved_bytes = p.file.outside_largest_bytes = 0;
  read_optional(data, "host_gaps_seconds", p.host_gaps_seconds);
  read_optional(data, "timed_step_seconds", p.timed_step_seconds);
  read_optional(data, "rest_of_step_seconds", p.rest_of_step_seconds);
  read_optional(data, "measured_beside_bytes", p.measured_beside_bytes);
  read_optional(data, "measured_peak_bytes", p.measured_peak_bytes);
  read_optional(data, "measured_reserved_peak_bytes", p.measured_reserved_peak_bytes);
  if (data.contains("calibrated") && data["calibrated"].is_object()) {
    const Json& c = data["calibrated"];
    ProfileCalibration cal;
    cal.link_factor = c.value("link_factor", 1.0);
    cal.compute_factor = c.value("compute_factor", 1.0);
    cal.why = c.value("why", std::string());
    p.calibrated = std::move(cal);
  }
  return p;
}

}  // namespace tierflow::tiering
