// The plan command past its parser (tiering/plan_cli.hpp): the refusals that come before anything is measured, what
// it asks the caller to measure, --nvme-memory's default from TIERFLOW_NVME_MEMORY, a profile's refusals, a shape's
// text and JSON, the planner's refusal naming the flag, and --model's report (the config, tokens a second).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>

#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/tiering/plan_cli.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

// A whole shape, with its rates given (nothing to measure).
PlanArguments shape_arguments() {
  PlanArguments a;
  a.layers = 2, a.hidden = 64, a.heads = 2, a.seq = 16, a.batch = 1, a.vocab = 1000;
  a.tflops = 1;
  a.pcie_gbps = 10;
  return a;
}

Config settings(const std::map<std::string, std::string>& variables = {}) { return Config::parse(variables); }

PlanMachine machine() {
  PlanMachine m;
  m.device_capacity_bytes = 80ull << 30;
  m.host_capacity_bytes = 64ull << 30;
  m.command_line = "python -m tierflow plan";
  return m;
}

template <typename F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const config_error& e) {
    return e.what();
  }
  return "accepted";
}

std::string refusal_of(const PlanArguments& a, const Config& s = settings(),
                       std::optional<std::string> nvme_variable = std::nullopt) {
  return refusal([&] { PlanCommand(a, s, nvme_variable).run(machine()); });
}

}  // namespace

TEST(PlanCli, FlagsThatNothingWouldUseAreRefusedNamingThem) {
  PlanArguments a = shape_arguments();
  a.nvme_gbps = 2;
  EXPECT_EQ(refusal([&] { PlanCommand(a, settings(), std::nullopt); }),
            "--nvme-gbps 2 without an NVMe budget: the rate is the NVMe tier's, and no --nvme-memory (nor "
            "TIERFLOW_NVME_MEMORY) gives one; accepted: --nvme-gbps with --nvme-memory SIZE, or neither");
  a = shape_arguments();
  a.optimizer = "nvme";
  EXPECT_EQ(refusal([&] { PlanCommand(a, settings(), std::nullopt); }).rfind(
                "--optimizer nvme keeps the optimizer's states on NVMe, and no NVMe budget was given", 0), 0u);
  a = shape_arguments();
  a.cpu_adam_rate = 2e9;
  a.optimizer = "none";
  EXPECT_EQ(refusal([&] { PlanCommand(a, settings(), std::nullopt); }).rfind(
                "--cpu-adam-rate 2e+09 with --optimizer none: the rate is the CPU AdamW's", 0), 0u);
  a.optimizer.reset();  // the variable's placement is named as the variable
  EXPECT_EQ(refusal([&] {
              PlanCommand(a, settings({{"TIERFLOW_OFFLOAD_OPTIMIZER", "none"}}), std::nullopt);
            }).rfind("--cpu-adam-rate 2e+09 with TIERFLOW_OFFLOAD_OPTIMIZER=none:", 0), 0u);
  a = shape_arguments();
  a.heads.reset();
  EXPECT_NE(refusal([&] { PlanCommand(a, settings(), std::nullopt); }).find("heads"), std::string::npos);
}

TEST(PlanCli, NvmeBudgetDefaultsToTheVariableUnlessAuto) {
  PlanArguments a = shape_arguments();
  a.nvme_gbps = 2;
  const Config set = settings({{"TIERFLOW_NVME_MEMORY", "8GiB"}});
  EXPECT_EQ(refusal([&] { PlanCommand(a, set, std::string("8GiB")); }), "accepted");
  EXPECT_NE(refusal([&] { PlanCommand(a, settings(), std::string("8GiB")); }), "accepted");  // not set: no default
  const Config autos = settings({{"TIERFLOW_NVME_MEMORY", "auto"}});
  EXPECT_NE(refusal([&] { PlanCommand(a, autos, std::string("auto")); }), "accepted");
}

TEST(PlanCli, AsksForTheMeasurementsNothingGave) {
  PlanArguments a = shape_arguments();
  PlanCommand given(a, settings(), std::nullopt);
  EXPECT_FALSE(given.needs_links());
  EXPECT_FALSE(given.needs_flops());
  a.tflops.reset();
  a.pcie_gbps.reset();
  PlanCommand measured(a, settings(), std::nullopt);
  EXPECT_TRUE(measured.needs_links());
  EXPECT_TRUE(measured.needs_flops());
  PlanMachine m = machine();
  m.links = links_from_pcie_gbps(10);
  m.flops_per_second = 1e12;
  a.json = true;
  const auto doc = nlohmann::json::parse(PlanCommand(a, settings(), std::nullopt).run(m));
  EXPECT_EQ(doc["links"]["d2h"], 10e9);  // the measured links, planned with
  // In the order measured; the CPU AdamW's rate (the default --optimizer host) is measured with its own kernel.
  EXPECT_EQ(doc["measured"], nlohmann::json({"links", "tflops", "cpu_adam_rate"}));
}

TEST(PlanCli, ShapePlansAsTextAndJson) {
  PlanArguments a = shape_arguments();
  const std::string text = PlanCommand(a, settings(), std::nullopt).run(machine());
  EXPECT_NE(text.find("\n2 blocks:"), std::string::npos) << text;
  EXPECT_NE(text.find("compute: 1 TFLOP/s (given)"), std::string::npos) << text;
  EXPECT_NE(text.find("links: 10 GB/s device->host, 10 GB/s host->device (given)"), std::string::npos) << text;
  EXPECT_EQ(PlanCommand(a, settings(), std::nullopt).blocks_from(),
            "--layers 2 --hidden 64 --heads 2 --seq 16 --batch 1 --vocab 1000 --ffn-mult 4 --dtype bf16");
  a.json = true;
  const auto doc = nlohmann::json::parse(PlanCommand(a, settings(), std::nullopt).run(machine()));
  EXPECT_TRUE(doc.contains("predicted"));
  EXPECT_EQ(doc["measured"], nlohmann::json({"cpu_adam_rate"}));
  a.cpu_adam_rate = 2e9;  // given: nothing is measured
  const auto given = nlohmann::json::parse(PlanCommand(a, settings(), std::nullopt).run(machine()));
  EXPECT_EQ(given["measured"], nlohmann::json::array());
}

TEST(PlanCli, BudgetTooSmallIsTheRefusalNamingTheFlag) {
  PlanArguments a = shape_arguments();
  a.gpu_memory = "1KiB";
  const std::string why = refusal_of(a);
  EXPECT_NE(why.find("no activation plan fits"), std::string::npos) << why;
  EXPECT_NE(why.find("--gpu-memory"), std::string::npos) << why;
}

TEST(PlanCli, ProfileRefusalsNameTheFile) {
  PlanArguments a;
  a.profile = "p.json";
  a.profile_repr = "'p.json'";
  PlanMachine m = machine();
  m.profile_text = "{";
  EXPECT_EQ(refusal([&] { PlanCommand(a, settings(), std::nullopt).run(m); }).rfind("--profile 'p.json': ", 0), 0u);
  m.profile_text = R"({"blocks": [], "links": {"d2h": 0, "h2d": 1e9, "duplex": 2e9}, "fixed_device_bytes": 0})";
  const std::string why = refusal([&] { PlanCommand(a, settings(), std::nullopt).run(m); });
  EXPECT_TRUE(why.rfind("--profile 'p.json': ", 0) == 0) << why;
  a.pcie_gbps = 10;  // the links given: the profile's are not read
  EXPECT_EQ(refusal([&] { PlanCommand(a, settings(), std::nullopt).run(m); }).find("links has no positive"),
            std::string::npos);
}

TEST(PlanCli, ModelIsRefusedBesideAShapeAndReportsTokensASecond) {
  PlanArguments a = shape_arguments();
  a.model = "m";
  a.model_shown = "'m'";
  EXPECT_EQ(refusal([&] { PlanCommand(a, settings(), std::nullopt); }).rfind(
                "--model 'm' with --layers --hidden --heads: the blocks come from one of them", 0), 0u);
  const auto dir = std::filesystem::temp_directory_path() / ("tierflow_plan_cli_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
      "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"})";
  PlanArguments m;
  m.model = dir.string();
  m.model_repr = "'" + dir.string() + "'";
  m.tflops = 400;
  m.pcie_gbps = 55;
  m.gpu_memory = "80GiB";
  m.vocab = 1;
  EXPECT_EQ(refusal([&] { PlanCommand(m, settings(), std::nullopt); }).rfind("--vocab and --ffn-mult come from", 0),
            0u);
  m.vocab.reset();
  m.optimizer = "none";
  const std::string text = PlanCommand(m, settings(), std::nullopt).run(machine());
  EXPECT_EQ(text.rfind("config: GPT-2 (gpt2) from " + (dir / "config.json").string() +
                           ": 0.124B parameters, 12 layers, hidden 768, heads 12/12 kv; --seq 1024 --batch 1 --dtype "
                           "bf16\n", 0), 0u) << text;
  const auto last = text.substr(text.rfind('\n') + 1);
  EXPECT_EQ(last.rfind("tokens/s: ", 0), 0u) << last;
  EXPECT_NE(last.find(" (1024 tokens a step, predicted whole step "), std::string::npos) << last;
  EXPECT_NE(last.find(','), std::string::npos) << last;  // hundreds of thousands of tokens, grouped
  m.json = true;
  const auto doc = nlohmann::json::parse(PlanCommand(m, settings(), std::nullopt).run(machine()));
  EXPECT_EQ(doc["model"]["parameters"], 124439808u);
  EXPECT_EQ(doc["model"]["seq"], 1024);
  EXPECT_EQ(doc["bytes_per_tier"]["device"]["total"], doc["predicted"]["gpu_peak_bytes"]);
  EXPECT_GT(doc["tokens_per_second"].get<double>(), 0);
  std::filesystem::remove_all(dir);
}

TEST(PlanCli, CpuAdamRateIsParametersASecondFromOneTo1e15) {
  EXPECT_EQ(check_params_rate(2.5e9, "'2.5e9'"), 2.5e9);
  EXPECT_EQ(refusal([] { check_params_rate(0.5, "'0.5'"); }),
            "'0.5' is not valid; accepted: parameters a second, a number from 1 to 1e15 (e.g. 2.5e9)");
  EXPECT_NE(refusal([] { check_params_rate(std::nullopt, "'x'"); }), "accepted");
}
