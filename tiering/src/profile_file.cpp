// The profile file (Note [Profile file]): its text, and what a file read back is checked for.
#include "tierflow/tiering/profile_file.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

namespace tierflow::tiering {
namespace {

using Json = nlohmann::ordered_json;  // keeps the file's order: the first bad field is the one named
constexpr std::uint8_t kBigInteger = 1;  // a binary node: an integer past 64 bits, its digits as written
constexpr int kMostDepth = 900;          // Python's json gives up near its recursion limit, 1000

[[noreturn]] void fail(const std::string& what) { throw config_error("profile: " + what); }

bool is_number_text(std::string_view t) {  // JSON's number grammar
  std::size_t i = 0;
  auto digits = [&] { const auto s = i; while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i; return i - s; };
  if (i < t.size() && t[i] == '-') ++i;
  if (i >= t.size()) return false;
  if (t[i] == '0') ++i; else if (digits() == 0) return false;
  if (i < t.size() && t[i] == '.') { ++i; if (digits() == 0) return false; }
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    if (digits() == 0) return false;
  }
  return i == t.size();
}

// Every number outside strings (and Python's NaN, Infinity, -Infinity) becomes 0 for nlohmann, which
// refuses those words and numbers past a double; its text is kept, in order, for the parse callback.
std::string numbers_apart(std::string_view text, std::deque<std::string>& numbers) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      const auto start = i++;
      while (i < text.size() && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
      i = std::min(i + 1, text.size());
      out.append(text.substr(start, i - start));
      continue;
    }
    auto word_end = i;
    while (word_end < text.size() && (std::isalnum(static_cast<unsigned char>(text[word_end])) ||
                                      std::string_view("+-.").find(text[word_end]) != std::string_view::npos)) {
      ++word_end;
    }
    const auto word = text.substr(i, word_end - i);
    if (word_end > i && (word == "NaN" || word == "Infinity" || word == "-Infinity" || is_number_text(word))) {
      numbers.emplace_back(word);
      out += '0';
      i = word_end;
    } else if (word_end > i) {
      out.append(word);
      i = word_end;
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

Json number_of(const std::string& t) {
  if (t == "NaN") return std::numeric_limits<double>::quiet_NaN();
  if (t == "Infinity") return std::numeric_limits<double>::infinity();
  if (t == "-Infinity") return -std::numeric_limits<double>::infinity();
  if (t.find_first_of(".eE") == std::string::npos) {
    const char* end = t.data() + t.size();
    if (t[0] == '-') {
      std::int64_t v = 0;
      if (std::from_chars(t.data(), end, v).ec == std::errc{}) return v;
    } else {
      std::uint64_t v = 0;
      if (std::from_chars(t.data(), end, v).ec == std::errc{}) return v;
    }
    return Json::binary(std::vector<std::uint8_t>(t.begin(), t.end()), kBigInteger);
  }
  return std::strtod(t.c_str(), nullptr);  // past a double: inf, as Python's float()
}

Json parse(std::string_view text) {
  std::deque<std::string> numbers;
  const std::string plain = numbers_apart(text, numbers);
  try {
    return Json::parse(plain, [&numbers](int depth, Json::parse_event_t event, Json& parsed) {
      if (depth > kMostDepth) throw config_error("profile: not JSON (nested more than 900 deep)");
      if (event == Json::parse_event_t::value && parsed.is_number() && !numbers.empty()) {
        parsed = number_of(numbers.front());
        numbers.pop_front();
      }
      return true;
    });
  } catch (const Json::exception& e) {
    fail(std::string("not JSON (") + e.what() + ")");
  }
}

std::string string_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (const char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '\\' || ch == q) { out += '\\'; out += ch; }
    else if (ch == '\n') out += "\\n";
    else if (ch == '\r') out += "\\r";
    else if (ch == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x"; out += kHex[u >> 4]; out += kHex[u & 15];
    } else out += ch;
  }
  return out + q;
}

// The value as Python's repr shows what json.loads made of it.
std::string repr(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "None";
    case Json::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case Json::value_t::number_integer: return std::to_string(v.get<std::int64_t>());
    case Json::value_t::number_unsigned: return std::to_string(v.get<std::uint64_t>());
    case Json::value_t::number_float: return python_float_repr(v.get<double>());
    case Json::value_t::binary: return std::string(v.get_binary().begin(), v.get_binary().end());
    case Json::value_t::string: return string_repr(v.get<std::string>());
    case Json::value_t::array: {
      std::string out = "[";
      for (const auto& e : v) { out += (out.size() > 1 ? ", " : "") + repr(e); if (out.size() > 80) break; }
      return out + "]";
    }
    default: {
      std::string out = "{";
      for (const auto& [k, e] : v.items()) {
        out += (out.size() > 1 ? ", " : "") + string_repr(k) + ": " + repr(e);
        if (out.size() > 80) break;
      }
      return out + "}";
    }
  }
}

std::string shown(const Json& v) {  // repr cut to 40 characters (code points), as Python cuts it
  const std::string r = repr(v);
  std::size_t points = 0, cut = r.size();
  for (std::size_t i = 0; i < r.size(); ++i) {
    if ((static_cast<unsigned char>(r[i]) & 0xC0) == 0x80) continue;
    if (++points == 38) cut = i;
  }
  return points <= 40 ? r : r.substr(0, cut) + "...";
}

std::string names_list(const std::vector<std::string_view>& names) {  // as Python shows a list of str
  std::string out = "[";
  for (const auto& n : names) out += (out.size() > 1 ? ", '" : "'") + std::string(n) + "'";
  return out + "]";
}

// A number field (Note [Profile file]): seconds and bandwidths, byte counts, or splittable and replayable.
Json checked(const std::string& where, std::string_view name, const Json& v) {
  bool ok = false;
  const char* accepted = nullptr;
  if (name == "splittable" || name == "replayable") {
    ok = v.is_boolean();
    accepted = "true or false";
  } else if ((name.size() >= 6 && name.substr(name.size() - 6) == "_bytes") ||
             name.find("_elements") != std::string_view::npos) {
    ok = v.is_number_unsigned();
    accepted = "an integer from 0 to 2^64 - 1";
  } else {
    double d = -1;
    if (v.is_number()) d = v.get<double>();
    if (v.is_binary() && !v.get_binary().empty() && v.get_binary()[0] != '-') {
      d = std::strtod(std::string(v.get_binary().begin(), v.get_binary().end()).c_str(), nullptr);
    }
    const bool share = name.find("_share_") != std::string_view::npos;  // a measured fraction of a speed
    ok = std::isfinite(d) && (share ? d > 0 && d <= 1 : d >= 0);
    accepted = share ? "a fraction in (0, 1]" : "a finite number >= 0";
    if (ok) return d;
  }
  if (!ok) fail(where + std::string(name) + " " + shown(v) + " is not valid; accepted: " + accepted);
  return v;
}

void set_block_field(BlockProfile& b, std::string_view name, const Json& v) {
  if (name == "splittable") { b.splittable = v.get<bool>(); return; }
  if (name == "replayable") { b.replayable = v.get<bool>(); return; }
  if (name.size() >= 6 && name.substr(name.size() - 6) == "_bytes") {
    const auto n = v.get<std::uint64_t>();
    if (name == "input_bytes") b.input_bytes = n;
    else if (name == "whole_bytes") b.whole_bytes = n;
    else if (name == "split_bytes") b.split_bytes = n;
    else if (name == "cheap_bytes") b.cheap_bytes = n;
    else if (name == "transient_bytes") b.transient_bytes = n;
    else if (name == "upload_bytes") b.upload_bytes = n;
    else if (name == "parameter_bytes") b.parameter_bytes = n;
    else b.download_bytes = n;
    return;
  }
  const auto d = v.get<double>();
  if (name == "forward_seconds") b.forward_seconds = d;
  else if (name == "backward_seconds") b.backward_seconds = d;
  else if (name == "split_recompute_seconds") b.split_recompute_seconds = d;
  else b.cheap_recompute_seconds = d;
}

// The fields of an object (a block or the links) that are not in `known`, sorted.
std::vector<std::string_view> unknown_fields(const Json& object, const std::vector<std::string_view>& known) {
  std::set<std::string_view> unknown;
  for (const auto& [k, v] : object.items()) {
    if (std::find(known.begin(), known.end(), k) == known.end()) unknown.insert(k);
  }
  return {unknown.begin(), unknown.end()};
}

bool is_version_one(const Json& v) {  // Python's 1 == 1.0 == True
  return (v.is_boolean() && v.get<bool>()) || (v.is_number() && v.get<double>() == kProfileVersion);
}

BlockProfile block_of(std::size_t i, const Json& b) {
  const auto& fields = profile_block_fields();
  const std::string where = "block " + std::to_string(i) + " ";
  if (!b.is_object()) fail(where + "is not an object; accepted: an object of " + names_list(fields));
  const auto unknown = unknown_fields(b, fields);
  if (!unknown.empty()) fail(where + "has unknown fields " + names_list(unknown) + "; known: " + names_list(fields));
  BlockProfile out;
  for (const auto& [k, v] : b.items()) set_block_field(out, k, checked(where, k, v));
  return out;
}

Links links_of(const Json& links) {
  const auto& fields = profile_link_fields();
  if (!links.is_object()) fail("links is not an object; accepted: an object of " + names_list(fields));
  const auto unknown = unknown_fields(links, fields);
  if (!unknown.empty()) fail("links has unknown fields " + names_list(unknown) + "; known: " + names_list(fields));
  Links out;
  for (const auto& [k, v] : links.items()) {
    const double d = checked("links ", k, v).get<double>();
    if (k == "d2h") out.d2h = d;
    else if (k == "h2d") out.h2d = d;
    else if (k == "duplex") out.duplex = d;
    else if (k == "nvme_write") out.nvme_write = d;
    else if (k == "nvme_read") out.nvme_read = d;
    else if (k == "compute_share_during_copies") out.compute_share_during_copies = d;
    else out.copy_share_during_cpu_step = d;
  }
  return out;
}

}  // namespace

const std::vector<std::string_view>& profile_block_fields() {
  static const std::vector<std::string_view> fields{
      "forward_seconds", "backward_seconds", "input_bytes", "whole_bytes", "split_bytes",
      "split_recompute_seconds", "cheap_bytes", "cheap_recompute_seconds", "splittable",
      "transient_bytes", "upload_bytes", "download_bytes", "parameter_bytes", "replayable"};
  return fields;
}

const std::vector<std::string_view>& profile_link_fields() {
  static const std::vector<std::string_view> fields{"d2h", "h2d", "duplex", "nvme_write", "nvme_read",
                                                    "compute_share_during_copies", "copy_share_during_cpu_step"};
  return fields;
}

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  const auto sci = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::scientific);
  const std::string s(buf, sci.ptr);
  const int exponent = std::atoi(s.c_str() + s.find('e') + 1);
  if (exponent < -4 || exponent >= 16) return s;  // Python's repr: 1e+30, 1e-05
  const auto fixed = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::fixed);
  std::string out(buf, fixed.ptr);
  return out.find('.') == std::string::npos ? out + ".0" : out;
}

std::string profile_to_json(const std::vector<BlockProfile>& blocks, const Links& links,
                            std::uint64_t fixed_device_bytes) {
  Json out = {{"format", kProfileFormat}, {"version", kProfileVersion}, {"blocks", Json::array()}};
  for (const auto& b : blocks) {
    out["blocks"].push_back(Json{
        {"forward_seconds", b.forward_seconds}, {"backward_seconds", b.backward_seconds},
        {"input_bytes", b.input_bytes}, {"whole_bytes", b.whole_bytes}, {"split_bytes", b.split_bytes},
        {"split_recompute_seconds", b.split_recompute_seconds}, {"cheap_bytes", b.cheap_bytes},
        {"cheap_recompute_seconds", b.cheap_recompute_seconds}, {"splittable", b.splittable},
        {"transient_bytes", b.transient_bytes}, {"upload_bytes", b.upload_bytes},
        {"download_bytes", b.download_bytes}, {"parameter_bytes", b.parameter_bytes},
        {"replayable", b.replayable}});
  }
  out["links"] = Json{{"d2h", links.d2h}, {"h2d", links.h2d}, {"duplex", links.duplex},
                      {"nvme_write", links.nvme_write}, {"nvme_read", links.nvme_read},
                      {"compute_share_during_copies", links.compute_share_during_copies},
                      {"copy_share_during_cpu_step", links.copy_share_during_cpu_step}};
  out["fixed_device_bytes"] = fixed_device_bytes;
  return out.dump(1);
}

ProfileFile profile_from_json(std::string_view text) {
  const Json data = parse(text);
  if (!data.is_object() || !data.contains("blocks") || !data["blocks"].is_array() || data["blocks"].empty()) {
    fail("expected an object with a non-empty \"blocks\" list");
  }
  const bool format_ok = !data.contains("format") || data["format"] == kProfileFormat;
  if (!format_ok || (data.contains("version") && !is_version_one(data["version"]))) {
    fail("format " + (data.contains("format") ? shown(data["format"]) : "None") + " version " +
         (data.contains("version") ? shown(data["version"]) : "None") + " is not '" + std::string(kProfileFormat) +
         "' version " + std::to_string(kProfileVersion));
  }
  const auto& blocks = data["blocks"];
  const auto most = transformer_shape_limits().front().max;  // layers
  if (static_cast<std::int64_t>(blocks.size()) > most) {
    fail(std::to_string(blocks.size()) + " blocks is not valid; accepted: 1 to " + std::to_string(most) + " blocks");
  }
  ProfileFile out;
  for (std::size_t i = 0; i < blocks.size(); ++i) out.blocks.push_back(block_of(i, blocks[i]));
  out.links = links_of(data.contains("links") ? data["links"] : Json::object());
  out.fixed_device_bytes = checked("", "fixed_device_bytes", data.contains("fixed_device_bytes")
                                                                   ? data["fixed_device_bytes"] : Json(std::uint64_t{0}))
                               .get<std::uint64_t>();
  // auto's measurement of the tensors outside the blocks (a file without them: 0, not measured).
  const std::pair<const char*, std::uint64_t*> outside[] = {{"outside_saved_bytes", &out.outside_saved_bytes},
                                                            {"outside_largest_bytes", &out.outside_largest_bytes}};
  for (const auto& [key, field] : outside)
    if (data.contains(key)) *field = checked("", key, data[key]).get<std::uint64_t>();
  // Note [Batch growth]: the size the profile is for, read by the session from the text (checked here).
  for (const char* key : {"batch_elements", "measured_beside_bytes", "measured_peak_bytes",
                          "measured_reserved_peak_bytes"})
    if (data.contains(key)) checked("", key, data[key]);
  if (data.contains("batch_tensor_elements")) {
    const auto& sizes = data["batch_tensor_elements"];
    if (!sizes.is_object())
      fail("batch_tensor_elements " + shown(sizes) +
           " is not valid; accepted: an object of the model's input tensors' places to integers from 0 to 2^64 - 1");
    for (const auto& [place, n] : sizes.items()) checked("", "batch_tensor_elements[" + place + "]", n);
  }
  return out;
}

std::string not_a_profile(std::string_view path, std::string_view why) {
  return "TIERFLOW_PROFILE=" + std::string(path) + ": not a tierflow profile (" + std::string(why) +
         "); delete it to measure again";
}

ProfileFile profile_for_model(std::string_view path, std::string_view text, std::size_t model_blocks) {
  ProfileFile profile;
  try {
    profile = profile_from_json(text);
  } catch (const config_error& e) {
    throw config_error(not_a_profile(path, e.what()));
  }
  if (profile.blocks.size() != model_blocks) {
    throw config_error("TIERFLOW_PROFILE=" + std::string(path) + ": profiles " + std::to_string(profile.blocks.size()) +
                       " blocks, the model has " + std::to_string(model_blocks) + " (delete it to measure again)");
  }
  return profile;
}

}  // namespace tierflow::tiering
