// The uses of offloaded parameters (tiering/param_uses.hpp, Note [Parameter uses]) without torch: a recording
// host stands for ParamResidency.
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/param_uses.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

// Records every event as text; throws where told.
struct Recorder final : ParamUsesHost {
  std::vector<std::string> events;
  std::set<ParamId> resident;
  std::string throw_on;  // an event's text that throws (once recorded)

  void note(const std::string& e) {
    events.push_back(e);
    if (e == throw_on) throw std::runtime_error("refused: " + e);
  }
  void begin_forward(UnitId u, std::uint64_t x) override { note("bf " + std::to_string(u) + " " + std::to_string(x)); }
  void end_forward(UnitId u, std::uint64_t x) override { note("ef " + std::to_string(u) + " " + std::to_string(x)); }
  void begin_backward(UnitId u, std::uint64_t x) override { note("bb " + std::to_string(u) + " " + std::to_string(x)); }
  void end_backward(UnitId u, std::uint64_t x) override { note("eb " + std::to_string(u) + " " + std::to_string(x)); }
  void end_phase() override { note("phase"); }
  bool offloaded(ParamId p) override { return resident.count(p) == 0; }
  void hold(ParamId p) override { note("hold " + std::to_string(p)); }
  void unhold(ParamId p, const std::string& why) override {
    note("unhold " + std::to_string(p) + (why.empty() ? "" : " why"));
    last_why = why;
  }
  void attach(UnitId u, ParamId p) override { note("attach " + std::to_string(u) + " " + std::to_string(p)); }
  std::string last_why;
};

// Blocks 0 and 1 (params 10, 11), the rest unit 2 (the embedding 20, shared by the head: one parameter).
struct Fixture {
  Recorder host;
  ParamUses uses{{{10}, {11}, {20}}, 2, {"blocks.0.w", "blocks.1.w", "wte.weight"}, "host", host};
};

}  // namespace

TEST(ParamUses, AForwardUseThatDidNotBeginIsNotRecorded) {
  Fixture f;
  f.host.throw_on = "bf 1 0";
  EXPECT_THROW(f.uses.begin_forward(1, 0), std::runtime_error);
  EXPECT_EQ(f.uses.open(1), 0u);
  EXPECT_FALSE(f.uses.pop_forward(1).has_value());
  EXPECT_FALSE(f.uses.forward_open());
}

TEST(ParamUses, NestedForwardUsesEndInnermostFirst) {
  Fixture f;
  const auto model = f.uses.begin_forward(2, 0);
  const auto outer = f.uses.begin_forward(0, 4, 7);
  const auto inner = f.uses.begin_forward(0, 8);
  EXPECT_EQ(f.uses.open(0), 2u);
  auto use = f.uses.pop_forward(0);
  ASSERT_TRUE(use.has_value());
  EXPECT_EQ(use->token, inner);
  EXPECT_EQ(use->extra_bytes, 8u);
  EXPECT_EQ(f.uses.open(0), 1u);
  f.uses.end_forward(*use);
  use = f.uses.pop_forward();  // innermost of any unit
  EXPECT_EQ(use->token, outer);
  EXPECT_EQ(use->call, 7u);
  EXPECT_EQ(f.uses.pop_forward()->token, model);
  EXPECT_FALSE(f.uses.pop_forward().has_value());
  EXPECT_EQ(f.host.events, (std::vector<std::string>{"bf 2 0", "bf 0 4", "bf 0 8", "ef 0 8"}));
}

TEST(ParamUses, ACallsBackwardUseEndsWhenItsLastNodesHaveRun) {
  Fixture f;
  const CallId c = f.uses.new_call(1, 3);
  f.uses.watched(c);
  EXPECT_EQ(f.uses.unbegun(1), std::vector<CallId>{c});
  ASSERT_TRUE(f.uses.begin_backward(false));
  EXPECT_FALSE(f.uses.begin_backward(false));  // another output of the model
  EXPECT_TRUE(f.uses.begin_call(c));
  EXPECT_FALSE(f.uses.begin_call(c));  // another output of the call
  EXPECT_TRUE(f.uses.unbegun(1).empty());
  f.uses.expect_ends(c, 2);
  EXPECT_EQ(f.uses.open(1), 1u);
  f.uses.edge_ran(c);
  EXPECT_EQ(f.uses.open(1), 1u);
  f.uses.edge_ran(c);
  EXPECT_EQ(f.uses.open(1), 0u);
  f.uses.edge_ran(c);  // a node of the call that ran again: nothing
  f.uses.close_backward();
  EXPECT_EQ(f.host.events, (std::vector<std::string>{"bb 1 3", "eb 1 3", "phase"}));
}

TEST(ParamUses, ARetainedGraphsSecondBackwardBeginsTheCallAgain) {
  Fixture f;
  const CallId c = f.uses.new_call(0, 0);
  for (int backward = 0; backward < 2; ++backward) {
    f.uses.begin_backward(false);
    EXPECT_TRUE(f.uses.begin_call(c));
    f.uses.expect_ends(c, 0);  // no last node runs: ends at once
    EXPECT_EQ(f.uses.open(0), 0u);
    f.uses.close_backward();
  }
  EXPECT_EQ(f.host.events, (std::vector<std::string>{"bb 0 0", "eb 0 0", "phase", "bb 0 0", "eb 0 0", "phase"}));
}

TEST(ParamUses, TheEndOfBackwardEndsOpenCallsHigherUnitsFirstThenHoldsThenThePhase) {
  Fixture f;
  f.uses.begin_forward(2, 0);
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kNothing);  // its unit's use is open
  f.uses.pop_forward(2);
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kHeld);  // the model's forward reads the head inline
  f.uses.model_ends(true);
  f.host.events.clear();
  f.uses.begin_backward(false);
  const CallId a = f.uses.new_call(0, 0), b = f.uses.new_call(1, 0);
  f.uses.begin_call(a);
  f.uses.begin_call(b);
  f.uses.close_backward();
  EXPECT_EQ(f.host.events, (std::vector<std::string>{"bb 0 0", "bb 1 0", "eb 1 0", "eb 0 0", "unhold 20 why",
                                                     "phase"}));
  EXPECT_NE(f.host.last_why.find("parameter 'wte.weight' lives on the host"), std::string::npos) << f.host.last_why;
  EXPECT_NE(f.host.last_why.find("retain_graph=True"), std::string::npos);
  EXPECT_EQ(f.uses.open(0) + f.uses.open(1), 0u);
  EXPECT_FALSE(f.uses.held(20));
}

TEST(ParamUses, AnErrorAtTheEndOfBackwardStillReleasesTheHoldsAndEndsThePhase) {
  Fixture f;
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kHeld);
  f.uses.model_ends(true);
  f.uses.begin_backward(false);
  f.uses.begin_call(f.uses.new_call(1, 0));
  f.host.throw_on = "eb 1 0";
  EXPECT_THROW(f.uses.close_backward(), std::runtime_error);
  EXPECT_FALSE(f.uses.in_backward());
  EXPECT_FALSE(f.uses.held(20));
  EXPECT_EQ(f.host.events.back(), "phase");
  EXPECT_EQ(f.host.events[f.host.events.size() - 2], "unhold 20 why");
}

TEST(ParamUses, ABackwardInsideAForwardOrBuildingAGraphIsRefusedChangingNothing) {
  Fixture f;
  f.uses.begin_forward(0, 0);
  try {
    f.uses.begin_backward(false);
    FAIL() << "accepted a backward inside the forward";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("inside the model's forward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TIERFLOW_OFFLOAD_PARAMS=none"), std::string::npos);
  }
  f.uses.pop_forward();
  try {
    f.uses.begin_backward(true);
    FAIL() << "accepted a double backward";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("create_graph=True"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(f.uses.in_backward());
  EXPECT_EQ(f.uses.backwards(), 0u);
}

TEST(ParamUses, ABlockReadingAnotherModulesWeightTakesItIntoItsUnitElsewhereItIsHeld) {
  Fixture f;
  f.uses.begin_forward(2, 0);  // the model's own unit
  f.uses.begin_forward(1, 0);
  f.uses.begin_forward(0, 0);  // a block inside a block: the innermost takes it
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kNothing);  // the rest unit's use is open
  f.uses.pop_forward(2);
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kAttached);
  EXPECT_EQ(f.host.events.back(), "attach 0 20");
  f.uses.pop_forward(0);
  f.uses.pop_forward(1);
  f.uses.begin_forward(0, 0);
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kNothing);  // a member of block 0 now
  EXPECT_EQ(f.uses.read(20, true), ReadVerdict::kNothing);
  f.uses.pop_forward(0);
  f.uses.begin_forward(1, 0);
  EXPECT_EQ(f.uses.read(10, true), ReadVerdict::kHeld);  // in a recompute (autograd runs): held, not attached
  EXPECT_EQ(f.uses.read(10, false), ReadVerdict::kNothing);  // held already
  f.host.resident.insert(11);
  f.uses.pop_forward(1);
  EXPECT_EQ(f.uses.read(11, false), ReadVerdict::kNothing);  // resident: nothing to fetch
  EXPECT_EQ(f.uses.read(99, false), ReadVerdict::kNothing);  // not offloaded by this model
  f.uses.forget({20});
  EXPECT_EQ(f.uses.read(20, false), ReadVerdict::kNothing);
}

TEST(ParamUses, HoldsOfAForwardNoBackwardFollowedEndWithItOrAtTheNextForward) {
  Fixture f;
  f.uses.read(20, false);
  f.uses.model_ends(false);  // evaluation: no graph waits
  EXPECT_FALSE(f.uses.held(20));
  EXPECT_EQ(f.host.events.back(), "unhold 20");  // no error left: nothing was released under a backward
  f.uses.read(20, false);
  f.uses.model_ends(true);  // a graph waits for its backward
  f.uses.model_begins();    // two forwards before one backward keep it
  f.uses.model_ends(false);
  EXPECT_TRUE(f.uses.held(20));
  f.uses.begin_backward(false);
  f.uses.close_backward();
  EXPECT_FALSE(f.uses.held(20));
  f.uses.read(20, false);
  f.uses.model_begins();  // after the backward, a forward that raised before its end
  EXPECT_FALSE(f.uses.held(20));
}

TEST(ParamUses, ACallWhoseObjectGoesWhileItsUseIsOpenStillEnds) {
  Fixture f;
  const CallId c = f.uses.new_call(0, 2), gone = f.uses.new_call(1, 0);
  f.uses.watched(gone);
  f.uses.drop_call(gone);  // never begun: its record goes now
  EXPECT_TRUE(f.uses.unbegun(1).empty());
  EXPECT_EQ(f.uses.calls(), 1u);
  f.uses.begin_backward(false);
  f.uses.begin_call(c);
  f.uses.expect_ends(c, 1);
  f.uses.drop_call(c);
  EXPECT_EQ(f.uses.calls(), 1u);
  f.uses.edge_ran(c);
  EXPECT_EQ(f.uses.open(0), 0u);
  EXPECT_EQ(f.uses.calls(), 0u);
  EXPECT_EQ(f.host.events.back(), "eb 0 2");
}

TEST(ParamUses, ARecomputeOpensAUseOnlyInBackwardWhereNoneIsOpen) {
  Fixture f;
  EXPECT_FALSE(f.uses.recompute_opens(0));  // not in backward
  f.uses.begin_backward(false);
  const CallId open = f.uses.new_call(1, 0);
  f.uses.begin_call(open);
  EXPECT_FALSE(f.uses.recompute_opens(1));  // its call's use is open
  ASSERT_TRUE(f.uses.recompute_opens(0));
  const CallId c = f.uses.new_call(0, 0);
  f.uses.begin_call(c);
  f.uses.recompute_begins(c, true);
  EXPECT_FALSE(f.uses.recompute_ends(1).has_value());
  const auto r = f.uses.recompute_ends(0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->first, c);
  EXPECT_TRUE(r->second);
  EXPECT_FALSE(f.uses.recompute_ends(0).has_value());
  f.uses.end_call(c);
  f.uses.end_call(c);  // once
  EXPECT_EQ(f.uses.open(0), 0u);
  EXPECT_EQ(f.host.events, (std::vector<std::string>{"bb 1 0", "bb 0 0", "eb 0 0"}));
}

TEST(ParamGathers, NestedContextsFetchOnceAndTheOutermostReleasesWrittenBackIfAnyLevelModified) {
  ParamGathers g;
  EXPECT_EQ(g.fresh({1, 2}), (std::vector<ParamId>{1, 2}));
  g.enter({1, 2}, false, {0, 0});
  EXPECT_EQ(g.fresh({2, 3}), std::vector<ParamId>{3});  // 2 is on the device already
  g.enter({2, 3}, true, {5, 0});                          // an inner level asks to modify 2
  auto r = g.exit({2, 3}, {5, 0});
  EXPECT_EQ(r.write_back, std::vector<ParamId>{3});  // 2 stays: the outer context holds it
  EXPECT_TRUE(r.discard.empty());
  EXPECT_TRUE(g.held(2));
  r = g.exit({1, 2}, {0, 0});
  EXPECT_EQ(r.write_back, std::vector<ParamId>{2});
  EXPECT_EQ(r.discard, std::vector<ParamId>{1});
  EXPECT_FALSE(g.any());
  g.enter({4}, true, {0});
  g.enter({4}, false, {0});  // an inner read-only level does not take back the outer's modify
  g.exit({4}, {0});
  EXPECT_EQ(g.exit({4}, {0}).write_back, std::vector<ParamId>{4});
}

TEST(ParamGathers, AnInPlaceWriteWithoutModifyIsNamedAgainstTheVersionWhenFetched) {
  ParamGathers g;
  g.enter({1, 2}, false, {3, 7});
  g.enter({1}, false, {4});  // an inner level: the version when fetched (3) is kept
  g.exit({1}, {4});
  const auto r = g.exit({1, 2}, {4, 7});
  EXPECT_EQ(r.discard, (std::vector<ParamId>{1, 2}));
  EXPECT_EQ(r.edited, std::vector<ParamId>{1});
  g.enter({1}, true, {0});
  EXPECT_TRUE(g.exit({1}, {9}).edited.empty());  // modify: written back, nothing refused
}

TEST(ParamGathers, AForwardThatBuildsAGraphInsideAContextIsRefusedAndNotCounted) {
  ParamGathers g;
  g.forward_begins(true, "GPT");  // nothing held: counted
  EXPECT_THROW(g.check_outside_passes(false, "GPT"), config_error) << "inside the model's forward";
  g.forward_ends();
  g.check_outside_passes(false, "GPT");
  g.enter({1}, false, {0});
  try {
    g.forward_begins(true, "GPT");
    FAIL() << "a training forward inside gathered()";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("a forward of GPT that builds a graph"), std::string::npos);
  }
  g.check_outside_passes(false, "GPT");  // the refused forward was not counted
  g.forward_begins(false, "GPT");         // evaluation under no_grad reads the gathered values
  g.forward_ends();
  g.forward_ends();  // one too many (a forward that raised): no underflow
  g.check_outside_passes(false, "GPT");
  try {
    g.check_outside_passes(true, "GPT");
    FAIL() << "gathered() inside a backward";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("inside GPT's backward"), std::string::npos);
  }
}

TEST(ParamGathers, TheRefusalsNameWhatTheUserPassed) {
  const std::string five = gathered_edited_error({"a.w", "b.w", "c.w", "d.w", "e.w"});
  EXPECT_NE(five.find("'a.w', 'b.w', 'c.w', 'd.w' and others written in place"), std::string::npos) << five;
  EXPECT_EQ(gathered_edited_error({"a.w"}),
            "tierflow.gathered(..., modify=False): 'a.w' written in place inside the block; the write was discarded "
            "(modify=False releases without writing back): pass modify=True to keep it");
  EXPECT_NE(gathered_step_refusal("AdamW").find("AdamW.step() inside a gathered() block"), std::string::npos);
  EXPECT_NE(assign_refusal("h.w", "nvme").find("replace parameter 'h.w', which lives on the nvme between uses "
                                              "(TIERFLOW_OFFLOAD_PARAMS=nvme"),
            std::string::npos);
  const std::string half = conversion_refusal("GPT", "<lambda>", "h.w", "torch.float32 on cpu", "torch.float16 on cpu",
                                              "host");
  EXPECT_NE(half.find("GPT._apply() after tierflow.wrap would make parameter 'h.w' (torch.float32 on cpu) "
                      "torch.float16 on cpu"),
            std::string::npos)
      << half;
  EXPECT_NE(conversion_refusal("GPT", "half", "h.w", "", "", "host").find("call .half() before tierflow.wrap"),
            std::string::npos);
}
