// Note [Wrap refusals]: what tierflow.wrap refuses (the device budget below the parameters and their gradients,
// meta tensors, foreign parameters, repointed wrappers, deep copies), each in words naming what is accepted.
#include <gtest/gtest.h>

#include <string>

#include "tierflow/core/config.hpp"
#include "tierflow/tiering/wrap_checks.hpp"

using namespace tierflow;

namespace {

constexpr std::uint64_t kMiB = 1 << 20;

Config settings(std::map<std::string, std::string> values) { return Config::parse(values); }

TEST(WrapChecks, DeviceBudgetCountsTheParametersAndTheirGradientsOnTheDevice) {
  const Config auto_acts = settings({{"TIERFLOW_GPU_MEMORY", "10MiB"}, {"TIERFLOW_OFFLOAD_ACTIVATIONS", "auto"}});
  // 4 MiB of weights, 3 MiB of them trainable: 7 MiB with the gradients fit 10 MiB; 6 + 5 do not.
  EXPECT_EQ(tiering::device_budget_refusal(auto_acts, 10 * kMiB, {4 * kMiB, 3 * kMiB}), "");
  EXPECT_EQ(tiering::device_budget_refusal(auto_acts, 10 * kMiB, {5 * kMiB, 5 * kMiB}), "") << "exactly the budget";
  EXPECT_EQ(tiering::device_budget_refusal(auto_acts, 10 * kMiB, {6 * kMiB, 5 * kMiB}),
            "TIERFLOW_GPU_MEMORY=10485760 (keyword gpu_memory) gives the device 10.00 MiB, less than the model's "
            "parameters and their gradients take on it (11.00 MiB: 6.00 MiB of parameters), so no activation plan "
            "can fit; accepted: a budget above 11.00 MiB with room for the activations, or TIERFLOW_OFFLOAD_PARAMS=host "
            "(keyword offload_params) to keep the parameters off the device");
  // A fixed mode cannot keep the budget; gradients offloaded take no device memory.
  const Config recompute = settings({{"TIERFLOW_GPU_MEMORY", "10MiB"}, {"TIERFLOW_OFFLOAD_ACTIVATIONS", "recompute"}});
  const std::string why = tiering::device_budget_refusal(recompute, 10 * kMiB, {6 * kMiB, 5 * kMiB});
  EXPECT_NE(why.find("so TIERFLOW_OFFLOAD_ACTIVATIONS=recompute (keyword offload_activations) cannot keep the run "
                     "within it;"), std::string::npos) << why;
  const Config grads_off = settings({{"TIERFLOW_OFFLOAD_GRADIENTS", "on"}, {"TIERFLOW_OFFLOAD_OPTIMIZER", "host"}});
  EXPECT_EQ(tiering::device_budget_refusal(grads_off, 10 * kMiB, {6 * kMiB, 6 * kMiB}), "");
  EXPECT_NE(tiering::device_budget_refusal(grads_off, 10 * kMiB, {11 * kMiB, 0}), "");
  // Parameters offloaded: not the device's to hold.
  const Config params_host = settings({{"TIERFLOW_OFFLOAD_PARAMS", "host"}});
  EXPECT_EQ(tiering::device_budget_refusal(params_host, kMiB, {100 * kMiB, 100 * kMiB}), "");
}

TEST(WrapChecks, RefusalsNameWhatWasWrongAndWhatIsAccepted) {
  EXPECT_EQ(tiering::meta_refusal(3, "'fc.weight'", {4, 8}),
            "3 of the model's parameters and buffers are on the meta device (the first: 'fc.weight' [4, 8]): they "
            "have shapes but no values to train; accepted: a model whose tensors hold values on the CPU or a GPU "
            "(materialize it first, e.g. model.to_empty(device='cpu') then load its weights, or build it outside "
            "torch.device('meta'))");
  const std::string foreign = tiering::foreign_parameters_refusal(1, 5, {});
  EXPECT_EQ(foreign.rfind("1 of the optimizer's 5 parameters are not parameters of the model being wrapped (the "
                          "first has shape [])", 0), 0u) << foreign;
  EXPECT_NE(foreign.find("An optimizer over part of the model (frozen layers, a second optimizer) is fine"),
            std::string::npos);
  const std::string wrapper = tiering::wrapper_refusal("accelerate.AcceleratedOptimizer", "AdamW", "'step'");
  EXPECT_EQ(wrapper.rfind("the optimizer wrapper accelerate.AcceleratedOptimizer keeps its own reference to the AdamW "
                          "it wraps (attribute 'step'), so it cannot be pointed at tierflow's CPU optimizer;", 0), 0u)
      << wrapper;
  EXPECT_NE(tiering::deepcopy_refusal().find("Deep-copy the model before tierflow.wrap"), std::string::npos);
}

}  // namespace
