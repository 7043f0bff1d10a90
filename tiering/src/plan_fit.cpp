// Bytes per tier by kind, and the settings that would make a plan fit; see Note [Plan fit] in plan_fit.hpp.
#include "tierflow/tiering/plan_fit.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/tiering/step_prediction.hpp"
#include "tierflow/tiering/transformer_profile.hpp"

namespace tierflow::tiering {
namespace {

std::uint64_t less_or_zero(std::uint64_t a, std::uint64_t b) { return a > b ? a - b : 0; }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

// A command-line word as a POSIX shell reads it back.
std::string shell_word(const std::string& w) {
  if (!w.empty() && w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:%+,@") ==
                        std::string::npos)
    return w;
  std::string out = "'";
  for (const char c : w) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The whole step of a candidate (Note [Step prediction]): the blocks' and the CPU optimizer's exposed time, as
// describe_plan predicts it.
double whole_step_seconds(const Plan& plan, const std::vector<BlockProfile>& blocks, const PlanCommandInputs& in,
                          const PlanCommandBudgets& pb) {
  return predict_step(plan, plan_command_blocks(blocks, in), pb.links, pb.budgets, optimizer_inputs(in, pb))
      .total_seconds;
}

}  // namespace

std::string_view to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::kParameters: return "parameters";
    case MemoryKind::kGradients: return "gradients";
    case MemoryKind::kOptimizerStates: return "optimizer states";
    case MemoryKind::kActivations: return "activations";
    case MemoryKind::kWorkspace: return "workspace";
  }
  return "?";
}

std::string_view to_string(MemoryTier tier) noexcept {
  switch (tier) {
    case MemoryTier::kDevice: return "device";
    case MemoryTier::kPinnedHost: return "pinned host";
    case MemoryTier::kNvme: return "NVMe";
  }
  return "?";
}

std::uint64_t MemoryTable::tier_total(MemoryTier tier) const noexcept {
  std::uint64_t sum = 0;
  for (const auto& row : bytes) sum += row[static_cast<std::size_t>(tier)];
  return sum;
}

std::vector<std::string> MemoryTable::lines() const {
  auto row = [](const std::string& name, const std::array<std::string, kMemoryTiers>& cells) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-18s%12s %12s %12s", name.c_str(), cells[0].c_str(), cells[1].c_str(),
                  cells[2].c_str());
    return std::string(buf);
  };
  std::vector<std::string> out{"bytes per tier:"};
  std::array<std::string, kMemoryTiers> head;
  for (std::size_t t = 0; t < kMemoryTiers; ++t) head[t] = std::string(to_string(static_cast<MemoryTier>(t)));
  out.push_back(row("", head));
  for (std::size_t k = 0; k < kMemoryKinds; ++k) {
    std::array<std::string, kMemoryTiers> cells;
    for (std::size_t t = 0; t < kMemoryTiers; ++t) cells[t] = format_bytes(bytes[k][t]);
    out.push_back(row(std::string(to_string(static_cast<MemoryKind>(k))), cells));
  }
  std::array<std::string, kMemoryTiers> totals;
  for (std::size_t t = 0; t < kMemoryTiers; ++t) totals[t] = format_bytes(tier_total(static_cast<MemoryTier>(t)));
  out.push_back(row("total", totals));
  return out;
}

std::string MemoryTable::json() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (std::size_t t = 0; t < kMemoryTiers; ++t) {
    std::string tier(to_string(static_cast<MemoryTier>(t)));
    std::replace(tier.begin(), tier.end(), ' ', '_');
    if (tier == "NVMe") tier = "nvme";
    nlohmann::ordered_json col = nlohmann::ordered_json::object();
    for (std::size_t k = 0; k < kMemoryKinds; ++k) {
      std::string kind(to_string(static_cast<MemoryKind>(k)));
      std::replace(kind.begin(), kind.end(), ' ', '_');
      col[kind] = bytes[k][t];
    }
    col["total"] = tier_total(static_cast<MemoryTier>(t));
    j[tier] = col;
  }
  return j.dump();
}

MemoryTable memory_table(const Plan& plan, const std::vector<BlockProfile>& blocks, const PlanCommandInputs& in,
                         const PlanCommandBudgets& pb) {
  if (!in.state) throw config_error("memory_table: an estimated model's plan (a profile has no bytes by kind)");
  const StateBytes& s = *in.state;
  const Budgets& b = pb.budgets;
  MemoryTable t;
  auto set = [&t](MemoryKind k, MemoryTier tier, std::uint64_t v) {
    t.bytes[static_cast<std::size_t>(k)][static_cast<std::size_t>(tier)] = v;
  };
  using K = MemoryKind;
  using T = MemoryTier;
  const bool fetched = b.params != ParamPolicy::kResident;
  const std::uint64_t device_params = fetched ? plan.device_param_bytes + plan.param_window_bytes : s.parameter_bytes;
  set(K::kParameters, T::kDevice, device_params);
  set(K::kParameters, T::kPinnedHost, plan.host_param_bytes);
  set(K::kParameters, T::kNvme, plan.nvme_param_bytes);
  const std::uint64_t gradients = gradient_device_bytes(in);  // --offload-gradients (Note [Plan report], Gradients)
  set(K::kGradients, T::kDevice, gradients);
  const bool optimizer_on_device = s.host == 0 && s.nvme == 0;
  set(K::kOptimizerStates, T::kDevice, optimizer_on_device ? s.optimizer_bytes : 0);
  set(K::kOptimizerStates, T::kPinnedHost, pb.optimizer_host_bytes);  // the pool's need (state_pool_need)
  set(K::kOptimizerStates, T::kNvme, s.nvme);
  std::uint64_t transient = 0;
  bool swaps = false;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    transient = std::max(transient, blocks[i].transient_bytes);
    if (i < plan.blocks.size() && plan.blocks[i].swap_bytes > 0) swaps = true;
  }
  const std::uint64_t workspace = transient + (swaps ? b.prefetch_bytes : 0);
  set(K::kWorkspace, T::kDevice, workspace);
  const std::uint64_t others = device_params + gradients + (optimizer_on_device ? s.optimizer_bytes : 0) +
                               workspace;
  set(K::kActivations, T::kDevice, less_or_zero(plan.predicted_device_peak_bytes, others));
  set(K::kActivations, T::kPinnedHost, less_or_zero(plan.host_bytes, plan.host_param_bytes));
  set(K::kActivations, T::kNvme, less_or_zero(plan.nvme_bytes, plan.nvme_param_bytes));
  return t;
}

std::string flags_text(const std::vector<FlagValue>& flags) {
  std::string out;
  for (const auto& [flag, value] : flags) out += (out.empty() ? "" : " ") + flag + " " + shell_word(value);
  return out;
}

namespace {
/// Bits a value of the optimizer's states takes, as --optimizer-states names the format (fp32 32, bf16 16,
/// 8bit 8): fewer is other numerics.
int state_bits(const std::string& format) { return format == "8bit" ? 8 : format == "bf16" ? 16 : 32; }
}  // namespace

FitSearch search_fitting_settings(const std::vector<BlockProfile>& blocks, const PlanCommandInputs& in,
                                  const StepOf& step_of) {
  if (!in.shape) {
    throw config_error("the settings that would make a plan fit are tried for a model shape or --model; a profile "
                       "gives no parameter bytes per block");
  }
  const bool nvme = in.nvme_memory.has_value();
  auto with = [](std::vector<std::string> values, const std::string& given) {
    values.erase(std::remove(values.begin(), values.end(), given), values.end());
    values.insert(values.begin(), given);  // the command's own first: no flag changed
    return values;
  };
  // --optimizer none too: torch's AdamW on the device, when its states fit there and the host's budget does not
  // hold the CPU AdamW's.
  std::vector<std::string> params_values{"host", "auto"}, optimizer_values{"none", "host"};
  if (nvme) {
    params_values.push_back("nvme");
    optimizer_values.push_back("nvme");
  }
  const auto params = with(params_values, in.offload_params.empty() ? "none" : in.offload_params);
  const auto optimizers = with(optimizer_values, in.optimizer);
  const auto states = with({"bf16", "8bit"}, std::string(to_string(in.optimizer_states)));
  const auto gradients = with({"on"}, in.offload_gradients ? "on" : "off");
  std::vector<std::string> prefetches{in.prefetch.text};
  try {
    const std::uint64_t given = budget_bytes(in.prefetch.text, 0);
    for (const std::uint64_t smaller : {given / 4, given / 16})
      if (smaller >= MiB)
        prefetches.push_back(smaller % MiB == 0 ? std::to_string(smaller / MiB) + "MiB" : std::to_string(smaller));
  } catch (const config_error&) {
  }

  FitSearch out;
  out.nvme_given = nvme;
  for (const auto& p : params) {
    for (const auto& o : optimizers) {
      for (const auto& st : states) {
        if (o == "none" && st != states.front()) continue;  // torch's AdamW keeps its own format
        for (const auto& pf : prefetches) {
          for (const auto& g : gradients) {
            if (o == "none" && g == "on") continue;  // no gradient copied to the host: refused
            FitTried t;
            if (p != params.front()) t.flags.emplace_back("--offload-params", p);
            if (o != optimizers.front()) t.flags.emplace_back("--optimizer", o);
            if (st != states.front()) t.flags.emplace_back("--optimizer-states", st);
            t.narrower_states = state_bits(st) < state_bits(states.front());
            if (pf != prefetches.front()) t.flags.emplace_back("--prefetch", pf);
            if (g != gradients.front()) t.flags.emplace_back("--offload-gradients", g);
            if (t.flags.empty()) continue;  // the command's own: refused already
            PlanCommandInputs c = in;
            c.offload_params = p;
            c.optimizer = o;
            c.optimizer_states = *parse_state_format(st);
            c.offload_gradients = g == "on";
            if (pf != prefetches.front()) c.prefetch = SettingText{pf, SettingSource::kFlag};
            try {
              c.state = estimate_training_state(*c.shape, parse_optimizer_placement(o), c.optimizer_states);
              const PlanCommandBudgets b = plan_command_budgets(c);
              const auto moved = plan_command_blocks(blocks, c);  // the gradients' traffic of this placement
              const Plan plan = plan_activations(moved, b.links, b.budgets);
              t.fits = plan.fits;
              t.step_seconds = step_of ? step_of(plan, moved, c, b) : whole_step_seconds(plan, moved, c, b);
              t.device_peak_bytes = plan.predicted_device_peak_bytes;
            } catch (const out_of_memory& e) {
              t.why = e.what();
            } catch (const config_error& e) {
              t.why = e.what();
            }
            out.tried.push_back(std::move(t));
          }
        }
      }
    }
  }
  // The fastest fit (ties: fewer flags) among those `narrower` says, for each of the two kinds.
  auto fastest = [&](bool narrower) {
    std::optional<std::size_t> best;
    for (std::size_t i = 0; i < out.tried.size(); ++i) {
      const FitTried& t = out.tried[i];
      if (!t.fits || t.narrower_states != narrower) continue;
      if (!best) {
        best = i;
        continue;
      }
      const FitTried& b = out.tried[*best];
      const double tol = 1e-9 * std::max(std::fabs(b.step_seconds), 1e-12);
      if (t.step_seconds < b.step_seconds - tol ||
          (std::fabs(t.step_seconds - b.step_seconds) <= tol && t.flags.size() < b.flags.size()))
        best = i;
    }
    return best;
  };
  out.best = fastest(false);
  const auto narrower = fastest(true);
  if (!out.best)
    out.best = narrower;
  else if (narrower && out.tried[*narrower].step_seconds < out.tried[*out.best].step_seconds)
    out.faster_narrower = narrower;
  return out;
}

std::string fit_advice(const FitSearch& search, const std::string& command) {
  if (!search.best) {
    return "; none of the " + std::to_string(search.tried.size()) +
           " combinations of --offload-params, --optimizer, --optimizer-states, --prefetch and --offload-gradients tried fits (Note "
           "[Plan fit]): raise --gpu-memory or --host-memory" +
           (search.nvme_given ? std::string(" or --nvme-memory")
                              : std::string(", or give an NVMe tier (--nvme-memory, --nvme-gbps)"));
  }
  // The command line last, whole: what a user (or a script) copies.
  const FitTried& b = search.tried[*search.best];
  std::string text = "; it fits with " + flags_text(b.flags) + " (tried by the planner: predicted step " +
                     seconds_text(b.step_seconds) + ", device peak " + format_bytes(b.device_peak_bytes);
  if (b.narrower_states) text += "; the optimizer's states narrower: other numerics";
  if (search.faster_narrower) {
    const FitTried& f = search.tried[*search.faster_narrower];
    text += "; faster, with other numerics (narrower optimizer states): " + flags_text(f.flags) + ", predicted step " +
            seconds_text(f.step_seconds);
  }
  return text + "): " + command_with(command, b.flags);
}

std::string command_with(const std::string& command, const std::vector<FlagValue>& flags) {
  // The command's words (shlex.join's: a word with a space is quoted, a flag never is).
  std::vector<std::string> words;
  for (std::size_t i = 0; i <= command.size();) {
    const std::size_t j = std::min(command.find(' ', i), command.size());
    if (j > i) words.push_back(command.substr(i, j - i));
    i = j + 1;
  }
  std::vector<FlagValue> appended;
  for (const auto& [flag, value] : flags) {
    bool replaced = false;
    for (std::size_t i = 0; i < words.size(); ++i) {
      if (words[i] == flag && i + 1 < words.size()) {
        words[i + 1] = shell_word(value);
        replaced = true;
      } else if (words[i].rfind(flag + "=", 0) == 0) {
        words[i] = flag + "=" + shell_word(value);
        replaced = true;
      }
    }
    if (!replaced) appended.emplace_back(flag, value);
  }
  // torch's AdamW on the device has no CPU AdamW rate: the command refuses --cpu-adam-rate with --optimizer none.
  const bool none = std::find(flags.begin(), flags.end(), FlagValue{"--optimizer", "none"}) != flags.end();
  std::string out;
  for (std::size_t i = 0; i < words.size(); ++i) {
    if (none && words[i] == "--cpu-adam-rate") {
      ++i;
      continue;
    }
    if (none && words[i].rfind("--cpu-adam-rate=", 0) == 0) continue;
    out += (out.empty() ? "" : " ") + words[i];
  }
  return appended.empty() ? out : out + " " + flags_text(appended);
}

}  // namespace tierflow::tiering
