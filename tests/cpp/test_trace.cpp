// Note [Trace]: the recorder's Chrome trace format (every event's fields), nothing recorded when off, the lanes
// of PendingWork's kinds, and recording from many threads at once.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/core/trace.hpp"

using namespace tierflow;
using Json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Each test starts with no events and recording off, and leaves it so.
class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    while (trace::on()) trace::stop();
    trace::clear();
  }
  void TearDown() override {
    while (trace::on()) trace::stop();
    trace::clear();
  }
};

// The format's fields: every event has name, ph, ts, pid, tid; X has dur >= 0; C has numeric args; M names.
void expect_chrome_format(const Json& doc) {
  ASSERT_TRUE(doc.is_object());
  ASSERT_TRUE(doc.contains("traceEvents") && doc["traceEvents"].is_array());
  EXPECT_TRUE(doc.contains("displayTimeUnit"));
  EXPECT_TRUE(doc["baseTimeNanoseconds"].is_number_integer());
  for (const Json& e : doc["traceEvents"]) {
    for (const char* k : {"name", "ph", "ts", "pid", "tid"}) ASSERT_TRUE(e.contains(k)) << k << " missing: " << e;
    EXPECT_TRUE(e["name"].is_string());
    EXPECT_TRUE(e["ts"].is_number());
    EXPECT_TRUE(e["pid"].is_number_integer());
    EXPECT_TRUE(e["tid"].is_number_integer());
    const std::string ph = e["ph"];
    ASSERT_TRUE(ph == "X" || ph == "C" || ph == "M") << e;
    if (ph == "X") {
      ASSERT_TRUE(e.contains("dur") && e["dur"].is_number()) << e;
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      EXPECT_GE(e["ts"].get<double>(), 0.0);
      EXPECT_TRUE(e["cat"].is_string());
    }
    if (ph == "C") {
      ASSERT_TRUE(e.contains("args") && e["args"].is_object() && !e["args"].empty()) << e;
      for (const auto& [k, v] : e["args"].items()) EXPECT_TRUE(v.is_number()) << k;
    }
    if (ph == "M") {
      EXPECT_TRUE(e["args"]["name"].is_string() || e["args"].contains("sort_index")) << e;
    }
  }
}

std::vector<Json> events_of(const Json& doc, const std::string& ph) {
  std::vector<Json> out;
  for (const Json& e : doc["traceEvents"])
    if (e["ph"] == ph) out.push_back(e);
  return out;
}

TEST_F(TraceTest, OffRecordsNothing) {
  ASSERT_FALSE(trace::on());
  trace::complete(trace::Lane::kForward, "block 0", now_ns(), now_ns() + 10);
  trace::counter("bytes per tier", now_ns(), {{"pinned host", 5}});
  { PendingWork w("device -> host copy", 4096); }
  trace::sample();
  EXPECT_EQ(trace::event_count(), 0u);
  const Json doc = Json::parse(trace::chrome_json());
  EXPECT_TRUE(events_of(doc, "X").empty());
  EXPECT_TRUE(events_of(doc, "C").empty());
}

TEST_F(TraceTest, EventsInTheChromeFormat) {
  trace::start();
  const std::uint64_t t0 = now_ns();
  trace::complete(trace::Lane::kForward, "block 3", t0, t0 + 2'500'000, {{"block", 3}, {"bytes", 1 << 20}});
  trace::complete(trace::Lane::kCpuAdam, "AdamW bucket", t0 + 1'000'000, t0 + 1'000'000);  // zero length
  trace::counter("bytes per tier", t0 + 500'000, {{"pinned host", 1 << 20}, {"NVMe", 0}});
  trace::stop();
  trace::complete(trace::Lane::kForward, "after stop", t0, t0 + 1);  // off again: not recorded
  const Json doc = Json::parse(trace::chrome_json());
  expect_chrome_format(doc);
  const auto xs = events_of(doc, "X");
  ASSERT_EQ(xs.size(), 2u);
  EXPECT_EQ(xs[0]["name"], "block 3");
  EXPECT_EQ(xs[0]["tid"], static_cast<int>(trace::Lane::kForward));
  EXPECT_EQ(xs[0]["cat"], "block");
  EXPECT_NEAR(xs[0]["dur"].get<double>(), 2500.0, 1e-6) << "microseconds";
  EXPECT_EQ(xs[0]["args"]["block"], 3);
  EXPECT_EQ(xs[0]["args"]["bytes"], 1 << 20);
  EXPECT_NEAR(xs[1]["ts"].get<double>() - xs[0]["ts"].get<double>(), 1000.0, 1e-3);
  EXPECT_EQ(xs[1]["dur"], 0.0);
  const auto cs = events_of(doc, "C");
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0]["args"]["pinned host"], 1 << 20);
  EXPECT_NEAR(cs[0]["ts"].get<double>() - xs[0]["ts"].get<double>(), 500.0, 1e-3);
  // Lanes are named (thread_name), only the ones used.
  std::set<std::string> names;
  for (const Json& m : events_of(doc, "M"))
    if (m["name"] == "thread_name") names.insert(m["args"]["name"].get<std::string>());
  EXPECT_EQ(names, (std::set<std::string>{"tierflow: block forward", "tierflow: CPU AdamW"}));
}

TEST_F(TraceTest, TimesAreRealtimeSinceTheBase) {
  // Note [Trace]'s clock: ts + baseTimeNanoseconds / 1000 is the realtime clock in microseconds, as in
  // torch.profiler's trace.
  trace::start();
  const auto real = std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::system_clock::now().time_since_epoch()).count();
  trace::complete(trace::Lane::kForward, "now", now_ns(), now_ns());
  trace::stop();
  const Json doc = Json::parse(trace::chrome_json());
  const double at = events_of(doc, "X").at(0)["ts"].get<double>() + doc["baseTimeNanoseconds"].get<double>() / 1000.0;
  EXPECT_NEAR(at, static_cast<double>(real), 2000.0);
  EXPECT_EQ(doc["baseTimeNanoseconds"].get<std::int64_t>() % 1000000, 0) << "whole milliseconds";
}

TEST_F(TraceTest, PendingWorkBecomesAnEventOnItsLane) {
  trace::start();
  {
    PendingWork a("device -> host copy", 4096);
    PendingWork b("NVMe read", 1 << 20, 12);
    b.done();
    b.done();  // idempotent: one event
  }
  { PendingWork c("host -> device copy", 8); }
  { PendingWork d("NVMe write", 16); }
  trace::stop();
  const Json doc = Json::parse(trace::chrome_json());
  expect_chrome_format(doc);
  const auto xs = events_of(doc, "X");
  ASSERT_EQ(xs.size(), 4u);
  std::map<std::string, Json> by_name;
  for (const Json& x : xs) by_name[x["name"]] = x;
  EXPECT_EQ(by_name.at("device -> host copy")["tid"], static_cast<int>(trace::Lane::kDeviceToHost));
  EXPECT_EQ(by_name.at("device -> host copy")["args"]["bytes"], 4096);
  EXPECT_EQ(by_name.at("host -> device copy")["tid"], static_cast<int>(trace::Lane::kHostToDevice));
  EXPECT_EQ(by_name.at("NVMe read")["tid"], static_cast<int>(trace::Lane::kNvmeRead));
  EXPECT_EQ(by_name.at("NVMe read")["args"]["block"], 12);
  EXPECT_EQ(by_name.at("NVMe write")["tid"], static_cast<int>(trace::Lane::kNvmeWrite));
}

TEST_F(TraceTest, OverlappingWorkGetsThreadsOfDisjointEvents) {
  // Copies in flight at once overlap; a Chrome thread holds only nested events (Note [Trace]).
  trace::start();
  const std::uint64_t t0 = now_ns();
  trace::complete(trace::Lane::kDeviceToHost, "a", t0, t0 + 100'000);
  trace::complete(trace::Lane::kDeviceToHost, "b", t0 + 10'000, t0 + 150'000);  // overlaps a
  trace::complete(trace::Lane::kDeviceToHost, "c", t0 + 20'000, t0 + 30'000);   // overlaps both
  trace::complete(trace::Lane::kDeviceToHost, "d", t0 + 120'000, t0 + 130'000); // after a: a's thread again
  trace::stop();
  const Json doc = Json::parse(trace::chrome_json());
  expect_chrome_format(doc);
  std::map<std::string, int> tid;
  std::map<int, std::vector<std::pair<double, double>>> by_tid;
  for (const Json& x : events_of(doc, "X")) {
    tid[x["name"]] = x["tid"];
    by_tid[x["tid"]].push_back({x["ts"].get<double>(), x["ts"].get<double>() + x["dur"].get<double>()});
  }
  const int lane = static_cast<int>(trace::Lane::kDeviceToHost);
  EXPECT_EQ(tid.at("a"), lane);
  EXPECT_EQ(tid.at("b"), lane + 100);
  EXPECT_EQ(tid.at("c"), lane + 200);
  EXPECT_EQ(tid.at("d"), lane);
  for (auto& [t, spans] : by_tid) {
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << "tid " << t;
  }
  std::map<int, std::string> names;
  for (const Json& m : events_of(doc, "M"))
    if (m["name"] == "thread_name") names[m["tid"]] = m["args"]["name"];
  EXPECT_EQ(names.at(lane), "tierflow: copy device -> host");
  EXPECT_EQ(names.at(lane + 100), "tierflow: copy device -> host #2");
  EXPECT_EQ(names.at(lane + 200), "tierflow: copy device -> host #3");
}

TEST_F(TraceTest, ManyThreadsRecordEveryEvent) {
  trace::start();
  constexpr int kThreads = 8, kEach = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < kEach; ++i) {
        const std::uint64_t s = now_ns();
        trace::complete(trace::Lane::kCpuAdam, "bucket", s, s + 1, {{"thread", t}, {"i", i}});
        if (i % 100 == 0) trace::counter("bytes per tier", s, {{"pinned host", i}});
      }
    });
  for (auto& th : threads) th.join();
  trace::stop();
  EXPECT_EQ(trace::event_count(), static_cast<std::size_t>(kThreads * (kEach + kEach / 100)));
  const Json doc = Json::parse(trace::chrome_json());
  std::set<std::pair<int, int>> seen;
  for (const Json& x : events_of(doc, "X")) seen.insert({x["args"]["thread"].get<int>(), x["args"]["i"].get<int>()});
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(kThreads * kEach)) << "each event once, none torn";
}

TEST_F(TraceTest, AttachedMetersAreSampledAndThePathWrittenAtDetach) {
  const fs::path dir = fs::temp_directory_path() / ("tierflow_trace_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "t.json").string();
  int a = 0, b = 0;
  trace::attach(&a, path, [] { return std::vector<std::pair<std::string, std::int64_t>>{{"pinned host", 100}}; });
  trace::attach(&b, "", [] {
    return std::vector<std::pair<std::string, std::int64_t>>{{"pinned host", 20}, {"NVMe", 7}};
  });
  EXPECT_TRUE(trace::on()) << "a path starts recording";
  trace::sample();
  trace::detach(&b);
  EXPECT_TRUE(trace::on());
  trace::detach(&a);
  EXPECT_FALSE(trace::on()) << "the path's owner gone: recording stops";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "written at detach";
  const Json doc = Json::parse(in);
  expect_chrome_format(doc);
  const auto cs = events_of(doc, "C");
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0]["name"], "bytes per tier");
  EXPECT_EQ(cs[0]["args"]["pinned host"], 120) << "summed over runtimes";
  EXPECT_EQ(cs[0]["args"]["NVMe"], 7);
  fs::remove_all(dir);
}

TEST_F(TraceTest, SinceKeepsTheEventsEndingAfterIt) {
  trace::start();
  const std::uint64_t t0 = now_ns();
  trace::complete(trace::Lane::kForward, "old", t0, t0 + 10);
  trace::complete(trace::Lane::kForward, "new", t0 + 100, t0 + 200);
  trace::stop();
  const Json doc = Json::parse(trace::chrome_json(t0 + 50));
  const auto xs = events_of(doc, "X");
  ASSERT_EQ(xs.size(), 1u);
  EXPECT_EQ(xs[0]["name"], "new");
}

TEST_F(TraceTest, AnUnwritablePathIsAnErrorNamingIt) {
  try {
    trace::write("/nonexistent-dir/t.json");
    FAIL() << "no error";
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/t.json"), std::string::npos) << e.what();
    // tierflow.trace(path) writes through it too: the caller names the setting, not write().
    EXPECT_EQ(std::string(e.what()).find("TIERFLOW_TRACE"), std::string::npos) << e.what();
  }
}

TEST_F(TraceTest, AttachRefusesAPathItCannotWriteAtOnce) {
  int a = 0;
  try {
    trace::attach(&a, "/nonexistent-dir-zz/t.json", nullptr);
    FAIL() << "accepted at attach: the file would fail only when the runtime ends";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("TIERFLOW_TRACE=/nonexistent-dir-zz/t.json"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("keyword trace"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(trace::on()) << "nothing attached, nothing recording";
  trace::detach(&a);  // nothing to do
}

TEST_F(TraceTest, PathRefusalSaysAMissingFolderOrAFailedProbeAndLeavesNoProbeBehind) {
  const std::string who = "tierflow.trace(path='x')";
  EXPECT_EQ(trace::path_refusal("/nonexistent-dir-zz/sub/../t.json", who),
            who + ": the folder /nonexistent-dir-zz does not exist; give a file path under a writable folder (the "
                  "setting TIERFLOW_TRACE takes the same)");
  EXPECT_EQ(trace::path_refusal("/proc/nope.json", who),
            who + ": cannot write there (creating /proc/nope.json.tmp: No such file or directory); give a file path "
                  "under a writable folder");
  const fs::path dir = fs::temp_directory_path() / ("tierflow_trace_probe_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "t.json").string();
  EXPECT_EQ(trace::path_refusal(path, who), "");
  EXPECT_FALSE(fs::exists(path + ".tmp")) << "the probe file removed";
  std::ofstream(path + ".tmp") << "a writer's";
  EXPECT_EQ(trace::path_refusal(path, who), "") << "a probe file there already: the folder is writable";
  EXPECT_TRUE(fs::exists(path + ".tmp")) << "someone else's file left alone";
  fs::remove_all(dir);
}

TEST_F(TraceTest, ALaterRuntimeOnThePathKeepsTheEarlierOnesEvents) {
  const fs::path dir = fs::temp_directory_path() / ("tierflow_trace_runs_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "t.json").string();
  auto names = [&] {
    std::ifstream in(path);
    std::vector<std::string> out;
    for (const Json& x : events_of(Json::parse(in), "X")) out.push_back(x["name"].get<std::string>());
    std::sort(out.begin(), out.end());
    return out;
  };
  int a = 0, b = 0;
  trace::attach(&a, path, nullptr);
  const std::uint64_t t = now_ns();
  trace::complete(trace::Lane::kCpuAdam, "run 1", t, t + 10);
  trace::detach(&a);
  EXPECT_EQ(names(), std::vector<std::string>{"run 1"});
  trace::attach(&b, path, nullptr);  // wrap again, same TIERFLOW_TRACE
  const std::uint64_t u = now_ns();
  trace::complete(trace::Lane::kCpuAdam, "run 2", u, u + 10);
  trace::detach(&b);
  EXPECT_EQ(names(), (std::vector<std::string>{"run 1", "run 2"})) << "the first run silently lost";
  fs::remove_all(dir);
}

}  // namespace
