#include <gtest/gtest.h>

#include "tierflow/tiering/saved_actions.hpp"

using namespace tierflow::tiering;

TEST(SavedActions, EachModeDoesWhatNoteActivationPlansSays) {
  const SavedClass all[] = {SavedClass::kExternal, SavedClass::kInput, SavedClass::kAttention, SavedClass::kSplit,
                            SavedClass::kCheap};
  for (SavedClass c : all) {
    EXPECT_EQ(saved_action(BlockMode::kKeep, c, true), SavedAction::kReference) << to_string(c);
    EXPECT_EQ(saved_action(BlockMode::kSwap, c, false),
              c == SavedClass::kExternal ? SavedAction::kReference : SavedAction::kSwap) << to_string(c);
  }
  // Recompute: only the inputs travel; parameters and buffers stay referenced.
  EXPECT_EQ(saved_action(BlockMode::kRecompute, SavedClass::kInput, false), SavedAction::kSwap);
  EXPECT_EQ(saved_action(BlockMode::kRecompute, SavedClass::kExternal, false), SavedAction::kReference);
  for (SavedClass c : {SavedClass::kAttention, SavedClass::kSplit, SavedClass::kCheap})
    EXPECT_EQ(saved_action(BlockMode::kRecompute, c, true), SavedAction::kRecompute) << to_string(c);
  // Split: attention whole, matmul rows in part, the rest recomputed ...
  EXPECT_EQ(saved_action(BlockMode::kSplit, SavedClass::kAttention, true), SavedAction::kSwap);
  EXPECT_EQ(saved_action(BlockMode::kSplit, SavedClass::kSplit, true), SavedAction::kSwapRows);
  EXPECT_EQ(saved_action(BlockMode::kSplit, SavedClass::kCheap, true), SavedAction::kRecompute);
  // ... and what is not exact is recomputed, never split.
  EXPECT_EQ(saved_action(BlockMode::kSplit, SavedClass::kAttention, false), SavedAction::kRecompute);
  EXPECT_EQ(saved_action(BlockMode::kSplit, SavedClass::kSplit, false), SavedAction::kRecompute);
}

TEST(SavedActions, SplitRowsRoundDownToTheGranuleAndSwapWholeOutputsAtOne) {
  EXPECT_EQ(split_rows(0.0, 1000, 8), 0);
  EXPECT_EQ(split_rows(0.37, 1000, 8), 368);   // floor(370 / 8) * 8
  EXPECT_EQ(split_rows(0.5, 1000, 1), 500);
  EXPECT_EQ(split_rows(0.999, 1000, 8), 992);
  EXPECT_EQ(split_rows(1.0, 1000, 8), 1000);   // everything: no matmul left to run
  EXPECT_EQ(split_rows(0.001, 1000, 8), 0);    // under one granule: nothing swapped
  EXPECT_EQ(split_rows(0.5, 0, 8), 0);
  EXPECT_EQ(split_rows(0.5, 7, 0), 3);         // a granule of 0 counts as 1
}
