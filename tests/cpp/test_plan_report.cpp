// The plan command's budgets and report (Note [Plan report]) and evaluate_alternative.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/optimizer/state_tier.hpp"
#include "tierflow/tiering/plan_fit.hpp"
#include "tierflow/tiering/plan_report.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

using namespace tierflow;
using namespace tierflow::tiering;
using Json = nlohmann::ordered_json;

namespace {

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

// The inputs `python -m tierflow plan --layers 4 ... --tflops 100 --pcie-gbps 20` gathers.
PlanCommandInputs shape_inputs(const std::string& optimizer = "host") {
  PlanCommandInputs in;
  in.gpu_memory = {"16GiB", SettingSource::kFlag};
  in.host_memory = {"64GiB", SettingSource::kVariable};
  in.prefetch = {"256MiB", SettingSource::kVariable};
  in.device_capacity_bytes = 80 * GiB;
  in.host_capacity_bytes = 128 * GiB;
  in.device_name = "cpu (emulated device)";
  in.optimizer = optimizer;
  in.shape = small_shape();
  in.dtype_name = "bf16";
  in.state = estimate_training_state(*in.shape, optimizer == "none"   ? OffloadTarget::kNone
                                                : optimizer == "host" ? OffloadTarget::kHost
                                                                      : OffloadTarget::kNvme);
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

}  // namespace

TEST(PlanCommandBudgets, DeviceBudgetComesFromTheFlagTheVariableOrTheDevice) {
  auto in = shape_inputs();
  auto b = plan_command_budgets(in);
  EXPECT_EQ(b.budgets.device_bytes, 16 * GiB);
  EXPECT_EQ(b.device_from, "--gpu-memory");
  in.gpu_memory = {"50%", SettingSource::kVariable};
  b = plan_command_budgets(in);
  EXPECT_EQ(b.budgets.device_bytes, 40 * GiB);
  EXPECT_EQ(b.device_from, "TIERFLOW_GPU_MEMORY");
  in.gpu_memory = {};
  b = plan_command_budgets(in);
  EXPECT_EQ(b.budgets.device_bytes, 80 * GiB);
  EXPECT_EQ(b.device_from, "the cpu (emulated device) device's total memory");
}

// The plan command's pinned host bytes for the CPU AdamW are the runtime's pool rule (optimizer::state_pool_need,
// registered as the bindings register it) over the shape's tensors: the states, or on NVMe two buffers of the
// largest parameter's state (the embedding), and one step's gradients and new weights in pinned staging.
TEST(PlanCommandBudgets, PinnedHostBytesAreTheRuntimesPoolNeedOfTheShapesTensors) {
  set_pinned_pool_rule([](const std::vector<std::uint64_t>& numels, int element_bytes, StateFormat format, bool nvme) {
    std::vector<optimizer::ParamStateShape> params;
    for (const std::uint64_t n : numels)
      params.push_back({static_cast<std::size_t>(n), false, static_cast<std::size_t>(element_bytes), format});
    return optimizer::state_pool_need(params, nvme).bytes;
  });
  const TransformerShape s = small_shape();
  const auto numels = transformer_parameter_numels(s);
  std::uint64_t sum = 0;
  for (const auto n : numels) sum += n;
  EXPECT_EQ(sum, transformer_parameters(s));
  EXPECT_EQ(*std::max_element(numels.begin(), numels.end()), 50304u * 1024u) << "the embedding (and head)";
  const auto v = static_cast<std::uint64_t>(s.vocab), h = static_cast<std::uint64_t>(s.hidden);
  // Pages of one step's staging: a gradient and a new weight (bf16) per tensor, whole 4 KiB pages each.
  std::uint64_t staging = 0;
  for (const auto n : numels) staging += 2 * ((2 * n + 4095) / 4096 * 4096);
  for (const std::string optimizer : {"host", "nvme"}) {
    auto in = shape_inputs(optimizer);
    const auto b = plan_command_budgets(in);
    const std::uint64_t states = optimizer == "host" ? in.state->host : 2 * ((12 * v * h + 4095) / 4096 * 4096);
    EXPECT_GE(b.optimizer_host_bytes, states + staging) << optimizer;
    EXPECT_LT(b.optimizer_host_bytes, states + staging + 4096 * numels.size()) << optimizer << ": page rounding only";
    EXPECT_EQ(b.budgets.host_bytes, 64 * GiB - b.optimizer_host_bytes) << optimizer;
    const auto blocks = estimate_transformer(*in.shape, *in.flops_per_second);
    const Plan plan = plan_activations(blocks, b.links, b.budgets);
    const MemoryTable t = memory_table(plan, blocks, in, b);
    EXPECT_EQ(t.bytes[static_cast<std::size_t>(MemoryKind::kOptimizerStates)]
                     [static_cast<std::size_t>(MemoryTier::kPinnedHost)],
              b.optimizer_host_bytes)
        << optimizer << ": the bytes-per-tier row";
    // A host budget a byte short of it is refused, naming the need.
    in.host_memory = {std::to_string(b.optimizer_host_bytes - 1), SettingSource::kFlag};
    EXPECT_NE(message_of(in).find("it needs " + std::to_string(b.optimizer_host_bytes) + " bytes"), std::string::npos)
        << message_of(in);
  }
  set_pinned_pool_rule({});
}

TEST(PlanCommandBudgets, HostBudgetLessTheOptimizerStatesAndFixedBytesFromTheEstimate) {
  const auto in = shape_inputs("host");
  const auto b = plan_command_budgets(in);
  ASSERT_GT(in.state->host, 0u);
  EXPECT_EQ(b.optimizer_host_bytes, in.state->host);
  EXPECT_EQ(b.budgets.host_bytes, 64 * GiB - in.state->host);
  EXPECT_EQ(b.host_from, "TIERFLOW_HOST_MEMORY");
  EXPECT_EQ(b.budgets.fixed_device_bytes, in.state->device);
  EXPECT_EQ(b.budgets.outside_saved_bytes, in.head_bytes) << "the plan keeps or swaps them";
  EXPECT_EQ(b.budgets.prefetch_bytes, 256 * MiB);
  EXPECT_EQ(b.budgets.nvme_bytes, 0u);
}

TEST(PlanCommandBudgets, HostTooSmallForTheOptimizerNamesTheFlagAndWhatToPass) {
  auto in = shape_inputs("host");
  in.host_memory = {"1GiB", SettingSource::kFlag};
  const auto msg = message_of(in);
  EXPECT_NE(msg.find("the host budget 1.00 GiB (--host-memory=1GiB, of 128.00 GiB RAM here) cannot hold the "
                     "optimizer states'"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("it needs " + std::to_string(in.state->host) + " bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pass --host-memory, or --optimizer nvme"), std::string::npos) << msg;
  in.host_memory.source = SettingSource::kVariable;
  EXPECT_NE(message_of(in).find("(TIERFLOW_HOST_MEMORY=1GiB"), std::string::npos);
}

TEST(PlanCommandBudgets, SizesAreParsedAsTheTableParsesTheirVariable) {
  auto in = shape_inputs();
  in.prefetch = {"0", SettingSource::kFlag};
  auto msg = message_of(in);
  EXPECT_NE(msg.find("--prefetch='0'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at least 1 byte"), std::string::npos) << msg;
  in = shape_inputs();
  in.gpu_memory = {"0", SettingSource::kFlag};
  EXPECT_NE(message_of(in).find("--gpu-memory='0'"), std::string::npos);
  in = shape_inputs();
  in.host_memory = {"lots", SettingSource::kVariable};
  EXPECT_NE(message_of(in).find("TIERFLOW_HOST_MEMORY='lots'"), std::string::npos);
}

TEST(PlanCommandBudgets, NvmeNeedsASizeAndARate) {
  auto in = shape_inputs();
  in.nvme_memory = "5%";
  in.nvme_bytes_per_second = 2e9;
  auto msg = message_of(in);
  EXPECT_EQ(msg.rfind("--nvme-memory '5%' is a percentage", 0), 0u) << msg;
  in.nvme_memory = "1GiB";
  in.nvme_bytes_per_second = 0;
  EXPECT_EQ(message_of(in), "--nvme-memory needs --nvme-gbps");
  in.nvme_bytes_per_second = 2e9;
  const auto b = plan_command_budgets(in);
  EXPECT_EQ(b.budgets.nvme_bytes, GiB);
  EXPECT_EQ(b.links.nvme_write, 2e9);
  EXPECT_EQ(b.links.nvme_read, 2e9);
  EXPECT_EQ(b.links.d2h, 20e9);
}

TEST(PlanCommandBudgets, FixedBytesPast64BitsAreRefusedWithTheExactCount) {
  auto in = shape_inputs();
  in.state->device = ~std::uint64_t{0};
  in.head_bytes = 10;
  EXPECT_EQ(message_of(in), "--layers 4 --hidden 1024: the rest of training needs 18446744073709551625 device "
                            "bytes; accepted: a shape whose byte counts fit in 64 bits");
}

TEST(PlanCommandBudgets, ProfileGivesTheFixedBytes) {
  auto in = shape_inputs();
  in.shape.reset();
  in.state.reset();
  in.profile_fixed_device_bytes = 3 * GiB;
  const auto b = plan_command_budgets(in);
  EXPECT_EQ(b.budgets.fixed_device_bytes, 3 * GiB);
  EXPECT_EQ(b.budgets.host_bytes, 64 * GiB);
}

TEST(BudgetBytes, RefusesTextAndPercentagesOfNothing) {
  EXPECT_EQ(budget_bytes("2GiB", 0), 2 * GiB);
  EXPECT_EQ(budget_bytes("25%", 4 * GiB), GiB);
  EXPECT_THROW(budget_bytes("lots", 0), config_error);
  EXPECT_THROW(budget_bytes("25%", 0), config_error);
}

namespace {

struct Planned {
  std::vector<BlockProfile> blocks;
  PlanCommandInputs in;
  PlanCommandBudgets budgets;
  Plan plan;
};

Planned plan_small(const std::string& gpu_memory, const std::string& optimizer = "host") {
  Planned p;
  p.in = shape_inputs(optimizer);
  p.in.gpu_memory = {gpu_memory, SettingSource::kFlag};
  p.blocks = estimate_transformer(*p.in.shape, *p.in.flops_per_second);
  p.budgets = plan_command_budgets(p.in);
  p.plan = plan_activations(p.blocks, p.budgets.links, p.budgets.budgets);
  return p;
}

bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

}  // namespace

TEST(DescribePlan, TextKeepsTodaysLinesThenExplainsEachBlock) {
  const auto p = plan_small("16GiB");
  const auto r = describe_plan(p.plan, p.blocks, p.in, p.budgets);
  ASSERT_GE(r.lines.size(), 7 + 2 * p.blocks.size());
  EXPECT_EQ(r.lines[0].rfind("model: 4 layers, hidden 1024, 16 heads, seq 1024, batch 8, bf16, vocab 50304 (", 0), 0u);
  EXPECT_EQ(r.lines[1], "compute: 100 TFLOP/s (given)");
  EXPECT_EQ(r.lines[2], "links: 20 GB/s device->host, 20 GB/s host->device (given)");
  EXPECT_EQ(r.lines[3].rfind("budgets: device 16.00 GiB (--gpu-memory); host ", 0), 0u) << r.lines[3];
  EXPECT_EQ(r.lines[4].rfind("parameters and optimizer (--optimizer host): device ", 0), 0u);
  EXPECT_EQ(r.lines[5], "plan (forward order):");
  // Issue 41: the 4 identical blocks on one line, here and in the reasons (Note [Plan report]).
  const std::string line0 = "  " + p.plan.block_line(0);
  EXPECT_EQ(r.lines[6], "  blocks 0-3 (4 identical): " + line0.substr(line0.find(": ") + 2));
  const std::size_t n = 1;
  EXPECT_EQ(r.lines[6 + n], p.plan.summary());
  EXPECT_EQ(r.lines[7 + n], "whole step predicted (Note [Step prediction]):");
  const std::size_t terms = 6;  // compute, activations, parameters, gradients, optimizer, whole step
  EXPECT_EQ(r.lines[7 + n + terms].rfind("  whole step: ", 0), 0u) << r.lines[7 + n + terms];
  EXPECT_EQ(r.lines[8 + n + terms].rfind("predicted: device peak ", 0), 0u);
  EXPECT_EQ(r.lines[9 + n + terms].rfind("why each block's action", 0), 0u);
  EXPECT_EQ(r.lines[10 + n + terms].rfind("  blocks 0-3 (4 identical): keep; swap host ", 0), 0u)
      << r.lines[10 + n + terms];
  EXPECT_TRUE(has(r.lines[10 + n + terms], "recompute host ")) << r.lines[10 + n + terms];
  const auto& fixed = r.lines.back();
  EXPECT_EQ(fixed.rfind("device's fixed bytes: parameters ", 0), 0u) << fixed;
  EXPECT_TRUE(has(fixed, "gradients " + format_bytes(p.in.state->gradient_bytes) +
                             " (freed by TIERFLOW_OFFLOAD_GRADIENTS=on"))
      << fixed;
  EXPECT_TRUE(has(fixed, "optimizer states 0 B;")) << fixed;  // already on host
}

TEST(DescribePlan, OptimizerOnTheDeviceNamesTheSettingThatMovesIt) {
  const auto p = plan_small("40GiB", "none");
  const auto r = describe_plan(p.plan, p.blocks, p.in, p.budgets);
  EXPECT_TRUE(has(r.lines.back(), "optimizer states " + format_bytes(p.in.state->optimizer_bytes) +
                                      " (freed by --optimizer host or nvme (TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme))"))
      << r.lines.back();
  const Json parts = Json::parse(r.json)["fixed_gpu_parts"];
  ASSERT_EQ(parts.size(), 4u) << parts;
  EXPECT_EQ(parts[2]["part"], "optimizer_states");
  EXPECT_EQ(parts[2]["gpu_bytes"], p.in.state->optimizer_bytes);
  EXPECT_EQ(parts[2]["freed_by"], "--optimizer host or nvme (TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme)");
  EXPECT_EQ(parts[0]["freed_by"], "--offload-params host, nvme or auto (TIERFLOW_OFFLOAD_PARAMS)");
}

TEST(DescribePlan, JsonHasTodaysKeysInOrderThenTheNewOnes) {
  const auto p = plan_small("16GiB");
  const Json j = Json::parse(describe_plan(p.plan, p.blocks, p.in, p.budgets).json);
  auto keys = [](const Json& o) {
    std::vector<std::string> out;
    for (const auto& item : o.items()) out.push_back(item.key());
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(keys(j), (V{"layers", "predicted", "budgets", "links", "tflops", "measured", "summary", "state",
                        "fixed_gpu_parts", "parameters", "step"}));
  ASSERT_EQ(j["layers"].size(), p.plan.blocks.size());
  EXPECT_EQ(keys(j["layers"][0]), (V{"mode", "alpha", "keep", "swap", "recompute", "swap_tier", "swap_bytes",
                                     "forward_seconds", "backward_seconds", "params", "alternatives"}));
  EXPECT_EQ(keys(j["predicted"]), (V{"gpu_peak_bytes", "step_seconds", "keep_all_step_seconds", "host_bytes",
                                     "nvme_bytes", "proven_optimal", "outside_kept", "outside_tier",
                                     "outside_bytes", "outside_swap_seconds", "outside_staging_bytes"}));
  EXPECT_EQ(keys(j["budgets"]), (V{"gpu_bytes", "fixed_gpu_bytes", "host_bytes_for_activations", "nvme_bytes",
                                   "prefetch_bytes", "outside_largest_bytes"}));
  EXPECT_EQ(keys(j["state"]), (V{"optimizer", "optimizer_states", "gpu_bytes", "host_bytes", "nvme_bytes",
                                 "outside_blocks_gpu_bytes", "offload_gradients", "pinned_host_bytes"}));
  EXPECT_EQ(j["state"]["optimizer_states"], "fp32");
  EXPECT_EQ(j["budgets"]["gpu_bytes"], 17179869184ULL);
  EXPECT_EQ(j["budgets"]["prefetch_bytes"], 268435456ULL);
  EXPECT_EQ(j["predicted"]["proven_optimal"], true);
  EXPECT_EQ(j["predicted"]["gpu_peak_bytes"], p.plan.predicted_device_peak_bytes);
  EXPECT_EQ(j["links"]["d2h"], 2e10);
  EXPECT_EQ(j["links"]["duplex"], 4e10);
  EXPECT_EQ(j["tflops"], 100.0);
  EXPECT_EQ(j["measured"], Json::array());
  EXPECT_EQ(j["summary"], p.plan.summary());
  EXPECT_EQ(j["state"]["optimizer"], "host");
  EXPECT_EQ(j["layers"][0]["mode"], std::string(to_string(p.plan.blocks[0].mode)));
  EXPECT_EQ(j["layers"][0]["params"], "gpu");
  EXPECT_EQ(keys(j["parameters"]), (V{"offload", "policy", "fetched_blocks", "rest", "rest_bytes",
                                      "gpu_resident_bytes", "gpu_window_bytes", "prefetch_bytes", "host_bytes",
                                      "nvme_bytes", "rest_fetch_seconds"}));
  EXPECT_EQ(j["parameters"]["policy"], "resident");
}

TEST(DescribePlan, OffloadedParametersLeaveTheFixedBytesAndArePrintedPerBlockAndTier) {
  Planned p;
  p.in = shape_inputs();
  p.in.offload_params = "host";
  p.in.gpu_memory = {"16GiB", SettingSource::kFlag};
  p.blocks = estimate_transformer(*p.in.shape, *p.in.flops_per_second);
  p.budgets = plan_command_budgets(p.in);
  const Budgets& b = p.budgets.budgets;
  EXPECT_EQ(b.params, ParamPolicy::kFetchAll);
  const std::uint64_t block_params = p.blocks[0].parameter_bytes;
  EXPECT_EQ(block_params, transformer_block_parameters(*p.in.shape) * 2);
  EXPECT_EQ(b.rest_parameter_bytes + 4 * block_params, p.in.state->parameter_bytes);
  EXPECT_EQ(b.fixed_device_bytes, p.in.state->device - p.in.state->parameter_bytes);
  p.plan = plan_activations(p.blocks, p.budgets.links, b);
  const auto r = describe_plan(p.plan, p.blocks, p.in, p.budgets);
  EXPECT_EQ(r.lines[5].rfind("parameters between uses (--offload-params host): blocks 0-3 fetched from host; the rest "
                             "(embeddings, final norm, head: ", 0), 0u) << r.lines[5];
  EXPECT_TRUE(has(r.lines[5], "host " + format_bytes(p.in.state->parameter_bytes))) << r.lines[5];
  EXPECT_EQ(r.lines[6], "plan (forward order):");
  EXPECT_TRUE(has(r.lines[7], "params fetched from host")) << r.lines[7];
  const Json j = Json::parse(r.json);
  EXPECT_EQ(j["layers"][3]["params"], "host");
  EXPECT_EQ(j["parameters"]["fetched_blocks"], 4);
  EXPECT_EQ(j["parameters"]["host_bytes"], p.in.state->parameter_bytes);
  EXPECT_EQ(j["fixed_gpu_parts"][0]["gpu_bytes"], 0);
  // auto chooses per block; nvme needs an NVMe tier; a profile has no parameter bytes per block.
  p.in.offload_params = "auto";
  EXPECT_EQ(plan_command_budgets(p.in).budgets.params, ParamPolicy::kAuto);
  p.in.offload_params = "nvme";
  EXPECT_TRUE(has(message_of(p.in), "--offload-params nvme needs an NVMe tier")) << message_of(p.in);
  p.in.offload_params = "disk";
  EXPECT_TRUE(has(message_of(p.in), "accepted: none, host, nvme, auto")) << message_of(p.in);
  p.in.offload_params = "host";
  p.in.shape.reset();
  p.in.state.reset();
  p.in.profile_fixed_device_bytes = GiB;
  EXPECT_TRUE(has(message_of(p.in), "accepted with --profile: none")) << message_of(p.in);
}

TEST(DescribePlan, FloatsReadBackExactly) {
  auto p = plan_small("16GiB");
  p.budgets.links = Links{1e-05, 0.1, 1e16, 123456.789, 5e-324};
  const Json links = Json::parse(describe_plan(p.plan, p.blocks, p.in, p.budgets).json)["links"];
  EXPECT_EQ(links["d2h"].get<double>(), 1e-05);
  EXPECT_EQ(links["h2d"].get<double>(), 0.1);
  EXPECT_EQ(links["duplex"].get<double>(), 1e16);
  EXPECT_EQ(links["nvme_write"].get<double>(), 123456.789);
  EXPECT_EQ(links["nvme_read"].get<double>(), 5e-324);
}

TEST(EvaluateAlternative, TheChosenAssignmentGivesThePlansOwnFigures) {
  const auto p = plan_small("16GiB");
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const auto a = evaluate_alternative(p.blocks, p.budgets.links, p.budgets.budgets, p.plan, i, p.plan.blocks[i]);
    EXPECT_EQ(a.step_seconds, p.plan.predicted_step_seconds);
    EXPECT_EQ(a.device_peak_bytes, p.plan.predicted_device_peak_bytes);
    EXPECT_EQ(a.host_bytes, p.plan.host_bytes);
    EXPECT_TRUE(a.fits());
  }
}

TEST(EvaluateAlternative, MatchesEvaluatePlanWithTheBlockChanged) {
  const auto p = plan_small("16GiB");
  const auto& links = p.budgets.links;
  const auto& budgets = p.budgets.budgets;
  for (BlockMode mode : {BlockMode::kKeep, BlockMode::kSwap, BlockMode::kSplit, BlockMode::kRecompute}) {
    BlockPlan alt;
    alt.mode = mode;
    alt.alpha = mode == BlockMode::kSplit ? 0.25 : 0;
    auto assignment = p.plan.blocks;
    assignment[1] = alt;
    const auto whole = evaluate_plan(p.blocks, links, budgets, assignment);
    const auto a = evaluate_alternative(p.blocks, links, budgets, p.plan, 1, alt);
    EXPECT_EQ(a.step_seconds, whole.predicted_step_seconds) << to_string(mode);
    EXPECT_EQ(a.device_peak_bytes, whole.predicted_device_peak_bytes) << to_string(mode);
    EXPECT_EQ(a.host_bytes, whole.host_bytes) << to_string(mode);
    EXPECT_EQ(a.fits(), whole.fits) << to_string(mode);
  }
}

TEST(DescribePlan, EveryRejectedAlternativeThatFitsIsNoFaster) {
  // Random budgets around the small model's needs: whenever an alternative fits, the (proven optimal)
  // plan is at least as fast, and the report says why each one lost.
  std::mt19937_64 rng(20);
  int fitting = 0, over = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const auto gib = std::uniform_int_distribution<int>(6, 24)(rng);
    Planned p;
    try {
      p = plan_small(std::to_string(gib) + "GiB");
    } catch (const out_of_memory&) {
      continue;
    }
    ASSERT_TRUE(p.plan.proven_optimal);
    const auto r = describe_plan(p.plan, p.blocks, p.in, p.budgets);
    for (std::size_t i = 0; i < p.blocks.size(); ++i) {
      for (BlockMode mode : {BlockMode::kKeep, BlockMode::kSwap, BlockMode::kRecompute}) {
        if (mode == p.plan.blocks[i].mode) continue;
        BlockPlan alt;
        alt.mode = mode;
        alt.tier = p.plan.blocks[i].tier;
        const auto a = evaluate_alternative(p.blocks, p.budgets.links, p.budgets.budgets, p.plan, i, alt);
        if (a.fits()) {
          ++fitting;
          EXPECT_GE(a.step_seconds, p.plan.predicted_step_seconds) << "block " << i << " " << to_string(mode);
        } else {
          ++over;
        }
      }
    }
    const Json doc = Json::parse(r.json);  // alive through the loop (a temporary's element would not be)
    for (const auto& layer : doc["layers"])
      for (const auto& alt : layer["alternatives"])
        EXPECT_NE(alt["why"].get<std::string>().rfind("faster", 0), 0u) << alt;
  }
  EXPECT_GT(fitting, 0);
  EXPECT_GT(over, 0);
}

TEST(DescribePlan, ProfileReportSaysTheFixedBytesAreNotBrokenDown) {
  auto p = plan_small("16GiB");
  p.in.shape.reset();
  p.in.state.reset();
  p.in.flops_per_second.reset();
  p.in.links_given = false;
  p.in.profile_path = "p.json";
  const auto r = describe_plan(p.plan, p.blocks, p.in, p.budgets);
  EXPECT_EQ(r.lines[0], "profile: p.json (4 blocks)");
  EXPECT_EQ(r.lines[1], "links: 20 GB/s device->host, 20 GB/s host->device (from the profile)");
  const Json j = Json::parse(r.json);
  EXPECT_TRUE(j["tflops"].is_null());
  EXPECT_FALSE(j.contains("state"));
  EXPECT_EQ(j["fixed_gpu_parts"][0]["part"], "from_profile");
  EXPECT_EQ(r.lines.back().rfind("device's fixed bytes: the profile's rest of training ", 0), 0u) << r.lines.back();
}

TEST(ExplainPlan, OneLinePerBlockAsTheCommandPrintsIt) {
  const auto p = plan_small("16GiB");
  const auto lines = explain_plan(p.plan, p.blocks, p.budgets.links, p.budgets.budgets);
  ASSERT_EQ(lines.size(), p.blocks.size());
  const auto report = describe_plan(p.plan, p.blocks, p.in, p.budgets).lines;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i].rfind("  block " + std::to_string(i) + ": ", 0), 0u) << lines[i];
  }
  // The command prints them with identical blocks grouped (issue 41).
  for (const auto& line : group_block_lines(lines)) {
    EXPECT_NE(std::find(report.begin(), report.end(), line), report.end()) << "the command prints " << line;
  }
  EXPECT_THROW(explain_plan(p.plan, {}, p.budgets.links, p.budgets.budgets), logic_error);
}

namespace tierflow::tiering {
namespace {

// The fit search tries torch's AdamW on the device (--optimizer none) too: with a host budget too small for the
// CPU AdamW's states and room on the device, that is the fit.
TEST(PlanFitSearch, TriesTheOptimizerOnTheDevice) {
  auto in = shape_inputs("host");
  in.host_memory = {"100MiB", SettingSource::kFlag};
  EXPECT_THROW(plan_command_budgets(in), config_error) << "the CPU AdamW's states do not fit 100 MiB";
  const auto blocks = estimate_transformer(*in.shape, *in.flops_per_second);
  const FitSearch search = search_fitting_settings(blocks, in);
  ASSERT_TRUE(search.best.has_value()) << fit_advice(search, "plan");
  EXPECT_EQ(flags_text(search.tried[*search.best].flags), "--optimizer none");
  EXPECT_NE(fit_advice(search, "plan --optimizer host").find("): plan --optimizer none"), std::string::npos)
      << fit_advice(search, "plan --optimizer host");
}

// Nothing fits: the advice asks for an NVMe tier only when the command gave none.
TEST(PlanFitSearch, TheRefusalAsksForAnNvmeTierOnlyWithoutOne) {
  auto in = shape_inputs("host");
  in.gpu_memory = {"1MiB", SettingSource::kFlag};
  const auto blocks = estimate_transformer(*in.shape, *in.flops_per_second);
  const std::string without = fit_advice(search_fitting_settings(blocks, in), "plan");
  EXPECT_NE(without.find("none of the"), std::string::npos) << without;
  EXPECT_NE(without.find("or give an NVMe tier (--nvme-memory, --nvme-gbps)"), std::string::npos) << without;
  in.nvme_memory = "1TiB";
  in.nvme_bytes_per_second = 2e9;
  const std::string with = fit_advice(search_fitting_settings(blocks, in), "plan");
  EXPECT_NE(with.find("none of the"), std::string::npos) << with;
  EXPECT_EQ(with.find("give an NVMe tier"), std::string::npos) << with;
  EXPECT_NE(with.find("raise --gpu-memory or --host-memory or --nvme-memory"), std::string::npos) << with;
}

// The advised command sets a flag the command gave in place: no flag twice.
TEST(PlanFitSearch, TheAdvisedCommandReplacesAGivenFlagsValue) {
  EXPECT_EQ(command_with("plan --optimizer none --gpu-memory 1GiB", {{"--optimizer", "nvme"}, {"--prefetch", "4MiB"}}),
            "plan --optimizer nvme --gpu-memory 1GiB --prefetch 4MiB");
  EXPECT_EQ(command_with("plan --optimizer=none --x 'a b'", {{"--optimizer", "host"}}),
            "plan --optimizer=host --x 'a b'");
  EXPECT_EQ(command_with("plan", {{"--offload-gradients", "on"}}), "plan --offload-gradients on");
  EXPECT_EQ(command_with("plan --cpu-adam-rate 1e9 --gpu-memory 1GiB --cpu-adam-rate=2e9", {{"--optimizer", "none"}}),
            "plan --gpu-memory 1GiB --optimizer none")
      << "the command refuses --cpu-adam-rate with --optimizer none";
}

}  // namespace
}  // namespace tierflow::tiering
