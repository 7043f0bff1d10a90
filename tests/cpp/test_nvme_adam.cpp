#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <vector>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/nvme_adam.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;
namespace fs = std::filesystem;

namespace {

class NvmeAdamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::current_path() / "nvme-test" /
            (std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-" +
             std::to_string(getpid())))
               .string();
    fs::create_directories(dir_);
    swap::NvmeEngineOptions o;
    o.paths = {dir_};
    o.bytes_per_path = 64 << 20;
    o.block_bytes = 128 << 10;
    o.faults = &faults_;
    nvme_ = std::make_shared<swap::NvmeEngine>(o);
    allocator::PinnedHostPoolOptions po;
    po.budget_bytes = 64 << 20;
    po.slab_bytes = 8 << 20;
    pool_ = std::make_shared<allocator::PinnedHostPool>(po);
  }
  void TearDown() override {
    nvme_.reset();
    fs::remove_all(dir_);
  }
  std::string dir_;
  swap::NvmeFaults faults_;
  std::shared_ptr<swap::NvmeEngine> nvme_;
  std::shared_ptr<allocator::PinnedHostPool> pool_;
};

struct Param {
  std::vector<float> master, m, v, vmax, grad;
  std::vector<std::uint16_t> out;
  explicit Param(std::size_t n, unsigned seed) : master(n), m(n), v(n), vmax(n), grad(n), out(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    for (auto& x : master) x = d(rng);
  }
};

}  // namespace

TEST_F(NvmeAdamTest, StepsExactlyLikeTheInMemoryOptimizer) {
  const std::vector<std::size_t> sizes{1, 17, 100003, 4096, 300000};
  std::vector<Param> mem, disk;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    mem.emplace_back(sizes[i], i);
    disk.emplace_back(sizes[i], i);
  }
  NvmeAdamStore store(nvme_, pool_, 2);
  CpuAdam adam(2);
  std::vector<std::uint64_t> keys;
  for (auto& p : disk) keys.push_back(store.add(p.master.size(), true, p.master.data()));
  AdamOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.amsgrad = true;
  std::mt19937 rng(7);
  std::normal_distribution<float> d;
  for (int step = 1; step <= 5; ++step) {
    std::vector<AdamTensor> ts;
    std::vector<NvmeAdamStore::Item> items;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (std::size_t j = 0; j < sizes[i]; ++j) mem[i].grad[j] = disk[i].grad[j] = d(rng);
      AdamTensor t;
      t.numel = sizes[i];
      t.master = mem[i].master.data();
      t.exp_avg = mem[i].m.data();
      t.exp_avg_sq = mem[i].v.data();
      t.max_exp_avg_sq = mem[i].vmax.data();
      t.grad = mem[i].grad.data();
      t.param_out = mem[i].out.data();
      t.param_type = ScalarType::kBFloat16;
      ts.push_back(t);
      items.push_back({keys[i], disk[i].grad.data(), ScalarType::kFloat32, disk[i].out.data(), ScalarType::kBFloat16});
    }
    adam.step(o, step, ts);
    ASSERT_TRUE(store.step(o, step, items).failed.empty());
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> master(sizes[i]), m(sizes[i]), v(sizes[i]), vmax(sizes[i]);
    store.read(keys[i], master.data(), m.data(), v.data(), vmax.data());
    EXPECT_EQ(master, mem[i].master) << i;
    EXPECT_EQ(m, mem[i].m);
    EXPECT_EQ(v, mem[i].v);
    EXPECT_EQ(vmax, mem[i].vmax);
    EXPECT_EQ(disk[i].out, mem[i].out) << "the bf16 weights are written in the same pass";
  }
  EXPECT_EQ(store.stats().steps, 5u);
  EXPECT_GT(store.stats().bytes_read, 0u);
}

TEST_F(NvmeAdamTest, AFailedWriteKeepsThePreviousStateAndWeights) {
  Param p(50000, 1), q(60000, 2);
  NvmeAdamStore store(nvme_, pool_, 1);
  auto kp = store.add(p.master.size(), false, p.master.data());
  auto kq = store.add(q.master.size(), false, q.master.data());
  std::vector<float> wp(p.master), wq(q.master);  // the model's fp32 weights
  for (auto& g : p.grad) g = 0.5f;
  for (auto& g : q.grad) g = -0.25f;
  std::vector<NvmeAdamStore::Item> items{{kp, p.grad.data(), ScalarType::kFloat32, wp.data(), ScalarType::kFloat32},
                                         {kq, q.grad.data(), ScalarType::kFloat32, wq.data(), ScalarType::kFloat32}};
  AdamOptions o;
  faults_.fail_writes = 1000;  // every write of this step fails
  auto r = store.step(o, 1, items);
  EXPECT_EQ(r.failed, (std::vector<std::size_t>{0, 1}));
  EXPECT_NE(r.first_error.find("write"), std::string::npos) << r.first_error;
  faults_.fail_writes = 0;
  EXPECT_EQ(wp, p.master) << "weights restored";
  EXPECT_EQ(wq, q.master);
  std::vector<float> master(p.master.size()), m(p.master.size()), v(p.master.size());
  store.read(kp, master.data(), m.data(), v.data(), nullptr);
  EXPECT_EQ(master, p.master);
  EXPECT_EQ(m, std::vector<float>(p.master.size(), 0.f)) << "moments untouched";
  EXPECT_EQ(store.stats().write_failures, 2u);
  EXPECT_TRUE(store.step(o, 1, items).failed.empty());  // the retry succeeds
  EXPECT_NE(wp, p.master);
  // One write failing: only that parameter keeps its old state.
  faults_.fail_writes = 1;
  std::vector<float> wq_before = wq;
  auto partial = store.step(o, 2, items);
  EXPECT_EQ(partial.failed.size(), 1u);
  faults_.fail_writes = 0;
  EXPECT_EQ(nvme_->stats().bytes_in_use, static_cast<std::uint64_t>(allocator::round_up(50000 * 12, 4096) +
                                                                      allocator::round_up(60000 * 12, 4096)))
      << "no NVMe space leaked by the failed attempt";
}
