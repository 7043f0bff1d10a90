// `python -m tierflow plan`'s budgets and how it shows a plan; see Note [Plan report].
#include "tierflow/tiering/plan_report.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <string_view>
#include <tuple>

#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/detail/plan_search.hpp"
#include "tierflow/tiering/step_prediction.hpp"
#include "tierflow/tiering/tier_table.hpp"

namespace tierflow::tiering {
namespace {

constexpr double kGB = 1e9;  // link speeds are decimal, like the vendors'

// printf into a std::string.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

using Json = nlohmann::ordered_json;  // keys in the order written (Note [Plan report])

// ---- budgets --------------------------------------------------------------------------------------

// `text` as a budget; config_error for a malformed one or a percentage of an unknown capacity.
Budget budget_of(const std::string& text, std::uint64_t capacity_bytes);

// Bytes of a size setting parsed as the table parses `variable`; errors name `label` (the flag or variable).
std::uint64_t setting_bytes(const std::string& text, std::uint64_t capacity, const std::string& label,
                            const char* variable) {
  return budget_bytes(parse_setting(variable, text, label), capacity);
}

// The device budget and what set it; the unset case is the plan command's (Note [GPU budget]).
std::pair<std::uint64_t, std::string> device_budget(const PlanCommandInputs& in) {
  constexpr const char* kVariable = "TIERFLOW_GPU_MEMORY";
  Budget setting;
  std::string from = "the " + in.device_name + " device's total memory";
  switch (in.gpu_memory.source) {
    case SettingSource::kFlag:
      setting = budget_of(parse_setting(kVariable, in.gpu_memory.text, "--gpu-memory"), in.device_capacity_bytes);
      from = "--gpu-memory";
      break;
    case SettingSource::kVariable:  // set: its value, as the table validated it
      setting = budget_of(in.gpu_memory.text, in.device_capacity_bytes);
      from = kVariable;
      break;
    case SettingSource::kUnset: break;
  }
  const bool given = in.gpu_memory.source != SettingSource::kUnset;
  return {gpu_budget_bytes(setting, given, in.device_capacity_bytes, UnsetGpuBudget::kWholeDevice), from};
}

std::uint64_t fixed_device_bytes(const PlanCommandInputs& in) {
  if (!in.state) return in.profile_fixed_device_bytes;
  // The activations outside the blocks are the plan's to keep or swap (Budgets::outside_saved_bytes); they must
  // still add up with the rest of training.
  // --offload-gradients on: the gradients the device holds at once, not all of them (Note [Plan report], Gradients).
  const std::uint64_t device = in.state->device - in.state->gradient_bytes + gradient_device_bytes(in);
  std::uint64_t fixed = 0;
  if (__builtin_add_overflow(device, in.head_bytes, &fixed)) {
    const unsigned __int128 sum = static_cast<unsigned __int128>(device) + in.head_bytes;
    const std::string text = std::to_string(static_cast<std::uint64_t>(sum / 10)) +
                             std::to_string(static_cast<unsigned>(sum % 10));
    throw config_error(in.blocks_from + ": the rest of training needs " + text +
                       " device bytes; accepted: a shape whose byte counts fit in 64 bits");
  }
  return device;
}

// "--optimizer-states 8bit: 6.03 bytes a parameter, 40.2 GiB": what the states would take in the format that
// keeps the fewest bytes, for a budget too small for them (empty when they are in it already, from a profile,
// or when they would not fit `budget_bytes` either).
std::string smaller_states_hint(const PlanCommandInputs& in, std::uint64_t budget_bytes) {
  constexpr StateFormat kLeast = StateFormat::k8bit;
  if (!in.shape || in.optimizer_states == kLeast) return "";
  const std::uint64_t bytes = cpu_optimizer_state_bytes(kLeast, transformer_parameters(*in.shape),
                                                        in.shape->dtype_bytes);
  if (bytes > budget_bytes) return "";  // 8-bit states would not fit either: no hint that does not help
  return format(", or --optimizer-states %s (TIERFLOW_OPTIMIZER_STATES=%s: %.3g bytes a parameter, ",
                to_string(kLeast), to_string(kLeast), cpu_optimizer_bytes_per_param(kLeast, in.shape->dtype_bytes)) +
         format_bytes(bytes) + ")";
}

// "--optimizer-states fp32": the CPU AdamW's states as errors and the report name their format.
std::string states_named(const PlanCommandInputs& in) {
  return std::string("--optimizer-states ") + to_string(in.optimizer_states);
}

// ---- why each block's action won --------------------------------------------------------------------

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

struct BlockWhy {
  std::vector<AlternativeCost> rejected;
};

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

Json alternatives_json(const Plan& plan, const BlockWhy& why) {
  Json items = Json::array();
  for (const auto& a : why.rejected) {
    items.push_back({{"mode", to_string(a.block.mode)},
                     {"alpha", a.block.alpha},
                     {"swap_tier", to_string(a.block.tier)},
                     {"swap_bytes", a.block.swap_bytes},
                     {"step_seconds", a.step_seconds},
                     {"gpu_peak_bytes", a.device_peak_bytes},
                     {"host_bytes", a.host_bytes},
                     {"nvme_bytes", a.nvme_bytes},
                     {"fits", a.fits()},
                     {"why", why_rejected(a, plan)}});
  }
  return items;
}

// ---- the fixed device bytes by part ------------------------------------------------------------------

struct FixedPart {
  const char* name;       // JSON "part"
  const char* label;      // text
  std::uint64_t bytes;
  std::string freed_by;   // the setting that would move it off the device ("" none)
};

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

std::string fixed_line(const std::vector<FixedPart>& parts) {
  std::string s = "device's fixed bytes:";
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const auto& p = parts[k];
    s += std::string(k ? ";" : "") + " " + p.label + " " + format_bytes(p.bytes);
    if (!p.freed_by.empty()) s += " (freed by " + p.freed_by + ")";
  }
  return s + "; workspace: in each block's working set";
}

Json fixed_json(const std::vector<FixedPart>& parts) {
  Json items = Json::array();
  for (const auto& p : parts)
    items.push_back({{"part", p.name}, {"gpu_bytes", p.bytes},
                     {"freed_by", p.freed_by.empty() ? Json(nullptr) : Json(p.freed_by)}});
  return items;
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

Json params_json(const Plan& plan, const PlanCommandInputs& in, const Budgets& budgets) {
  std::size_t fetched = 0;
  for (const auto& b : plan.blocks) fetched += b.params != Tier::kGpu;
  return {{"offload", in.offload_params},
          {"policy", to_string(budgets.params)},
          {"fetched_blocks", fetched},
          {"rest", to_string(plan.rest_params)},
          {"rest_bytes", budgets.rest_parameter_bytes},
          {"gpu_resident_bytes", plan.device_param_bytes},
          {"gpu_window_bytes", plan.param_window_bytes},
          {"prefetch_bytes", plan.param_prefetch_bytes},
          {"host_bytes", plan.host_param_bytes},
          {"nvme_bytes", plan.nvme_param_bytes},
          {"rest_fetch_seconds", plan.rest_fetch_seconds}};
}

// --offload-params: the policy, the tier and the parameters out of the fixed bytes (Note [Plan report]).
void apply_offload_params(const PlanCommandInputs& in, Budgets& b) {
  const std::string& v = in.offload_params;
  if (v == "none" || v.empty()) return;
  if (v != "host" && v != "nvme" && v != "auto")
    throw config_error("--offload-params " + quote_config_value(v) + "; accepted: none, host, nvme, auto");
  if (!in.shape || !in.state)
    throw config_error("--offload-params " + v + " needs a model shape: a profile gives no parameter bytes per "
                       "block; accepted with --profile: none");
  if (v == "nvme" && b.nvme_bytes == 0)
    throw config_error("--offload-params nvme needs an NVMe tier: pass --nvme-memory and --nvme-gbps");
  b.params = v == "auto" ? ParamPolicy::kAuto : ParamPolicy::kFetchAll;
  b.param_tier = v == "nvme" ? Tier::kNvme : Tier::kHost;
  const std::uint64_t blocks = transformer_block_parameters(*in.shape) *
                               static_cast<std::uint64_t>(in.shape->dtype_bytes) *
                               static_cast<std::uint64_t>(in.shape->layers);
  b.rest_parameter_bytes = in.state->parameter_bytes - blocks;  // the model's, so at least its blocks'
  b.fixed_device_bytes -= in.state->parameter_bytes;             // in the fixed bytes (state->device)
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
                  format_bytes(pb.optimizer_host_bytes) + " of optimizer states); NVMe " +
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
                                  cpu_optimizer_bytes_per_param(in.optimizer_states, in.shape->dtype_bytes))) +
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

// The "step" object of the JSON: each term's seconds, then the optimizer's parts.
Json step_json(const StepPrediction& step, const OptimizerStepInputs& o) {
  Json terms = Json::object();
  for (const auto& [name, seconds] : step_terms(step)) terms[name] = seconds;
  const auto& t = step.optimizer;
  return {{"terms_seconds", std::move(terms)},
          {"blocks_seconds", step.blocks_seconds},
          {"backward_seconds", step.backward_seconds},
          {"optimizer", {{"on_cpu", o.on_cpu},
                         {"parameters", o.parameters},
                         {"params_per_second", o.params_per_second > 0 ? Json(o.params_per_second) : Json(nullptr)},
                         {"states", to_string(o.states)},
                         {"steps_during_backward", o.steps_during_backward},
                         {"kernel_seconds", t.kernel_seconds},
                         {"nvme_state_bytes", o.nvme_state_bytes},
                         {"nvme_read_seconds", t.nvme_read_seconds},
                         {"nvme_write_seconds", t.nvme_write_seconds},
                         {"busy_seconds", t.busy_seconds},
                         {"exposed_seconds", t.exposed_seconds}}}};
}

// The JSON document of Note [Plan report]: today's keys, then the issue-17 ones.
std::string plan_json(const Plan& plan, const PlanCommandInputs& in, const PlanCommandBudgets& pb,
                      const std::vector<BlockWhy>& why, const std::vector<FixedPart>& parts,
                      const StepPrediction& step, const OptimizerStepInputs& optimizer) {
  const Budgets& budgets = pb.budgets;
  const Links& links = pb.links;
  const bool has_flops = in.flops_per_second && *in.flops_per_second != 0;
  Json layers = Json::array();
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    layers.push_back({{"mode", to_string(b.mode)},
                      {"alpha", b.alpha},
                      {"keep", b.keep},
                      {"swap", b.swap},
                      {"recompute", b.recompute},
                      {"swap_tier", to_string(b.tier)},
                      {"swap_bytes", b.swap_bytes},
                      {"forward_seconds", b.forward_seconds},
                      {"backward_seconds", b.backward_seconds},
                      {"params", to_string(b.params)},
                      {"alternatives", alternatives_json(plan, why[i])}});
  }
  Json doc;
  doc["layers"] = std::move(layers);
  doc["predicted"] = {{"gpu_peak_bytes", plan.predicted_device_peak_bytes},
                      {"step_seconds", plan.predicted_step_seconds},
                      {"keep_all_step_seconds", plan.keep_all_step_seconds},
                      {"host_bytes", plan.host_bytes},
                      {"nvme_bytes", plan.nvme_bytes},
                      {"proven_optimal", plan.proven_optimal},
                      {"outside_kept", plan.outside_kept},
                      {"outside_tier", std::string(to_string(plan.outside_tier))},
                      {"outside_bytes", plan.outside_bytes},
                      {"outside_swap_seconds", plan.outside_swap_seconds}};
  doc["budgets"] = {{"gpu_bytes", budgets.device_bytes},
                    {"fixed_gpu_bytes", budgets.fixed_device_bytes},
                    {"host_bytes_for_activations", budgets.host_bytes},
                    {"nvme_bytes", budgets.nvme_bytes},
                    {"prefetch_bytes", budgets.prefetch_bytes}};
  doc["links"] = {{"d2h", links.d2h}, {"h2d", links.h2d}, {"duplex", links.duplex},
                  {"nvme_write", links.nvme_write}, {"nvme_read", links.nvme_read}};
  doc["tflops"] = has_flops ? Json(*in.flops_per_second / 1e12) : Json(nullptr);
  doc["measured"] = in.measured;
  doc["summary"] = plan.summary();
  if (in.state) {
    doc["state"] = {{"optimizer", in.optimizer},
                    {"optimizer_states", to_string(in.optimizer_states)},
                    {"gpu_bytes", in.state->device},
                    {"host_bytes", in.state->host},
                    {"nvme_bytes", in.state->nvme},
                    {"outside_blocks_gpu_bytes", in.head_bytes},
                    {"offload_gradients", in.offload_gradients}};
  }
  doc["fixed_gpu_parts"] = fixed_json(parts);
  doc["parameters"] = params_json(plan, in, budgets);
  doc["step"] = step_json(step, optimizer);
  // Names and lines are ASCII; a --profile path of other bytes is escaped, never an error.
  return doc.dump(-1, ' ', true, Json::error_handler_t::replace);
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

std::uint64_t budget_bytes(const std::string& text, std::uint64_t capacity_bytes) {
  return budget_of(text, capacity_bytes).resolve(capacity_bytes);
}

namespace {
Budget budget_of(const std::string& text, std::uint64_t capacity_bytes) {
  const auto b = parse_budget(text);
  if (!b) {
    throw config_error(quote_config_value(text) + " is not a size or a percentage; accepted: " +
                       std::string(kSizeForms) + ", or a percentage such as 90%");
  }
  if (b->is_fraction && capacity_bytes == 0) {
    throw config_error(quote_config_value(text) + " is a percentage of a capacity that is unknown here; accepted: " +
                       std::string(kSizeForms));
  }
  return *b;
}
}  // namespace

PlanCommandBudgets plan_command_budgets(const PlanCommandInputs& in) {
  if (in.offload_gradients && in.optimizer != "host" && in.optimizer != "nvme") {
    throw config_error("--offload-gradients on (TIERFLOW_OFFLOAD_GRADIENTS) with --optimizer " + in.optimizer +
                       ": no gradient is copied to the host without the CPU optimizer, so every gradient stays on "
                       "the device until zero_grad; accepted: --offload-gradients off, or --optimizer host or nvme");
  }
  if (in.offload_gradients && !in.state) {
    throw config_error("--offload-gradients on needs a model shape: a profile's fixed device bytes hold its "
                       "gradients as recorded; accepted with --profile: --offload-gradients off");
  }
  PlanCommandBudgets out;
  auto& b = out.budgets;
  std::tie(b.device_bytes, out.device_from) = device_budget(in);
  out.host_from = in.host_memory.source == SettingSource::kFlag ? "--host-memory" : "TIERFLOW_HOST_MEMORY";
  const std::uint64_t host_total =
      setting_bytes(in.host_memory.text, in.host_capacity_bytes, out.host_from, "TIERFLOW_HOST_MEMORY");
  out.optimizer_host_bytes = in.state ? in.state->host : 0;
  if (out.optimizer_host_bytes > host_total) {
    throw config_error("the host budget " + format_bytes(host_total) + " (" + out.host_from + "=" +
                       in.host_memory.text + ", of " + format_bytes(in.host_capacity_bytes) +
                       " RAM here) cannot hold the optimizer states' " + format_bytes(out.optimizer_host_bytes) +
                       ": it needs " + std::to_string(out.optimizer_host_bytes) +
                       " bytes (" + states_named(in) + ") and more for activations; pass --host-memory, or "
                       "--optimizer nvme" + smaller_states_hint(in, host_total));
  }
  if (in.nvme_memory) {
    try {
      b.nvme_bytes = budget_bytes(*in.nvme_memory, 0);
    } catch (const config_error& e) {
      throw config_error(std::string("--nvme-memory ") + e.what());
    }
  }
  if (b.nvme_bytes && in.nvme_bytes_per_second <= 0) throw config_error("--nvme-memory needs --nvme-gbps");
  // --optimizer nvme: the states share the NVMe budget when there is one (without one, activations get none).
  out.optimizer_nvme_bytes = in.nvme_memory && in.state ? in.state->nvme : 0;
  if (out.optimizer_nvme_bytes > b.nvme_bytes) {
    throw config_error("the NVMe budget " + format_bytes(b.nvme_bytes) + " (--nvme-memory=" + *in.nvme_memory +
                       ") cannot hold the optimizer states' " + format_bytes(out.optimizer_nvme_bytes) +
                       " (--optimizer nvme): it needs " + std::to_string(out.optimizer_nvme_bytes) + " bytes (" +
                       states_named(in) + ") and more for activations; pass a larger --nvme-memory, or "
                       "--optimizer host" + smaller_states_hint(in, b.nvme_bytes));
  }
  b.nvme_bytes -= out.optimizer_nvme_bytes;
  out.links = in.links;
  if (b.nvme_bytes) out.links.nvme_write = out.links.nvme_read = in.nvme_bytes_per_second;
  b.prefetch_bytes = setting_bytes(in.prefetch.text, 0,
                                   in.prefetch.source == SettingSource::kFlag ? "--prefetch" : "TIERFLOW_PREFETCH_BYTES",
                                   "TIERFLOW_PREFETCH_BYTES");
  b.fixed_device_bytes = fixed_device_bytes(in);
  b.outside_saved_bytes = in.head_bytes;  // the shape's estimate, or the profile's measurement
  b.host_bytes = host_total - out.optimizer_host_bytes;
  apply_offload_params(in, b);
  return out;
}

OptimizerStepInputs optimizer_inputs(const PlanCommandInputs& in, const PlanCommandBudgets& pb) {
  OptimizerStepInputs o;
  o.on_cpu = in.optimizer == "host" || in.optimizer == "nvme";
  if (!o.on_cpu || !in.shape) {
    o.on_cpu = o.on_cpu && in.cpu_adam_params_per_second > 0;  // a profile: the rate alone says nothing
    return o;
  }
  o.parameters = transformer_parameters(*in.shape);
  o.states = in.optimizer_states;
  o.params_per_second = cpu_adam_rate(in.cpu_adam_params_per_second, in.optimizer_states, in.shape->dtype_bytes);
  o.steps_during_backward = in.optimizer == "host";
  if (in.optimizer == "nvme" && in.state) {
    o.nvme_state_bytes = in.state->nvme;
    o.nvme_read = o.nvme_write = in.nvme_bytes_per_second > 0 ? in.nvme_bytes_per_second : pb.links.nvme_read;
  }
  return o;
}

std::uint64_t gradient_device_bytes(const PlanCommandInputs& in) {
  if (!in.state) return 0;
  if (!in.offload_gradients || !in.shape) return in.state->gradient_bytes;
  // Each unit's gradients go once their copy lands: the unit backward makes and the one still copying (the two
  // largest: a block's, or the rest's: embeddings, final norm, head).
  const std::uint64_t block =
      transformer_block_parameters(*in.shape) * static_cast<std::uint64_t>(in.shape->dtype_bytes);
  const std::uint64_t blocks = block * static_cast<std::uint64_t>(in.shape->layers);
  const std::uint64_t rest = in.state->gradient_bytes > blocks ? in.state->gradient_bytes - blocks : 0;
  const std::uint64_t two = in.shape->layers > 1 ? std::max(rest, block) + block : rest + block;
  return std::min(in.state->gradient_bytes, two);
}

std::vector<BlockProfile> plan_command_blocks(std::vector<BlockProfile> blocks, const PlanCommandInputs& in) {
  if (!in.shape) return blocks;  // a measured profile has its own traffic
  // --optimizer host: each block's gradients go device->host during its backward (optimizer_traffic's
  // grads_down_in_backward, TIERFLOW_OVERLAP_STEP on); nvme steps in step(), after backward.
  const bool down = in.optimizer == "host";
  for (auto& b : blocks) b.download_bytes = down ? b.parameter_bytes : 0;
  return blocks;
}

std::vector<std::string> explain_plan(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                                      const Budgets& budgets) {
  TIERFLOW_EXPECTS(plan.blocks.size() == blocks.size(), "explain_plan: a plan of " +
                                                            std::to_string(plan.blocks.size()) + " blocks for " +
                                                            std::to_string(blocks.size()));
  const auto why = why_of_blocks(plan, blocks, links, budgets);
  std::vector<std::string> lines;
  for (std::size_t i = 0; i < blocks.size(); ++i) lines.push_back(why_line(i, plan, why[i]));
  return lines;
}

PlanReport describe_plan(const Plan& plan, const std::vector<BlockProfile>& blocks, const PlanCommandInputs& in,
                         const PlanCommandBudgets& pb) {
  TIERFLOW_EXPECTS(plan.blocks.size() == blocks.size(), "describe_plan: a plan of " +
                                                            std::to_string(plan.blocks.size()) + " blocks for " +
                                                            std::to_string(blocks.size()));
  const auto why = why_of_blocks(plan, blocks, pb.links, pb.budgets);
  const auto parts = fixed_parts(in, pb.budgets, plan);
  const auto optimizer = optimizer_inputs(in, pb);
  // The blocks the planner planned (plan_command_blocks is idempotent): the gradient term is the plan's own.
  const auto step = predict_step(plan, plan_command_blocks(blocks, in), pb.links, pb.budgets, optimizer);
  return {plan_lines(plan, in, pb, why, parts, step, optimizer), plan_json(plan, in, pb, why, parts, step, optimizer)};
}

const std::vector<std::string>& plan_shape_flags() {
  static const std::vector<std::string> flags{"layers", "hidden", "heads", "seq", "batch"};
  return flags;
}

void check_blocks_source(bool profile, const std::vector<std::string>& given_shape_flags) {
  auto flags = [](const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "--" : ", --") + n;
    return out;
  };
  if (profile && !given_shape_flags.empty()) {
    throw config_error("--profile and a shape (" + flags(given_shape_flags) + ") exclude each other");
  }
  if (profile) return;
  std::vector<std::string> missing;
  for (const auto& f : plan_shape_flags()) {
    if (std::find(given_shape_flags.begin(), given_shape_flags.end(), f) == given_shape_flags.end()) {
      missing.push_back(f);
    }
  }
  if (!missing.empty()) throw config_error("give a shape (missing " + flags(missing) + ") or --profile FILE");
}

double check_rate(std::optional<double> value, const std::string& shown, bool zero) {
  if (value && ((*value >= kLeastRate && *value <= kMostRate) || (zero && *value == 0))) return *value;
  char range[64];
  std::snprintf(range, sizeof range, "a number from %g to %g", kLeastRate, kMostRate);
  throw config_error(shown + " is not valid; accepted: " + range + (zero ? ", or 0 for none" : ""));
}

std::int64_t shape_argument(std::string_view field, std::string_view digits, const std::string& shown) {
  std::int64_t most = 0;
  for (const auto& l : transformer_shape_limits()) most = l.field == field ? l.max : most;
  std::int64_t value = 0;
  const bool all_digits = !digits.empty() && digits.size() <= 20 &&
                          std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (!all_digits || ec != std::errc{} || end != digits.data() + digits.size() || value < 1 || value > most) {
    throw config_error(shown + " is not valid; accepted: an integer from 1 to " + std::to_string(most));
  }
  return value;
}

Links links_from_pcie_gbps(double gbps) noexcept {
  Links links;
  links.d2h = links.h2d = gbps * kDecimalGB;
  links.duplex = 2 * links.d2h;
  return links;
}

std::string plan_refusal(const std::string& error, bool out_of_memory, const PlanCommandInputs& inputs,
                         const PlanCommandBudgets& budgets) {
  const std::string prefix = "tierflow: ";
  const std::string what = error.rfind(prefix, 0) == 0 ? error.substr(prefix.size()) : error;
  if (out_of_memory) {
    return what + " (the device budget: " + budgets.device_from +
           (inputs.gpu_memory.source == SettingSource::kFlag ? "" : "; pass --gpu-memory") + ")";
  }
  return inputs.blocks_from + " with prefetch window " + std::to_string(budgets.budgets.prefetch_bytes) +
         " bytes: " + error;
}

}  // namespace tierflow::tiering
