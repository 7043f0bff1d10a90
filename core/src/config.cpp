// Reading the configuration: the environment and keywords parsed with the table's rows (config_rows.cpp), and
// the typed Config back to text. See Note [One configuration table].
#include "tierflow/core/config.hpp"

#include <algorithm>
#include <iterator>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

#include "tierflow/core/error.hpp"
#include "config_rows.hpp"

extern char** environ;

namespace tierflow {
namespace {

// Length of the valid UTF-8 sequence at the start of `s` (no overlong forms, surrogates or code
// points past U+10FFFF), or 0 when it is not one.
std::size_t utf8_sequence(std::string_view s) {
  const auto b = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
  if (n == 0 || s.size() < n) return 0;
  for (std::size_t i = 1; i < n; ++i)
    if ((b(i) & 0xC0) != 0x80) return 0;
  if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
  if (c == 0xED && b(1) >= 0xA0) return 0;  // UTF-16 surrogate
  if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
  if (c == 0xF4 && b(1) >= 0x90) return 0;  // past U+10FFFF
  return n;
}

bool printable_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s.substr(i));
    if (n == 0 || s[i] == '\0') return false;
    i += n;
  }
  return true;
}

}  // namespace

std::string quote_config_value(std::string_view value) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < value.size();) {
    const auto c = static_cast<unsigned char>(value[i]);
    const std::size_t n = utf8_sequence(value.substr(i));
    const auto c1 = n > 1 ? static_cast<unsigned char>(value[i + 1]) : 0;
    const auto c2 = n > 2 ? static_cast<unsigned char>(value[i + 2]) : 0;
    // C1 controls (U+0080..U+009F: NEL breaks lines) and the line and paragraph separators.
    if ((n == 2 && c == 0xC2 && c1 < 0xA0) || (n == 3 && c == 0xE2 && c1 == 0x80 && (c2 == 0xA8 || c2 == 0xA9))) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", n == 2 ? c1 : 0x2000 + (c2 == 0xA8 ? 0x28 : 0x29));
      out += buf;
      i += n;
      continue;
    }
    if (n > 1 || (n == 1 && c >= 0x20 && c != 0x7F && c != '\'' && c != '\\')) {
      out.append(value.substr(i, n));
      i += n;
      continue;
    }
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c == '\'' || c == '\\') (out += '\\') += static_cast<char>(c);
    else ((out += "\\x") += kHex[c >> 4]) += kHex[c & 15];
    ++i;
  }
  return out + "'";
}

namespace {

using config_detail::bad_value;
using config_detail::find_row;
using config_detail::keyword_of;
using config_detail::kPrefix;
using config_detail::lower;
using config_detail::Row;
using config_detail::rows;


std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Maps a keyword ("host_memory") or a full name to the full variable name.
std::string full_name(std::string_view key) {
  std::string upper(key);
  for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper.rfind(kPrefix, 0) == 0) return upper;
  return std::string(kPrefix) + upper;
}

std::string format_double(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}


}  // namespace

std::string_view to_string(OffloadTarget t) noexcept {
  switch (t) {
    case OffloadTarget::kNone: return "none";
    case OffloadTarget::kHost: return "host";
    case OffloadTarget::kNvme: return "nvme";
    case OffloadTarget::kAuto: return "auto";
    case OffloadTarget::kRecompute: return "recompute";
  }
  return "?";
}

std::string_view to_string(DeviceChoice d) noexcept {
  switch (d) {
    case DeviceChoice::kAuto: return "auto";
    case DeviceChoice::kCuda: return "cuda";
    case DeviceChoice::kEmulated: return "emulated";
  }
  return "?";
}

std::string_view to_string(EmulationMode m) noexcept {
  return m == EmulationMode::kAdversarial ? "adversarial" : "polite";
}

std::string_view to_string(LogLevel l) noexcept {
  switch (l) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

std::optional<LogLevel> parse_log_level(std::string_view text) {
  const std::string s = config_detail::lower(config_detail::trim(text));
  if (s == "warning") return LogLevel::kWarn;
  for (LogLevel l : {LogLevel::kError, LogLevel::kWarn, LogLevel::kInfo, LogLevel::kDebug}) {
    if (s == to_string(l)) return l;
  }
  return std::nullopt;
}

const std::vector<ConfigEntry>& config_table() {
  static const std::vector<ConfigEntry> kTable = [] {
    std::vector<ConfigEntry> t;
    for (const auto& r : rows()) t.push_back(r.entry);
    return t;
  }();
  return kTable;
}

std::string closest_config_name(std::string_view name) {
  std::string best;
  std::size_t best_d = ~std::size_t{0};
  for (const auto& r : rows()) {
    std::size_t d = edit_distance(name, r.entry.name);
    if (d < best_d) {
      best_d = d;
      best = std::string(r.entry.name);
    }
  }
  return best;
}

std::string collection_value_refusal(std::string_view key, bool sequence, std::string_view type_name,
                                     std::string_view value_repr) {
  std::string name(key);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (name.rfind("TIERFLOW_", 0) != 0) name = "TIERFLOW_" + name;
  const auto& table = config_table();
  const auto row = std::find_if(table.begin(), table.end(), [&](const ConfigEntry& e) { return e.name == name; });
  if (row == table.end()) return "";
  if (sequence && row->accepted.find("list") != std::string_view::npos) return "";
  return std::string(key) + "=" + std::string(value_repr) + " (" + name + ") is a " + std::string(type_name) +
         ", where one value is expected; accepted: " + std::string(row->accepted);
}

Config Config::defaults() { return parse({}, {}); }

namespace {

// Parses one value into `c`; errors name `label` (the variable, or a command-line flag standing for it).
void apply_row(Config& c, const Row& row, std::string_view label, std::string_view value) {
  // The environment holds bytes; every value is text, and a message quoting it must stay valid UTF-8.
  if (!printable_utf8(value)) bad_value(label, value, row.entry.accepted, "not UTF-8 text");
  row.apply(c, label, value);
}

}  // namespace

Config Config::parse(const std::map<std::string, std::string>& variables,
                     const std::map<std::string, std::string>& overrides) {
  Config c;
  for (const auto& r : rows()) r.apply(c, r.entry.name, r.entry.default_value);
  for (const auto& [name, value] : variables) {
    if (name.rfind(kPrefix, 0) != 0) continue;
    const Row* row = find_row(name);
    if (!row) {
      throw config_error("unknown environment variable " + quote_config_value(name) + "; did you mean " +
                         closest_config_name(name) +
                         "? (tierflow.config_table() lists every accepted variable)");
    }
    apply_row(c, *row, row->entry.name, value);
    c.given.emplace(row->entry.name);
  }
  for (const auto& [key, value] : overrides) {
    std::string name = full_name(key);
    const Row* row = find_row(name);
    if (!row) {
      throw config_error("unknown tierflow setting " + quote_config_value(key) + "; did you mean '" +
                         keyword_of(closest_config_name(name)) +
                         "'? (tierflow.config_table() lists every accepted setting)");
    }
    apply_row(c, *row, row->entry.name, value);
    c.given.emplace(row->entry.name);
  }
  return c;
}

std::string parse_setting(std::string_view name, std::string_view value, std::string_view label) {
  const std::string full = full_name(name);
  const Row* row = find_row(full);
  if (!row) throw config_error("unknown tierflow setting " + quote_config_value(name));
  Config c = Config::defaults();
  apply_row(c, *row, label.empty() ? std::string_view(row->entry.name) : label, value);
  return c.to_strings().at(full);
}

Config Config::from_environment(const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    std::string_view k = kv.substr(0, eq);
    if (k.rfind(kPrefix, 0) == 0) vars.emplace(std::string(k), std::string(kv.substr(eq + 1)));
  }
  return parse(vars, overrides);
}

std::map<std::string, std::string> Config::to_strings() const {
  std::string paths;
  for (std::size_t i = 0; i < nvme_paths.size(); ++i) paths += (i ? "," : "") + nvme_paths[i];
  return {
      {"TIERFLOW_GPU_MEMORY", gpu_memory.to_string()},
      {"TIERFLOW_HOST_MEMORY", host_memory.to_string()},
      {"TIERFLOW_NVME_PATHS", paths},
      {"TIERFLOW_NVME_MEMORY",
       !nvme_memory.is_fraction && nvme_memory.bytes == kNvmeAutoBytes ? "auto" : nvme_memory.to_string()},
      {"TIERFLOW_AIO_BLOCK_SIZE", std::to_string(aio_block_size)},
      {"TIERFLOW_AIO_QUEUE_DEPTH", std::to_string(aio_queue_depth)},
      {"TIERFLOW_NVME_CHECKSUM", nvme_checksum ? "on" : "off"},
      {"TIERFLOW_OFFLOAD_ACTIVATIONS", std::string(to_string(offload_activations))},
      {"TIERFLOW_OFFLOAD_PARAMS", std::string(to_string(offload_params))},
      {"TIERFLOW_OFFLOAD_OPTIMIZER", std::string(to_string(offload_optimizer))},
      {"TIERFLOW_OPTIMIZER_STATES", to_string(optimizer_states)},
      {"TIERFLOW_CPU_THREADS", cpu_threads == 0 ? "auto" : std::to_string(cpu_threads)},
      {"TIERFLOW_CPU_ISA", cpu_isa},
      {"TIERFLOW_LOG_LEVEL", std::string(to_string(log_level))},
      {"TIERFLOW_STALL_TIMEOUT", stall_timeout_seconds > 0 ? format_double(stall_timeout_seconds) + "s" : "none"},
      {"TIERFLOW_REPORT", report_path},
      {"TIERFLOW_TRACE", trace_path},
      {"TIERFLOW_PROFILE", profile_path},
      {"TIERFLOW_REPLAN", replan ? "on" : "off"},
      {"TIERFLOW_MIN_OFFLOAD_BYTES", std::to_string(min_offload_bytes)},
      {"TIERFLOW_PREFETCH_BYTES", std::to_string(prefetch_bytes)},
      {"TIERFLOW_PINNED_SLAB_BYTES", std::to_string(pinned_slab_bytes)},
      {"TIERFLOW_OVERLAP_STEP", overlap_step ? "on" : "off"},
      {"TIERFLOW_PARTITION_OPTIMIZER", partition_optimizer ? "on" : "off"},
      {"TIERFLOW_GRAD_ACCUMULATION_STEPS", std::to_string(grad_accumulation_steps)},
      {"TIERFLOW_MAX_GRAD_NORM", max_grad_norm > 0 ? format_double(max_grad_norm) : "none"},
      {"TIERFLOW_SKIP_NONFINITE", skip_nonfinite ? "on" : "off"},
      {"TIERFLOW_GPU_OPTIMIZER_FRACTION",
       gpu_optimizer_fraction_auto ? "auto" : format_double(gpu_optimizer_fraction)},
      {"TIERFLOW_GRAD_BUCKET_BYTES", grad_bucket_bytes == 0 ? "auto" : std::to_string(grad_bucket_bytes)},
      {"TIERFLOW_WEIGHTS_RETURN", weights_return_in_forward ? "forward" : "step"},
      {"TIERFLOW_OFFLOAD_GRADIENTS", offload_gradients ? "on" : "off"},
      {"TIERFLOW_MIMALLOC", mimalloc ? "on" : "off"},
      {"TIERFLOW_DEVICE", std::string(to_string(device))},
      {"TIERFLOW_EMULATED_DEVICE", std::string(to_string(emulated_device))},
      {"TIERFLOW_EMULATED_SEED", std::to_string(emulated_seed)},
  };
}
}  // namespace tierflow
