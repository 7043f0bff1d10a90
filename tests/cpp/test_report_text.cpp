// The statistics report's table (tiering/report_text.hpp): the text tierflow.report() prints, golden against the
// Python table it replaced (two reports: the runtime's rows alone, and every optional row), its bytes, and Python's
// json.dumps text with NaN read.
#include <gtest/gtest.h>

#include <string>

#include "tierflow/tiering/report_text.hpp"

using namespace tierflow::tiering;

namespace {

// The runtime's stats alone: an emulated pool, no threads named, no ISA.
const char* const kMinimalJson =
    "{\"device\": \"cpu\", \"activations\": {\"device_bytes\": {\"peak\": 1536, \"current\": 0}, \"host_b"
    "ytes\": {\"peak\": 5"
    "242880}, \"nvme_bytes\": {\"peak\": 0}, \"packs\": 10, \"unpacks\": 9, \"offloaded_blocks\": 3, \"of"
    "floaded_bytes\":"
    " 3221225472, \"offload_waits\": 2, \"offload_wait_ms\": 1.234, \"skipped_parameters\": 4, \"dedup_hi"
    "ts\": 1, \"ke"
    "pt_small\": 5, \"kept_region\": 0, \"host_fallbacks\": 0}, \"prefetch\": {\"prefetched_blocks\": 7, "
    "\"hits\": 6, \"f"
    "orwarded\": 1, \"stalls\": 0, \"stall_ms\": 0.0, \"unprefetched\": 0}, \"host_pool\": {\"pinned\": f"
    "alse, \"budget_b"
    "ytes\": 8589934592, \"in_use\": {\"peak\": 1000}, \"reserved\": {\"peak\": 2097152}, \"slab_allocati"
    "ons\": 2}, \"lin"
    "ks\": {\"gpu_to_host_bytes\": 123456789, \"gpu_to_host_ops\": 5, \"host_to_gpu_bytes\": 1023, \"host"
    "_to_gpu_ops\""
    ": 1}, \"optimizer\": {\"steps\": 3, \"step_ms\": 12.345, \"elements\": 1000, \"threads\": 0}}";
const char* const kMinimalText =
    "tierflow report\n"
    "GPU tier (cpu)\n"
    "  saved activations held, peak                      1.50 KiB\n"
    "  saved activations held, now                       0 B\n"
    "host tier (pinned pool, emulated: not page-locked)\n"
    "  budget                                            8.00 GiB\n"
    "  in use, peak                                      1000 B\n"
    "  reserved in slabs, peak                           2.00 MiB (2 slab allocations)\n"
    "  saved activations held, peak                      5.00 MiB\n"
    "links\n"
    "  gpu -> host                                       117.74 MiB in 5 copies\n"
    "  host -> gpu                                       1023 B in 1 copies\n"
    "saved tensors\n"
    "  saved / read                                      10 / 9\n"
    "  offloaded                                         3 storages, 3.00 GiB\n"
    "  forward waited for the copy window                2 times (1.23 ms)\n"
    "  not copied: parameters / duplicates               4 / 1\n"
    "  kept: small / no_offload / pool full              5 / 0 / 0\n"
    "prefetch\n"
    "  prefetched ahead                                  7\n"
    "  hits / forwarded                                  6 / 1\n"
    "  stalls                                            0 (0.00 ms waiting, 0 never prefetched)\n"
    "CPU optimizer\n"
    "  steps                                             3 (12.3 ms, 1000 element updates, all threads, ?)";

// Every optional row: NVMe-only activations, parameters between uses, the states, a partition, the steps during
// backward off and counted, the gradient stream with its sizing and freed gradients, blocks not recomputed (their
// indices sorted as numbers), and a NaN elsewhere in the plan.
const char* const kFullJson =
    "{\"device\": \"cuda\", \"activations\": {\"device_bytes\": {\"peak\": 1536, \"current\": 0}, \"host_"
    "bytes\": {\"peak\": "
    "5242880}, \"nvme_bytes\": {\"peak\": 1099511627776}, \"packs\": 10, \"unpacks\": 9, \"offloaded_bloc"
    "ks\": 3, \"offl"
    "oaded_bytes\": 3221225472, \"offload_waits\": 2, \"offload_wait_ms\": 1.234, \"skipped_parameters\":"
    " 4, \"dedup_"
    "hits\": 1, \"kept_small\": 5, \"kept_region\": 0, \"host_fallbacks\": 0}, \"prefetch\": {\"prefetche"
    "d_blocks\": 7, "
    "\"hits\": 6, \"forwarded\": 1, \"stalls\": 0, \"stall_ms\": 0.0, \"unprefetched\": 0}, \"host_pool\""
    ": {\"pinned\": tru"
    "e, \"budget_bytes\": 8589934592, \"in_use\": {\"peak\": 1000}, \"reserved\": {\"peak\": 2097152}, \""
    "slab_allocation"
    "s\": 2}, \"links\": {\"gpu_to_host_bytes\": 123456789, \"gpu_to_host_ops\": 5, \"host_to_gpu_bytes\""
    ": 1023, \"host"
    "_to_gpu_ops\": 1}, \"optimizer\": {\"steps\": 3, \"step_ms\": 12.345, \"elements\": 1000, \"threads"
    "\": 4, \"isa\": \"a"
    "vx512\", \"states\": {\"bytes\": 12000, \"elements\": 1000, \"tier\": \"host\", \"format\": \"bf16\""
    "}, \"partition\": {\"r"
    "ank\": 1, \"world_size\": 2, \"owned_parameters\": 3, \"parameters\": 6, \"owned_elements\": 500, \""
    "elements\": 100"
    "0, \"broadcasts\": 6, \"broadcast_bytes\": 4000, \"broadcast_host_ms\": 0.55}, \"steps_during_backwa"
    "rd_off\": \"D"
    "DP's hook came first\", \"overlap\": {\"early_steps\": 5, \"committed\": 4, \"redone\": 1, \"taken_b"
    "ack\": 0, \"held"
    "\": 0}, \"streaming\": {\"buckets\": 8, \"bucket_bytes\": 33554432, \"bucket_count\": 2, \"grad_byte"
    "s_to_host\": 53"
    "68709120, \"weight_bytes_to_device\": 6442450944, \"sized_link_bytes_per_s\": 25000000000.0, \"sized_cpu_grad"
    "_bytes_per_s\": 3300000000.0, \"sized_backward_ms\": 45.67, \"grads_released\": 3, \"grad_bytes_free"
    "d\": 104857"
    "6, \"grads_restored\": 1, \"kernel_ms\": 10.0, \"step_kernel_ms\": 2.5, \"step_wait_ms\": 0.25, \"we"
    "ight_wait_ms\""
    ": 1.05}}, \"params\": {\"device_peak_bytes\": 1073741824, \"host_bytes\": 2147483648, \"nvme_bytes\""
    ": 0, \"fetche"
    "s\": 12, \"prefetch_hits\": 11, \"stalls\": 1}, \"plan\": {\"not_replayed\": {\"10\": \"it writes a "
    "buffer\", \"2\": \"r"
    "andom numbers\"}, \"x\": NaN}}";
const char* const kFullText =
    "tierflow report\n"
    "GPU tier (cuda)\n"
    "  saved activations held, peak          1.50 KiB\n"
    "  saved activations held, now           0 B\n"
    "  parameters on the device, peak        1.00 GiB (between uses: host 2.00 GiB, NVMe 0 B; 12 fetches, 11 "
    "prefetched, 1 stalls)\n"
    "host tier (pinned pool)\n"
    "  budget                                8.00 GiB\n"
    "  in use, peak                          1000 B\n"
    "  reserved in slabs, peak               2.00 MiB (2 slab allocations)\n"
    "  saved activations held, peak          5.00 MiB\n"
    "  saved activations on NVMe only, peak  1.00 TiB\n"
    "links\n"
    "  gpu -> host                           117.74 MiB in 5 copies\n"
    "  host -> gpu                           1023 B in 1 copies\n"
    "saved tensors\n"
    "  saved / read                          10 / 9\n"
    "  offloaded                             3 storages, 3.00 GiB\n"
    "  forward waited for the copy window    2 times (1.23 ms)\n"
    "  not copied: parameters / duplicates   4 / 1\n"
    "  kept: small / no_offload / pool full  5 / 0 / 0\n"
    "prefetch\n"
    "  prefetched ahead                      7\n"
    "  hits / forwarded                      6 / 1\n"
    "  stalls                                0 (0.00 ms waiting, 0 never prefetched)\n"
    "CPU optimizer\n"
    "  steps                                 3 (12.3 ms, 1000 element updates, 4 threads, avx512)\n"
    "  states (master, moments)              11.72 KiB on the host for 1000 elements, bf16 moments (12.00 byt"
    "es each)\n"
    "  partitioned across ranks              rank 1 of 2: 3 of 6 parameters, 500 of 1000 elements; 6 weight b"
    "roadcasts (3.91 KiB, 0.6 ms on the host)\n"
    "  steps during backward                 off: DDP's hook came first\n"
    "  stepped during backward               5 (committed 4, redone 1, taken back 0, held 0)\n"
    "  gradient buckets                      8 of 32.00 MiB (2 per backward), 5.00 GiB down, 6.00 GiB of weig"
    "hts up\n"
    "  bucket size from                      link 25.0 GB/s, CPU AdamW 3.3 GB/s of gradients, backward 45.7 m"
    "s\n"
    "  gradients freed on the device         1.00 MiB once on the host (1 put back)\n"
    "  CPU step during backward / in step()  10.0 ms / 2.5 ms (step() waited 0.2 ms, weights waited 1.1 ms)\n"
    "blocks not recomputed (side effects)\n"
    "  block 2                               random numbers\n"
    "  block 10                              it writes a buffer";

}  // namespace

TEST(ReportText, RuntimeRowsAlignedPastTheLongestLabel) { EXPECT_EQ(report_text(kMinimalJson), kMinimalText); }

TEST(ReportText, EveryOptionalRowInItsPlace) { EXPECT_EQ(report_text(kFullJson), kFullText); }

TEST(ReportText, BytesInBinaryUnitsWholeBelowAKibibyte) {
  EXPECT_EQ(report_bytes(1023.9), "1023 B");
  EXPECT_EQ(report_bytes(1536), "1.50 KiB");
  EXPECT_EQ(report_bytes(-2048), "-2.00 KiB");
  EXPECT_EQ(report_bytes(5.0 * (1ull << 50)), "5120.00 TiB");
}

// Python's json.dumps writes an infinite or NaN float bare (Infinity, NaN): such a value prints as Python's str()
// of it, and a row it guards still shows (Python finds inf and nan true), as the Python table did.
TEST(ReportText, InfiniteAndNanValuesPrintAsPythonsAndKeepTheirRows) {
  std::string json = kMinimalJson;
  const std::string tail = "\"threads\": 0}}";
  ASSERT_EQ(json.substr(json.size() - tail.size()), tail);
  json.replace(json.size() - tail.size(), tail.size(),
               "\"threads\": 0, \"streaming\": {\"buckets\": 1, \"bucket_bytes\": 1024, \"bucket_count\": 1, "
               "\"grad_bytes_to_host\": 1, \"weight_bytes_to_device\": 1, \"sized_link_bytes_per_s\": Infinity, "
               "\"sized_cpu_grad_bytes_per_s\": NaN, \"sized_backward_ms\": 1.0, \"kernel_ms\": -Infinity, "
               "\"step_kernel_ms\": 0.0, \"step_wait_ms\": 0.0, \"weight_wait_ms\": 0.0}}}");
  const std::string text = report_text(json);
  EXPECT_NE(text.find("bucket size from"), std::string::npos) << text;
  EXPECT_NE(text.find("link inf GB/s, CPU AdamW nan GB/s of gradients, backward 1.0 ms"), std::string::npos) << text;
  EXPECT_NE(text.find("-inf ms / 0.0 ms"), std::string::npos) << text;
}
