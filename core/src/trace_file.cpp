// See Note [Trace file] in trace_file.hpp.
#include "tierflow/core/trace_file.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"

namespace tierflow::trace {
namespace {

using Json = nlohmann::ordered_json;  // the files' fields keep their order

constexpr const char* kLanePrefix = "tierflow: ";

// e[key] when `e` is an object holding it, else null.
const Json* field(const Json& e, const char* key) {
  if (!e.is_object()) return nullptr;
  const auto it = e.find(key);
  return it == e.end() ? nullptr : &*it;
}

bool field_is(const Json& e, const char* key, const char* text) {
  const Json* v = field(e, key);
  return v != nullptr && v->is_string() && v->get_ref<const std::string&>() == text;
}

// A JSON number (or a number written as text) as a double; what Python's float() takes.
double number(const Json* v, const char* what) {
  if (v != nullptr && v->is_number()) return v->get<double>();
  if (v != nullptr && v->is_string()) {
    const std::string& s = v->get_ref<const std::string&>();
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (end != s.c_str() && *end == '\0') return d;
  }
  throw config_error(std::string("a trace event's ") + what + " is not a number" +
                     (v != nullptr ? ": " + v->dump() : std::string(" (missing)")));
}

// e.get(key) or {} as Python reads it: a missing, null or empty value is an empty object.
Json args_of(const Json& e) {
  const Json* a = field(e, "args");
  if (a == nullptr || a->is_null() || ((a->is_object() || a->is_array() || a->is_string()) && a->empty()))
    return Json::object();
  return *a;
}

// Python's round(x, 3): the exact binary value rounded to 3 decimals, ties to even (printf rounds it so).
double round3(double x) {
  if (!(std::fabs(x) < 1e17)) return x;  // past 2^53 every double is an integer
  char text[64];
  std::snprintf(text, sizeof text, "%.3f", x);
  return std::strtod(text, nullptr);
}

Json parse(const std::string& text, const char* what) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    throw config_error(std::string(what) + " is not JSON (" + e.what() + ")");
  }
}

// The document's events, which merge() and one_step() need.
const Json& events_of(const Json& doc, const char* what) {
  const Json* ev = field(doc, "traceEvents");
  if (ev == nullptr || !ev->is_array()) throw config_error(std::string(what) + " is not a Chrome trace (no traceEvents list)");
  return *ev;
}

// Kineto (torch.profiler) and tierflow: ts are microseconds since baseTimeNanoseconds; 0 when there is none.
std::int64_t base_ns(const Json& doc) {
  const Json* b = field(doc, "baseTimeNanoseconds");
  if (b == nullptr || b->is_null()) return 0;
  if (b->is_number_integer()) return b->get<std::int64_t>();
  return static_cast<std::int64_t>(number(b, "baseTimeNanoseconds"));
}

// A span of one of tierflow's lanes.
struct Span {
  std::string lane;
  Json name;
  double ts = 0, dur = 0;
  Json args;
  double end() const { return ts + dur; }
  double block() const {  // its "block" argument (0 without one)
    const Json* b = field(args, "block");
    return b != nullptr && b->is_number() ? b->get<double>() : 0.0;
  }
};

// (pid, tid) -> lane name for tierflow's lanes (thread_name "tierflow: ...", a lane's further threads "... #2").
std::vector<std::pair<Json, std::string>> lanes_of(const Json& events) {
  std::vector<std::pair<Json, std::string>> out;
  for (const Json& e : events) {
    if (!field_is(e, "ph", "M") || !field_is(e, "name", "thread_name")) continue;
    const Json* args = field(e, "args");
    const Json* name = args != nullptr ? field(*args, "name") : nullptr;
    if (name == nullptr || !name->is_string()) continue;
    const std::string& n = name->get_ref<const std::string&>();
    if (n.rfind(kLanePrefix, 0) != 0) continue;
    const std::string lane = n.substr(std::strlen(kLanePrefix));
    const Json key = Json::array({field(e, "pid") ? *field(e, "pid") : Json(), field(e, "tid") ? *field(e, "tid") : Json()});
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == key; });
    const std::string value = lane.substr(0, lane.find(" #"));
    if (it == out.end())
      out.emplace_back(key, value);
    else
      it->second = value;
  }
  return out;
}

// The steps' (start, end) times (Note [Trace file]'s one step); empty without step markers or block forwards.
std::vector<std::pair<double, double>> steps_of(const std::vector<Span>& spans) {
  std::vector<std::pair<double, double>> marks;
  for (const Span& s : spans)
    if (s.lane == "steps") marks.emplace_back(s.ts, s.end());
  if (!marks.empty()) {
    std::sort(marks.begin(), marks.end());
    return marks;
  }
  std::vector<const Span*> forwards;
  for (const Span& s : spans)
    if (s.lane == "block forward") forwards.push_back(&s);
  if (forwards.empty()) return {};
  double first = forwards[0]->block();
  for (const Span* s : forwards) first = std::min(first, s->block());
  std::vector<double> starts;
  for (const Span* s : forwards)
    if (s->block() == first) starts.push_back(s->ts);
  std::sort(starts.begin(), starts.end());
  double last = spans[0].end();
  for (const Span& s : spans) last = std::max(last, s.end());
  std::vector<std::pair<double, double>> out;
  for (std::size_t i = 0; i < starts.size(); ++i) out.emplace_back(starts[i], i + 1 < starts.size() ? starts[i + 1] : last);
  return out;
}

}  // namespace

std::string load_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    throw io_error(err, "cannot read the trace " + path + ": " + std::strerror(err));
  }
  std::string text;
  char buf[1 << 16];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const int err = errno;
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw io_error(err, "cannot read the trace " + path + ": " + std::strerror(err));
  Json doc;
  try {
    doc = Json::parse(text);
  } catch (const Json::exception& e) {
    throw config_error(path + " is not JSON (" + e.what() + "); give a trace TIERFLOW_TRACE or tierflow.trace wrote");
  }
  if (doc.is_array()) doc = Json{{"traceEvents", std::move(doc)}};
  events_of(doc, path.c_str());
  return doc.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string merge(const std::string& tierflow_json, const std::string& torch_json) {
  const Json tierflow_doc = parse(tierflow_json, "the tierflow trace"), torch_doc = parse(torch_json, "the torch trace");
  const std::int64_t tb = base_ns(tierflow_doc), kb = base_ns(torch_doc);
  if (tb == 0 || kb == 0)
    throw config_error("both traces need a baseTimeNanoseconds (torch.profiler's export_chrome_trace writes one "
                       "since torch 2.1, tierflow's always): without one their clocks cannot be lined up");
  const std::int64_t base = std::min(tb, kb);
  const double torch_shift = static_cast<double>(kb - base) / 1000.0;
  const double tierflow_shift = static_cast<double>(tb - base) / 1000.0;
  const Json& torch_events = events_of(torch_doc, "the torch trace");
  std::vector<Json> torch_pids;  // the processes torch names
  for (const Json& e : torch_events)
    if (field_is(e, "ph", "M") && field_is(e, "name", "process_name"))
      torch_pids.push_back(field(e, "pid") ? *field(e, "pid") : Json());
  Json out_events = Json::array();
  for (Json e : torch_events) {
    if (!field_is(e, "ph", "M") && field(e, "ts") != nullptr) e["ts"] = round3(number(field(e, "ts"), "ts") + torch_shift);
    out_events.push_back(std::move(e));
  }
  for (Json e : events_of(tierflow_doc, "the tierflow trace")) {
    if (field_is(e, "ph", "M")) {
      const Json pid = field(e, "pid") ? *field(e, "pid") : Json();
      if (field_is(e, "name", "process_name") && std::find(torch_pids.begin(), torch_pids.end(), pid) != torch_pids.end())
        continue;  // the same process: torch names it; tierflow's lanes are its threads
    } else if (field(e, "ts") != nullptr) {
      e["ts"] = round3(number(field(e, "ts"), "ts") + tierflow_shift);
    }
    out_events.push_back(std::move(e));
  }
  Json out = torch_doc;
  out.erase("traceEvents");
  out["traceEvents"] = std::move(out_events);
  out["baseTimeNanoseconds"] = base;
  if (!out.contains("displayTimeUnit")) out["displayTimeUnit"] = "ms";
  return out.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string merge_files(const std::string& tierflow_path, const std::string& torch_path, const std::string& out_path) {
  const std::string merged = merge(load_file(tierflow_path), load_file(torch_path));
  std::FILE* f = std::fopen(out_path.c_str(), "w");
  if (f == nullptr) {
    const int err = errno;
    throw io_error(err, "cannot write the merged trace to " + out_path + ": " + std::strerror(err));
  }
  const bool ok = std::fwrite(merged.data(), 1, merged.size(), f) == merged.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !ok)
    throw io_error(err, "cannot write the merged trace to " + out_path + ": " + std::strerror(err));
  return merged;
}

std::string one_step(const std::string& trace_json, std::int64_t step) {
  const Json doc = parse(trace_json, "the trace");
  const Json& events = events_of(doc, "the trace");
  const auto lanes = lanes_of(events);
  std::vector<Span> spans;
  std::vector<std::pair<double, Json>> counters;
  for (const Json& e : events) {
    if (field_is(e, "ph", "X")) {
      const Json key = Json::array({field(e, "pid") ? *field(e, "pid") : Json(), field(e, "tid") ? *field(e, "tid") : Json()});
      const auto lane = std::find_if(lanes.begin(), lanes.end(), [&](const auto& p) { return p.first == key; });
      if (lane == lanes.end()) continue;
      const Json* dur = field(e, "dur");
      spans.push_back(Span{lane->second, field(e, "name") ? *field(e, "name") : Json(""), number(field(e, "ts"), "ts"),
                           dur != nullptr ? number(dur, "dur") : 0.0, args_of(e)});
    } else if (field_is(e, "ph", "C") && field_is(e, "name", "bytes per tier")) {
      counters.emplace_back(number(field(e, "ts"), "ts"), args_of(e));
    }
  }
  if (spans.empty())
    throw config_error("the trace has no tierflow events: was TIERFLOW_TRACE (or tierflow.trace) on while a "
                       "wrapped model trained?");
  std::vector<std::pair<double, double>> steps = steps_of(spans);
  const bool marked = std::any_of(spans.begin(), spans.end(), [](const Span& s) { return s.lane == "steps"; });
  const char* split = marked ? "steps" : !steps.empty() ? "block forward" : "trace";
  if (steps.empty()) {
    double first = spans[0].ts, last = spans[0].end();
    for (const Span& s : spans) first = std::min(first, s.ts), last = std::max(last, s.end());
    steps.emplace_back(first, last);
  }
  const auto count = static_cast<std::int64_t>(steps.size());
  if (step >= count || step < -count)
    throw config_error("--step " + std::to_string(step) + ": the trace has " + std::to_string(count) + " step(s) (0 to " +
                       std::to_string(count - 1) + ", or -1 for the last)");
  const std::int64_t index = step < 0 ? step + count : step;
  const auto [start, end] = steps[static_cast<std::size_t>(index)];
  Json inside = Json::array();
  for (const Span& s : spans)
    if ((s.ts < end && s.end() > start) || s.ts == start)
      inside.push_back(Json{{"lane", s.lane}, {"name", s.name}, {"ts", s.ts}, {"dur", s.dur}, {"args", s.args}});
  Json series = Json::array();
  const Json* before = nullptr;  // the last reading at or before the step's start
  for (const auto& [ts, values] : counters)
    if (ts <= start) before = &values;
  if (before != nullptr) series.push_back(Json::array({start, *before}));
  for (const auto& [ts, values] : counters)
    if (start <= ts && ts <= end) series.push_back(Json::array({ts, values}));
  Json out{{"start", start}, {"end", end}, {"spans", std::move(inside)}, {"counters", std::move(series)},
           {"count", count}, {"index", index}, {"split", split}};
  return out.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace tierflow::trace
