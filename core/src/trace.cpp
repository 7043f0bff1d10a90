// See Note [Trace] in trace.hpp.
#include "tierflow/core/trace.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include <nlohmann/json.hpp>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"

namespace tierflow::trace {

namespace detail {
std::atomic<bool> g_on{false};
}  // namespace detail

namespace {

using Json = nlohmann::ordered_json;  // every event's fields in the order the format lists them

struct Event {
  char ph;  // 'X' or 'C'
  Lane lane;
  std::string name;
  std::uint64_t start_ns;
  std::uint64_t end_ns;
  std::vector<std::pair<std::string, std::int64_t>> args;
};

struct Owner {
  std::string path;
  Meter meter;
  std::uint64_t since_ns = 0;  // its path's trace: the events ending after the path was first attached
};

// Never destroyed: work may finish (and record) during exit, after static destructors ran.
struct Recorder {
  std::mutex mutex;  // guards events, dropped, recorders
  std::vector<Event> events;
  std::size_t dropped = 0;
  int recorders = 0;  // start() minus stop(): recording while positive
  std::mutex owners_mutex;  // guards owners; held while meters run, so that none runs after its detach
  std::map<const void*, Owner> owners;
  std::map<std::string, std::uint64_t> path_since;  // guarded by mutex: each path's first attach (Note [Trace]'s runs)
  bool exit_hook = false;

  static Recorder& get() {
    static Recorder* r = new Recorder();
    return *r;
  }
  void add(Event e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (recorders <= 0) return;  // stopped since the caller's check
    if (events.size() >= kMaxTraceEvents) {
      ++dropped;
      return;
    }
    events.push_back(std::move(e));
  }
};

// realtime ns - steady ns, now (Note [Trace]'s clock).
std::int64_t realtime_offset_ns() {
  const std::int64_t steady = static_cast<std::int64_t>(now_ns());
  const std::int64_t real = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
  return real - steady;
}

double micros(std::int64_t ns) { return static_cast<double>(ns) / 1000.0; }

void write_at_exit() {
  auto& r = Recorder::get();
  std::vector<std::pair<std::string, std::uint64_t>> paths;
  {
    std::lock_guard<std::mutex> lock(r.owners_mutex);
    for (const auto& [owner, o] : r.owners)
      if (!o.path.empty()) paths.emplace_back(o.path, o.since_ns);
  }
  for (const auto& [p, since] : paths) {
    try {
      write(p, since);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[tierflow warn] TIERFLOW_TRACE: %s\n", e.what());
    }
  }
}

// Creates and removes the probe file `path`.tmp: 0 when it could be (or exists already), else its errno.
int probe_errno(const std::string& path) {
  const std::string probe = path + ".tmp";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) return errno == EEXIST ? 0 : errno;
  ::close(fd);
  ::unlink(probe.c_str());
  return 0;
}

}  // namespace

const char* lane_name(Lane lane) noexcept {
  switch (lane) {
    case Lane::kForward: return "block forward";
    case Lane::kBackward: return "block backward";
    case Lane::kReplay: return "block replay";
    case Lane::kDeviceToHost: return "copy device -> host";
    case Lane::kHostToDevice: return "copy host -> device";
    case Lane::kNvmeWrite: return "NVMe write";
    case Lane::kNvmeRead: return "NVMe read";
    case Lane::kCpuAdam: return "CPU AdamW";
    case Lane::kCpuAdamQueue: return "CPU AdamW queue";
    case Lane::kOther: return "other work";
    case Lane::kSteps: return "steps";
  }
  return "other work";
}

const char* lane_category(Lane lane) noexcept {
  switch (lane) {
    case Lane::kForward:
    case Lane::kBackward:
    case Lane::kReplay: return "block";
    case Lane::kDeviceToHost:
    case Lane::kHostToDevice: return "copy";
    case Lane::kNvmeWrite:
    case Lane::kNvmeRead: return "nvme";
    case Lane::kCpuAdam:
    case Lane::kCpuAdamQueue: return "optimizer";
    case Lane::kOther: return "work";
    case Lane::kSteps: return "step";
  }
  return "work";
}

Lane lane_of_kind(const char* kind) noexcept {
  if (kind == nullptr) return Lane::kOther;
  const bool nvme = std::strstr(kind, "NVMe") != nullptr;
  if (nvme) return std::strstr(kind, "write") ? Lane::kNvmeWrite : Lane::kNvmeRead;
  if (std::strstr(kind, "device -> host")) return Lane::kDeviceToHost;
  if (std::strstr(kind, "host -> device")) return Lane::kHostToDevice;
  if (std::strstr(kind, "CPU optimizer")) return Lane::kCpuAdamQueue;
  return Lane::kOther;
}

void start() {
  auto& r = Recorder::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.recorders == 0) {  // a new recording: the last one's events were written already (or never will be),
    if (r.path_since.empty()) {  // unless a TIERFLOW_TRACE path's file is to hold them again (Note [Trace]'s runs)
      r.events.clear();
      r.dropped = 0;
    } else {
      std::uint64_t oldest = UINT64_MAX;
      for (const auto& [p, since] : r.path_since) oldest = std::min(oldest, since);
      r.events.erase(std::remove_if(r.events.begin(), r.events.end(),
                                    [&](const Event& e) { return e.end_ns < oldest; }),
                     r.events.end());
    }
  }
  ++r.recorders;
  detail::g_on.store(true, std::memory_order_relaxed);
}

void stop() noexcept {
  auto& r = Recorder::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.recorders > 0) --r.recorders;
  detail::g_on.store(r.recorders > 0, std::memory_order_relaxed);
}

void clear() noexcept {
  auto& r = Recorder::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.path_since.clear();
  r.events.clear();
  r.events.shrink_to_fit();
  r.dropped = 0;
}

void complete(Lane lane, std::string name, std::uint64_t start_ns, std::uint64_t end_ns,
              std::initializer_list<Arg> args) noexcept {
  if (!on()) return;
  try {
    Event e{'X', lane, std::move(name), start_ns, std::max(start_ns, end_ns), {}};
    e.args.reserve(args.size());
    for (const Arg& a : args) e.args.emplace_back(a.key, a.value);
    Recorder::get().add(std::move(e));
  } catch (...) {  // no memory for one more event: the trace misses it, the work goes on
  }
}

void complete_args(Lane lane, std::string name, std::uint64_t start_ns, std::uint64_t end_ns,
                   std::vector<std::pair<std::string, std::int64_t>> args) noexcept {
  if (!on()) return;
  try {
    Recorder::get().add(Event{'X', lane, std::move(name), start_ns, std::max(start_ns, end_ns), std::move(args)});
  } catch (...) {
  }
}

void work_done(const char* kind, std::uint64_t bytes, std::int64_t id,
               std::chrono::steady_clock::time_point since) noexcept {
  if (!on()) return;
  const auto start_ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(since.time_since_epoch()).count());
  const auto b = static_cast<std::int64_t>(bytes);
  if (id >= 0)
    complete(lane_of_kind(kind), kind, start_ns, now_ns(), {{"bytes", b}, {"block", id}});
  else
    complete(lane_of_kind(kind), kind, start_ns, now_ns(), {{"bytes", b}});
}

void counter(std::string name, std::uint64_t at_ns, std::vector<std::pair<std::string, std::int64_t>> values) noexcept {
  if (!on()) return;
  try {
    Recorder::get().add(Event{'C', Lane::kOther, std::move(name), at_ns, at_ns, std::move(values)});
  } catch (...) {
  }
}

void attach(const void* owner, std::string path, Meter meter) {
  auto& r = Recorder::get();
  const bool records = !path.empty();
  std::uint64_t since = now_ns();
  if (records) {
    // Its file is written when the runtime ends: say now, at wrap, when it cannot be (Note [Trace]).
    if (const int err = probe_errno(path))
      throw config_error("TIERFLOW_TRACE=" + path + " (keyword trace) cannot be written: creating " + path +
                         ".tmp failed: " + std::strerror(err) + "; accepted: a file path under an existing writable "
                         "folder (empty: no trace)");
    std::lock_guard<std::mutex> lock(r.mutex);
    since = r.path_since.emplace(path, since).first->second;  // the path's first attach
  }
  {
    std::lock_guard<std::mutex> lock(r.owners_mutex);
    r.owners[owner] = Owner{std::move(path), std::move(meter), since};
    if (records && !r.exit_hook) {
      r.exit_hook = true;
      std::atexit(write_at_exit);
    }
  }
  if (records) start();
}

std::string path_refusal(const std::string& path, const std::string& who) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path full = fs::absolute(path, ec).lexically_normal();  // Python's os.path.abspath
  if (!full.has_filename() && full.has_relative_path()) full = full.parent_path();  // "dir/" names dir
  const fs::path folder = full.parent_path();
  if (!fs::is_directory(folder, ec))
    return who + ": the folder " + folder.string() + " does not exist; give a file path under a writable folder (the "
           "setting TIERFLOW_TRACE takes the same)";
  if (const int err = probe_errno(path))
    return who + ": cannot write there (creating " + path + ".tmp: " + std::strerror(err) + "); give a file path "
           "under a writable folder";
  return "";
}

void detach(const void* owner) noexcept {
  auto& r = Recorder::get();
  std::string path;
  std::uint64_t since = 0;
  {
    std::lock_guard<std::mutex> lock(r.owners_mutex);
    auto it = r.owners.find(owner);
    if (it == r.owners.end()) return;
    path = std::move(it->second.path);
    since = it->second.since_ns;
    r.owners.erase(it);
  }
  if (path.empty()) return;
  try {
    write(path, since);
  } catch (const std::exception& e) {
    log(LogLevel::kWarn, std::string("TIERFLOW_TRACE: ") + e.what());
  }
  stop();
}

void sample() noexcept {
  if (!on()) return;
  auto& r = Recorder::get();
  try {
    std::vector<std::pair<std::string, std::int64_t>> sum;
    {
      std::lock_guard<std::mutex> lock(r.owners_mutex);
      if (r.owners.empty()) return;
      for (const auto& [owner, o] : r.owners) {
        if (!o.meter) continue;
        for (const auto& [series, value] : o.meter()) {
          auto it = std::find_if(sum.begin(), sum.end(), [&](const auto& p) { return p.first == series; });
          if (it == sum.end())
            sum.emplace_back(series, value);
          else
            it->second += value;
        }
      }
    }
    if (!sum.empty()) counter("bytes per tier", now_ns(), std::move(sum));
  } catch (...) {  // a meter that failed: no sample this time
  }
}

std::size_t event_count() noexcept {
  auto& r = Recorder::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.events.size();
}

std::size_t dropped_count() noexcept {
  auto& r = Recorder::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.dropped;
}

std::string chrome_json(std::uint64_t since_ns, std::int64_t pid) {
  auto& r = Recorder::get();
  std::vector<Event> events;
  std::size_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    events.reserve(r.events.size());
    for (const Event& e : r.events)
      if (e.end_ns >= since_ns) events.push_back(e);
    dropped = r.dropped;
  }
  std::stable_sort(events.begin(), events.end(),
                   [](const Event& a, const Event& b) { return a.start_ns < b.start_ns; });
  if (pid == 0) pid = static_cast<std::int64_t>(::getpid());
  const std::int64_t offset = realtime_offset_ns();
  constexpr std::int64_t kMs = 1000000;
  const std::int64_t first = static_cast<std::int64_t>(events.empty() ? now_ns() : events[0].start_ns);
  const std::int64_t base = ((first + offset) / kMs) * kMs;  // realtime, whole milliseconds (Note [Trace])
  auto ts = [&](std::uint64_t t) { return micros(static_cast<std::int64_t>(t) + offset - base); };

  Json out = Json::object();
  Json list = Json::array();
  list.push_back({{"name", "process_name"}, {"ph", "M"}, {"ts", 0}, {"pid", pid}, {"tid", 0},
                  {"args", {{"name", "tierflow"}}}});
  // Each event's thread within its lane (Note [Trace]: disjoint events per thread); events are in start order.
  constexpr int kLaneIds = 12, kSlotStride = 100;
  static_assert(static_cast<int>(Lane::kSteps) < kLaneIds, "a lane past the table");
  std::vector<int> tid(events.size(), 0);
  std::vector<std::uint64_t> slot_end[kLaneIds];  // per lane, per thread: the end of its last event
  for (std::size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    if (e.ph != 'X') continue;
    const int lane = static_cast<int>(e.lane);
    auto& ends = slot_end[lane];
    std::size_t k = 0;
    while (k < ends.size() && ends[k] > e.start_ns) ++k;
    if (k == ends.size()) ends.push_back(0);
    ends[k] = e.end_ns;
    tid[i] = lane + kSlotStride * static_cast<int>(k);
  }
  int order = 0;
  for (Lane lane : kLanes) {
    const int l = static_cast<int>(lane);
    for (int k = 0; k < static_cast<int>(slot_end[l].size()); ++k) {
      const std::string name = std::string("tierflow: ") + lane_name(lane) + (k ? " #" + std::to_string(k + 1) : "");
      list.push_back({{"name", "thread_name"}, {"ph", "M"}, {"ts", 0}, {"pid", pid}, {"tid", l + kSlotStride * k},
                      {"args", {{"name", name}}}});
      list.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"ts", 0}, {"pid", pid},
                      {"tid", l + kSlotStride * k}, {"args", {{"sort_index", order++}}}});
    }
  }
  for (std::size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    Json j = Json::object();
    j["name"] = e.name;
    j["ph"] = std::string(1, e.ph);
    j["ts"] = ts(e.start_ns);
    if (e.ph == 'X') j["dur"] = micros(static_cast<std::int64_t>(e.end_ns - e.start_ns));
    j["pid"] = pid;
    j["tid"] = tid[i];
    if (e.ph == 'X') j["cat"] = lane_category(e.lane);
    Json args = Json::object();
    for (const auto& [k, v] : e.args) args[k] = v;
    j["args"] = std::move(args);
    list.push_back(std::move(j));
  }
  out["traceEvents"] = std::move(list);
  out["displayTimeUnit"] = "ms";
  out["baseTimeNanoseconds"] = base;  // as torch.profiler writes it: ts + base / 1000 is realtime in microseconds
  out["otherData"] = {{"producer", "tierflow"}, {"clock", "CLOCK_REALTIME microseconds since baseTimeNanoseconds"},
                      {"dropped_events", dropped}};
  return out.dump();
}

void write(const std::string& path, std::uint64_t since_ns) {
  const std::string text = chrome_json(since_ns);
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr)
    throw io_error(errno, "cannot write the trace to " + tmp + " (for " + path + "): " + std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !ok) {
    std::remove(tmp.c_str());
    throw io_error(ok ? errno : err, "cannot write the trace to " + tmp + " (for " + path + ")");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw io_error(e, "cannot rename " + tmp + " to " + path + ": " + std::strerror(e));
  }
}

}  // namespace tierflow::trace
