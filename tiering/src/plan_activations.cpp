// plan_activations: the inputs checked, the search run (plan_search.cpp, plan_params.cpp) for each place of
// the saved tensors outside the blocks, and the refusal when nothing fits. See Note [Activation planner].
#include "tierflow/tiering/planner.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/detail/plan_params.hpp"
#include "tierflow/tiering/detail/plan_search.hpp"

namespace tierflow::tiering {
namespace {

using detail::nvme_available;

// Profiles come from files and measurements: a bad one is the user's (config_error), said before planning.
void check_inputs(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets) {
  auto valid = [](double x) { return std::isfinite(x) && x >= 0; };
  // Every byte the plan could count at once (all blocks kept and at work, the rest of training, the
  // prefetch window, every parameter) must fit in 63 bits, so that no sum of the model or the search wraps.
  constexpr std::uint64_t kMaxTotal = std::uint64_t{1} << 63;
  std::uint64_t total = 0;
  const bool budgets_fit = !__builtin_add_overflow(budgets.fixed_device_bytes, budgets.prefetch_bytes, &total) &&
                           !__builtin_add_overflow(total, budgets.rest_parameter_bytes, &total) &&
                           !__builtin_add_overflow(total, budgets.outside_saved_bytes, &total);
  bool bytes_fit = budgets_fit && total < kMaxTotal;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto& p = blocks[i];
    if (!(valid(p.forward_seconds) && valid(p.backward_seconds) && valid(p.split_recompute_seconds) &&
          valid(p.cheap_recompute_seconds)))
      throw config_error("plan_activations: block " + std::to_string(i) +
                         " has a negative or non-finite time; accepted: finite seconds >= 0");
    for (std::uint64_t b : {p.input_bytes, p.whole_bytes, p.split_bytes, p.cheap_bytes, p.transient_bytes,
                            p.upload_bytes, p.download_bytes, p.parameter_bytes, p.parameter_bytes})  // resident + window
      bytes_fit = bytes_fit && !__builtin_add_overflow(total, b, &total) && total < kMaxTotal;
  }
  if (!(valid(links.d2h) && valid(links.h2d) && valid(links.duplex) && valid(links.nvme_write) &&
        valid(links.nvme_read)))
    throw config_error("plan_activations: a link bandwidth is negative or non-finite; accepted: finite bytes "
                       "per second >= 0");
  for (double share : {links.compute_share_during_copies, links.copy_share_during_cpu_step})
    if (!(share > 0 && share <= 1))
      throw config_error("plan_activations: a link or compute share is " + std::to_string(share) +
                         "; accepted: a fraction in (0, 1]");
  if (!bytes_fit)
    throw config_error("plan_activations: the blocks' saved, transient and parameter bytes plus "
                       "fixed_device_bytes, prefetch_bytes, rest_parameter_bytes and outside_saved_bytes add up to 2^63 "
                       "bytes or more; "
                       "accepted: totals below 2^63 (8 EiB)");
  if (budgets.params != ParamPolicy::kResident) {
    if (budgets.param_tier == Tier::kGpu)
      throw config_error("plan_activations: fetched parameters need a tier to live on; accepted: host or nvme");
    if (budgets.param_tier == Tier::kNvme && !nvme_available(links, budgets))
      throw config_error("plan_activations: parameters on NVMe need an NVMe tier (nvme_bytes, nvme_read and "
                         "nvme_write above 0)");
  }
}

}  // namespace

namespace detail {

std::optional<Plan> plan_within(const std::vector<BlockProfile>& blocks, const Links& links,
                                const Budgets& budgets) {
  std::vector<BlockPlan> all_keep(blocks.size());
  Plan keep = evaluate_plan(blocks, links, budgets, all_keep);
  if (keep.fits) return keep;
  const auto search = detail::search_plan(blocks, links, budgets);
  if (!search.found) return std::nullopt;
  Plan plan = evaluate_plan(blocks, links, budgets, search.assignment);
  plan.proven_optimal = search.complete;
  return plan;
}

}  // namespace detail

namespace {

// plan_activations with the saved tensors outside the blocks already decided (budgets.outside_saved_bytes 0).
Plan plan_blocks(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets) {
  if (budgets.params != ParamPolicy::kResident) return detail::plan_with_params(blocks, links, budgets);
  if (auto plan = detail::plan_within(blocks, links, budgets)) return *plan;
  // The cheapest plan in device memory keeps nothing: every block's working set comes back in turn.
  std::uint64_t working = 0, inputs = 0;
  for (const auto& p : blocks) {
    working = std::max(working, p.saved_bytes() + p.transient_bytes);
    inputs += p.input_bytes;
  }
  const std::uint64_t window = detail::window_bytes(budgets.prefetch_bytes, inputs);
  const std::uint64_t floor = budgets.fixed_device_bytes + working + window;
  std::string msg = "tierflow: no activation plan fits: the cheapest in device memory needs " +
                    std::to_string(floor) + " bytes (" + format_bytes(floor) + ": " +
                    format_bytes(budgets.fixed_device_bytes) + " for the rest of training, " +
                    format_bytes(working) + " for the largest block's working set, " +
                    format_bytes(window) + " of prefetch window) and the device budget is " +
                    format_bytes(budgets.device_bytes);
  if (floor <= budgets.device_bytes) {
    msg += "; it also swaps " + format_bytes(inputs) + " of block inputs, more than the host (" +
           format_bytes(budgets.host_bytes) + ") and NVMe (" + format_bytes(budgets.nvme_bytes) +
           ") budgets hold with what the device can keep; raise TIERFLOW_HOST_MEMORY (host_memory=) or give "
           "TIERFLOW_NVME_PATHS (nvme_paths=)";
  } else {
    msg += "; raise TIERFLOW_GPU_MEMORY (gpu_memory=) to at least " + format_bytes(floor) +
           ", lower TIERFLOW_PREFETCH_BYTES (prefetch_bytes=), or offload the parameters "
           "(TIERFLOW_OFFLOAD_PARAMS, offload_params=)";
  }
  throw out_of_memory(msg);
}

}  // namespace

Plan plan_activations(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets) {
  check_inputs(blocks, links, budgets);
  const std::uint64_t outside = budgets.outside_saved_bytes;
  if (outside == 0) return plan_blocks(blocks, links, budgets);
  const std::uint64_t staging = outside_staging_bytes(budgets);
  // Note [Activation planner], Outside the blocks: the search once with them kept, once swapped to the host, once
  // swapped to NVMe (when there is an NVMe tier).
  std::optional<Plan> best;
  std::optional<out_of_memory> refused;
  std::uint64_t largest_transient = 0;
  for (const auto& p : blocks) largest_transient = std::max(largest_transient, p.transient_bytes);
  const bool nvme = detail::nvme_available(links, budgets);
  std::vector<std::string> tried;  // what the refusal names
  for (const Tier where : {Tier::kGpu, Tier::kHost, Tier::kNvme}) {
    Budgets b = budgets;
    b.outside_saved_bytes = b.outside_largest_bytes = 0;
    b.fixed_device_bytes += detail::outside_device_bytes(outside, largest_transient, where == Tier::kGpu);
    if (where == Tier::kHost) {
      if (b.host_bytes < outside) continue;  // the host cannot hold them
      b.host_bytes -= outside;
    } else if (where == Tier::kNvme) {
      if (!nvme || b.nvme_bytes < outside) continue;  // no NVMe tier, or one without room for them
      if (b.host_bytes < staging) continue;           // no host room to stage them on their way
      b.nvme_bytes -= outside;
      b.host_bytes -= staging;
    }
    tried.push_back(where == Tier::kGpu ? "kept on the device" : where == Tier::kHost ? "swapped to the host"
                                                                                       : "swapped to NVMe");
    try {
      const Plan inner = plan_blocks(blocks, links, b);
      Plan plan = evaluate_plan(blocks, links, budgets, inner.blocks, inner.rest_params, where);
      plan.proven_optimal = inner.proven_optimal;
      if (!best || plan.predicted_step_seconds < best->predicted_step_seconds) best = std::move(plan);
    } catch (const out_of_memory& e) {
      refused = e;  // the last choice's, when every one fails: it needs the fewest device bytes (or as few)
    }
  }
  if (best) return *best;
  std::string with = tried[0];
  for (std::size_t i = 1; i < tried.size(); ++i) with += (i + 1 == tried.size() ? " or " : ", ") + tried[i];
  if (budgets.host_bytes < outside) with += " (the host budget cannot hold them)";
  if (nvme && budgets.nvme_bytes < outside) with += " (the NVMe budget cannot hold them)";
  else if (nvme && budgets.host_bytes < staging)
    with += " (the host budget cannot stage the largest of them, " + format_bytes(staging) + ", on its way to NVMe)";
  throw out_of_memory(std::string(refused->what()) + " (with " + format_bytes(outside) +
                      " saved outside the blocks " + with + ")");
}

}  // namespace tierflow::tiering
