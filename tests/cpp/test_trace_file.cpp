// Note [Trace file]: a trace read back (and refused with words naming the file), merged with torch.profiler's on
// one clock, and cut to one step by its step markers, by its first block's forwards, or whole.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"
#include "tierflow/core/trace_file.hpp"

using namespace tierflow;
using Json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// The message of what `f` throws as `E` ("" when it throws nothing).
template <class E, class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

class TraceFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tierflow_trace_file_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name, const std::string& text) {
    const std::string p = (dir_ / name).string();
    std::ofstream(p) << text;
    return p;
  }
  fs::path dir_;
};

// A thread of tierflow's lane `lane` (pid 7).
Json lane(int tid, const std::string& name) {
  return {{"name", "thread_name"}, {"ph", "M"}, {"ts", 0}, {"pid", 7}, {"tid", tid}, {"args", {{"name", "tierflow: " + name}}}};
}
Json span(int tid, const std::string& name, double ts, double dur, Json args = Json::object()) {
  return {{"name", name}, {"ph", "X"}, {"ts", ts}, {"dur", dur}, {"pid", 7}, {"tid", tid}, {"cat", "block"}, {"args", args}};
}
Json tiers(double ts, int host) {
  return {{"name", "bytes per tier"}, {"ph", "C"}, {"ts", ts}, {"pid", 7}, {"tid", 0}, {"args", {{"pinned host", host}}}};
}

TEST_F(TraceFileTest, LoadReadsAnObjectOrABareListAndNamesTheFileItRefuses) {
  const std::string missing = (dir_ / "none.json").string();
  EXPECT_EQ(thrown<io_error>([&] { trace::load_file(missing); }),
            "cannot read the trace " + missing + ": No such file or directory");
  const std::string bad = file("bad.json", "{not json");
  const std::string why = thrown<config_error>([&] { trace::load_file(bad); });
  EXPECT_EQ(why.rfind(bad + " is not JSON (", 0), 0u) << why;
  EXPECT_NE(why.find("); give a trace TIERFLOW_TRACE or tierflow.trace wrote"), std::string::npos) << why;
  const std::string other = file("other.json", R"({"events": []})");
  EXPECT_EQ(thrown<config_error>([&] { trace::load_file(other); }),
            other + " is not a Chrome trace (no traceEvents list)");
  const Json list = Json::parse(trace::load_file(file("list.json", R"([{"name": "a", "ph": "X"}])")));
  EXPECT_EQ(list, (Json{{"traceEvents", {{{"name", "a"}, {"ph", "X"}}}}}));
}

TEST_F(TraceFileTest, MergeShiftsBothOntoTheEarlierBaseAndKeepsTorchsProcessName) {
  // tierflow's base 5 ms + 1234 ns after torch's: its ts move by 5001.234 us, torch's stay.
  const std::int64_t torch_base = 1'700'000'000'000'000'000;
  const Json tierflow_doc{{"traceEvents",
                           {{{"name", "process_name"}, {"ph", "M"}, {"ts", 0}, {"pid", 7}, {"tid", 0}, {"args", {{"name", "tierflow"}}}},
                            lane(1, "block forward"), span(1, "block 0 forward", 0.1, 2.0), tiers(3.0, 10)}},
                          {"baseTimeNanoseconds", torch_base + 5'001'234}};
  const Json torch_doc{{"schemaVersion", 1},
                       {"traceEvents",
                        {{{"name", "process_name"}, {"ph", "M"}, {"pid", 7}, {"tid", 0}, {"args", {{"name", "python"}}}},
                         {{"name", "aten::mm"}, {"ph", "X"}, {"ts", 10}, {"dur", 4}, {"pid", 7}, {"tid", 9}}}},
                       {"baseTimeNanoseconds", torch_base}};
  const Json m = Json::parse(trace::merge(tierflow_doc.dump(), torch_doc.dump()));
  EXPECT_EQ(m["schemaVersion"], 1) << "torch's fields kept";
  EXPECT_EQ(m["baseTimeNanoseconds"], torch_base);
  EXPECT_EQ(m["displayTimeUnit"], "ms");
  const Json& ev = m["traceEvents"];
  ASSERT_EQ(ev.size(), 5u) << "tierflow's process_name dropped: torch names pid 7";
  EXPECT_EQ(ev[0]["args"]["name"], "python");
  EXPECT_EQ(ev[1]["ts"], 10.0) << "torch's events on its own base";
  EXPECT_EQ(ev[2], lane(1, "block forward")) << "metadata unshifted";
  EXPECT_EQ(ev[3]["ts"].get<double>(), 5001.334) << "0.1 + 5001.234 rounded to 3 decimals";
  EXPECT_EQ(ev[4]["ts"].get<double>(), 5004.234);
  // The other way round: tierflow's base first, torch's events shift; another process keeps its name.
  Json late_torch = torch_doc;
  late_torch["baseTimeNanoseconds"] = torch_base + 10'000'000;
  late_torch["traceEvents"][0]["pid"] = 8;
  Json early = tierflow_doc;
  early["baseTimeNanoseconds"] = torch_base;
  const Json m2 = Json::parse(trace::merge(early.dump(), late_torch.dump()));
  ASSERT_EQ(m2["traceEvents"].size(), 6u);
  EXPECT_EQ(m2["traceEvents"][1]["ts"], 10010.0);
  EXPECT_EQ(m2["traceEvents"][2]["args"]["name"], "tierflow");
  EXPECT_EQ(m2["traceEvents"][4]["ts"], 0.1);
}

TEST_F(TraceFileTest, MergeRefusesATraceWithoutABaseAndMergeFilesWritesTheResult) {
  const Json no_base{{"traceEvents", Json::array()}};
  const Json with_base{{"traceEvents", Json::array()}, {"baseTimeNanoseconds", 5}};
  const std::string why = thrown<config_error>([&] { trace::merge(with_base.dump(), no_base.dump()); });
  EXPECT_NE(why.find("both traces need a baseTimeNanoseconds"), std::string::npos) << why;
  const std::string a = file("a.json", with_base.dump()), b = file("b.json", with_base.dump());
  const std::string out = (dir_ / "m.json").string();
  const std::string merged = trace::merge_files(a, b, out);
  std::ifstream in(out);
  EXPECT_EQ(Json::parse(in), Json::parse(merged));
  EXPECT_EQ(thrown<io_error>([&] { trace::merge_files(a, (dir_ / "x.json").string(), out); }),
            "cannot read the trace " + (dir_ / "x.json").string() + ": No such file or directory");
  const std::string nowhere = (dir_ / "no" / "m.json").string();
  EXPECT_NE(thrown<io_error>([&] { trace::merge_files(a, b, nowhere); }).find("cannot write the merged trace to " + nowhere),
            std::string::npos);
}

TEST_F(TraceFileTest, OneStepIsAnOptimizerStepOfTheStepsLane) {
  // Three steps marked; the block lane has a second thread (#2): one lane.
  Json doc{{"traceEvents",
            {lane(11, "steps"), lane(1, "block forward"), lane(101, "block forward #2"),
             span(11, "step 1", 0, 100), span(11, "step 2", 100, 100), span(11, "step 3", 200, 50),
             span(1, "block 0 forward", 10, 5, {{"block", 0}}), span(101, "block 1 forward", 210, 5, {{"block", 1}}),
             span(1, "block 0 forward", 200, 5), tiers(90, 1), tiers(150, 2), tiers(220, 3), tiers(300, 4),
             span(5, "not ours", 210, 1)}}};
  const Json s = Json::parse(trace::one_step(doc.dump()));
  EXPECT_EQ(s["count"], 3);
  EXPECT_EQ(s["index"], 2);
  EXPECT_EQ(s["split"], "steps");
  EXPECT_EQ(s["start"], 200.0);
  EXPECT_EQ(s["end"], 250.0);
  ASSERT_EQ(s["spans"].size(), 3u) << s["spans"] << ": the step's mark, both forwards inside; not the unnamed thread's";
  EXPECT_EQ(s["spans"][0], (Json{{"lane", "steps"}, {"name", "step 3"}, {"ts", 200.0}, {"dur", 50.0}, {"args", Json::object()}}));
  EXPECT_EQ(s["spans"][1]["args"]["block"], 1) << "block forward #2's thread is the block forward lane";
  EXPECT_EQ(s["spans"][2]["lane"], "block forward");
  // The last reading before the step moves to its start, then the readings inside.
  EXPECT_EQ(s["counters"], (Json{{200.0, {{"pinned host", 2}}}, {220.0, {{"pinned host", 3}}}}));
  const Json first = Json::parse(trace::one_step(doc.dump(), 0));
  EXPECT_EQ(first["index"], 0);
  EXPECT_EQ(first["start"], 0.0);
  EXPECT_EQ(first["counters"], (Json{{90.0, {{"pinned host", 1}}}})) << "no reading before the first step";
  EXPECT_EQ(Json::parse(trace::one_step(doc.dump(), -3))["index"], 0) << "Python's negative indexes";
}

TEST_F(TraceFileTest, OneStepOfAnOlderTraceIsSplitByTheFirstBlocksForwards) {
  // No steps lane: each forward of block 1 (the lowest index here) starts a step; the last ends at the last event.
  const Json doc{{"traceEvents",
                  {lane(1, "block forward"), lane(2, "block backward"), span(1, "f1", 0, 5, {{"block", 1}}),
                   span(1, "f2", 5, 5, {{"block", 2}}), span(2, "b", 10, 30), span(1, "f1", 50, 5, {{"block", 1}}),
                   span(2, "b", 60, 40)}}};
  const Json last = Json::parse(trace::one_step(doc.dump()));
  EXPECT_EQ(last["split"], "block forward");
  EXPECT_EQ(last["count"], 2);
  EXPECT_EQ(last["start"], 50.0);
  EXPECT_EQ(last["end"], 100.0);
  const Json first = Json::parse(trace::one_step(doc.dump(), 0));
  EXPECT_EQ(first["end"], 50.0);
  EXPECT_EQ(first["spans"].size(), 3u);
}

TEST_F(TraceFileTest, OneStepOfATraceWithoutStepsIsTheWholeTraceAndRefusalsSayWhy) {
  const Json doc{{"traceEvents", {lane(4, "copy device -> host"), span(4, "copy", 3, 4), span(4, "copy", 20, 5)}}};
  const Json s = Json::parse(trace::one_step(doc.dump()));
  EXPECT_EQ(s["split"], "trace");
  EXPECT_EQ(s["count"], 1);
  EXPECT_EQ(s["start"], 3.0);
  EXPECT_EQ(s["end"], 25.0);
  EXPECT_EQ(thrown<config_error>([&] { trace::one_step(doc.dump(), 1); }),
            "--step 1: the trace has 1 step(s) (0 to 0, or -1 for the last)");
  EXPECT_EQ(thrown<config_error>([&] { trace::one_step(doc.dump(), -2); }),
            "--step -2: the trace has 1 step(s) (0 to 0, or -1 for the last)");
  const Json none{{"traceEvents", {span(4, "copy", 3, 4)}}};
  EXPECT_EQ(thrown<config_error>([&] { trace::one_step(none.dump()); }),
            "the trace has no tierflow events: was TIERFLOW_TRACE (or tierflow.trace) on while a wrapped model "
            "trained?");
}

}  // namespace
