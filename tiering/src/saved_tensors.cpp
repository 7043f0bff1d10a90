// See Note [Saved-tensor decisions] in saved_tensors.hpp.
#include "tierflow/tiering/saved_tensors.hpp"

#include <algorithm>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

PackTarget parse_pack_target(const std::string& text) {
  if (text == "policy") return PackTarget::kPolicy;
  if (text == "keep") return PackTarget::kKeep;
  if (text == "host") return PackTarget::kHost;
  if (text == "nvme") return PackTarget::kNvme;
  if (text == "outside_nvme") return PackTarget::kOutsideNvme;
  throw config_error("pack target '" + text + "'; accepted: policy, keep, host, nvme, outside_nvme");
}

const std::vector<StatField<SavedTensorStats>>& saved_tensor_stat_fields() {
  using S = SavedTensorStats;
  static const std::vector<StatField<S>> fields = {
      {"packs", &S::packs},
      {"skipped_parameters", &S::skipped_parameters},
      {"skipped_unmanaged", &S::skipped_unmanaged},
      {"dedup_hits", &S::dedup_hits},
      {"kept_small", &S::kept_small},
      {"kept_region", &S::kept_region},
      {"host_fallbacks", &S::host_fallbacks},
      {"offloaded_blocks", &S::offloaded_blocks},
      {"offloaded_bytes", &S::offloaded_bytes},
      {"policy_bytes", &S::policy_bytes},
      {"policy_largest_bytes", &S::policy_largest_bytes},
      {"offload_waits", &S::offload_waits},
      {"offload_wait_ms", &S::offload_wait_ns, nullptr, 1e-6},
      {"unpacks", &S::unpacks},
  };
  return fields;
}

const std::vector<StatField<SavedTensorStats>>& saved_tensor_nvme_stat_fields() {
  using S = SavedTensorStats;
  static const std::vector<StatField<S>> fields = {
      {"writes", &S::nvme_writes},
      {"write_bytes", &S::nvme_write_bytes},
      {"reads", &S::nvme_reads},
      {"forwarded", &S::nvme_forwarded},
      {"write_failures", &S::nvme_write_failures},
      {"full", &S::nvme_full},
      {"staging_waits", &S::staging_waits},
  };
  return fields;
}

const std::vector<StatField<SavedTensorStats>>& saved_tensor_prefetch_stat_fields() {
  using S = SavedTensorStats;
  static const std::vector<StatField<S>> fields = {
      {"prefetched_blocks", &S::prefetched_blocks},
      {"hits", &S::prefetch_hits},
      {"forwarded", &S::forwarded},
      {"stalls", &S::stalls},
      {"stall_ms", &S::stall_ns, nullptr, 1e-6},
      {"unprefetched", &S::unprefetched},
  };
  return fields;
}

SavedTensors::SavedTensors(ActivationScheduleOptions options, std::uint64_t min_offload_bytes)
    : schedule_(options), min_offload_bytes_(min_offload_bytes) {}

PackChoice SavedTensors::pack(const SavedTensorFacts& facts, PackTarget target, bool has_nvme) {
  ++stats_.packs;
  PackChoice c;
  if (!facts.defined) return c;
  if (!facts.managed) {
    ++stats_.skipped_unmanaged;
    return c;
  }
  if (facts.parameter) {
    ++stats_.skipped_parameters;
    return c;
  }
  if (facts.saved_already) {
    ++stats_.dedup_hits;
    c.verdict = PackVerdict::kSameBlock;
    return c;
  }
  const bool small = facts.bytes < min_offload_bytes_;
  const bool region = facts.in_no_offload_region;
  // kOutsideNvme decides as kPolicy does and counts as it does; only the destination differs.
  const bool policy = target == PackTarget::kPolicy || target == PackTarget::kOutsideNvme;
  const PackDirective directive = policy                        ? PackDirective::kPolicy
                                  : target == PackTarget::kKeep ? PackDirective::kKeep
                                                                : PackDirective::kOffload;
  const PackDecision d = schedule_.on_pack(static_cast<std::size_t>(facts.bytes), !small && !region, directive);
  c.verdict = PackVerdict::kNewBlock;
  if (policy && !small && !region) {
    stats_.policy_bytes += facts.bytes;
    stats_.policy_largest_bytes = std::max<std::uint64_t>(stats_.policy_largest_bytes, facts.bytes);
  }
  c.id = d.id;
  c.offload = d.offload;
  const bool nvme_asked = target == PackTarget::kNvme || target == PackTarget::kOutsideNvme ||
                          (target == PackTarget::kPolicy && schedule_.options().target == OffloadTarget::kNvme);
  c.to = has_nvme && nvme_asked ? swap::StagedTarget::kNvme : swap::StagedTarget::kHost;
  if (!d.offload) {
    if (small) ++stats_.kept_small;
    else if (region) ++stats_.kept_region;
  }
  return c;
}

void SavedTensors::offloaded(std::uint64_t bytes) {
  ++stats_.offloaded_blocks;
  stats_.offloaded_bytes += bytes;
}

bool SavedTensors::host_full(BlockId id) {
  schedule_.registry().transition(id, Residence::kResident);
  return stats_.host_fallbacks++ == 0;
}

ReadServe SavedTensors::read(BlockId id, bool copy_ready, bool was_offloaded) {
  ++stats_.unpacks;
  const bool first_read = !schedule_.consumed(id);
  switch (schedule_.registry().residence(id)) {
    case Residence::kInFlightToHost:
      ++stats_.forwarded;
      return ReadServe::kForward;
    case Residence::kOnHost:
    case Residence::kOnNvme:
      ++stats_.unprefetched;
      ++stats_.stalls;
      return ReadServe::kFetchNow;
    case Residence::kInFlightToDevice:
      if (copy_ready) ++stats_.prefetch_hits;
      else ++stats_.stalls;
      return ReadServe::kAsIs;
    case Residence::kResident:
      if (was_offloaded && first_read) ++stats_.prefetch_hits;  // forwarded by a prefetch
      return ReadServe::kAsIs;
    case Residence::kReleased:
      break;
  }
  return ReadServe::kAsIs;
}

SavedTensorStats SavedTensors::stats(const swap::StagedPipelineStats& p) const {
  SavedTensorStats s = stats_;
  s.offload_waits = p.offload_waits;
  s.offload_wait_ns = p.offload_wait_ns;
  s.staging_waits = p.staging_waits;
  s.nvme_writes = p.nvme_writes;
  s.nvme_write_bytes = p.nvme_write_bytes;
  s.nvme_reads = p.nvme_reads;
  s.nvme_forwarded = p.nvme_forwarded;
  s.nvme_write_failures = p.nvme_write_failures;
  s.nvme_full = p.nvme_full;
  s.device_bytes = schedule_.registry().device_bytes().values();
  s.host_bytes = schedule_.registry().host_bytes().values();
  s.nvme_bytes = schedule_.registry().nvme_bytes().values();
  return s;
}

}  // namespace tierflow::tiering
