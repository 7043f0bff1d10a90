// The fake front end of the plan driver's tests (Note [Plan driver]): it measures nothing and applies nothing,
// records what the driver asked for; test_plan_driver.cpp (phases, re-plan, the JSON) and
// test_plan_driver_growth.cpp (batch sizes, profiles read back) drive the driver through it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/log.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace tierflow::tiering::plan_driver_fakes {

// Routine planning lines are info (Note [Plan messages]): a test reading them asks for info while it runs.
struct InfoLogs {
  LogLevel before = tierflow::log_level();
  InfoLogs() { tierflow::set_log_level(LogLevel::kInfo); }
  ~InfoLogs() { tierflow::set_log_level(before); }
  InfoLogs(const InfoLogs&) = delete;
  InfoLogs& operator=(const InfoLogs&) = delete;
};

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::size_t kBlocks = 4;

inline BlockRecord block_record() {
  BlockRecord r;
  r.input_bytes = 1 * kMiB;
  r.attention_bytes = 4 * kMiB;
  r.split_bytes = 8 * kMiB;
  r.cheap_bytes = 4 * kMiB;
  r.split_flops = 6e9;
  r.attention_flops = 2e9;
  r.total_flops = 10e9;
  r.has_split_ops = true;
  r.forward_seconds = 0.010;
  r.backward_seconds = 0.020;
  r.parameter_bytes = 1 * kMiB;
  return r;
}

inline Links links() {
  Links l;
  l.d2h = l.h2d = 1e9;
  l.duplex = 2e9;
  return l;
}

// Measures nothing, applies nothing: records what the driver asked for.
struct FakeFront : PlanFrontEnd {
  SessionBudgetInputs inputs;
  std::vector<std::size_t> inexact;  // split blocks the first probe of each plan finds inexact
  bool inexact_once = true;
  int probes = 0, timings = 0, measures = 0;
  std::vector<DrivenPlan> applied;
  std::vector<AutoProfile> written;
  std::uint64_t first_saved = 0;
  std::uint64_t outside_bytes = 0;

  FakeFront() {
    inputs.device_budget_bytes = 1ull << 40;
    inputs.host_budget_bytes = 1ull << 40;
    inputs.prefetch_bytes = 4 * kMiB;
    inputs.parameter_bytes = kBlocks * kMiB;
  }
  SessionBudgetInputs budget_inputs() override { return inputs; }
  std::vector<std::size_t> inexact_splits(const std::vector<BlockPlan>& blocks) override {
    ++probes;
    std::vector<std::size_t> out;
    for (const std::size_t i : inexact)
      if (blocks.at(i).mode == BlockMode::kSplit) out.push_back(i);
    if (inexact_once) inexact.clear();
    return out;
  }
  std::optional<std::uint64_t> apply(const DrivenPlan& plan) override {
    applied.push_back(plan);
    return std::nullopt;
  }
  void start_timing() override { ++timings; }
  double probe_seconds = 0;  // how long measuring the timed step (its link probes) takes
  TimedStepMeasures measure_timed_step() override {
    ++measures;
    now += probe_seconds;
    TimedStepMeasures m;
    m.blocks.assign(kBlocks, block_record());
    m.links = links();
    m.outside_saved_bytes = outside_bytes;
    m.blocks_forward_seconds = 0.040;
    m.blocks_backward_seconds = 0.080;
    m.blocks_replay_seconds = 0.040;
    return m;
  }
  std::uint64_t first_step_saved_bytes() override { return first_saved; }
  void write_profile(const AutoProfile& profile) override { written.push_back(profile); }
  double now = 0;  // the clock: each forward's time, set by forward()
  double now_seconds() override { return now; }
};

// A forward of the model at time `t` (seconds).
inline PhaseAction forward(PlanDriver& d, FakeFront& f, const InputElements& inputs, double t) {
  f.now = t;
  return d.before_forward(inputs, f);
}

inline PlanDriverSettings settings(std::size_t blocks = kBlocks) {
  PlanDriverSettings s;
  s.blocks = blocks;
  s.prefetch_bytes = 4 * kMiB;
  return s;
}

inline InputElements batch(std::uint64_t tokens) { return {{"[0][0]", tokens}, {"[1]['labels']", tokens}}; }

// Three forwards of `tokens` a second apart: the profiling steps; the plan comes before the third.
inline void profile_and_plan(PlanDriver& d, FakeFront& f, std::uint64_t tokens = 128) {
  EXPECT_EQ(forward(d, f, batch(tokens), 1.0), PhaseAction::kNone);
  EXPECT_EQ(forward(d, f, batch(tokens), 2.0), PhaseAction::kStartTiming);
  EXPECT_EQ(forward(d, f, batch(tokens), 3.0), PhaseAction::kMeasureAndPlan);
}

// A device budget between recomputing every block and keeping them all: the plan moves bytes over the link.
inline std::uint64_t tight_budget(FakeFront& f) {
  PlanDriver probe(settings());
  profile_and_plan(probe, f);
  const Budgets b = probe.budgets(*probe.profile(), f);
  const auto& blocks = probe.profile()->file.blocks;
  const Plan low = forced_plan(blocks, links(), b, BlockMode::kRecompute);
  const Plan high = forced_plan(blocks, links(), b, BlockMode::kKeep);
  f.applied.clear();
  f.written.clear();
  f.probes = f.timings = f.measures = 0;
  return low.predicted_device_peak_bytes + (high.predicted_device_peak_bytes - low.predicted_device_peak_bytes) / 3;
}

inline bool any_mode(const DrivenPlan& p, BlockMode mode) {
  return std::any_of(p.plan.blocks.begin(), p.plan.blocks.end(), [mode](const BlockPlan& b) { return b.mode == mode; });
}

// Steps `seconds` apart from t = 3 on, the forwards after the plan's.
inline double run_steps(PlanDriver& d, FakeFront& f, int steps, double seconds, double t = 3.0,
                 std::uint64_t tokens = 128) {
  for (int i = 0; i < steps; ++i) {
    t += seconds;
    forward(d, f, batch(tokens), t);
  }
  return t;
}

}  // namespace tierflow::tiering::plan_driver_fakes
