// See stream_rules.hpp.
#include "tierflow/optimizer/stream_rules.hpp"

#include <cstring>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/step_ledger.hpp"

namespace tierflow::optimizer {

const char* param_not_streamable(const ParamFacts& p) noexcept {
  if (!p.requires_grad) return "it does not require grad";
  if (!p.leaf) return "it is not a leaf tensor";
  if (!p.contiguous) return "it is not contiguous";
  if (!p.type) return "its dtype is not float32, bfloat16 or float16";
  if (!p.on_device) return "it is not on the runtime's device";
  return nullptr;
}

const char* grad_not_streamable(const GradFacts& g) noexcept {
  if (!g.defined) return "it has no gradient";
  if (g.sparse) return "its gradient is sparse";
  if (!g.contiguous) return "its gradient is not contiguous";
  if (g.numel != g.param_numel) return "its gradient's numel differs from the parameter's";
  if (!g.type) return "its gradient's dtype is not float32, bfloat16 or float16";
  if (!g.on_device) return "its gradient is not on the runtime's device";
  return nullptr;
}

std::optional<StateFormat> moments_format(std::size_t numel, const StateArrayFacts& exp_avg,
                                          const StateArrayFacts& exp_avg_sq) {
  // Note [Optimizer state formats]: a moment's format is its dtype; both moments share it.
  const std::optional<StateFormat> format = exp_avg.format;
  for (const StateArrayFacts* t : {&exp_avg, &exp_avg_sq})
    if (!t->defined || !t->host || !t->contiguous || !format || t->format != format ||
        t->bytes != moment_bytes(*format, numel))
      return std::nullopt;
  return format;
}

StateFormat check_stream_state(std::size_t slot, std::size_t numel, const StateArrayFacts& master,
                               const StateArrayFacts& exp_avg, const StateArrayFacts& exp_avg_sq,
                               const StateArrayFacts& max_exp_avg_sq, bool step_counter_ok) {
  const std::string who = "GradStream::set_state: slot " + std::to_string(slot);
  auto host_flat = [](const StateArrayFacts& t) { return t.defined && t.host && t.contiguous; };
  auto fp32_of_size = [&](const StateArrayFacts& t) {
    return host_flat(t) && t.format == StateFormat::kFp32 && t.bytes == 4 * numel;
  };
  TIERFLOW_EXPECTS(fp32_of_size(master), who + " needs a contiguous fp32 CPU master of the parameter's size");
  const std::optional<StateFormat> format = moments_format(numel, exp_avg, exp_avg_sq);
  TIERFLOW_EXPECTS(format, who + " needs contiguous CPU moments of one format (TIERFLOW_OPTIMIZER_STATES): float32 or "
                                 "bfloat16 of the parameter's size, or 8bit's uint8 buffer of moment_bytes");
  TIERFLOW_EXPECTS(!max_exp_avg_sq.defined || fp32_of_size(max_exp_avg_sq),
                   who + " needs a contiguous fp32 CPU max_exp_avg_sq of the parameter's size");
  TIERFLOW_EXPECTS(step_counter_ok, "GradStream::set_state: the step counter must be a one-element CPU tensor");
  return *format;
}

namespace {
bool same_call(const KernelStep& a, const KernelStep& b) noexcept {
  if (a.step != b.step || a.group != b.group) return false;
  if (std::memcmp(&a.options.grad_scale, &b.options.grad_scale, sizeof(double)) != 0) return false;
  AdamOptions x = a.options, y = b.options;
  x.grad_scale = y.grad_scale = 1.0;  // compared as bits above
  return same_options(x, y);
}
}  // namespace

std::vector<std::vector<std::size_t>> group_kernel_calls(const std::vector<KernelStep>& steps) {
  std::vector<std::vector<std::size_t>> calls;
  std::vector<bool> done(steps.size(), false);
  for (std::size_t a = 0; a < steps.size(); ++a) {
    if (done[a] || steps[a].skip) continue;
    calls.emplace_back();
    for (std::size_t k = a; k < steps.size(); ++k) {
      if (done[k] || steps[k].skip || !same_call(steps[k], steps[a])) continue;
      done[k] = true;
      calls.back().push_back(k);
    }
  }
  return calls;
}

}  // namespace tierflow::optimizer
