// tiering::BlockWrites (Note [Replay side effects]): what a C++ trainer's blocks write in place in their forwards,
// which values a call keeps from before, what a rerun restores, and when a block is no longer rerun.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/replay_rule.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

TEST(BlockWrites, TheFirstCallKeepsEveryValueAndLaterOnesTheWrittenOnly) {
  BlockWrites w;
  BlockWrites::Before b = w.before(0, 3);  // one state tensor, two parameters
  EXPECT_FALSE(b.compared);
  EXPECT_EQ(b.keep, std::vector<bool>({true, true, true}));
  const BlockWrites::After a = w.after(0, 1, b, {true, false, false});  // the state written (running statistics)
  EXPECT_EQ(a.restore, std::vector<bool>({true, false, false}));
  EXPECT_EQ(a.refused_now, "");
  b = w.before(0, 3);
  EXPECT_TRUE(b.compared);  // by version counters from now on
  EXPECT_EQ(b.keep, std::vector<bool>({true, false, false}));
  // A later call that wrote nothing still restores what an earlier one wrote.
  EXPECT_EQ(w.after(0, 1, b, {false, false, false}).restore, std::vector<bool>({true, false, false}));
  EXPECT_EQ(w.refusal(0), "");
  EXPECT_FALSE(w.before(1, 3).compared);  // blocks apart
}

TEST(BlockWrites, AWriteWithNoValueKeptRefusesRerunsOnceNamingTheTensor) {
  BlockWrites w;
  w.after(2, 1, w.before(2, 3), {false, false, false});
  BlockWrites::Before b = w.before(2, 3);
  BlockWrites::After a = w.after(2, 1, b, {false, false, true});  // parameter 1 written: no value from before
  EXPECT_EQ(a.restore, std::vector<bool>({false, false, false}));
  EXPECT_NE(a.refused_now.find("parameter 1"), std::string::npos) << a.refused_now;
  EXPECT_EQ(w.refusal(2), a.refused_now);
  a = w.after(2, 1, w.before(2, 3), {true, false, false});  // said once; the first reason stays
  EXPECT_EQ(a.refused_now, "");
  EXPECT_NE(w.refusal(2).find("parameter 1"), std::string::npos);
  EXPECT_EQ(w.refusal(5), "");
}

TEST(BlockWrites, StateTensorsAreNamedApartFromParameters) {
  BlockWrites w;
  w.after(0, 2, w.before(0, 3), {false, false, false});
  const BlockWrites::After a = w.after(0, 2, w.before(0, 3), {false, true, false});
  EXPECT_NE(a.refused_now.find("state tensor 1"), std::string::npos) << a.refused_now;
}

TEST(BlockWrites, ADifferentNumberOfTensorsStartsTheBlockAgain) {
  BlockWrites w;
  w.after(0, 1, w.before(0, 2), {true, false});
  const BlockWrites::Before b = w.before(0, 3);  // the trainer passed another state list
  EXPECT_FALSE(b.compared);
  EXPECT_EQ(b.keep, std::vector<bool>({true, true, true}));
  EXPECT_THROW(w.after(0, 1, b, {true, false}), logic_error);  // not the call `before` was taken for
}
