// What parameter residency decides before any parameter moves (tiering/param_residency_plan.hpp), without torch.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/param_residency_plan.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

std::vector<ParamUnit> three_units() {
  std::vector<ParamUnit> plan(3);
  plan[0].residence = Tier::kHost;
  plan[0].params = {{1, 100}, {2, 50}};
  plan[1].residence = Tier::kNvme;
  plan[1].params = {{3, 200}};
  plan[2].residence = Tier::kGpu;  // resident: neither fetched nor counted
  plan[2].params = {{4, 1000}};
  return plan;
}

}  // namespace

TEST(ParamResidencyPlan, PrefetchesOneFetchedUnitAheadUnderTheBudget) {
  const ParamScheduleOptions o = param_residency_options(three_units(), 1000, 2);
  EXPECT_EQ(o.prefetch_bytes, 200u);  // the largest fetched unit, not the resident one's 1000
  EXPECT_EQ(o.device_budget_bytes, 1000u);
  EXPECT_EQ(o.blocks, 2u);
  EXPECT_EQ(param_residency_options(three_units(), 1000, 7).blocks, 3u);  // at most every unit
}

TEST(ParamResidencyPlan, ABudgetBelowTheLargestFetchedUnitIsRefused) {
  EXPECT_THROW(param_residency_options(three_units(), 199, 2), out_of_memory);
  EXPECT_NO_THROW(param_residency_options(three_units(), 200, 2));
}

TEST(ParamResidencyPlan, NvmeSpaceIsCheckedNamingTheSettings) {
  EXPECT_NO_THROW(check_param_nvme_space(0, 0));
  EXPECT_NO_THROW(check_param_nvme_space(4096, 4096));
  try {
    check_param_nvme_space(4097, 4096);
    FAIL() << "more parameter bytes than NVMe has were accepted";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("need 4097 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("TIERFLOW_NVME_MEMORY"), std::string::npos) << what;
  }
}

TEST(ParamResidencyPlan, ErrorsNameTheParameterAsTheUserKnowsIt) {
  EXPECT_EQ(name_parameter("parameter 42 needs 8 bytes", 42, "fc.weight"), "parameter 'fc.weight' needs 8 bytes");
  EXPECT_EQ(name_parameter("the budget is full", 42, "fc.weight"), "the budget is full");
}

TEST(ParamResidencyPlan, EachOffloadedParameterHasItsOwnStorage) {
  ParamStorages s;
  int a = 0, b = 0;
  s.add(&a, 1, "fc.weight");
  s.add(&b, 2, "fc.bias");
  EXPECT_NO_THROW(s.add(&a, 1, "fc.weight"));  // the same parameter again (a unit that reads another's)
  try {
    s.add(&a, 3, "head.weight");
    FAIL() << "two parameters over one storage were accepted";
  } catch (const config_error& e) {
    EXPECT_STREQ(e.what(), "offload_params: parameters 'fc.weight' and 'head.weight' share one storage; offloaded "
                           "parameters must each have their own");
  }
}
