#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

#include "loop_fs.hpp"
#include "sanitizers.hpp"
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
  NvmeAdamStore store(nvme_, pool_, tierflow::testing::kAdamThreads);
  CpuAdam adam(tierflow::testing::kAdamThreads);
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

namespace {

using tierflow::testing::LoopFs;

// One step of the in-memory optimizer, to compare with.
void step_in_memory(CpuAdam& adam, const AdamOptions& o, int step, std::vector<Param>& ps) {
  std::vector<AdamTensor> ts;
  for (auto& p : ps) {
    AdamTensor t;
    t.numel = p.master.size();
    t.master = p.master.data();
    t.exp_avg = p.m.data();
    t.exp_avg_sq = p.v.data();
    t.grad = p.grad.data();
    t.param_out = p.out.data();
    t.param_type = ScalarType::kBFloat16;
    ts.push_back(t);
  }
  adam.step(o, step, ts);
}

void expect_state(NvmeAdamStore& store, std::uint64_t key, const Param& want, const std::string& what) {
  const std::size_t n = want.master.size();
  std::vector<float> master(n), m(n), v(n);
  store.read(key, master.data(), m.data(), v.data(), nullptr);
  EXPECT_EQ(master, want.master) << what;
  EXPECT_EQ(m, want.m) << what;
  EXPECT_EQ(v, want.v) << what;
}

}  // namespace

// Issue 16: a full disk in the middle of a step fails only the items that
// found no space; a retry of those after space is freed steps each parameter
// exactly once, and every state equals the in-memory optimizer's.
TEST_F(NvmeAdamTest, AFullDiskMidStepFailsOnlyTheRestAndARetryStepsEachOnce) {
  LoopFs disk(dir_, 48);
  std::shared_ptr<swap::NvmeEngine> nvme = nvme_;
  if (disk.ok()) {
    swap::NvmeEngineOptions o;
    o.paths = {disk.path()};
    o.bytes_per_path = 1ULL << 30;  // past the disk: the disk decides (real ENOSPC)
    o.block_bytes = 128 << 10;
    o.grow_bytes = 1 << 20;
    nvme = std::make_shared<swap::NvmeEngine>(o);
  }
  NvmeAdamStore store(nvme, pool_, tierflow::testing::kAdamThreads);
  CpuAdam adam(tierflow::testing::kAdamThreads);
  const std::vector<std::size_t> sizes{100000, 200000, 300000, 400000};  // each new state needs fresh space
  std::vector<Param> mem, disk_params;
  std::vector<std::uint64_t> keys;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    mem.emplace_back(sizes[i], 10 + i);
    disk_params.emplace_back(sizes[i], 10 + i);
    for (std::size_t j = 0; j < sizes[i]; ++j) mem[i].grad[j] = disk_params[i].grad[j] = 0.01f * ((j % 7) - 3.0f);
    keys.push_back(store.add(sizes[i], false, disk_params[i].master.data()));
  }
  std::vector<NvmeAdamStore::Item> items;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    items.push_back({keys[i], disk_params[i].grad.data(), ScalarType::kFloat32, disk_params[i].out.data(),
                     ScalarType::kBFloat16});
  // Room for the first item's new state, not for the second's.
  nvme->reserve({NvmeAdamStore::state_bytes(sizes[0], false)});
  if (disk.ok()) disk.fill(256 << 10);
  else faults_.fail_grows = 1000;  // no loop device here: the injected full disk
  AdamOptions o;
  o.lr = 1e-2;
  auto r = store.step(o, 1, items);
  faults_.fail_grows = 0;
  ASSERT_FALSE(r.failed.empty()) << "the disk was full";
  ASSERT_NE(r.failed.front(), 0u) << "the first item had its space";
  for (std::size_t k = 0; k < r.failed.size(); ++k) EXPECT_EQ(r.failed[k], r.failed.front() + k) << "the rest failed";
  EXPECT_TRUE(r.lost.empty());
  EXPECT_NE(r.first_error.find(disk.ok() ? "No space left" : "injected"), std::string::npos) << r.first_error;
  for (std::size_t i : r.failed) {
    expect_state(store, keys[i], disk_params[i], "a failed item keeps its state");  // unchanged masters
    EXPECT_EQ(disk_params[i].out, std::vector<std::uint16_t>(sizes[i], 0)) << "and its weight";
  }
  if (disk.ok()) disk.empty();
  std::vector<NvmeAdamStore::Item> retry;
  for (std::size_t i : r.failed) retry.push_back(items[i]);
  ASSERT_TRUE(store.step(o, 1, retry).failed.empty()) << "space freed: the retry steps the rest";
  step_in_memory(adam, o, 1, mem);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    expect_state(store, keys[i], mem[i], "stepped exactly once: " + std::to_string(i));
    EXPECT_EQ(disk_params[i].out, mem[i].out) << i;
  }
  if (!disk.ok()) GTEST_SKIP() << "ran with an injected full disk only: " << disk.why();
}

// Issue 16: a state corrupt on disk is lost for its own parameter only; the
// step goes on for the others, and the store says which one.
TEST_F(NvmeAdamTest, ACorruptStateIsLostForItsParameterOnly) {
  NvmeAdamStore store(nvme_, pool_, tierflow::testing::kAdamThreads);
  CpuAdam adam(tierflow::testing::kAdamThreads);
  const std::vector<std::size_t> sizes{30000, 50000, 70000};
  std::vector<Param> mem, disk_params;
  std::vector<std::uint64_t> keys;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    mem.emplace_back(sizes[i], 20 + i);
    disk_params.emplace_back(sizes[i], 20 + i);
    for (std::size_t j = 0; j < sizes[i]; ++j) mem[i].grad[j] = disk_params[i].grad[j] = 0.5f;
    keys.push_back(store.add(sizes[i], false, disk_params[i].master.data()));
  }
  // Flip bytes of parameter 1's state in the swap file itself.
  auto where = store.extents(keys[1]);
  ASSERT_EQ(where.size(), 1u);
  {
    int fd = ::open(where[0].file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const char junk[16] = "corrupt bytes!!";
    ASSERT_EQ(pwrite(fd, junk, sizeof junk, static_cast<off_t>(where[0].offset + 4096)), 16);
    fsync(fd);
    ::close(fd);
  }
  std::vector<NvmeAdamStore::Item> items;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    items.push_back({keys[i], disk_params[i].grad.data(), ScalarType::kFloat32, disk_params[i].out.data(),
                     ScalarType::kBFloat16});
  AdamOptions o;
  auto r = store.step(o, 1, items);
  EXPECT_EQ(r.lost, std::vector<std::size_t>{1});
  EXPECT_EQ(r.failed, std::vector<std::size_t>{1});
  EXPECT_NE(r.first_error.find("checksum mismatch"), std::string::npos) << r.first_error;
  EXPECT_EQ(disk_params[1].out, std::vector<std::uint16_t>(sizes[1], 0)) << "its weight untouched";
  std::vector<float> x(sizes[1]);
  EXPECT_THROW(store.read(keys[1], x.data(), x.data(), x.data(), nullptr), io_error) << "lost for good";
  std::vector<Param> stepped{mem[0], mem[2]};
  step_in_memory(adam, o, 1, stepped);
  expect_state(store, keys[0], stepped[0], "intact states stepped");
  expect_state(store, keys[2], stepped[1], "intact states stepped");
  // A good state written over it (from a checkpoint) makes it whole again.
  store.write(keys[1], mem[1].master.data(), mem[1].m.data(), mem[1].v.data(), nullptr);
  EXPECT_TRUE(store.step(o, 1, {items[1]}).failed.empty());
}

TEST_F(NvmeAdamTest, ReservationNamesTheNeedAndTheFreeSpace) {
  NvmeAdamStore store(nvme_, pool_, 1);
  store.reserve({NvmeAdamStore::state_bytes(1 << 20, false)});  // 12 MiB of 64: fine
  try {
    store.reserve({NvmeAdamStore::state_bytes(std::size_t{1} << 40, true)});
    FAIL() << "16 TiB of states were reserved in a 64 MiB tier";
  } catch (const io_error& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("states of 1 parameter(s) need 16.00 TiB"), std::string::npos) << m;
    EXPECT_NE(m.find("TIERFLOW_NVME_MEMORY"), std::string::npos) << m;
  }
}

// Note [Optimizer state formats] on NVMe: a bf16 or 8-bit state stepped through the store equals the same state
// stepped in memory byte for byte, moments included, and its block holds the master plus moment_bytes per moment.
TEST_F(NvmeAdamTest, PackedMomentsStepLikeTheInMemoryOptimizerAndTakeTheirBytesOnly) {
  const std::vector<std::size_t> sizes{1, 17, 300, 100003};  // one block, a part block, several, many
  for (StateFormat format : {StateFormat::kBf16, StateFormat::k8bit}) {
    SCOPED_TRACE(to_string(format));
    NvmeAdamStore store(nvme_, pool_, tierflow::testing::kAdamThreads);
    CpuAdam adam(tierflow::testing::kAdamThreads);
    std::vector<Param> mem;
    std::vector<std::vector<std::uint8_t>> mm, mv;  // the in-memory run's moments, in the format
    std::vector<std::vector<float>> grads;
    std::vector<std::uint64_t> keys;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      mem.emplace_back(sizes[i], 10 + i);
      mm.emplace_back(moment_bytes(format, sizes[i]), 0);
      mv.emplace_back(moment_bytes(format, sizes[i]), 0);
      grads.emplace_back(sizes[i]);
      keys.push_back(store.add(sizes[i], false, mem[i].master.data(), nullptr, nullptr, nullptr, format));
      EXPECT_EQ(store.format(keys[i]), format);
      std::uint64_t on_disk = 0;
      for (const auto& x : store.extents(keys[i])) on_disk += x.bytes;
      EXPECT_GE(on_disk, 4 * sizes[i] + 2 * moment_bytes(format, sizes[i]));
    }
    EXPECT_EQ(NvmeAdamStore::state_bytes(1000, false, StateFormat::k8bit), 4000u + 2 * (1008u + 4 * 4));
    EXPECT_EQ(NvmeAdamStore::state_bytes(1000, false, StateFormat::kBf16), 4000u + 2 * 2000u);
    std::vector<Param> disk;
    for (std::size_t i = 0; i < sizes.size(); ++i) disk.emplace_back(sizes[i], 10 + i);
    AdamOptions o;
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    std::mt19937 rng(3);
    std::normal_distribution<float> d;
    const std::uint64_t read_before = store.stats().bytes_read;
    for (int step = 1; step <= 4; ++step) {
      std::vector<AdamTensor> ts;
      std::vector<NvmeAdamStore::Item> items;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        for (auto& g : grads[i]) g = d(rng) * (i == 3 ? 1e-3f : 1.0f);
        AdamTensor t;
        t.numel = sizes[i];
        t.master = mem[i].master.data();
        t.state_format = format;
        t.m = format == StateFormat::k8bit ? packed_8bit(mm[i].data(), sizes[i]) : PackedMoment{mm[i].data(), nullptr};
        t.v = format == StateFormat::k8bit ? packed_8bit(mv[i].data(), sizes[i]) : PackedMoment{mv[i].data(), nullptr};
        t.grad = grads[i].data();
        t.param_out = mem[i].out.data();
        t.param_type = ScalarType::kBFloat16;
        ts.push_back(t);
        items.push_back({keys[i], grads[i].data(), ScalarType::kFloat32, disk[i].out.data(), ScalarType::kBFloat16});
      }
      adam.step(o, step, ts);
      ASSERT_TRUE(store.step(o, step, items).failed.empty());
    }
    std::uint64_t state_total = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      state_total += NvmeAdamStore::state_bytes(sizes[i], false, format);
      std::vector<float> master(sizes[i]);
      std::vector<std::uint8_t> m(moment_bytes(format, sizes[i])), v(m.size());
      store.read(keys[i], master.data(), m.data(), v.data(), nullptr, format);
      EXPECT_EQ(master, mem[i].master) << i;
      EXPECT_EQ(m, mm[i]) << i << ": the moments' bytes, scales included";
      EXPECT_EQ(v, mv[i]) << i;
      EXPECT_EQ(disk[i].out, mem[i].out) << i;
      // Read as fp32 (decoded) and written back (encoded): the same bytes on disk.
      std::vector<float> m32(sizes[i]), v32(sizes[i]);
      store.read(keys[i], master.data(), m32.data(), v32.data(), nullptr);
      store.write(keys[i], master.data(), m32.data(), v32.data(), nullptr);
      store.read(keys[i], master.data(), m.data(), v.data(), nullptr, format);
      EXPECT_EQ(m, mm[i]) << i << ": decoded and encoded again";
      EXPECT_EQ(v, mv[i]) << i;
    }
    EXPECT_EQ(store.stats().bytes_read - read_before, 4 * state_total) << "moment_bytes a moment, not 4 a parameter";
    for (auto k : keys) store.remove(k);
  }
}

TEST_F(NvmeAdamTest, PackedMomentsRefuseAmsgradAndForeignFormats) {
  std::vector<float> master(64, 1.0f);
  NvmeAdamStore store(nvme_, pool_, 1);
  try {
    store.add(64, true, master.data(), nullptr, nullptr, nullptr, StateFormat::k8bit);
    FAIL() << "amsgrad with 8-bit moments was accepted";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("TIERFLOW_OPTIMIZER_STATES"), std::string::npos) << e.what();
  }
  const auto key = store.add(64, false, master.data(), nullptr, nullptr, nullptr, StateFormat::kBf16);
  std::vector<std::uint8_t> m(moment_bytes(StateFormat::k8bit, 64)), v(m.size());
  EXPECT_THROW(store.read(key, master.data(), m.data(), v.data(), nullptr, StateFormat::k8bit), logic_error);
}
