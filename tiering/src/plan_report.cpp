// How `python -m tierflow plan` shows a plan: its text lines, why each block's action won; see Note [Plan report].
// The JSON document is plan_report_json.cpp's, the budgets and arguments plan_command.cpp's.
#include "tierflow/tiering/plan_report.hpp"

#include <charconv>
#include <string_view>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/detail/plan_report_parts.hpp"
#include "tierflow/tiering/detail/plan_search.hpp"
#include "tierflow/tiering/step_prediction.hpp"

namespace tierflow::tiering {
namespace detail {
namespace {

// The actions the planner did not choose for block i (Note [Plan report]).
std::vector<BlockPlan> rejected_actions(const BlockProfile& p, const BlockPlan& chosen, const Links& links) {
  const SwapTier tier = chosen.mode == BlockMode::kKeep ? SwapTier::kHost : chosen.tier;
  std::vector<BlockPlan> out;
  for (BlockMode mode : {BlockMode::kKeep, BlockMode::kSwap, BlockMode::kSplit, BlockMode::kRecompute}) {
    if (mode == chosen.mode || (mode == BlockMode::kSplit && !p.splittable)) continue;
    if (!p.replayable && mode != BlockMode::kKeep && mode != BlockMode::kSwap) continue;  // Note [Replay side effects]
    BlockPlan b;
    b.mode = mode;
    b.tier = tier;
    b.params = chosen.params;  // the alternative changes the activations' action only
    if (mode == BlockMode::kSplit) b.alpha = detail::link_alpha(p, swap_tiers(links, {}), tier);
    out.push_back(b);
  }
  return out;
}

}  // namespace

std::string why_rejected(const AlternativeCost& a, const Plan& plan) {
  std::string over;
  if (!a.fits_device) over += "device";
  if (!a.fits_host) over += std::string(over.empty() ? "" : ", ") + "host";
  if (!a.fits_nvme) over += std::string(over.empty() ? "" : ", ") + "NVMe";
  if (!over.empty()) return "over the " + over + " budget";
  if (a.step_seconds > plan.predicted_step_seconds) return "slower";
  if (a.step_seconds == plan.predicted_step_seconds) return "as fast";
  return plan.proven_optimal ? "faster" : "faster (the search stopped at its node limit)";
}

// evaluate_alternative for every block; blocks of one profile with one choice share their figures.
std::vector<BlockWhy> why_of_blocks(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                                    const Budgets& budgets) {
  std::vector<BlockWhy> out(blocks.size());
  std::vector<std::size_t> seen;  // a block of each (profile, choice) met so far
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    bool shared = false;
    for (std::size_t j : seen) {
      const auto& c = plan.blocks[j];
      if (c.mode == b.mode && c.alpha == b.alpha && c.tier == b.tier && detail::same_profile(blocks[i], blocks[j])) {
        out[i] = out[j];
        shared = true;
        break;
      }
    }
    if (shared) continue;
    seen.push_back(i);
    for (const auto& alt : rejected_actions(blocks[i], b, links))
      out[i].rejected.push_back(evaluate_alternative(blocks, links, budgets, plan, i, alt));
  }
  return out;
}

std::vector<FixedPart> fixed_parts(const PlanCommandInputs& in, const Budgets& budgets, const Plan& plan) {
  if (!in.state) return {{"from_profile", "the profile's rest of training", budgets.fixed_device_bytes, ""}};
  const auto& s = *in.state;
  const bool optimizer_on_device = in.optimizer == "none";
  const bool params_on_device = budgets.params == ParamPolicy::kResident;  // else the plan counts them
  return {
      {"parameters", "parameters", params_on_device ? s.parameter_bytes : 0,
       params_on_device ? "--offload-params host, nvme or auto (TIERFLOW_OFFLOAD_PARAMS)" : ""},
      {"gradients", "gradients", gradient_device_bytes(in),
       in.offload_gradients ? ""
                            : "TIERFLOW_OFFLOAD_GRADIENTS=on (--offload-gradients on; each freed once copied to host)"},
      {"optimizer_states", "optimizer states", optimizer_on_device ? s.optimizer_bytes : 0,
       optimizer_on_device ? "--optimizer host or nvme (TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme)" : ""},
      // Not in the fixed bytes: the plan keeps them or swaps them (Note [Activation planner], Outside the blocks).
      {"outside_blocks", "activations outside the blocks (the plan's choice)", plan.outside_kept ? in.head_bytes : 0,
       plan.outside_kept && in.head_bytes > 0 ? "the plan, which swaps them to the host or NVMe when that is faster "
                                                "within the budgets"
                                              : ""},
  };
}

}  // namespace detail

namespace {

constexpr double kGB = 1e9;  // link speeds are decimal, like the vendors'

using detail::BlockWhy;
using detail::FixedPart;
using detail::format;
using detail::states_named;
using detail::why_rejected;

std::string action_name(const Plan& plan, const BlockPlan& b) {
  std::string s(to_string(b.mode));
  if (b.mode == BlockMode::kSplit) s += format(" alpha %.3f", b.alpha);
  if (b.mode != BlockMode::kKeep) s += " " + plan.tier_name(b.tier);
  return s;
}

std::string why_line(std::size_t i, const Plan& plan, const BlockWhy& why) {
  std::string s = format("  block %zu: %s; ", i, action_name(plan, plan.blocks[i]).c_str());
  if (why.rejected.empty()) return s + "no other action";
  for (std::size_t k = 0; k < why.rejected.size(); ++k) {
    const auto& a = why.rejected[k];
    s += (k ? "; " : "") + action_name(plan, a.block) + format(" %.4f s, peak ", a.step_seconds) +
         format_bytes(a.device_peak_bytes) + ": " + why_rejected(a, plan);
  }
  return s;
}

std::string fixed_line(const std::vector<FixedPart>& parts) {
  std::string s = "device's fixed bytes:";
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const auto& p = parts[k];
    s += std::string(k ? ";" : "") + " " + p.label + " " + format_bytes(p.bytes);
    if (!p.freed_by.empty()) s += " (freed by " + p.freed_by + ")";
  }
  return s + "; workspace: in each block's working set";
}

// ---- parameters between uses ------------------------------------------------------------------------

// "0-3, 7": the blocks whose parameters live on `where`.
std::string block_ranges(const Plan& plan, Tier where) {
  std::string out;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    if (plan.blocks[i].params != where || (i > 0 && plan.blocks[i - 1].params == where)) continue;
    std::size_t j = i;
    while (j + 1 < plan.blocks.size() && plan.blocks[j + 1].params == where) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(i) + (j > i ? "-" + std::to_string(j) : "");
  }
  return out;
}

std::string params_line(const Plan& plan, const PlanCommandInputs& in, const Budgets& budgets) {
  std::string s = "parameters between uses (--offload-params " + in.offload_params + "): ";
  std::vector<std::string> parts;
  for (Tier t : {Tier::kHost, Tier::kNvme, Tier::kGpu}) {
    const std::string r = block_ranges(plan, t);
    const bool several = r.find_first_of("-,") != std::string::npos;
    if (!r.empty()) parts.push_back((several ? "blocks " : "block ") + r + (t == Tier::kGpu ? " resident" : " fetched from " + std::string(to_string(t))));
  }
  for (std::size_t k = 0; k < parts.size(); ++k) s += (k ? "; " : "") + parts[k];
  s += "; the rest (embeddings, final norm, head: " + format_bytes(budgets.rest_parameter_bytes) + ") " +
       (plan.rest_params == Tier::kGpu ? std::string("resident") : "fetched from " + std::string(to_string(plan.rest_params)));
  return s + "; bytes per tier: device " + format_bytes(plan.device_param_bytes) + " resident + " +
         format_bytes(plan.param_window_bytes) + " fetched at once (prefetch window " +
         format_bytes(plan.param_prefetch_bytes) + "), host " + format_bytes(plan.host_param_bytes) + ", NVMe " +
         format_bytes(plan.nvme_param_bytes);
}

// The text lines of Note [Plan report].
std::vector<std::string> plan_lines(const Plan& plan, const PlanCommandInputs& in, const PlanCommandBudgets& pb,
                                    const std::vector<BlockWhy>& why, const std::vector<FixedPart>& parts,
                                    const StepPrediction& step, const OptimizerStepInputs& optimizer) {
  const Budgets& budgets = pb.budgets;
  const Links& links = pb.links;
  const auto measured = [&](const char* what) {
    for (const auto& m : in.measured)
      if (m == what) return true;
    return false;
  };
  std::vector<std::string> lines;
  if (in.shape) {
    const auto& s = *in.shape;
    // Grouped-query attention: the kv heads beside the query heads (Note [Model families]).
    const bool grouped = s.kv_heads > 0 && s.kv_heads != s.heads;
    const std::string kv = grouped ? format(" (%lld kv)", static_cast<long long>(s.kv_heads)) : std::string();
    lines.push_back(format("model: %lld layers, hidden %lld, %lld heads%s, seq %lld, batch %lld, %s, vocab %lld "
                           "(%.3gB parameters)",
                           static_cast<long long>(s.layers), static_cast<long long>(s.hidden),
                           static_cast<long long>(s.heads), kv.c_str(), static_cast<long long>(s.seq),
                           static_cast<long long>(s.batch), in.dtype_name.c_str(), static_cast<long long>(s.vocab),
                           static_cast<double>(transformer_parameters(s)) / 1e9));
  } else {
    lines.push_back("profile: " + in.profile_path + " (" + std::to_string(plan.blocks.size()) + " blocks)");
  }
  const std::string where = " (measured on " + in.device_name + ")";
  const bool has_flops = in.flops_per_second && *in.flops_per_second != 0;
  if (has_flops)
    lines.push_back(format("compute: %.3g TFLOP/s", *in.flops_per_second / 1e12) +
                    (measured("tflops") ? where : " (given)"));
  lines.push_back(format("links: %.3g GB/s device->host, %.3g GB/s host->device", links.d2h / kGB, links.h2d / kGB) +
                  (measured("links") ? where : in.links_given ? " (given)" : " (from the profile)") +
                  (budgets.nvme_bytes ? format("; NVMe %.1f GB/s write, %.1f GB/s read", links.nvme_write / kGB,
                                               links.nvme_read / kGB)
                                      : ""));
  lines.push_back("budgets: device " + format_bytes(budgets.device_bytes) + " (" + pb.device_from + "); host " +
                  format_bytes(budgets.host_bytes) + " for activations (" +
                  format_bytes(budgets.host_bytes + pb.optimizer_host_bytes) + " from " + pb.host_from + ", less " +
                  format_bytes(pb.optimizer_host_bytes) + " of the optimizer's pinned states and step staging); NVMe " +
                  (budgets.nvme_bytes ? format_bytes(budgets.nvme_bytes) : "none") +
                  (pb.optimizer_nvme_bytes ? " (" + format_bytes(budgets.nvme_bytes + pb.optimizer_nvme_bytes) +
                                                 " from --nvme-memory, less " + format_bytes(pb.optimizer_nvme_bytes) +
                                                 " of optimizer states)"
                                           : "") +
                  "; prefetch window " +
                  format_bytes(budgets.prefetch_bytes));
  if (in.state) {
    lines.push_back("parameters and optimizer (--optimizer " + in.optimizer + "): device " +
                    format_bytes(in.state->device - in.state->gradient_bytes + gradient_device_bytes(in)) +
                    (in.offload_gradients ? " (gradients freed once copied: --offload-gradients on)" : "") +
                    ", host " + format_bytes(in.state->host) + ", NVMe " +
                    format_bytes(in.state->nvme) +
                    (in.optimizer == "none" || !in.shape
                         ? std::string()
                         : format("; CPU AdamW states %s: %.3g bytes a parameter", states_named(in).c_str(),
                                  cpu_optimizer_bytes_per_param(in.optimizer_states, in.shape->dtype_bytes)) +
                               (optimizer.params_per_second > 0
                                    ? format(", %.3g parameters a second", optimizer.params_per_second) +
                                          (measured("cpu_adam_rate") ? " (measured on this machine)" : " (given)")
                                    : std::string())) +
                    "; activations outside the blocks (final norm, head, fp32 loss): " +
                    format_bytes(in.head_bytes) +
                    (plan.outside_kept                    ? " kept on the device"
                     : plan.outside_tier == Tier::kNvme ? " swapped to NVMe"
                                                        : " swapped to the host"));
  } else {
    lines.push_back("the rest of training on the device (from the profile): " +
                    format_bytes(budgets.fixed_device_bytes));
  }
  if (budgets.params != ParamPolicy::kResident) lines.push_back(params_line(plan, in, budgets));
  lines.push_back("plan (forward order):");
  std::vector<std::string> block_lines;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) block_lines.push_back("  " + plan.block_line(i));
  for (auto& l : group_block_lines(block_lines)) lines.push_back(std::move(l));
  lines.push_back(plan.summary());
  // Added by issue 41: the whole step, term by term (Note [Step prediction]).
  lines.push_back("whole step predicted (Note [Step prediction]):");
  for (auto& l : step_prediction_lines(step, optimizer)) lines.push_back(std::move(l));
  lines.push_back("predicted: device peak " + format_bytes(plan.predicted_device_peak_bytes) + " of " +
                  format_bytes(budgets.device_bytes) +
                  format(", blocks' forward + backward%s %.4f s per step (keeping everything: %.4f s)",
                         plan.outside_kept ? "" : " and the round trip of what is saved outside them",
                         plan.predicted_step_seconds, plan.keep_all_step_seconds));
  // Added by issue 17 (the plan explains itself), after the lines above.
  lines.push_back("why each block's action (the plan's step and device peak had that block alone done otherwise):");
  std::vector<std::string> why_lines;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) why_lines.push_back(why_line(i, plan, why[i]));
  for (auto& l : group_block_lines(why_lines)) lines.push_back(std::move(l));
  lines.push_back(fixed_line(parts));

  return lines;
}

}  // namespace

std::vector<std::string> group_block_lines(const std::vector<std::string>& lines) {
  // "<indent>block <i>: <rest>" -> (indent, i, rest); other lines stay as they are.
  struct Parsed {
    std::string indent, rest;
    std::size_t index = 0;
    bool ok = false;
  };
  const auto parse = [](const std::string& line) {
    Parsed p;
    const auto at = line.find("block ");
    if (at == std::string::npos || line.find_first_not_of(' ') != at) return p;
    const auto colon = line.find(": ", at);
    if (colon == std::string::npos) return p;
    const std::string_view digits(line.data() + at + 6, colon - at - 6);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), p.index);
    if (ec != std::errc{} || end != digits.data() + digits.size() || digits.empty()) return p;
    p.indent = line.substr(0, at);
    p.rest = line.substr(colon + 2);
    p.ok = true;
    return p;
  };
  std::vector<std::string> out;
  for (std::size_t i = 0; i < lines.size();) {
    const Parsed first = parse(lines[i]);
    std::size_t j = i + 1;
    Parsed last = first;
    while (first.ok && j < lines.size()) {
      const Parsed next = parse(lines[j]);
      if (!next.ok || next.rest != first.rest || next.indent != first.indent || next.index != last.index + 1) break;
      last = next;
      ++j;
    }
    if (j - i == 1) {
      out.push_back(lines[i]);
    } else {
      out.push_back(first.indent + "blocks " + std::to_string(first.index) + "-" + std::to_string(last.index) + " (" +
                    std::to_string(j - i) + " identical): " + first.rest);
    }
    i = j;
  }
  return out;
}

std::vector<std::string> explain_plan(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                                      const Budgets& budgets) {
  TIERFLOW_EXPECTS(plan.blocks.size() == blocks.size(), "explain_plan: a plan of " +
                                                            std::to_string(plan.blocks.size()) + " blocks for " +
                                                            std::to_string(blocks.size()));
  const auto why = detail::why_of_blocks(plan, blocks, links, budgets);
  std::vector<std::string> lines;
  for (std::size_t i = 0; i < blocks.size(); ++i) lines.push_back(why_line(i, plan, why[i]));
  return lines;
}

PlanReport describe_plan(const Plan& plan, const std::vector<BlockProfile>& blocks, const PlanCommandInputs& in,
                         const PlanCommandBudgets& pb) {
  TIERFLOW_EXPECTS(plan.blocks.size() == blocks.size(), "describe_plan: a plan of " +
                                                            std::to_string(plan.blocks.size()) + " blocks for " +
                                                            std::to_string(blocks.size()));
  const auto why = detail::why_of_blocks(plan, blocks, pb.links, pb.budgets);
  const auto parts = detail::fixed_parts(in, pb.budgets, plan);
  const auto optimizer = optimizer_inputs(in, pb);
  // The blocks the planner planned (plan_command_blocks is idempotent): the gradient term is the plan's own.
  const auto step = predict_step(plan, plan_command_blocks(blocks, in), pb.links, pb.budgets, optimizer);
  return {plan_lines(plan, in, pb, why, parts, step, optimizer), detail::plan_json(plan, in, pb, why, parts, step, optimizer)};
}

}  // namespace tierflow::tiering
