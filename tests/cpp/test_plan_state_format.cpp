// The plan command's host and NVMe budgets with the CPU AdamW's state format (issue 39; Note [Transformer
// estimate], Optimizer states, and Note [Plan report]): bytes a parameter from TIERFLOW_OPTIMIZER_STATES.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/optimizer/state_format.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

using namespace tierflow;
using namespace tierflow::tiering;
using Json = nlohmann::ordered_json;

namespace {

constexpr StateFormat kFormats[] = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::k8bit};

TransformerShape small_shape() {
  TransformerShape s;
  s.layers = 4;
  s.hidden = 1024;
  s.heads = 16;
  s.seq = 1024;
  s.batch = 8;
  s.dtype_bytes = 2;
  s.vocab = 50304;
  return s;
}

OffloadTarget placement(const std::string& optimizer) { return parse_optimizer_placement(optimizer); }

// `python -m tierflow plan --layers 4 --hidden 1024 ... --optimizer <optimizer> --optimizer-states <states>
// --host-memory <host>` with given rates.
PlanCommandInputs inputs(const std::string& optimizer, StateFormat states, const std::string& host) {
  PlanCommandInputs in;
  in.gpu_memory = {"16GiB", SettingSource::kFlag};
  in.host_memory = {host, SettingSource::kFlag};
  in.prefetch = {"256MiB", SettingSource::kVariable};
  in.device_capacity_bytes = 80 * GiB;
  in.host_capacity_bytes = 128 * GiB;
  in.device_name = "cpu (emulated device)";
  in.optimizer = optimizer;
  in.optimizer_states = states;
  in.shape = small_shape();
  in.dtype_name = "bf16";
  in.state = estimate_training_state(*in.shape, placement(optimizer), states);
  in.head_bytes = estimate_head_device_bytes(*in.shape);
  in.blocks_from = "--layers 4 --hidden 1024";
  in.links = Links{20e9, 20e9, 40e9, 0, 0};
  in.flops_per_second = 100e12;
  in.links_given = true;
  return in;
}

std::string message_of(const PlanCommandInputs& in) {
  try {
    plan_command_budgets(in);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

}  // namespace

TEST(PlanStateFormat, BytesAParameterAreTheMasterAndTheFormatsMoments) {
  // bf16 parameters: an fp32 master (4) beside m and v.
  EXPECT_DOUBLE_EQ(cpu_optimizer_bytes_per_param(StateFormat::kFp32, 2), 12.0);
  EXPECT_DOUBLE_EQ(cpu_optimizer_bytes_per_param(StateFormat::kBf16, 2), 8.0);
  EXPECT_DOUBLE_EQ(cpu_optimizer_bytes_per_param(StateFormat::k8bit, 2), 6.0 + 8.0 / 256);
  // fp32 parameters keep an fp32 master on the host too (the parameter is the device's; measured by
  // tests/python/test_plan_model.py: optimizer.states.bytes is 12 bytes an fp32 parameter).
  EXPECT_DOUBLE_EQ(cpu_optimizer_bytes_per_param(StateFormat::kFp32, 4), 12.0);
  EXPECT_DOUBLE_EQ(cpu_optimizer_bytes_per_param(StateFormat::k8bit, 4), 6.0 + 8.0 / 256);
}

TEST(PlanStateFormat, StateBytesAreTheOptimizersBuffersToTheirPadding) {
  for (StateFormat f : kFormats) {
    for (std::uint64_t n : {std::uint64_t{256} * 1000, std::uint64_t{1}, std::uint64_t{257}, std::uint64_t{4099}}) {
      const std::uint64_t buffers = 4 * n + 2 * optimizer::moment_bytes(f, n);  // master, m, v
      const std::uint64_t counted = cpu_optimizer_state_bytes(f, n, 2);
      // Exact for whole blocks; the 8-bit codes' padding to 16 bytes (per moment) is not counted.
      EXPECT_LE(counted, buffers) << to_string(f) << " n " << n;
      EXPECT_LT(buffers - counted, 2 * 16u) << to_string(f) << " n " << n;
      if (n % 256 == 0) {
        EXPECT_EQ(counted, buffers) << to_string(f) << " n " << n;
      }
    }
  }
  EXPECT_EQ(cpu_optimizer_state_bytes(StateFormat::k8bit, 512, 4), 4 * 512 + 2 * (512 + 4 * 2)) << "a master for fp32";
}

TEST(PlanStateFormat, TrainingStateOnTheOptimizersTierFollowsTheFormat) {
  const TransformerShape s = small_shape();
  const std::uint64_t n = transformer_parameters(s);
  const std::uint64_t blocks = (n + 255) / 256;
  const std::uint64_t want[] = {12 * n, 8 * n, 6 * n + 8 * blocks};  // fp32, bf16, 8bit
  for (std::size_t i = 0; i < 3; ++i) {
    const StateFormat f = kFormats[i];
    const auto host = estimate_training_state(s, OffloadTarget::kHost, f);
    const auto nvme = estimate_training_state(s, OffloadTarget::kNvme, f);
    EXPECT_EQ(host.host, want[i]) << to_string(f);
    EXPECT_EQ(host.optimizer_bytes, want[i]) << to_string(f);
    EXPECT_EQ(host.nvme, 0u);
    EXPECT_EQ(nvme.nvme, want[i]) << to_string(f);
    EXPECT_EQ(nvme.host, 0u);
    EXPECT_EQ(host.device, 4 * n) << "parameters and gradients stay bf16 on the device";
    // torch's AdamW on the device: its m and v in the parameters' dtype, whatever the setting.
    EXPECT_EQ(estimate_training_state(s, OffloadTarget::kNone, f).device, 8 * n) << to_string(f);
  }
  EXPECT_EQ(estimate_training_state(s, OffloadTarget::kHost).host, 12 * n) << "the default is fp32, today's count";
}

TEST(PlanStateFormat, HostBudgetFitsEightBitStatesWhereFp32DoNot) {
  const std::uint64_t n = transformer_parameters(small_shape());
  const std::string host = std::to_string(10 * n);  // 10 bytes a parameter: under fp32's 12, over 8bit's 6.03
  // fp32: refused, naming the format and the one that fits.
  const std::string msg = message_of(inputs("host", StateFormat::kFp32, host));
  EXPECT_TRUE(has(msg, "cannot hold the optimizer states'")) << msg;
  EXPECT_TRUE(has(msg, "it needs " + std::to_string(12 * n) + " bytes (--optimizer-states fp32)")) << msg;
  EXPECT_TRUE(has(msg, "pass --host-memory, or --optimizer nvme, or --optimizer-states 8bit "
                       "(TIERFLOW_OPTIMIZER_STATES=8bit: 6.03 bytes a parameter, ")) << msg;
  // bf16 and 8bit: the budget less their states is what swapped activations may use, and the plan fits.
  for (StateFormat f : {StateFormat::kBf16, StateFormat::k8bit}) {
    const auto in = inputs("host", f, host);
    const auto b = plan_command_budgets(in);
    EXPECT_EQ(b.optimizer_host_bytes, in.state->host) << to_string(f);
    EXPECT_EQ(b.budgets.host_bytes, 10 * n - in.state->host) << to_string(f);
    const auto blocks = estimate_transformer(*in.shape, *in.flops_per_second);
    const Plan plan = plan_activations(blocks, b.links, b.budgets);
    EXPECT_TRUE(plan.fits) << to_string(f) << ": " << plan.summary();
    const auto report = describe_plan(plan, blocks, in, b);
    EXPECT_TRUE(has(report.lines[4], std::string("; CPU AdamW states --optimizer-states ") + to_string(f) + ": " +
                                         (f == StateFormat::kBf16 ? "8" : "6.03") + " bytes a parameter;"))
        << report.lines[4];
    EXPECT_EQ(Json::parse(report.json)["state"]["host_bytes"], in.state->host);
  }
  // 8bit at the least host budget its states take; a byte less is refused, naming no smaller format.
  auto in = inputs("host", StateFormat::k8bit, std::to_string(6 * n + 8 * ((n + 255) / 256)));
  EXPECT_EQ(plan_command_budgets(in).budgets.host_bytes, 0u);
  in.host_memory.text = std::to_string(6 * n + 8 * ((n + 255) / 256) - 1);
  const std::string least = message_of(in);
  EXPECT_TRUE(has(least, "(--optimizer-states 8bit) and more for activations; pass --host-memory, or --optimizer "
                         "nvme")) << least;
  EXPECT_FALSE(has(least, "or --optimizer-states")) << least;
}

TEST(PlanStateFormat, NvmeBudgetHoldsTheStatesThenActivations) {
  const std::uint64_t n = transformer_parameters(small_shape());
  // --optimizer nvme without --nvme-memory: the states go to NVMe; activations get no NVMe tier.
  auto in = inputs("nvme", StateFormat::k8bit, "64GiB");
  auto b = plan_command_budgets(in);
  EXPECT_EQ(b.optimizer_nvme_bytes, 0u);
  EXPECT_EQ(b.budgets.nvme_bytes, 0u);
  EXPECT_EQ(b.optimizer_host_bytes, 0u);
  // With --nvme-memory of 10 bytes a parameter: fp32 states (12) are refused, 8bit's leave the rest.
  in.nvme_memory = std::to_string(10 * n);
  in.nvme_bytes_per_second = 2e9;
  b = plan_command_budgets(in);
  EXPECT_EQ(b.optimizer_nvme_bytes, in.state->nvme);
  EXPECT_EQ(b.budgets.nvme_bytes, 10 * n - in.state->nvme);
  const auto blocks = estimate_transformer(*in.shape, *in.flops_per_second);
  const Plan plan = plan_activations(blocks, b.links, b.budgets);
  EXPECT_TRUE(plan.fits) << plan.summary();
  const auto report = describe_plan(plan, blocks, in, b);
  EXPECT_TRUE(has(report.lines[3], "; NVMe " + format_bytes(10 * n - in.state->nvme) + " (" + format_bytes(10 * n) +
                                       " from --nvme-memory, less " + format_bytes(in.state->nvme) +
                                       " of optimizer states); prefetch window"))
      << report.lines[3];
  auto fp32 = inputs("nvme", StateFormat::kFp32, "64GiB");
  fp32.nvme_memory = in.nvme_memory;
  fp32.nvme_bytes_per_second = 2e9;
  const std::string msg = message_of(fp32);
  EXPECT_TRUE(has(msg, "the NVMe budget " + format_bytes(10 * n) + " (--nvme-memory=" + *in.nvme_memory +
                           ") cannot hold the optimizer states' " + format_bytes(12 * n) + " (--optimizer nvme)"))
      << msg;
  EXPECT_TRUE(has(msg, "pass a larger --nvme-memory, or --optimizer host, or --optimizer-states 8bit")) << msg;
  // --optimizer host: the NVMe budget is the activations' and parameters' alone.
  auto on_host = inputs("host", StateFormat::kFp32, "64GiB");
  on_host.nvme_memory = "1GiB";
  on_host.nvme_bytes_per_second = 2e9;
  EXPECT_EQ(plan_command_budgets(on_host).budgets.nvme_bytes, GiB);
}
