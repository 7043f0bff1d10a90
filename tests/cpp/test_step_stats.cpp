// tiering::StepRecorder: per-step figures from counter snapshots (Note [Step stats]).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/trace.hpp"
#include "tierflow/tiering/step_stats.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

constexpr std::uint64_t kMs = 1'000'000;  // ns

/// Counters whose totals are `k` times a base of distinct values per field.
StepCounters at(std::uint64_t k) {
  StepCounters c;
  c.device_to_host_bytes = 1000 * k;
  c.host_to_device_bytes = 700 * k;
  c.host_to_nvme_bytes = 300 * k;
  c.nvme_to_host_bytes = 200 * k;
  c.copy_wait_ns = 3 * kMs * k;
  c.cpu_step_ns = 5 * kMs * k;
  c.nvme_wait_ns = 7 * kMs * k;
  c.param_wait_ns = 11 * kMs * k;
  c.device_activations = {100, 100};  // every tier read at its meter's peak: exact unless a test says otherwise
  c.pinned_host = {50, 50};
  c.nvme = {0, 0};
  return c;
}

const std::vector<StepMark> kForwardAndStep = {StepMark::kForwardBegin, StepMark::kForwardEnd, StepMark::kStepBegin,
                                               StepMark::kStepEnd};
const std::vector<StepMark> kForwardThenStep = {StepMark::kForwardBegin, StepMark::kStepBegin, StepMark::kStepEnd};

/// Marks `marks` a millisecond apart from `t_ms` ms, `tier` of `c` read as `readings[i]` at mark i (the last
/// reading at every mark after it).
void mark_readings(StepRecorder& r, std::uint64_t t_ms, StepCounters& c, TierReading StepCounters::*tier,
                   const std::vector<StepMark>& marks, const std::vector<TierReading>& readings) {
  for (std::size_t i = 0; i < marks.size(); ++i) {
    if (i < readings.size()) c.*tier = readings[i];
    r.mark(marks[i], (t_ms + i) * kMs, c);
  }
}

}  // namespace

TEST(StepRecorder, OneStepTakesEachSpanAndTheCountersDifferences) {
  StepRecorder r;
  const std::uint64_t t0 = 1000 * kMs;
  r.mark(StepMark::kForwardBegin, t0, at(1));
  r.mark(StepMark::kForwardEnd, t0 + 10 * kMs, at(1));
  r.mark(StepMark::kBackwardBegin, t0 + 12 * kMs, at(2));
  r.mark(StepMark::kBackwardEnd, t0 + 32 * kMs, at(2));
  r.mark(StepMark::kStepBegin, t0 + 33 * kMs, at(3));
  EXPECT_TRUE(r.open());
  r.mark(StepMark::kStepEnd, t0 + 37 * kMs, at(4));
  EXPECT_FALSE(r.open());
  ASSERT_EQ(r.steps().size(), 1u);
  const StepStats s = *r.last();
  EXPECT_EQ(s.step, 1u);
  EXPECT_EQ(s.forwards, 1u);
  EXPECT_EQ(s.backwards, 1u);
  EXPECT_DOUBLE_EQ(s.forward_s, 0.010);
  EXPECT_DOUBLE_EQ(s.backward_s, 0.020);
  EXPECT_DOUBLE_EQ(s.step_s, 0.004);
  EXPECT_DOUBLE_EQ(s.wall_s, 0.037);
  // from the first mark's counters (k=1) to the last's (k=4): 3 times each base
  EXPECT_EQ(s.device_to_host_bytes, 3000u);
  EXPECT_EQ(s.host_to_device_bytes, 2100u);
  EXPECT_EQ(s.host_to_nvme_bytes, 900u);
  EXPECT_EQ(s.nvme_to_host_bytes, 600u);
  EXPECT_DOUBLE_EQ(s.exposed_copy_wait_s, 0.009);
  EXPECT_DOUBLE_EQ(s.exposed_cpu_step_s, 0.015);
  EXPECT_DOUBLE_EQ(s.exposed_nvme_wait_s, 0.021);
}

TEST(StepRecorder, MicroBatchesAddUpUntilStep) {
  StepRecorder r;  // an optimizer is watched: a forward after a backward goes on with the same step
  std::uint64_t t = 5 * kMs;
  for (int i = 0; i < 2; ++i) {
    r.mark(StepMark::kForwardBegin, t, at(1));
    r.mark(StepMark::kForwardEnd, t + 2 * kMs, at(1));
    r.mark(StepMark::kBackwardBegin, t + 3 * kMs, at(1));
    r.mark(StepMark::kBackwardEnd, t + 6 * kMs, at(1));
    t += 10 * kMs;
  }
  EXPECT_TRUE(r.steps().empty());
  r.mark(StepMark::kStepBegin, t, at(1));
  r.mark(StepMark::kStepEnd, t + kMs, at(1));
  ASSERT_EQ(r.steps().size(), 1u);
  EXPECT_EQ(r.last()->forwards, 2u);
  EXPECT_EQ(r.last()->backwards, 2u);
  EXPECT_DOUBLE_EQ(r.last()->forward_s, 0.004);
  EXPECT_DOUBLE_EQ(r.last()->backward_s, 0.006);
  EXPECT_DOUBLE_EQ(r.last()->step_s, 0.001);
}

TEST(StepRecorder, BackwardWithoutItsEndEndsAtStep) {
  StepRecorder r;
  r.mark(StepMark::kForwardBegin, 10 * kMs, at(1));
  r.mark(StepMark::kForwardEnd, 11 * kMs, at(1));
  r.mark(StepMark::kBackwardBegin, 12 * kMs, at(1));
  r.mark(StepMark::kStepBegin, 20 * kMs, at(1));
  r.mark(StepMark::kStepEnd, 21 * kMs, at(1));
  EXPECT_DOUBLE_EQ(r.last()->backward_s, 0.008);
}

TEST(StepRecorder, WithoutAnOptimizerTheNextForwardEndsTheStep) {
  StepRecorder r(10, /*ends_at_step=*/false);
  r.mark(StepMark::kForwardBegin, 10 * kMs, at(1));
  r.mark(StepMark::kForwardEnd, 12 * kMs, at(1));
  r.mark(StepMark::kForwardBegin, 13 * kMs, at(1));  // a second forward before any backward: same step
  r.mark(StepMark::kForwardEnd, 14 * kMs, at(1));
  r.mark(StepMark::kBackwardBegin, 15 * kMs, at(2));
  r.mark(StepMark::kBackwardEnd, 18 * kMs, at(2));
  EXPECT_TRUE(r.steps().empty());
  r.mark(StepMark::kForwardBegin, 30 * kMs, at(3));
  ASSERT_EQ(r.steps().size(), 1u);
  EXPECT_EQ(r.last()->forwards, 2u);
  EXPECT_DOUBLE_EQ(r.last()->wall_s, 0.020);
  EXPECT_EQ(r.last()->device_to_host_bytes, 2000u);
  EXPECT_TRUE(r.open()) << "the forward that ended the step begins the next";
  r.mark(StepMark::kForwardEnd, 31 * kMs, at(3));
  r.mark(StepMark::kBackwardBegin, 32 * kMs, at(3));
  r.set_ends_at_step(true);
  r.mark(StepMark::kForwardBegin, 40 * kMs, at(4));
  EXPECT_EQ(r.steps().size(), 1u) << "with an optimizer watched, only step() ends a step";
}

TEST(StepRecorder, PeakIsTheMetersWhenItRoseDuringTheStep) {
  StepRecorder r;
  StepCounters c = at(1);
  // a new all-time peak (250) reached between the marks
  mark_readings(r, 10, c, &StepCounters::device_activations, kForwardAndStep, {{0, 100}, {40, 100}, {0, 250}});
  EXPECT_EQ(r.last()->peak_device_activation_bytes, 250u);
  EXPECT_TRUE(r.last()->peaks_exact);
}

TEST(StepRecorder, PeakBelowTheAllTimePeakIsTheHighestReading) {
  StepRecorder r;
  StepCounters c = at(1);
  // an earlier step reached 500
  mark_readings(r, 10, c, &StepCounters::device_activations, kForwardAndStep, {{5, 500}, {120, 500}, {30, 500}});
  EXPECT_EQ(r.last()->peak_device_activation_bytes, 120u);
  EXPECT_FALSE(r.last()->peaks_exact) << "120 is a lower bound: the meter's 500 may or may not be this step's";

  // read at the all-time peak: exact
  mark_readings(r, 20, c, &StepCounters::device_activations, kForwardAndStep, {{5, 500}, {500, 500}});
  EXPECT_EQ(r.last()->peak_device_activation_bytes, 500u);
  EXPECT_TRUE(r.last()->peaks_exact);
}

TEST(StepRecorder, TierWithoutAMeterPeakHasItsReadings) {
  StepRecorder r;
  StepCounters c = at(1);
  mark_readings(r, 10, c, &StepCounters::nvme, kForwardAndStep,
                {{64, TierReading::kNoPeak}, {192, TierReading::kNoPeak}, {0, TierReading::kNoPeak}});
  EXPECT_EQ(r.last()->peak_nvme_bytes, 192u);
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 50u);
  EXPECT_FALSE(r.last()->peaks_exact);
}

/// A tier's reading with a window (Note [Window peak]).
TierReading windowed(std::int64_t current, std::int64_t window) { return {current, TierReading::kNoPeak, window}; }

TEST(StepRecorder, WindowedPeakBelowAnEarlierStepsIsExact) {
  StepRecorder r;
  StepCounters c = at(1);
  // 500 between the marks, gone by the reading
  mark_readings(r, 10, c, &StepCounters::pinned_host, kForwardThenStep, {windowed(0, 0), windowed(10, 500)});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 500u);
  // the second step went to 120 only, below the first's 500
  mark_readings(r, 20, c, &StepCounters::pinned_host, kForwardAndStep,
                {windowed(20, 20), windowed(30, 120), windowed(5, 90), windowed(5, 5)});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 120u);
  c.device_activations = windowed(0, 0);
  c.nvme = windowed(0, 0);
  r.mark(StepMark::kForwardBegin, 30 * kMs, c);
  c.device_activations = windowed(0, 64);
  c.nvme = windowed(0, 32);
  r.mark(StepMark::kStepBegin, 31 * kMs, c);
  r.mark(StepMark::kStepEnd, 32 * kMs, c);
  EXPECT_EQ(r.last()->peak_device_activation_bytes, 64u);
  EXPECT_EQ(r.last()->peak_nvme_bytes, 32u);
  EXPECT_TRUE(r.last()->peaks_exact) << "every tier windowed: exact";
}

TEST(StepRecorder, TheFirstMarksWindowIsTheTimeBeforeTheStep) {
  StepRecorder r;
  StepCounters c = at(1);
  // 900 before the step began (between steps)
  mark_readings(r, 10, c, &StepCounters::pinned_host, kForwardThenStep,
                {windowed(40, 900), windowed(10, 60), windowed(10, 10)});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 60u);
  // a reading above the windows after it counts (the step held it)
  mark_readings(r, 20, c, &StepCounters::pinned_host, kForwardThenStep, {windowed(70, 70), windowed(0, 30)});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 70u);
}

TEST(StepRecorder, AStepEndingAtTheNextForwardHasTheWindowUpToIt) {
  StepRecorder r(10, false);
  StepCounters c = at(1);
  c.pinned_host = windowed(0, 0);
  r.mark(StepMark::kForwardBegin, 10 * kMs, c);
  r.mark(StepMark::kBackwardBegin, 11 * kMs, c);
  r.mark(StepMark::kBackwardEnd, 12 * kMs, c);
  c.pinned_host = windowed(0, 300);  // after the backward, before the next forward (the user's optimizer)
  r.mark(StepMark::kForwardBegin, 20 * kMs, c);
  ASSERT_EQ(r.steps().size(), 1u);
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 300u);
  c.pinned_host = windowed(0, 7);
  r.mark(StepMark::kBackwardBegin, 21 * kMs, c);
  r.mark(StepMark::kBackwardEnd, 22 * kMs, c);
  r.mark(StepMark::kForwardBegin, 30 * kMs, c);
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 7u) << "the 300 was the first step's";
}

TEST(StepRecorder, ATierReadWithoutAWindowFallsBackOnItsMeter) {
  StepRecorder r;
  StepCounters c = at(1);
  // one mark without a window (the second): the step's window has a hole
  mark_readings(r, 10, c, &StepCounters::pinned_host, kForwardThenStep,
                {windowed(0, 0), {0, 50, TierReading::kNoPeak}, windowed(0, 20)});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 0u) << "the readings only (the all-time peak did not rise)";
  EXPECT_FALSE(r.last()->peaks_exact);
}

TEST(StepRecorder, ParamWaitIsItsOwnFigure) {
  StepRecorder r;
  r.mark(StepMark::kForwardBegin, 10 * kMs, at(1));
  r.mark(StepMark::kStepBegin, 11 * kMs, at(2));
  r.mark(StepMark::kStepEnd, 12 * kMs, at(3));
  EXPECT_DOUBLE_EQ(r.last()->exposed_param_wait_s, 0.022);
  EXPECT_DOUBLE_EQ(r.last()->exposed_copy_wait_s, 0.006) << "the activations' copies apart";
  StepStats a = *r.last(), b = a;
  b.exposed_param_wait_s = 0.002;
  EXPECT_DOUBLE_EQ(mean_of_steps({a, b}).exposed_param_wait_s, 0.012);
}

TEST(StepRecorder, PeaksStartOverEachStep) {
  StepRecorder r;
  StepCounters c = at(1);
  mark_readings(r, 10, c, &StepCounters::pinned_host, kForwardThenStep, {{900, 900}, {0, 900}});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 900u);
  mark_readings(r, 20, c, &StepCounters::pinned_host, kForwardThenStep, {{30, 900}, {70, 900}});
  EXPECT_EQ(r.last()->peak_pinned_host_bytes, 70u) << "the first step's 900 is not this step's";
}

TEST(StepRecorder, CountersSeenOutOfOrderGiveZeroNotAWrap) {
  StepRecorder r;
  r.mark(StepMark::kForwardBegin, 10 * kMs, at(3));
  r.mark(StepMark::kStepBegin, 11 * kMs, at(2));
  r.mark(StepMark::kStepEnd, 12 * kMs, at(2));
  EXPECT_EQ(r.last()->device_to_host_bytes, 0u);
  EXPECT_DOUBLE_EQ(r.last()->exposed_cpu_step_s, 0.0);
}

TEST(StepRecorder, RingKeepsTheLastCapacitySteps) {
  StepRecorder r(3);
  EXPECT_FALSE(r.last().has_value());
  for (std::uint64_t i = 1; i <= 5; ++i) {
    r.mark(StepMark::kForwardBegin, i * 100 * kMs, at(i));
    r.mark(StepMark::kStepBegin, i * 100 * kMs + kMs, at(i));
    r.mark(StepMark::kStepEnd, i * 100 * kMs + 2 * kMs, at(i + 1));
  }
  ASSERT_EQ(r.steps().size(), 3u);
  EXPECT_EQ(r.steps().front().step, 3u);
  EXPECT_EQ(r.last()->step, 5u);
  EXPECT_EQ(r.recorded(), 5u);
  EXPECT_THROW(StepRecorder(0), logic_error);
  r.clear();
  EXPECT_TRUE(r.steps().empty());
  EXPECT_EQ(r.recorded(), 5u);
}

TEST(StepRecorder, EndWithoutABeginningIsIgnored) {
  StepRecorder r;
  r.mark(StepMark::kStepEnd, 10 * kMs, at(1));
  r.mark(StepMark::kBackwardEnd, 11 * kMs, at(1));
  EXPECT_TRUE(r.steps().empty());
  EXPECT_FALSE(r.open());
}

TEST(StepStatsSummary, MeanOfTimesAndBytesHighestPeak) {
  StepStats a, b;
  a.step = 4;
  b.step = 5;
  a.forward_s = 0.010;
  b.forward_s = 0.030;
  a.exposed_cpu_step_s = 0.002;
  b.exposed_cpu_step_s = 0.004;
  a.device_to_host_bytes = 100;
  b.device_to_host_bytes = 300;
  a.forwards = b.forwards = 2;
  a.peak_pinned_host_bytes = 700;
  b.peak_pinned_host_bytes = 500;
  b.peaks_exact = false;
  const StepStats m = mean_of_steps({a, b});
  EXPECT_EQ(m.step, 5u);
  EXPECT_DOUBLE_EQ(m.forward_s, 0.020);
  EXPECT_DOUBLE_EQ(m.exposed_cpu_step_s, 0.003);
  EXPECT_EQ(m.device_to_host_bytes, 200u);
  EXPECT_EQ(m.forwards, 2u);
  EXPECT_EQ(m.peak_pinned_host_bytes, 700u);
  EXPECT_FALSE(m.peaks_exact);
  EXPECT_THROW(mean_of_steps({}), logic_error);
}

TEST(StepStatsFields, EveryFieldReadsItsMember) {
  StepStats s;
  s.step = 9;
  s.exposed_nvme_wait_s = 0.5;
  s.peak_nvme_bytes = 77;
  std::size_t seen = 0;
  for (const auto& f : step_stat_fields()) {
    const std::string name = f.name;
    const double want = name == "step"                  ? 9.0
                        : name == "exposed_nvme_wait_s" ? 0.5
                        : name == "peak_nvme_bytes"     ? 77.0
                                                        : 0.0;
    if (want != 0.0) {
      EXPECT_EQ(f.of(s), want) << name;
      ++seen;
    }
  }
  EXPECT_EQ(seen, 3u);
  EXPECT_EQ(step_stat_fields().size(), 18u);
}

// The trace's steps lane (Note [Step stats]): each step ended, from its first forward to its end, one event
// "step <n>" with its number and forwards; at the last backward's end without an optimizer, at step()'s with one;
// nothing while the trace is off.
TEST(StepRecorder, EachStepEndedIsAnEventOnTheTracesStepsLane) {
  trace::clear();
  StepCounters c = at(1);
  StepRecorder quiet(10, true);  // the trace off: counted, not recorded
  for (const StepMark m : kForwardAndStep) quiet.mark(m, 1 * kMs, c);
  EXPECT_EQ(trace::event_count(), 0u);
  trace::start();
  StepRecorder no_optimizer(10, false);
  const std::vector<StepMark> micro_batch = {StepMark::kForwardBegin, StepMark::kForwardEnd,
                                             StepMark::kBackwardBegin, StepMark::kBackwardEnd};
  for (std::size_t i = 0; i < micro_batch.size(); ++i) no_optimizer.mark(micro_batch[i], (10 + i) * kMs, c);
  StepRecorder watched(10, true);  // two micro-batches, then step()
  std::uint64_t t_ms = 20;
  for (int k = 0; k < 2; ++k)
    for (const StepMark m : micro_batch) watched.mark(m, t_ms++ * kMs, c);
  watched.mark(StepMark::kStepBegin, t_ms++ * kMs, c);
  watched.mark(StepMark::kStepEnd, t_ms * kMs, c);
  trace::stop();
  const std::string json = trace::chrome_json();
  trace::clear();
  EXPECT_EQ(no_optimizer.recorded(), 0u) << "the recorder's step ends at the next forward; the trace's at backward";
  const auto count = [&json](const std::string& text) {
    std::size_t n = 0;
    for (std::size_t at = json.find(text); at != std::string::npos; at = json.find(text, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("\"name\":\"step 1\""), 2u) << json;  // each recorder numbers its own steps
  EXPECT_EQ(count("\"forwards\":1"), 1u) << json;
  EXPECT_EQ(count("\"forwards\":2"), 1u) << json;
  EXPECT_EQ(count("\"dur\":3000.0"), 1u) << json;   // 10 ms to 13 ms: first forward to backward's end
  EXPECT_EQ(count("\"dur\":9000.0"), 1u) << json;   // 20 ms to 29 ms: first forward to step()'s end
}
