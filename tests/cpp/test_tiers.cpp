// Note [Tiers from the configuration]: what a configuration makes of the tiers.
#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <string>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/tier_table.hpp"
#include "tierflow/tiering/tiers.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {

Config config(std::map<std::string, std::string> vars) {
  vars.emplace("TIERFLOW_DEVICE", "emulated");
  return Config::parse(vars);
}

std::string refusal(const Config& c) {
  try {
    tier_settings(c);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() / ("tierflow-tiers-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST(TierSettings, EmulatedDeviceAndItsModes) {
  TierSettings polite = tier_settings(config({{"TIERFLOW_EMULATED_DEVICE", "polite"}}));
  EXPECT_EQ(polite.device, allocator::DeviceKind::kEmulated);
  EXPECT_FALSE(polite.adversarial);
  EXPECT_FALSE(polite.pool.poison_freed);
  EXPECT_FALSE(polite.pool.cuda_pinned) << "pinned with cudaHostAlloc only on CUDA";
  TierSettings hostile = tier_settings(config({{"TIERFLOW_EMULATED_DEVICE", "adversarial"}, {"TIERFLOW_EMULATED_SEED", "7"}}));
  EXPECT_TRUE(hostile.adversarial);
  EXPECT_TRUE(hostile.pool.poison_freed) << "the pool turns hostile with the copy engine";
  EXPECT_TRUE(hostile.copies.adversarial);
  EXPECT_EQ(hostile.copies.seed, 7u);
}

TEST(TierSettings, CudaWithoutAGpuIsRefusedNamingWhy) {
  if (allocator::cuda_available()) GTEST_SKIP() << "a GPU is usable here: TIERFLOW_DEVICE=cuda is served";
  const std::string m = refusal(Config::parse({{"TIERFLOW_DEVICE", "cuda"}}));
  EXPECT_NE(m.find("TIERFLOW_DEVICE='cuda'"), std::string::npos) << m;
  EXPECT_NE(m.find("accepted here: auto, emulated"), std::string::npos) << m;
  EXPECT_EQ(tier_settings(Config::parse({{"TIERFLOW_DEVICE", "auto"}})).device, allocator::DeviceKind::kEmulated);
}

TEST(TierSettings, HostBudgetFromTheConfiguration) {
  TierSettings s = tier_settings(config({{"TIERFLOW_HOST_MEMORY", "3GiB"}, {"TIERFLOW_PINNED_SLAB_BYTES", "4MiB"}}));
  EXPECT_EQ(s.pool.budget_bytes, 3ULL << 30);
  EXPECT_EQ(s.pool.slab_bytes, 4ULL << 20);
  Tiers tiers(config({{"TIERFLOW_HOST_MEMORY", "3GiB"}, {"TIERFLOW_GPU_MEMORY", "1GiB"}}));
  EXPECT_EQ(tiers.host_budget_bytes(), 3ULL << 30);
  EXPECT_EQ(tiers.host_pool()->budget_bytes(), 3ULL << 30);
  EXPECT_EQ(tiers.device_budget_bytes(), 1ULL << 30);
  EXPECT_EQ(tiers.copy_engine()->device(), allocator::DeviceKind::kEmulated);
}

TEST(TierSettings, SettingsThisVersionCannotServeAreRefused) {
  std::string m = refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "auto"}, {"TIERFLOW_OFFLOAD_ACTIVATIONS", "none"}}));
  EXPECT_NE(m.find("TIERFLOW_OFFLOAD_PARAMS='auto' with TIERFLOW_OFFLOAD_ACTIVATIONS='none'"), std::string::npos) << m;
  m = refusal(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "nvme"}}));
  EXPECT_NE(m.find("needs TIERFLOW_NVME_PATHS"), std::string::npos) << m;
  m = refusal(config({{"TIERFLOW_OFFLOAD_OPTIMIZER", "nvme"}}));
  EXPECT_NE(m.find("TIERFLOW_OFFLOAD_OPTIMIZER='nvme' needs TIERFLOW_NVME_PATHS"), std::string::npos) << m;
  m = refusal(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "nvme"}, {"TIERFLOW_NVME_PATHS", "/no/such/tierflow/dir"}}));
  EXPECT_NE(m.find("'/no/such/tierflow/dir' is not an accessible directory"), std::string::npos) << m;
}

TEST(TierSettings, FsdpRefusesWhatWouldMoveItsShardsAndSaysWhatItAccepts) {
  const std::string accepted = "accepted with FSDP2: TIERFLOW_OFFLOAD_OPTIMIZER=host";
  // What FSDP2 trains: the defaults with tierflow's CPU optimizer or the user's, any activation setting.
  for (bool cpu_optimizer : {false, true}) {
    EXPECT_EQ(fsdp_settings_refusal(config({}), cpu_optimizer), "");
    for (const char* activations : {"none", "host", "recompute", "auto"})
      EXPECT_EQ(fsdp_settings_refusal(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", activations}}), cpu_optimizer), "");
    EXPECT_EQ(fsdp_settings_refusal(config({{"TIERFLOW_GPU_OPTIMIZER_FRACTION", "0"}}), cpu_optimizer), "");
    // Parameter offload would move the shards whoever steps them.
    const std::string why = fsdp_settings_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "host"}}), cpu_optimizer);
    EXPECT_NE(why.find("TIERFLOW_OFFLOAD_PARAMS='host' would move the parameters FSDP2 shards"), std::string::npos)
        << why;
    EXPECT_NE(why.find(accepted), std::string::npos) << why;
  }
  // Gradients freed during backward and an explicit GPU share: refused only where the CPU optimizer steps.
  const Config grads = config({{"TIERFLOW_OFFLOAD_GRADIENTS", "on"}});
  EXPECT_EQ(fsdp_settings_refusal(grads, false), "");
  std::string why = fsdp_settings_refusal(grads, true);
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_GRADIENTS='on' frees gradients during backward"), std::string::npos) << why;
  EXPECT_NE(why.find(accepted), std::string::npos) << why;
  const Config share = config({{"TIERFLOW_GPU_OPTIMIZER_FRACTION", "0.25"}});
  EXPECT_EQ(fsdp_settings_refusal(share, false), "");
  why = fsdp_settings_refusal(share, true);
  EXPECT_NE(why.find("TIERFLOW_GPU_OPTIMIZER_FRACTION=0.25 would step part of FSDP2's shards"), std::string::npos)
      << why;
  EXPECT_NE(why.find("TIERFLOW_GPU_OPTIMIZER_FRACTION=auto or 0"), std::string::npos) << why;
  // FSDP2's own CPU offload: the user's optimizer steps its host shards; tierflow's would own them too.
  EXPECT_EQ(fsdp_settings_refusal(config({}), false, true), "");
  EXPECT_EQ(fsdp_settings_refusal(config({{"TIERFLOW_OFFLOAD_OPTIMIZER", "none"}}), false, true), "");
  why = fsdp_settings_refusal(config({}), true, true);
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_OPTIMIZER='host' beside FSDP2's shards kept in host memory"), std::string::npos)
      << why;
  EXPECT_NE(why.find("CPUOffloadPolicy"), std::string::npos) << why;
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_OPTIMIZER=none"), std::string::npos) << why;
  EXPECT_EQ(fsdp_settings_refusal(config({}), true, false), "");
}

TEST(TierSettings, ParameterOffloadIsRefusedOnlyBesideSettingsItCannotServe) {
  EXPECT_EQ(params_offload_refusal(config({})), "");
  EXPECT_EQ(params_offload_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "host"}})), "");
  EXPECT_EQ(params_offload_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "nvme"}})), "");
  EXPECT_EQ(params_offload_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "host"},
                                           {"TIERFLOW_GPU_OPTIMIZER_FRACTION", "0"}})), "");
  std::string why = params_offload_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "host"},
                                                   {"TIERFLOW_GPU_OPTIMIZER_FRACTION", "0.5"}}));
  EXPECT_NE(why.find("TIERFLOW_GPU_OPTIMIZER_FRACTION=0.5"), std::string::npos) << why;
  EXPECT_NE(why.find("accepted: TIERFLOW_GPU_OPTIMIZER_FRACTION=0 or auto"), std::string::npos) << why;
  EXPECT_EQ(params_offload_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "auto"}})), "");  // activations auto
  why = params_offload_refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "auto"}, {"TIERFLOW_OFFLOAD_ACTIVATIONS", "host"}}));
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_PARAMS='auto' with TIERFLOW_OFFLOAD_ACTIVATIONS='host'"), std::string::npos)
      << why;
  EXPECT_NE(why.find("accepted: TIERFLOW_OFFLOAD_ACTIVATIONS=auto, or TIERFLOW_OFFLOAD_PARAMS=host or nvme"),
            std::string::npos) << why;
  const std::string m = refusal(config({{"TIERFLOW_OFFLOAD_PARAMS", "nvme"}}));
  EXPECT_NE(m.find("TIERFLOW_OFFLOAD_PARAMS='nvme' needs TIERFLOW_NVME_PATHS"), std::string::npos) << m;
}

TEST(TierSettings, ParameterOffloadWithATorchOptimizerIsRefusedOnCudaOnly) {
  const Config host = config({{"TIERFLOW_OFFLOAD_PARAMS", "host"}});
  EXPECT_EQ(params_optimizer_refusal(host, false, false), "");  // emulated: steps the host copies
  EXPECT_EQ(params_optimizer_refusal(host, true, true), "");     // CPU AdamW
  EXPECT_EQ(params_optimizer_refusal(config({}), true, false), "");
  const std::string why = params_optimizer_refusal(host, true, false);
  EXPECT_NE(why.find("TIERFLOW_OFFLOAD_OPTIMIZER='none' on CUDA"), std::string::npos) << why;
  EXPECT_NE(why.find("accepted: TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme"), std::string::npos) << why;
}

TEST(TierSettings, WhichTargetsGetAnNvmeEngine) {
  TempDir d;
  const std::string paths = d.path.string();
  auto nvme = [&](const char* acts, const char* opt, bool with_paths) {
    std::map<std::string, std::string> v = {{"TIERFLOW_OFFLOAD_ACTIVATIONS", acts}, {"TIERFLOW_OFFLOAD_OPTIMIZER", opt}};
    if (with_paths) v["TIERFLOW_NVME_PATHS"] = paths;
    TierSettings s = tier_settings(config(v));
    return std::make_pair(s.nvme, s.activations_on_nvme);
  };
  EXPECT_EQ(nvme("nvme", "host", true), std::make_pair(true, true));
  EXPECT_EQ(nvme("auto", "host", true), std::make_pair(true, true)) << "a planned mode may use a configured NVMe tier";
  EXPECT_EQ(nvme("recompute", "host", true), std::make_pair(true, true));
  EXPECT_EQ(nvme("auto", "host", false), std::make_pair(false, false));
  EXPECT_EQ(nvme("host", "host", true), std::make_pair(false, false)) << "paths alone build nothing";
  EXPECT_EQ(nvme("host", "nvme", true), std::make_pair(true, false)) << "the optimizer's states alone";
  EXPECT_EQ(nvme("none", "none", true), std::make_pair(false, false));
  const TierSettings params = tier_settings(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "none"},
                                                    {"TIERFLOW_OFFLOAD_PARAMS", "nvme"}, {"TIERFLOW_NVME_PATHS", paths}}));
  EXPECT_TRUE(params.nvme && !params.activations_on_nvme) << "the parameters alone";
}

TEST(TierSettings, NvmeBudgetIsTheConfiguredShareOfTheSmallestFreeSpace) {
  TempDir d;
  const auto a = d.path / "a", b = d.path / "b";
  std::filesystem::create_directories(a);
  std::filesystem::create_directories(b);
  const std::string paths = a.string() + "," + b.string();
  TierSettings s = tier_settings(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "nvme"}, {"TIERFLOW_NVME_PATHS", paths},
                                         {"TIERFLOW_NVME_MEMORY", "64MiB"}, {"TIERFLOW_AIO_QUEUE_DEPTH", "8"}}));
  ASSERT_TRUE(s.nvme);
  EXPECT_EQ(s.nvme_options.paths.size(), 2u);
  EXPECT_EQ(s.nvme_options.bytes_per_path, 64ULL << 20);
  EXPECT_EQ(s.nvme_options.queue_depth, 8u);
  struct statvfs fs {};
  ASSERT_EQ(statvfs(a.c_str(), &fs), 0);
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  TierSettings half = tier_settings(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "nvme"}, {"TIERFLOW_NVME_PATHS", paths},
                                            {"TIERFLOW_NVME_MEMORY", "50%"}}));
  // The free space moves while other tests write: within 1% of half of it.
  EXPECT_NEAR(static_cast<double>(half.nvme_options.bytes_per_path), free_bytes / 2.0, free_bytes * 0.01);
}

TEST(Tiers, NvmeEngineOnlyWhereATargetNeedsIt) {
  Tiers plain(config({}));
  EXPECT_EQ(plain.nvme_engine(), nullptr);
  EXPECT_EQ(plain.nvme_available_bytes(), 0u);
  EXPECT_THROW(plain.measure_nvme(1 << 20), config_error) << "no NVMe tier to probe";
  TempDir d;
  Tiers tiers(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "nvme"}, {"TIERFLOW_NVME_PATHS", d.path.string()},
                      {"TIERFLOW_NVME_MEMORY", "64MiB"}}));
  ASSERT_NE(tiers.nvme_engine(), nullptr);
  EXPECT_GT(tiers.nvme_available_bytes(), 0u);
  EXPECT_LE(tiers.nvme_available_bytes(), 64ULL << 20);
  const swap::NvmeBandwidth bw = tiers.measure_nvme(4 << 20);
  EXPECT_GT(bw.write_bytes_per_second, 0.0);
  EXPECT_GT(bw.read_bytes_per_second, 0.0);
}

// Note [GPU budget]: one function, the unset case its only difference between a run and the plan command.
TEST(GpuBudget, UnsetIsTheTableDefaultForARunAndTheWholeDeviceForThePlanCommand) {
  constexpr std::uint64_t kDevice = 80ULL << 30;
  const Config unset = config({});
  EXPECT_EQ(gpu_budget_bytes(unset.gpu_memory, false, kDevice, UnsetGpuBudget::kTableDefault), kDevice / 10 * 9);
  EXPECT_EQ(gpu_budget_bytes(unset.gpu_memory, false, kDevice, UnsetGpuBudget::kWholeDevice), kDevice);
  const Config half = config({{"TIERFLOW_GPU_MEMORY", "50%"}});
  for (auto unset_means : {UnsetGpuBudget::kTableDefault, UnsetGpuBudget::kWholeDevice})
    EXPECT_EQ(gpu_budget_bytes(half.gpu_memory, true, kDevice, unset_means), kDevice / 2);
  // A run's budget is that function on its device.
  const Tiers tiers(config({{"TIERFLOW_GPU_MEMORY", "3MiB"}}));
  EXPECT_EQ(tiers.device_budget_bytes(), 3u << 20);
  const Tiers defaults(config({}));
  EXPECT_EQ(defaults.device_budget_bytes(),
            gpu_budget_bytes(unset.gpu_memory, false, allocator::device_capacity_bytes(defaults.device()),
                             UnsetGpuBudget::kTableDefault));
  EXPECT_LT(defaults.device_budget_bytes(), allocator::device_capacity_bytes(defaults.device()));
}

TEST(Tiers, OneCudaDeviceNamesTheDevicesAndWhatToDo) {
  EXPECT_EQ(one_cuda_device({}, 0), "");       // a CPU model
  EXPECT_EQ(one_cuda_device({1, 1}, 1), "");   // on the current device
  const std::string other = one_cuda_device({1}, 0);
  EXPECT_NE(other.find("the model is on cuda:1 but the current CUDA device is cuda:0"), std::string::npos);
  EXPECT_NE(other.find("torch.cuda.set_device(1)"), std::string::npos);
  EXPECT_NE(other.find("CUDA_VISIBLE_DEVICES=1"), std::string::npos);
  const std::string across = one_cuda_device({2, 0, 2}, 0);
  EXPECT_NE(across.find("are on cuda:0, cuda:2: tierflow drives one GPU per process"), std::string::npos);
}

// Note [Ranks on one machine]: a share of the machine is divided among its ranks; a size is each rank's own.
TEST(TierSettings, RanksOnOneMachineDivideSharesNotSizes) {
  TempDir d;
  const std::string path = d.path.string();
  auto settings = [&](const std::string& host, const std::string& nvme, RankShare ranks) {
    return tier_settings(config({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "nvme"}, {"TIERFLOW_NVME_PATHS", path},
                                 {"TIERFLOW_HOST_MEMORY", host}, {"TIERFLOW_NVME_MEMORY", nvme}}),
                         nullptr, ranks);
  };
  const TierSettings alone = settings("40%", "64MiB", {});
  const TierSettings fourth = settings("40%", "64MiB", {3, 4});
  EXPECT_NEAR(static_cast<double>(fourth.pool.budget_bytes), alone.pool.budget_bytes / 4.0, 1.0);
  EXPECT_EQ(fourth.nvme_options.bytes_per_path, 64ULL << 20) << "a size is each rank's own";
  EXPECT_EQ(alone.nvme_options.name_tag, "");
  EXPECT_EQ(fourth.nvme_options.name_tag, "rank3-");
  EXPECT_EQ(settings("3GiB", "auto", {1, 2}).pool.budget_bytes, 3ULL << 30);
  EXPECT_EQ(settings("3GiB", "auto", {1, 2}).nvme_options.bytes_per_path, kNvmeAutoBytes) << "auto grows on demand";
  struct statvfs fs {};
  ASSERT_EQ(statvfs(path.c_str(), &fs), 0);
  const double free_bytes = static_cast<double>(fs.f_bavail) * fs.f_frsize;
  EXPECT_NEAR(static_cast<double>(settings("3GiB", "50%", {0, 2}).nvme_options.bytes_per_path), free_bytes / 4,
              free_bytes * 0.01);
}

TEST(RankShare, TheLocalRanksAreTorchrunsOrTheWholeGroup) {
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_EQ(rank_share(0, 1).local_ranks, 1);
  EXPECT_EQ(rank_share(5, 8).local_ranks, 8);
  EXPECT_EQ(rank_share(5, 8).rank, 5);
  ::setenv("LOCAL_WORLD_SIZE", "4", 1);
  EXPECT_EQ(rank_share(5, 8).local_ranks, 4);
  ::setenv("LOCAL_WORLD_SIZE", "four", 1);
  try {
    rank_share(5, 8);
    ADD_FAILURE() << "accepted LOCAL_WORLD_SIZE=four";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("LOCAL_WORLD_SIZE=four is not valid; accepted:"), std::string::npos);
  }
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_THROW(rank_share(2, 2), config_error);
  EXPECT_THROW(rank_share(0, 0), config_error);
}

// Note [Tier descriptors]: a fourth tier is a row with its links and room; the planner's search, untouched,
// puts blocks on it where it beats the other rows, and its plan is the brute force's optimum over every row.
TEST(TierDescriptors, PlannerUsesAFurtherTierRow) {
  BlockProfile p;
  p.forward_seconds = 2e-3;
  p.backward_seconds = 4e-3;
  p.input_bytes = 16 * MiB;
  p.whole_bytes = 32 * MiB;
  p.cheap_bytes = 48 * MiB;
  p.cheap_recompute_seconds = 0.2e-3;
  p.splittable = false;  // keep, swap or recompute: the brute force below has no alphas to grid
  p.transient_bytes = 8 * MiB;
  const std::vector<BlockProfile> blocks(4, p);
  Links links;
  links.d2h = links.h2d = 20e9;
  links.nvme_write = links.nvme_read = 3e9;
  Budgets budgets;
  budgets.fixed_device_bytes = 64 * MiB;
  budgets.device_bytes = budgets.fixed_device_bytes + 2 * p.saved_bytes() + p.transient_bytes;  // one kept
  budgets.host_bytes = p.input_bytes;                                                            // one input
  budgets.nvme_bytes = 1ULL << 30;
  const Plan without = plan_activations(blocks, links, budgets);
  // A remote host's memory behind the host's network link: slower than the host, faster than NVMe.
  budgets.further_swap_tiers.push_back({"remote", /*via=*/0, 8e9, 8e9, 2 * p.input_bytes, true});
  const TierTable tiers = swap_tiers(links, budgets);
  ASSERT_EQ(tiers.size(), 3u);
  EXPECT_EQ(tiers.path_write(2), 8e9);
  EXPECT_EQ(tiers.path_read(1), 3e9);
  TierTable fast = tiers;
  fast.rows[2].link_write = fast.rows[2].link_read = 40e9;
  EXPECT_EQ(fast.path_write(2), 20e9) << "a swap through the host is no faster than the host's own link";
  EXPECT_EQ(fast.path_read(2), 20e9);
  // Parameters fetched from NVMe share NVMe's own link with an NVMe swap only; PCIe is priced apart.
  EXPECT_TRUE(tiers.shares_own_link(1, 1));
  EXPECT_FALSE(tiers.shares_own_link(0, 1));
  EXPECT_FALSE(tiers.shares_own_link(2, 1));
  EXPECT_FALSE(tiers.shares_own_link(0, 0));
  const Plan with = plan_activations(blocks, links, budgets);
  ASSERT_TRUE(with.fits);
  const auto on_remote = std::count_if(with.blocks.begin(), with.blocks.end(), [](const BlockPlan& b) {
    return b.mode != BlockMode::kKeep && b.tier == static_cast<SwapTier>(2);
  });
  EXPECT_EQ(on_remote, 2) << with.summary();
  ASSERT_EQ(with.tier_bytes.size(), 3u);
  EXPECT_EQ(with.tier_bytes[2], 2 * p.input_bytes);
  // The lines name the row: the summary counts its bytes, a block on it says where it goes.
  EXPECT_NE(with.summary().find(format_bytes(2 * p.input_bytes) + " remote"), std::string::npos) << with.summary();
  for (std::size_t i = 0; i < with.blocks.size(); ++i)
    if (with.blocks[i].mode != BlockMode::kKeep && with.blocks[i].tier == static_cast<SwapTier>(2))
      EXPECT_NE(with.block_line(i).find(" remote "), std::string::npos) << with.block_line(i);
  EXPECT_LT(with.predicted_step_seconds, without.predicted_step_seconds);
  // The brute force over keep and {swap, recompute} x {host, nvme, remote} for every block.
  const std::vector<std::pair<BlockMode, int>> choices = {
      {BlockMode::kKeep, 0},      {BlockMode::kSwap, 0}, {BlockMode::kRecompute, 0}, {BlockMode::kSwap, 1},
      {BlockMode::kRecompute, 1}, {BlockMode::kSwap, 2}, {BlockMode::kRecompute, 2}};
  double best = std::numeric_limits<double>::infinity();
  std::vector<BlockPlan> a(blocks.size());
  for (std::size_t code = 0; code < 7 * 7 * 7 * 7; ++code) {
    for (std::size_t i = 0, c = code; i < blocks.size(); ++i, c /= 7) {
      a[i].mode = choices[c % 7].first;
      a[i].tier = static_cast<SwapTier>(choices[c % 7].second);
    }
    const Plan plan = evaluate_plan(blocks, links, budgets, a);
    if (plan.fits) best = std::min(best, plan.predicted_step_seconds);
  }
  EXPECT_NEAR(with.predicted_step_seconds, best, 1e-12 * best);
  // A row reached through an absent one is absent too: behind NVMe with no NVMe, nothing goes there.
  Budgets no_nvme = budgets;
  no_nvme.nvme_bytes = 0;
  no_nvme.further_swap_tiers[0].via = 1;
  EXPECT_FALSE(swap_tiers(links, no_nvme).rows[2].present);
  no_nvme.further_swap_tiers[0].via = 0;
  EXPECT_TRUE(swap_tiers(links, no_nvme).rows[2].present);
  // A row the configuration's table cannot reach is refused by name.
  budgets.further_swap_tiers[0].via = 3;
  EXPECT_THROW(swap_tiers(links, budgets), config_error);
}
