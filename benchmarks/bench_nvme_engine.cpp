// Times tierflow's NVMe engine: one block of --bytes written then read back,
// striped over --dirs in requests of --bs with --qd in flight, O_DIRECT.
// Prints one JSON object. benchmarks/bench_nvme.py runs it beside fio. The
// timing is swap::measure_bandwidth, the activation planner's own probe.
//
//   bench_nvme_engine --dirs /mnt/a[,/mnt/b] --bytes 2GiB --bs 1MiB --qd 32 [--repeats 3]
#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/swap/nvme_engine.hpp"
#include "tierflow/swap/nvme_probe.hpp"

using namespace tierflow;

int main(int argc, char** argv) {
  std::vector<std::string> dirs;
  std::uint64_t bytes = 1ULL << 30, bs = 1 << 20;
  unsigned qd = 32;
  int repeats = 3;
  bool checksums = false;
  bool huge = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--dirs") {
      std::stringstream ss(v);
      std::string d;
      while (std::getline(ss, d, ',')) dirs.push_back(d);
    } else if (k == "--bytes") {
      bytes = parse_size(v).value_or(0);
    } else if (k == "--bs") {
      bs = parse_size(v).value_or(0);
    } else if (k == "--qd") {
      qd = static_cast<unsigned>(std::stoul(v));
    } else if (k == "--repeats") {
      repeats = std::stoi(v);
    } else if (k == "--huge") {
      huge = v == "on";
    } else if (k == "--checksums") {
      checksums = v == "on";
    } else {
      std::fprintf(stderr, "unknown option %s; accepted: --dirs --bytes --bs --qd --repeats --checksums\n", k.c_str());
      return 2;
    }
  }
  if (dirs.empty() || bytes == 0 || bs == 0) {
    std::fprintf(stderr, "usage: bench_nvme_engine --dirs DIR[,DIR] --bytes SIZE --bs SIZE --qd N\n");
    return 2;
  }
  swap::NvmeEngineOptions o;
  o.paths = dirs;
  o.bytes_per_path = allocator::round_up(bytes / dirs.size() + bs, 4096);
  o.block_bytes = bs;
  o.queue_depth = qd;
  o.checksums = checksums;
  swap::NvmeEngine engine(o);
  // The buffer is what tierflow reads into: pinned-pool-like memory, on huge pages
  // where the kernel gives them (fewer pages to pin per O_DIRECT request).
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 1;
  if (huge) madvise(mem, bytes, MADV_HUGEPAGE);
  struct Buf {
    std::byte* p;
    std::byte* data() { return p; }
  } buf{static_cast<std::byte*>(mem)};
  // The planner's probe (Note [NVMe probe]): the figure auto prices NVMe with.
  const swap::NvmeBandwidth bw = swap::measure_bandwidth(engine, buf.data(), bytes, repeats);
  std::printf("{\"write_gbps\": %.4f, \"read_gbps\": %.4f, \"bytes\": %llu, \"bs\": %llu, \"qd\": %u, \"paths\": %zu}\n",
              bw.write_bytes_per_second / 1e9, bw.read_bytes_per_second / 1e9, static_cast<unsigned long long>(bytes),
              static_cast<unsigned long long>(bs), qd, dirs.size());
  munmap(mem, bytes);
  return 0;
}
