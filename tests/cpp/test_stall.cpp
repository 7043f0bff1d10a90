// Note [Stall timeout]: a wait on a copy or an NVMe request that never completes raises, naming it and what
// else is in flight, within TIERFLOW_STALL_TIMEOUT.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <future>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nvme_test_dir.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/optimizer/adam_args.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/grad_content.hpp"
#include "tierflow/optimizer/nvme_adam.hpp"
#include "tierflow/optimizer/step_engine.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/staged_pipeline.hpp"

using namespace tierflow;
using namespace tierflow::swap;
using namespace tierflow::testing_nvme;

namespace {

using Clock = std::chrono::steady_clock;

// The process-wide limit for one test, restored after it.
class StallTest : public ::testing::Test {
 protected:
  void SetUp() override { before_ = stall_timeout(); }
  void TearDown() override { set_stall_timeout(before_); }
  double before_ = 0;
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The stall error of `wait`, and how long it took to come; fails the test when it does not come.
std::pair<std::string, double> stall_of(const TransferHandle& h) {
  const auto t0 = Clock::now();
  try {
    h.wait();
  } catch (const stall_error& e) {
    return {e.what(), seconds_since(t0)};
  }
  ADD_FAILURE() << "the wait ended without a stall error";
  return {"", seconds_since(t0)};
}

TEST_F(StallTest, AStalledCopyRaisesWithinTheTimeoutNamingItAndWhatElseIsInFlight) {
  auto faults = std::make_shared<CopyFaults>();
  faults->d2h_delay_us = 1'200'000;  // each device -> host copy holds its stream this long
  auto engine = make_emulated_copy_engine(faults);
  std::vector<char> src(4096, 1), dst(4096), src2(8192, 2), dst2(8192);
  set_stall_timeout(0.15);
  const TransferHandle first = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size());
  const TransferHandle second = engine->copy(Direction::kDeviceToHost, dst2.data(), src2.data(), src2.size());
  const auto [what, took] = stall_of(first);
  EXPECT_LT(took, 0.9) << "raised within the timeout, not when the copy ended";
  EXPECT_GE(took, 0.14);
  EXPECT_NE(what.find("for a device -> host copy of 4.00 KiB"), std::string::npos) << what;
  EXPECT_NE(what.find("TIERFLOW_STALL_TIMEOUT=0.15 s"), std::string::npos) << what;
  // Both copies are in flight, oldest first, with their ages.
  const auto at = what.find("In flight, oldest first:");
  ASSERT_NE(at, std::string::npos) << what;
  const auto a = what.find("device -> host copy of 4.00 KiB", at), b = what.find("device -> host copy of 8.00 KiB", at);
  EXPECT_TRUE(a != std::string::npos && b != std::string::npos && a < b) << what;
  EXPECT_NE(what.find(" s old"), std::string::npos) << what;
  // The work itself goes on: with no limit the wait ends when the copy does, and what it moved is there.
  set_stall_timeout(0);
  first.wait();
  second.wait();
  EXPECT_EQ(dst, src);
  EXPECT_TRUE(PendingWork::in_flight(8).empty()) << "finished work leaves the list";
}

TEST_F(StallTest, AWaitWithinTheTimeoutIsUntouched) {
  auto faults = std::make_shared<CopyFaults>();
  faults->d2h_delay_us = 100'000;
  auto engine = make_emulated_copy_engine(faults);
  std::vector<char> src(4096, 3), dst(4096);
  set_stall_timeout(5.0);
  const TransferHandle h = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size());
  EXPECT_NO_THROW(h.wait());
  EXPECT_EQ(dst, src);
}

TEST_F(StallTest, AStuckNvmeWriteRaisesNamingItsBlock) {
  const NvmeTestDir dir("stall-");
  {
    NvmeFaults faults;
    NvmeEngine e(faulty_nvme_options(dir.path(), faults, 256 << 10));
    std::vector<char> data(1 << 20, 7);
    const NvmeBlock b = e.allocate(data.size());
    faults.write_delay_us = 1'000'000;  // the disk holds each write request this long
    set_stall_timeout(0.15);
    const TransferHandle w = e.write(b, data.data(), data.size());
    const auto [what, took] = stall_of(w);
    EXPECT_LT(took, 0.9);
    EXPECT_NE(what.find("for a NVMe write of 1.00 MiB (block " + std::to_string(b) + ")"), std::string::npos) << what;
    set_stall_timeout(0);
    faults.write_delay_us = 0;
    w.wait();  // it completes in the end, and the block reads back
    std::vector<char> back(data.size());
    e.read(b, back.data(), back.size()).wait();
    EXPECT_EQ(back, data);
  }
}

TEST(StallConfig, TheTimeoutParsesSecondsMinutesHoursAndNone) {
  auto parse = [](const std::string& v) { return Config::parse({}, {{"stall_timeout", v}}).stall_timeout_seconds; };
  EXPECT_EQ(Config::parse({}, {}).stall_timeout_seconds, 600.0);  // 10 minutes (kDefaultStallTimeout)
  EXPECT_EQ(kDefaultStallTimeout, 600.0);
  EXPECT_EQ(parse("90"), 90.0);
  EXPECT_EQ(parse("90s"), 90.0);
  EXPECT_EQ(parse("10min"), 600.0);
  EXPECT_EQ(parse("1h"), 3600.0);
  EXPECT_EQ(parse("1.5"), 1.5);
  EXPECT_EQ(parse("1"), 1.0);
  EXPECT_EQ(parse("none"), 0.0);
  // Zero in any unit is none, consistently.
  EXPECT_EQ(parse("0"), 0.0);
  EXPECT_EQ(parse("0s"), 0.0);
  EXPECT_EQ(parse("0min"), 0.0);
  for (const char* bad : {"", "-3", "ten", "5d", "nan", "0.5", "0.5s", "0.01min", "999ms"}) {
    try {
      parse(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const config_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("TIERFLOW_STALL_TIMEOUT"), std::string::npos) << what;
      EXPECT_NE(what.find("at least 1 second: seconds (e.g. 600), 30s, 10min, 1h; or none"), std::string::npos)
          << what;
    }
  }
  try {
    parse("0.5s");
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("under a second is refused"), std::string::npos) << e.what();
  }
  EXPECT_EQ(Config::parse({}, {{"stall_timeout", "90s"}}).to_strings().at("TIERFLOW_STALL_TIMEOUT"), "90s");
}

// Item 5: the limit is process-wide; a second runtime's claim with another value is refused while the first
// lives, the same value is fine, and so is any value once the first is gone.
TEST_F(StallTest, ASecondClaimWithAnotherLimitIsRefusedWhileTheFirstLives) {
  {
    StallTimeoutClaim first(30.0);
    EXPECT_EQ(stall_timeout(), 30.0);
    StallTimeoutClaim same(30.0);
    try {
      StallTimeoutClaim other(5.0);
      ADD_FAILURE() << "a second runtime changed the first one's limit";
    } catch (const config_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("TIERFLOW_STALL_TIMEOUT"), std::string::npos) << what;
      EXPECT_NE(what.find("stall_timeout"), std::string::npos) << what;
      EXPECT_NE(what.find("asks for 5 s"), std::string::npos) << what;
      EXPECT_NE(what.find("uses 30 s"), std::string::npos) << what;
    }
    EXPECT_EQ(stall_timeout(), 30.0) << "the refused claim left the limit alone";
  }
  StallTimeoutClaim later(5.0);  // the first is gone
  EXPECT_EQ(stall_timeout(), 5.0);
}

// Item 3: a wait's limit counts from the work's start, not the wait's: a copy already past most of its limit
// when the wait begins raises after the rest of it.
TEST_F(StallTest, TheLimitCountsFromTheWorksStartNotTheWaits) {
  auto faults = std::make_shared<CopyFaults>();
  faults->hold_d2h = true;
  auto engine = make_emulated_copy_engine(faults);
  std::vector<char> src(4096, 1), dst(4096);
  set_stall_timeout(0.6);
  const TransferHandle h = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(450));
  const auto [what, took] = stall_of(h);
  EXPECT_LT(took, 0.4) << "the wait took its own full limit: counted from the wait's start";
  EXPECT_NE(what.find("device -> host copy of 4.00 KiB"), std::string::npos) << what;
  const auto [again, took_again] = stall_of(h);  // a second wait on what stalled raises at once
  EXPECT_LT(took_again, 0.1);
  faults->hold_d2h = false;
  set_stall_timeout(0);
  h.wait();
}

// Review fix: a stall ends training at the limit of the OLDEST work in flight. A wait on a newer copy ends at the
// older one's deadline, naming it first (it used to take its own full limit: a stall that a release only logged
// raised one limit later, on a copy submitted after it); and a call that can raise checks it first.
TEST_F(StallTest, AWaitOnNewerWorkRaisesAtTheOldestWorksLimitNamingItFirst) {
  auto faults = std::make_shared<CopyFaults>();
  faults->hold_d2h = true;
  auto engine = make_emulated_copy_engine(faults);
  std::vector<char> src(4096, 1), dst(4096), src2(8192, 2), dst2(8192);
  set_stall_timeout(0.6);
  const auto t0 = Clock::now();
  const TransferHandle older = engine->copy(Direction::kDeviceToHost, dst.data(), src.data(), src.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_NO_THROW(raise_if_stalled()) << "nothing is past its limit yet";
  const TransferHandle newer = engine->copy(Direction::kDeviceToHost, dst2.data(), src2.data(), src2.size());
  const auto [what, took] = stall_of(newer);
  const double since_start = seconds_since(t0);
  EXPECT_LT(since_start, 0.8) << "raised at the newer copy's own limit (0.9 s), not the older one's (0.6 s)";
  EXPECT_GE(since_start, 0.59);
  const auto oldest = what.find("device -> host copy of 4.00 KiB");
  const auto waited = what.find("device -> host copy of 8.00 KiB");
  EXPECT_TRUE(oldest != std::string::npos && waited != std::string::npos && oldest < waited)
      << "the oldest stalled copy is named first: " << what;
  EXPECT_NE(what.find("the oldest work in flight"), std::string::npos) << what;
  // A call that can raise (the staged pipeline's offload, fetch) raises at once, naming the oldest.
  try {
    raise_if_stalled();
    ADD_FAILURE() << "raise_if_stalled() past the oldest copy's limit did not raise";
  } catch (const stall_error& e) {
    EXPECT_EQ(std::string(e.what()).find("tierflow: a device -> host copy of 4.00 KiB"), 0u) << e.what();
  }
  faults->hold_d2h = false;
  set_stall_timeout(0);
  older.wait();
  newer.wait();
  set_stall_timeout(0.6);
  EXPECT_NO_THROW(raise_if_stalled()) << "nothing in flight once the copies end";
}

// Item 1: the pinned pool's allocation that waits for a fenced block whose copy stalls raises the stall (it
// neither loops on the fence nor reports the pool full).
TEST_F(StallTest, APoolAllocationWaitingForAStalledCopyRaisesTheStall) {
  auto faults = std::make_shared<CopyFaults>();
  auto engine = make_emulated_copy_engine(faults);
  allocator::PinnedHostPoolOptions po;
  po.budget_bytes = 1 << 20;
  po.slab_bytes = 1 << 20;
  auto pool = std::make_shared<allocator::PinnedHostPool>(po);
  void* block = pool->allocate(1 << 20);  // the whole budget
  std::vector<char> src(1 << 20, 5);
  faults->hold_d2h = true;  // a hung device: the copy into the block never starts
  const TransferHandle h = engine->copy(Direction::kDeviceToHost, block, src.data(), src.size());
  pool->deallocate(block, h.state());  // reused once the copy is done
  set_stall_timeout(0.3);
  const auto t0 = Clock::now();
  auto attempt = std::async(std::launch::async, [&] { return pool->try_allocate(1 << 20); });
  const bool returned = attempt.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  faults->hold_d2h = false;  // a looping allocation ends once the copy does
  std::string what;
  void* got = nullptr;
  try {
    got = attempt.get();
  } catch (const stall_error& e) {
    what = e.what();
  }
  EXPECT_TRUE(returned) << "the allocation kept waiting on the stalled copy";
  EXPECT_LT(seconds_since(t0), 3.5);
  EXPECT_EQ(got, nullptr);
  EXPECT_NE(what.find("device -> host copy of 1.00 MiB"), std::string::npos)
      << "not raised as a stall (a false out-of-memory or a success after the hang): '" << what << "'";
  set_stall_timeout(0);
  h.wait();
  if (got) pool->deallocate(got);
}

// Item 2: a block released while its copy hangs keeps its memory, and the pipeline's teardown returns within
// the limit, keeping that memory for good (one warning) instead of hanging.
TEST_F(StallTest, TeardownWithAHungCopyReturnsWithinTheLimitKeepingItsMemory) {
  auto faults = std::make_shared<CopyFaults>();
  std::shared_ptr<CopyEngine> engine = make_emulated_copy_engine(faults);
  allocator::PinnedHostPoolOptions po;
  po.budget_bytes = 4 << 20;
  po.slab_bytes = 1 << 20;
  auto pool = std::make_shared<allocator::PinnedHostPool>(po);
  StagedPipelineOptions o;
  o.allocate_device = [](std::size_t bytes, int) {
    auto mem = std::make_shared<std::vector<unsigned char>>(bytes);
    return DeviceBuffer{mem->data(), mem};
  };
  o.compute_stream = [engine](int) { return engine->compute_stream(nullptr); };
  auto pipeline = std::make_unique<StagedPipeline>(o, pool, engine);
  auto device = std::make_shared<std::vector<unsigned char>>(256 << 10, 9);
  std::weak_ptr<void> device_alive = device;
  faults->hold_d2h = true;
  ASSERT_TRUE(pipeline->offload(1, DeviceBuffer{device->data(), device}, device->size(), 0, StagedTarget::kHost,
                                engine->compute_stream(nullptr)));
  device.reset();
  set_stall_timeout(0.3);
  pipeline->release(1);  // cannot raise: parks the block, whose copy still reads the device copy
  EXPECT_FALSE(device_alive.expired()) << "a released block whose copy stalls lost its device memory";
  EXPECT_GT(pool->stats().in_use.current, 0) << "its staging went back to the pool under the copy";
  EXPECT_THROW(pipeline->offload(2, o.allocate_device(4096, 0), 4096, 0, StagedTarget::kHost,
                                 engine->compute_stream(nullptr)),
               stall_error)
      << "the next offload raises the stall";
  const std::size_t kept_before = kept_forever_count();
  const auto t0 = Clock::now();
  auto teardown = std::async(std::launch::async, [&] { pipeline.reset(); });
  const bool returned = teardown.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "teardown waited for the hung copy without a limit";
  EXPECT_LT(seconds_since(t0), 1.0);
  faults->hold_d2h = false;  // a hanging teardown ends now
  teardown.get();
  if (returned) {
    EXPECT_EQ(kept_forever_count(), kept_before + 1) << "one warning naming the memory kept";
    EXPECT_FALSE(device_alive.expired()) << "teardown freed memory the hung copy still reads";
  }
  set_stall_timeout(0);
  engine->synchronize();
}

// Item 1: the staged pipeline's wait for staging, on an NVMe write that stalls, raises the stall instead of
// giving up as if no staging memory could be had (a false out-of-memory: the block would stay on the device).
TEST_F(StallTest, AStagingWaitOnAStalledNvmeWriteRaisesTheStall) {
  const NvmeTestDir dir("stall-staging-");
  {
    NvmeFaults nvme_faults;
    auto nvme = std::make_shared<NvmeEngine>(faulty_nvme_options(dir.path(), nvme_faults, 256 << 10));
    std::shared_ptr<CopyEngine> engine = make_emulated_copy_engine();
    allocator::PinnedHostPoolOptions po;
    po.budget_bytes = 1 << 20;  // staging for one block
    po.slab_bytes = 1 << 20;
    auto pool = std::make_shared<allocator::PinnedHostPool>(po);
    StagedPipelineOptions o;
    o.allocate_device = [](std::size_t bytes, int) {
      auto mem = std::make_shared<std::vector<unsigned char>>(bytes, 3);
      return DeviceBuffer{mem->data(), mem};
    };
    o.compute_stream = [engine](int) { return engine->compute_stream(nullptr); };
    StagedPipeline pipeline(o, pool, engine, nvme);
    nvme_faults.write_delay_us = 800'000;  // the disk holds each write this long
    set_stall_timeout(0.25);
    ASSERT_TRUE(pipeline.offload(1, o.allocate_device(1 << 20, 0), 1 << 20, 0, StagedTarget::kNvme,
                                 engine->compute_stream(nullptr)));
    std::string what;
    bool offloaded = false;
    const auto t0 = Clock::now();
    try {  // needs block 1's staging, free once its (stalled) write is done
      offloaded = pipeline.offload(2, o.allocate_device(1 << 20, 0), 1 << 20, 0, StagedTarget::kNvme,
                                   engine->compute_stream(nullptr));
    } catch (const stall_error& e) {
      what = e.what();
    }
    EXPECT_LT(seconds_since(t0), 0.7);
    EXPECT_FALSE(offloaded);
    EXPECT_NE(what.find("NVMe write of 1.00 MiB"), std::string::npos)
        << "the stalled write was taken for a lack of staging: '" << what << "'";
    set_stall_timeout(0);
    nvme_faults.write_delay_us = 0;
  }
}

// Item 1: the NVMe optimizer's stalled read raises (its state is not taken for lost, its buffer not reused for
// the next item), and the state on NVMe stays intact.
TEST_F(StallTest, TheNvmeOptimizersStalledReadRaisesInsteadOfTakingTheStateForLost) {
  const NvmeTestDir dir("stall-adam-");
  {
    NvmeFaults faults;
    auto nvme = std::make_shared<NvmeEngine>(faulty_nvme_options(dir.path(), faults, 128 << 10));
    allocator::PinnedHostPoolOptions po;
    po.budget_bytes = 16 << 20;
    po.slab_bytes = 4 << 20;
    auto pool = std::make_shared<allocator::PinnedHostPool>(po);
    optimizer::NvmeAdamStore store(nvme, pool, 1);
    const std::size_t n = 20000;
    std::vector<float> master(n, 0.5f), grad(n, 0.25f), weight(master), weight2(master);
    const auto k1 = store.add(n, false, master.data());
    const auto k2 = store.add(n, false, master.data());
    std::vector<optimizer::NvmeAdamStore::Item> items{
        {k1, grad.data(), optimizer::ScalarType::kFloat32, weight.data(), optimizer::ScalarType::kFloat32},
        {k2, grad.data(), optimizer::ScalarType::kFloat32, weight2.data(), optimizer::ScalarType::kFloat32}};
    optimizer::AdamOptions ao;
    faults.read_delay_us = 900'000;  // the disk holds each read this long
    set_stall_timeout(0.25);
    std::string what;
    optimizer::NvmeAdamStore::StepResult r;
    const auto t0 = Clock::now();
    try {
      r = store.step(ao, 1, items);
    } catch (const stall_error& e) {
      what = e.what();
    }
    EXPECT_LT(seconds_since(t0), 0.8) << "raised within the limit";
    EXPECT_NE(what.find("NVMe read of"), std::string::npos)
        << "a stalled read taken for a lost state (" << r.lost.size() << " lost, " << r.failed.size()
        << " failed): '" << what << "'";
    EXPECT_TRUE(r.lost.empty());
    EXPECT_EQ(weight, master) << "no weight was stepped from a read that had not landed";
    set_stall_timeout(0);
    faults.read_delay_us = 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // the held reads land (in kept buffers)
    std::vector<float> back(n), m(n), v(n);
    store.read(k1, back.data(), m.data(), v.data(), nullptr);
    EXPECT_EQ(back, master) << "the state on NVMe is intact";
  }
}

// Item 7: the CPU optimizer's step (the step engine's worker) waits with the limit: a bucket whose gradient
// copy never lands raises naming the copy (not settled as failed: its memory stays), and a bucket whose
// kernel never ends raises naming the CPU step, instead of hanging step().
struct StallHost final : optimizer::StepEngineHost {
  optimizer::CpuAdam adam{1};
  std::vector<std::int64_t> steps;
  std::set<std::size_t> landed, failed;
  std::vector<std::weak_ptr<void>> blocks;
  std::atomic<bool> hang_kernel{false};
  swap::CopyEngine* copies = nullptr;
  optimizer::HostArray allocate(std::size_t bytes) override {
    auto block = std::make_shared<std::vector<float>>((bytes + 3) / 4 + 1, 0.0f);
    blocks.push_back(block);
    return {block->data(), bytes, block};
  }
  void adam_step(const optimizer::AdamOptions& o, std::int64_t step,
                 const std::vector<optimizer::KernelArrays>& arrays) override {
    while (hang_kernel.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    adam.step(o, step, optimizer::adam_tensors(arrays));
  }
  std::int64_t steps_taken(std::size_t slot) override { return steps.at(slot); }
  void count_step(std::size_t slot) override { steps.at(slot) += 1; }
  void gradient_landed(std::size_t slot) override { landed.insert(slot); }
  void gradient_copy_failed(std::size_t slot) override { failed.insert(slot); }
  swap::StreamRef compute_stream(optimizer::DeviceId) override { return swap::StreamRef::emulated_compute(); }
  void make_stream_wait(swap::StreamRef stream, const swap::TransferHandle& copy) override {
    copies->make_stream_wait(stream, copy);
  }
};

struct StepEngineRig {
  std::shared_ptr<CopyFaults> faults = std::make_shared<CopyFaults>();
  std::unique_ptr<CopyEngine> copies = make_emulated_copy_engine(faults);
  StallHost host;
  std::unique_ptr<optimizer::StepEngine> engine;
  std::vector<float> weight, grad, master, m, v;
  explicit StepEngineRig(std::size_t n) : weight(n, 0.5f), grad(n, 0.125f), master(weight), m(n), v(n) {
    host.copies = copies.get();
    engine = std::make_unique<optimizer::StepEngine>(optimizer::StepEngineOptions{}, host);
    std::lock_guard<std::mutex> lock(engine->mutex());
    engine->add(n, 4 * n, optimizer::ScalarType::kFloat32, 0, true);
    host.steps.push_back(0);
    optimizer::AdamOptions o;
    engine->ledger().set_group(0, o);
    auto arr = [](std::vector<float>& x) {
      return optimizer::HostArray{x.data(), x.size() * 4, std::shared_ptr<void>(&x, [](void*) {})};
    };
    engine->set_state(0, arr(master), arr(m), arr(v), {}, optimizer::StateFormat::kFp32);
  }
  // One backward streaming the gradient (its copy queued on the emulated device), then the bucket launched.
  void backward() {
    std::lock_guard<std::mutex> lock(engine->mutex());
    engine->backward_begins(1);
    ASSERT_EQ(engine->ledger().arrive(0), optimizer::GradArrival::kStream);
    engine->sync_buckets();
    ASSERT_TRUE(engine->ledger().may_stream(0));
    const optimizer::HostArray dst = engine->stage_gradient(0, optimizer::ScalarType::kFloat32, grad.size() * 4);
    ASSERT_TRUE(dst.defined());
    engine->gradient_copied(0, copies->copy(Direction::kDeviceToHost, dst.data, grad.data(), dst.bytes, {},
                                            StreamRef::emulated_compute()));
    engine->streamed(0, {100, 1, optimizer::grad_content(grad.data(), 4, grad.size())}, false);
    engine->backward_ends(2);
    engine->launch_unlaunched();
  }
  // step()'s wait for the worker: the stall's text, and how long it took to come.
  std::pair<std::string, double> step_wait() {
    const auto t0 = Clock::now();
    try {
      engine->wait_worker_unlocked(true);
    } catch (const stall_error& e) {
      return {e.what(), seconds_since(t0)};
    }
    return {"", seconds_since(t0)};
  }
};

TEST_F(StallTest, AStepWhoseGradientCopyHangsRaisesNamingItAndKeepsItsMemory) {
  StepEngineRig rig(4096);
  rig.faults->hold_d2h = true;
  set_stall_timeout(0.3);
  rig.backward();
  auto waited = std::async(std::launch::async, [&] { return rig.step_wait(); });
  const bool returned = waited.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  rig.faults->hold_d2h = false;
  const auto [what, took] = waited.get();
  EXPECT_TRUE(returned) << "step() hung on the bucket";
  EXPECT_NE(what.find("device -> host copy of 16.00 KiB"), std::string::npos) << what;
  EXPECT_TRUE(rig.host.failed.empty()) << "a stalled copy was settled as a failed one";
  EXPECT_TRUE(rig.host.landed.empty());
  std::size_t alive = 0;
  for (const auto& b : rig.host.blocks) alive += b.expired() ? 0 : 1;
  set_stall_timeout(0);
  rig.copies->synchronize();
  rig.engine.reset();
  std::size_t alive_after = 0;
  for (const auto& b : rig.host.blocks) alive_after += b.expired() ? 0 : 1;
  EXPECT_GE(alive_after, 1u) << "the bucket's gradient memory went while its stalled copy could still write it";
  (void)alive;
}

TEST_F(StallTest, AStepWhoseKernelNeverEndsRaisesNamingTheCpuStep) {
  StepEngineRig rig(4096);
  rig.host.hang_kernel = true;
  set_stall_timeout(0.3);
  rig.backward();
  auto waited = std::async(std::launch::async, [&] { return rig.step_wait(); });
  const bool returned = waited.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  rig.host.hang_kernel = false;
  const auto [what, took] = waited.get();
  EXPECT_TRUE(returned) << "step() hung on the worker";
  EXPECT_NE(what.find("CPU optimizer step of a gradient bucket of 16.00 KiB"), std::string::npos) << what;
  EXPECT_LT(took, 1.0);
  set_stall_timeout(0);
  rig.engine->wait_worker_unlocked(true);  // it ends once the kernel does
}

}  // namespace

namespace {
TEST(StallPolled, WorkSeenOnlyWhenPolledIsNotTheOldestStall) {
  // A CUDA copy's end is seen when its event is queried: past its deadline unpolled, it may long be over, so the
  // check of the oldest work skips it (Note [Stall timeout]); ordinary work past its deadline still raises.
  tierflow::StallTimeoutClaim claim(1.0);
  tierflow::PendingWork polled("device -> host copy on a CUDA stream", 64);
  polled.seen_only_when_polled();
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_NO_THROW(tierflow::raise_if_stalled());
  EXPECT_EQ(tierflow::oldest_deadline(), std::chrono::steady_clock::time_point::max());
  tierflow::PendingWork plain("NVMe read", 64);
  EXPECT_NE(tierflow::oldest_deadline(), std::chrono::steady_clock::time_point::max());
}
}  // namespace
