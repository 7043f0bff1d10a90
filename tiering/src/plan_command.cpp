// `python -m tierflow plan`'s budgets and arguments; see Note [Plan report], Budgets and Arguments.
#include "tierflow/tiering/plan_command.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <string_view>
#include <tuple>

#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/detail/plan_report_parts.hpp"
#include "tierflow/tiering/step_prediction.hpp"
#include "tierflow/tiering/tier_table.hpp"

namespace tierflow::tiering {
namespace {

using detail::format;
using detail::states_named;

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

// The largest tensor a shape saves outside the blocks (Note [Transformer estimate], the head): the loss's fp32
// logits, tokens x vocab x 4, unless the head's input (tokens x hidden in the dtype) is wider. Past 64 bits it
// saturates: the planner counts at most outside_saved_bytes, and the shape's check refuses such a head first.
std::uint64_t outside_largest_bytes(const TransformerShape& shape) {
  const auto tokens = static_cast<std::uint64_t>(std::max<std::int64_t>(shape.tokens(), 0));
  std::uint64_t largest = 0;
  for (const std::uint64_t per_token : {static_cast<std::uint64_t>(std::max<std::int64_t>(shape.vocab, 0)) * 4,
                                        static_cast<std::uint64_t>(std::max(shape.hidden, 0)) *
                                            static_cast<std::uint64_t>(std::max(shape.dtype_bytes, 0))}) {
    std::uint64_t bytes = 0;
    if (__builtin_mul_overflow(tokens, per_token, &bytes)) return std::numeric_limits<std::uint64_t>::max();
    largest = std::max(largest, bytes);
  }
  return largest;
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

}  // namespace

namespace detail {
std::string states_named(const PlanCommandInputs& in) {
  return std::string("--optimizer-states ") + to_string(in.optimizer_states);
}
}  // namespace detail

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

namespace {
PinnedPoolRule& pinned_pool_rule() {
  static PinnedPoolRule rule;
  return rule;
}
}  // namespace

void set_pinned_pool_rule(PinnedPoolRule rule) { pinned_pool_rule() = std::move(rule); }

std::uint64_t optimizer_pinned_bytes(const PlanCommandInputs& in) {
  const bool cpu = in.optimizer == "host" || in.optimizer == "nvme";
  const PinnedPoolRule& rule = pinned_pool_rule();
  if (!cpu || !in.shape || !rule) return in.state ? in.state->host : 0;  // a profile: no tensors known
  // The runtime's own rule (wrap refuses a pool below it): the states, or two buffers of the largest on NVMe, and
  // one step's gradients and new weights in pinned staging, each of the shape's tensors on the device.
  return rule(transformer_parameter_numels(*in.shape), in.shape->dtype_bytes, in.optimizer_states,
                             in.optimizer == "nvme");
}

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
  out.optimizer_host_bytes = optimizer_pinned_bytes(in);
  if (out.optimizer_host_bytes > host_total) {
    const bool nvme = in.optimizer == "nvme";
    throw config_error("the host budget " + format_bytes(host_total) + " (" + out.host_from + "=" +
                       in.host_memory.text + ", of " + format_bytes(in.host_capacity_bytes) +
                       " RAM here) cannot hold " +
                       (nvme ? "the optimizer's pinned staging " : "the optimizer states' ") +
                       format_bytes(out.optimizer_host_bytes) + ": it needs " +
                       std::to_string(out.optimizer_host_bytes) + " bytes (" + states_named(in) +
                       (pinned_pool_rule() && in.shape && !nvme
                            ? ", with one step's gradients and new weights in pinned staging"
                            : "") +
                       ") and more for activations; pass --host-memory" +
                       (nvme ? "" : ", or --optimizer nvme" + smaller_states_hint(in, host_total)));
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
  // The largest of them, their host staging on the way to NVMe: a shape's fp32 logits (the largest tensor the head
  // saves, estimate_head_saved_bytes), or the profile's measurement.
  b.outside_largest_bytes = in.shape ? outside_largest_bytes(*in.shape) : in.outside_largest_bytes;
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
