// Host tier benchmark: the pinned pool against pinning per tensor, and the
// copy engine against a plain memcpy of the same bytes, in one run.
//
//   build/dev/benchmarks/bench_host_tier [--json PATH]
//
// Ratios, not absolute numbers, are the result: the machine is shared and
// noisy, so each comparison is measured back to back in the same process.
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tierflow/allocator/device.hpp"
#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/swap/copy_engine.hpp"

#ifdef TIERFLOW_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace tierflow;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// What a pool replaces: pin (or, emulated, map resident) memory per tensor.
void* pin_one(std::size_t bytes, bool cuda) {
#ifdef TIERFLOW_WITH_CUDA
  if (cuda) {
    void* p = nullptr;
    return cudaHostAlloc(&p, bytes, cudaHostAllocDefault) == cudaSuccess ? p : nullptr;
  }
#endif
  (void)cuda;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void unpin_one(void* p, std::size_t bytes, bool cuda) {
#ifdef TIERFLOW_WITH_CUDA
  if (cuda) {
    cudaFreeHost(p);
    return;
  }
#endif
  (void)cuda;
  munmap(p, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "benchmarks/results/host_tier.json";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--json") json_path = argv[i + 1];

  const bool cuda = allocator::cuda_available();
  const std::size_t block = 4 << 20;  // a typical saved activation
  const int blocks_per_step = 32, steps = 20;

  // 1. Allocation: pool (warm) vs pinning each tensor.
  allocator::PinnedHostPoolOptions po;
  po.budget_bytes = 1ULL << 30;
  po.slab_bytes = 64ULL << 20;
  po.cuda_pinned = cuda;
  allocator::PinnedHostPool pool(po);
  std::vector<void*> live(blocks_per_step);
  for (auto& p : live) p = pool.allocate(block);  // warm-up: slabs pinned once
  for (auto* p : live) pool.deallocate(p);
  auto t0 = Clock::now();
  for (int s = 0; s < steps; ++s) {
    for (auto& p : live) p = pool.allocate(block);
    for (auto* p : live) pool.deallocate(p);
  }
  const double pool_s = seconds_since(t0);
  t0 = Clock::now();
  for (int s = 0; s < steps; ++s) {
    for (auto& p : live) p = pin_one(block, cuda);
    for (auto* p : live) unpin_one(p, block, cuda);
  }
  const double pin_s = seconds_since(t0);
  const double n_alloc = double(steps) * blocks_per_step;

  // 2. Copies: both directions on the engine's streams vs one memcpy of the same bytes.
  //    Emulated only here; on a GPU the same engine runs cudaMemcpyAsync.
  auto engine = swap::make_emulated_copy_engine();
  const std::size_t copy_bytes = 256ULL << 20;
  std::vector<std::uint8_t> dev_a(copy_bytes, 1), dev_b(copy_bytes, 2);
  auto* host_a = static_cast<std::uint8_t*>(pool.allocate(copy_bytes));
  auto* host_b = static_cast<std::uint8_t*>(pool.allocate(copy_bytes));
  std::memset(host_a, 0, copy_bytes);
  std::memset(host_b, 3, copy_bytes);
  const int reps = 5;
  double memcpy_best = 1e30, engine_best = 1e30;
  for (int r = 0; r < reps; ++r) {
    t0 = Clock::now();
    std::memcpy(host_a, dev_a.data(), copy_bytes);
    std::memcpy(dev_b.data(), host_b, copy_bytes);
    memcpy_best = std::min(memcpy_best, seconds_since(t0));
    t0 = Clock::now();
    auto d2h = engine->copy(swap::Direction::kDeviceToHost, host_a, dev_a.data(), copy_bytes);
    auto h2d = engine->copy(swap::Direction::kHostToDevice, dev_b.data(), host_b, copy_bytes);
    d2h.wait();
    h2d.wait();
    engine_best = std::min(engine_best, seconds_since(t0));
  }
  pool.deallocate(host_a);
  pool.deallocate(host_b);
  const double moved = 2.0 * copy_bytes;

  const double pool_us = 1e6 * pool_s / n_alloc, pin_us = 1e6 * pin_s / n_alloc;
  const double memcpy_gbps = moved / memcpy_best / 1e9, engine_gbps = moved / engine_best / 1e9;
  std::printf("host tier benchmark (%s)\n", cuda ? "CUDA pinned memory" : "emulated device");
  std::printf("  allocate+free a 4 MiB block: pool %.2f us, pin per tensor %.2f us  -> pool %.1fx faster\n",
              pool_us, pin_us, pin_us / pool_us);
  std::printf("  256 MiB each way: copy engine %.2f GB/s, serial memcpy %.2f GB/s -> ratio %.2f\n",
              engine_gbps, memcpy_gbps, engine_gbps / memcpy_gbps);

  if (FILE* f = std::fopen(json_path.c_str(), "w")) {
    std::fprintf(f,
                 "{\n  \"device\": \"%s\",\n  \"block_bytes\": %zu,\n  \"pool_alloc_free_us\": %.4f,\n"
                 "  \"pin_per_tensor_alloc_free_us\": %.4f,\n  \"pool_speedup\": %.3f,\n"
                 "  \"copy_bytes_each_way\": %zu,\n  \"engine_both_directions_gbps\": %.4f,\n"
                 "  \"serial_memcpy_gbps\": %.4f,\n  \"engine_over_memcpy\": %.4f\n}\n",
                 cuda ? "cuda" : "emulated", block, pool_us, pin_us, pin_us / pool_us, copy_bytes,
                 engine_gbps, memcpy_gbps, engine_gbps / memcpy_gbps);
    std::fclose(f);
    std::printf("  wrote %s\n", json_path.c_str());
  } else {
    std::fprintf(stderr, "could not write %s\n", json_path.c_str());
    return 1;
  }
  return 0;
}
