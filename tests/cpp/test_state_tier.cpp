// The CPU AdamW's state-tier decisions (Note [NVMe optimizer faults] in state_tier.hpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/state_tier.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;

namespace {

std::string oom_text(const std::vector<ParamStateShape>& states, bool nvme, std::uint64_t budget) {
  try {
    check_state_pool(states, nvme, budget, "64MiB");
  } catch (const out_of_memory& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(StateTier, StateBytesCountMasterAndMomentsAndAmsgradsMax) {
  EXPECT_EQ(state_bytes({1000, false}), 12000u);
  EXPECT_EQ(state_bytes({1000, true}), 16000u);
  EXPECT_EQ(state_bytes({0, true}), 0u);
}

TEST(StateTier, HostTierNeedsEveryStateInWholePages) {
  // 100 elements: 1200 bytes, one page; 1024 elements amsgrad: 16384 bytes, four pages.
  const auto need = state_pool_need({{100, false}, {1024, true}}, /*nvme=*/false);
  EXPECT_EQ(need.bytes, 4096u + 16384u);
  EXPECT_EQ(need.what, "the states of 2 parameters (1124 elements, fp32 master, exp_avg, exp_avg_sq, max_exp_avg_sq)");
  EXPECT_EQ(state_pool_need({{100, false}}, false).what,
            "the states of 1 parameters (100 elements, fp32 master, exp_avg, exp_avg_sq)");
}

TEST(StateTier, NvmeTierNeedsTwoBuffersOfTheLargestState) {
  const auto need = state_pool_need({{100, false}, {1 << 20, false}, {10, true}}, /*nvme=*/true);
  EXPECT_EQ(need.bytes, 2u * 12u * (1u << 20));
  EXPECT_EQ(need.what, "two buffers of the largest parameter's state (12.00 MiB) that the states stream through from NVMe");
}

TEST(StateTier, PoolCheckRaisesOnlyPastTheBudgetNamingTheSetting) {
  const std::vector<ParamStateShape> states = {{1 << 20, false}};  // 12 MiB
  EXPECT_EQ(oom_text(states, false, 12u << 20), "");  // exactly fits
  EXPECT_EQ(oom_text(states, false, (12u << 20) - 1),
            "tierflow: the optimizer needs 12.00 MiB of pinned host memory for the states of 1 parameters "
            "(1048576 elements, fp32 master, exp_avg, exp_avg_sq), more than the pinned pool's budget of "
            "12.00 MiB (TIERFLOW_HOST_MEMORY=64MiB); raise TIERFLOW_HOST_MEMORY, keep the moments in 8 bits "
            "(TIERFLOW_OPTIMIZER_STATES=8bit, 6 bytes a parameter with the master) or put the states on NVMe "
            "(TIERFLOW_OFFLOAD_OPTIMIZER=nvme)");
  const std::string nvme = oom_text(states, true, 1 << 20);
  EXPECT_NE(nvme.find("needs 24.00 MiB of pinned host memory for two buffers"), std::string::npos) << nvme;
  EXPECT_EQ(nvme.substr(nvme.find("(TIERFLOW_HOST_MEMORY=")),
            "(TIERFLOW_HOST_MEMORY=64MiB); raise TIERFLOW_HOST_MEMORY, keep the moments in 8 bits "
            "(TIERFLOW_OPTIMIZER_STATES=8bit, 6 bytes a parameter with the master)")
      << nvme;
  // 8-bit moments already: the advice is the budget or NVMe.
  ParamStateShape q8{1 << 20, false};
  q8.format = StateFormat::k8bit;
  const std::string small = oom_text({q8}, false, 1 << 20);
  EXPECT_NE(small.find("with 8bit moments"), std::string::npos) << small;
  EXPECT_EQ(small.find("keep the moments in 8 bits"), std::string::npos) << small;
  EXPECT_EQ(oom_text({}, false, 0), "");  // nothing to hold
}

TEST(StateTier, DescribeUsesTheNameElseThePlace) {
  EXPECT_EQ(describe_parameter("2.weight", std::nullopt, {64, 32}), "'2.weight' [64, 32]");
  EXPECT_EQ(describe_parameter(std::nullopt, std::make_pair(std::size_t{1}, std::size_t{3}), {7}),
            "'param group 1 index 3' [7]");
  EXPECT_EQ(describe_parameter("bias", std::make_pair(std::size_t{0}, std::size_t{0}), {}), "'bias' []");
  EXPECT_EQ(describe_parameter(std::nullopt, std::nullopt, {2}), "'None' [2]");
}

TEST(StateTier, StepErrorNamesLostAndUnwrittenAndTheFirstLostReason) {
  const std::string text = nvme_step_error({{"'a' [1]", false, "disk full"},
                                            {"'b' [2]", true, "checksum mismatch"},
                                            {"'c' [3]", true, "checksum mismatch 2"}});
  EXPECT_EQ(text,
            "NVMe optimizer step: the state of 2 parameter(s) could not be read back and is lost: 'b' [2], 'c' [3]; "
            "opt.state_dict() still saves every intact state (the lost ones marked 'tierflow_state_lost'): restore "
            "these from your last good checkpoint (tierflow.CPUAdamW.fill_lost_states); the new state of 1 "
            "parameter(s) could not be written: 'a' [1]; their previous state and weights are kept, and a retry of "
            "step() steps only them. The other parameters stepped. First error: checksum mismatch");
}

TEST(StateTier, StepErrorNamesAtMostEightUnwritten) {
  std::vector<StepProblem> problems;
  for (int i = 0; i < 10; ++i) problems.push_back({"'p" + std::to_string(i) + "' [1]", false, "e" + std::to_string(i)});
  const std::string text = nvme_step_error(problems);
  EXPECT_NE(text.find("the new state of 10 parameter(s) could not be written: 'p0' [1]"), std::string::npos);
  EXPECT_NE(text.find("'p7' [1] ...; their previous state"), std::string::npos) << text;
  EXPECT_EQ(text.find("'p8'"), std::string::npos);
  EXPECT_EQ(text.find("is lost"), std::string::npos);
  EXPECT_EQ(text.substr(text.size() - 15), "First error: e0");
  problems.resize(8);
  EXPECT_EQ(nvme_step_error(problems).find(" ..."), std::string::npos);
  EXPECT_THROW(nvme_step_error({}), logic_error);
}

TEST(StateTier, LoadRefusalNamesEveryLostStateAndTheWayOut) {
  EXPECT_EQ(lost_states_refusal({"'a' [1]", "3"}),
            "tierflow CPUAdamW.load_state_dict: the state of 2 parameter(s) was lost when this state dict was "
            "saved ('a' [1], 3; 'tierflow_state_lost' marks them); take their states from an earlier checkpoint "
            "with tierflow.CPUAdamW.fill_lost_states(state_dict, earlier) and load that");
  EXPECT_THROW(lost_states_refusal({}), logic_error);
}

TEST(StateTier, FillRefusalNamesTheKeysWithoutAnIntactEarlierState) {
  EXPECT_EQ(unfilled_lost_states({"0", "'w'"}),
            "tierflow CPUAdamW.fill_lost_states: the earlier state dict has no intact state for parameter(s) "
            "[0, 'w']");
  EXPECT_THROW(unfilled_lost_states({}), logic_error);
}

TEST(StateTier, OffloadedGradientsNeedStepsDuringBackward) {
  EXPECT_FALSE(offload_gradients_refusal(false, false, "off", "nvme"));
  EXPECT_FALSE(offload_gradients_refusal(true, true, "on", "host"));
  const auto text = offload_gradients_refusal(true, false, "off", "host");
  ASSERT_TRUE(text);
  EXPECT_NE(text->find("TIERFLOW_OVERLAP_STEP=on (it is off)"), std::string::npos);
  EXPECT_NE(text->find("TIERFLOW_OFFLOAD_OPTIMIZER=host (it is host)"), std::string::npos);
  EXPECT_NE(text->find("accepted: those two settings, or TIERFLOW_OFFLOAD_GRADIENTS=off"), std::string::npos);
  EXPECT_NE(grad_scaler_refusal().find("accepted: bf16 without a scaler"), std::string::npos);
}

TEST(StateTier, OneStepAlsoHoldsTheMovingParametersGradientsAndNewWeights) {
  // 1000 fp32 elements on the device: 12000 bytes of states (3 pages), a 4000-byte gradient and a
  // 4000-byte staging (a page each); a CPU parameter (0) moves nothing.
  const auto need = state_pool_need({{1000, false, 4}, {1000, false, 0}}, /*nvme=*/false);
  EXPECT_EQ(need.bytes, 2u * 12288u + 2u * 4096u);
  EXPECT_EQ(need.what, "the states of 2 parameters (2000 elements, fp32 master, exp_avg, exp_avg_sq) and one "
                       "step's gradients and new weights of 1 parameters in pinned staging (8.00 KiB)");
  // bf16 on NVMe: two buffers of the largest state, plus 2 bytes per element twice.
  const auto nvme = state_pool_need({{1 << 20, false, 2}}, /*nvme=*/true);
  EXPECT_EQ(nvme.bytes, 2u * 12u * (1u << 20) + 2u * 2u * (1u << 20));
  // A budget that holds the states but not the step is refused, naming the bytes needed.
  const std::string text = oom_text({{1 << 20, false, 4}}, false, 12u << 20);
  EXPECT_NE(text.find("needs 20.00 MiB of pinned host memory"), std::string::npos) << text;
  EXPECT_EQ(oom_text({{1 << 20, false, 4}}, false, 20u << 20), "");
}
