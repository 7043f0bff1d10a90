// A runtime's statistics document (tiering/runtime_stats.hpp): every part, each field its table names, counts as
// integers and scaled fields (the optimizer's step time in milliseconds) as numbers with a fraction.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tierflow/tiering/runtime_stats.hpp"

using namespace tierflow;
using Json = nlohmann::json;

namespace {

TEST(RuntimeStats, EveryPartWithTheFieldsOfItsTable) {
  tiering::RuntimeStatsParts p;
  p.device = "emulated";
  p.activations.packs = 7;
  p.activations.stall_ns = 5;
  p.activations.device_bytes = StatValues{10, 20, 30, 20};
  p.host_pool.in_use = StatValues{1, 2, 3, 2};
  p.host_budget_bytes = 1 << 30;
  p.host_pinned = false;
  p.optimizer = {3, 4096, 2'500'000};
  p.cpu_threads = 2;
  p.cpu_isa = "avx2";
  p.emulated.delayed_copies = 9;
  p.emulated_mode = "adversarial";
  p.poisoned_device_memory = true;
  p.device_late_writes = 1;
  p.links.d2h_bytes = 4096;
  const Json s = Json::parse(tiering::runtime_stats_json(p));
  EXPECT_EQ(s["device"], "emulated");
  EXPECT_EQ(s["activations"]["packs"], 7);
  EXPECT_TRUE(s["activations"]["packs"].is_number_integer());
  EXPECT_EQ(s["activations"]["device_bytes"], (Json{{"current", 10}, {"peak", 20}, {"allocated", 30}, {"freed", 20}}));
  EXPECT_TRUE(s["activations"]["nvme"].is_object());
  EXPECT_TRUE(s["activations"].contains("host_bytes") && s["activations"].contains("nvme_bytes"));
  EXPECT_EQ(s["host_pool"]["budget_bytes"], 1 << 30);
  EXPECT_EQ(s["host_pool"]["pinned"], false);
  EXPECT_EQ(s["host_pool"]["in_use"]["peak"], 2);
  EXPECT_TRUE(s["host_pool"].contains("reserved"));
  EXPECT_EQ(s["optimizer"]["steps"], 3);
  EXPECT_EQ(s["optimizer"]["elements"], 4096);
  EXPECT_TRUE(s["optimizer"]["step_ms"].is_number_float());
  EXPECT_DOUBLE_EQ(s["optimizer"]["step_ms"].get<double>(), 2.5);
  EXPECT_EQ(s["optimizer"]["threads"], 2);
  EXPECT_EQ(s["optimizer"]["isa"], "avx2");
  EXPECT_EQ(s["emulated"]["delayed_copies"], 9);
  EXPECT_EQ(s["emulated"]["mode"], "adversarial");
  EXPECT_EQ(s["emulated"]["poisoned_device_memory"], true);
  EXPECT_EQ(s["emulated"]["device_late_writes"], 1);
  EXPECT_EQ(s["links"]["gpu_to_host_bytes"], 4096);
  // Each part holds every field of its table (a counter added to a struct and its table shows up).
  for (const auto& f : tiering::saved_tensor_stat_fields()) EXPECT_TRUE(s["activations"].contains(f.name)) << f.name;
  for (const auto& f : tiering::saved_tensor_nvme_stat_fields()) EXPECT_TRUE(s["activations"]["nvme"].contains(f.name)) << f.name;
  for (const auto& f : tiering::saved_tensor_prefetch_stat_fields()) EXPECT_TRUE(s["prefetch"].contains(f.name)) << f.name;
  for (const auto& f : allocator::pinned_pool_stat_fields()) EXPECT_TRUE(s["host_pool"].contains(f.name)) << f.name;
  for (const auto& f : swap::copy_engine_stat_fields()) EXPECT_TRUE(s["links"].contains(f.name)) << f.name;
  for (const auto& f : swap::emulated_copy_stat_fields()) EXPECT_TRUE(s["emulated"].contains(f.name)) << f.name;
}

}  // namespace
