// The plan command's arguments (Note [Plan report]): where the blocks come from, the rates and shape
// arguments it accepts, the links of --pcie-gbps, and its line when the planner refuses.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/plan_report.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {
template <typename F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const config_error& e) {
    return e.what();
  }
  return "accepted";
}
}  // namespace

TEST(PlanArguments, BlocksComeFromAWholeShapeOrAProfile) {
  const std::vector<std::string> all{"layers", "hidden", "heads", "seq", "batch"};
  EXPECT_EQ(refusal([&] { check_blocks_source(false, all); }), "accepted");
  EXPECT_EQ(refusal([&] { check_blocks_source(true, {}); }), "accepted");
  EXPECT_EQ(refusal([&] { check_blocks_source(true, {"layers", "seq"}); }),
            "--profile and a shape (--layers, --seq) exclude each other");
  EXPECT_EQ(refusal([&] { check_blocks_source(false, {"layers", "heads"}); }),
            "give a shape (missing --hidden, --seq, --batch) or --profile FILE");
}

TEST(PlanArguments, RatesStayWhereEveryTimeIsFinite) {
  EXPECT_EQ(check_rate(20.0, "'20'", false), 20.0);
  EXPECT_EQ(check_rate(0.0, "'0'", true), 0.0);
  EXPECT_EQ(refusal([] { check_rate(0.0, "'0'", false); }), "'0' is not valid; accepted: a number from 1e-06 to 1e+06");
  EXPECT_EQ(refusal([] { check_rate(2e6, "'2e6'", true); }),
            "'2e6' is not valid; accepted: a number from 1e-06 to 1e+06, or 0 for none");
  EXPECT_EQ(refusal([] { check_rate(std::nullopt, "'nan'", false); }).rfind("'nan' is not valid", 0), 0u);
}

TEST(PlanArguments, ShapeArgumentsAreDecimalIntegersWithinTheLimits) {
  EXPECT_EQ(shape_argument("layers", "0012", "'0012'"), 12);
  EXPECT_EQ(refusal([] { shape_argument("layers", "10001", "'10001'"); }),
            "'10001' is not valid; accepted: an integer from 1 to 10000");
  for (const char* bad : {"0", "", "-1", "1e3", "99999999999999999999", "123456789012345678901"}) {
    EXPECT_NE(refusal([&] { shape_argument("layers", bad, "x"); }), "accepted") << bad;
  }
}

TEST(PlanArguments, PcieRateIsEachWayAndDuplexTwice) {
  const auto links = links_from_pcie_gbps(20);
  EXPECT_EQ(links.d2h, 20e9);
  EXPECT_EQ(links.h2d, 20e9);
  EXPECT_EQ(links.duplex, 40e9);
}

TEST(PlanArguments, ARefusedPlanSaysWhatSetTheBudget) {
  PlanCommandInputs inputs;
  inputs.blocks_from = "--profile 'p.json'";
  PlanCommandBudgets budgets;
  budgets.device_from = "the device's total memory";
  budgets.budgets.prefetch_bytes = 64;
  EXPECT_EQ(plan_refusal("tierflow: needs 3 GiB", true, inputs, budgets),
            "needs 3 GiB (the device budget: the device's total memory; pass --gpu-memory)");
  inputs.gpu_memory.source = SettingSource::kFlag;
  budgets.device_from = "--gpu-memory";
  EXPECT_EQ(plan_refusal("needs 3 GiB", true, inputs, budgets), "needs 3 GiB (the device budget: --gpu-memory)");
  EXPECT_EQ(plan_refusal("bytes past 2^63", false, inputs, budgets),
            "--profile 'p.json' with prefetch window 64 bytes: bytes past 2^63");
}
