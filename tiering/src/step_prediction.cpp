// The whole step predicted term by term; see Note [Step prediction].
#include "tierflow/tiering/step_prediction.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {
namespace {

// A link no copy waits on: the model's phases become their compute.
constexpr double kUnlimitedBytesPerSecond = 1e300;

template <typename... Args>
std::string format(const char* fmt, Args... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

double moment_bytes(StateFormat states) noexcept {
  switch (states) {
    case StateFormat::kFp32: return 4;
    case StateFormat::kBf16: return 2;
    case StateFormat::k8bit: return 1 + 4.0 / static_cast<double>(kQuantBlock);  // a float scale a block
  }
  return 4;
}

double step_of(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
               const Plan& plan) {
  return evaluate_plan(blocks, links, budgets, plan.blocks, plan.rest_params, plan.outside_tier)
      .predicted_step_seconds;
}

std::atomic<CpuAdamRateSource> rate_source{nullptr};

}  // namespace

double cpu_adam_step_bytes_per_param(StateFormat states, int dtype_bytes) noexcept {
  constexpr double kMaster = 4;
  return 2 * kMaster + 2 * 2 * moment_bytes(states) + 2.0 * dtype_bytes;
}

double cpu_adam_rate_in(double params_per_second, StateFormat known_in, StateFormat wanted, int dtype_bytes) noexcept {
  return params_per_second * cpu_adam_step_bytes_per_param(known_in, dtype_bytes) /
         cpu_adam_step_bytes_per_param(wanted, dtype_bytes);
}

OptimizerStepTimes optimizer_step_times(const OptimizerStepInputs& o, double backward_seconds) {
  OptimizerStepTimes t;
  if (!o.on_cpu || o.parameters == 0) return t;
  const auto rate_ok = [](double r) { return r >= 0 && std::isfinite(r); };
  if (!rate_ok(o.params_per_second)) {
    throw config_error(format("the CPU AdamW's rate %g parameters a second; accepted: a positive number "
                              "(--cpu-adam-rate), or 0 to measure it on this machine",
                              o.params_per_second));
  }
  if (o.nvme_state_bytes && (!rate_ok(o.nvme_read) || !rate_ok(o.nvme_write))) {
    throw config_error(format("NVMe rates %g read, %g write bytes a second; accepted: positive numbers "
                              "(--nvme-gbps)", o.nvme_read, o.nvme_write));
  }
  // A rate of 0 is unknown: that part is not predicted (step_prediction_lines says so).
  if (o.params_per_second > 0) t.kernel_seconds = static_cast<double>(o.parameters) / o.params_per_second;
  if (o.nvme_state_bytes && o.nvme_read > 0 && o.nvme_write > 0) {
    t.nvme_read_seconds = static_cast<double>(o.nvme_state_bytes) / o.nvme_read;
    t.nvme_write_seconds = static_cast<double>(o.nvme_state_bytes) / o.nvme_write;
  }
  t.busy_seconds = std::max(t.kernel_seconds, t.nvme_read_seconds + t.nvme_write_seconds);
  t.exposed_seconds = o.steps_during_backward ? std::max(0.0, t.busy_seconds - backward_seconds) : t.busy_seconds;
  return t;
}

StepPrediction predict_step(const Plan& plan, const std::vector<BlockProfile>& blocks, const Links& links,
                            const Budgets& budgets, const OptimizerStepInputs& optimizer, double rest_seconds) {
  TIERFLOW_EXPECTS(plan.blocks.size() == blocks.size(), "predict_step: a plan of " +
                                                            std::to_string(plan.blocks.size()) + " blocks for " +
                                                            std::to_string(blocks.size()));
  StepPrediction p;
  // Compute: every link unlimited, no slowdown beside copies.
  Links unlimited = links;
  unlimited.d2h = unlimited.h2d = kUnlimitedBytesPerSecond;
  unlimited.duplex = 0;
  if (links.nvme_read > 0) unlimited.nvme_read = kUnlimitedBytesPerSecond;
  if (links.nvme_write > 0) unlimited.nvme_write = kUnlimitedBytesPerSecond;
  unlimited.compute_share_during_copies = unlimited.copy_share_during_cpu_step = 1;
  p.compute_seconds = step_of(blocks, unlimited, budgets, plan);
  // The activations' copies alone: no parameter fetched, no optimizer traffic.
  std::vector<BlockProfile> staged = blocks;
  for (auto& b : staged) b.upload_bytes = b.download_bytes = b.parameter_bytes = 0;
  Budgets no_params = budgets;
  no_params.rest_parameter_bytes = 0;
  const double activations = step_of(staged, links, no_params, plan);
  // Then the parameters (and the optimizer's weights coming back).
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    staged[i].upload_bytes = blocks[i].upload_bytes;
    staged[i].parameter_bytes = blocks[i].parameter_bytes;
  }
  const double with_params = step_of(staged, links, budgets, plan);
  // Then the gradients: the plan itself.
  const Plan whole = evaluate_plan(blocks, links, budgets, plan.blocks, plan.rest_params, plan.outside_tier);
  p.blocks_seconds = whole.predicted_step_seconds;
  p.activation_copy_seconds = activations - p.compute_seconds;
  p.parameter_fetch_seconds = with_params - activations;
  p.gradient_copy_seconds = p.blocks_seconds - with_params;
  for (const auto& b : whole.blocks) p.backward_seconds += b.backward_seconds;
  p.optimizer = optimizer_step_times(optimizer, p.backward_seconds);
  p.rest_seconds = rest_seconds;
  p.total_seconds = p.blocks_seconds + p.optimizer.exposed_seconds + p.rest_seconds;
  return p;
}

std::vector<std::pair<std::string, double>> step_terms(const StepPrediction& p) {
  return {{"compute", p.compute_seconds},
          {"activation_copies", p.activation_copy_seconds},
          {"parameter_fetches", p.parameter_fetch_seconds},
          {"gradient_copies", p.gradient_copy_seconds},
          {"optimizer", p.optimizer.exposed_seconds},
          {"rest", p.rest_seconds},
          {"total", p.total_seconds}};
}

std::vector<std::string> step_prediction_lines(const StepPrediction& p, const OptimizerStepInputs& o) {
  std::vector<std::string> lines;
  lines.push_back(format("  compute (blocks' forward, backward and replays): %.4f s", p.compute_seconds));
  lines.push_back(format("  activation copies exposed: %.4f s", p.activation_copy_seconds));
  lines.push_back(format("  parameter fetches exposed: %.4f s", p.parameter_fetch_seconds));
  lines.push_back(format("  gradient copies (device->host) exposed: %.4f s", p.gradient_copy_seconds));
  if (!o.on_cpu) {
    lines.push_back("  optimizer: on the device (not predicted)");
  } else {
    const auto& t = p.optimizer;
    if (o.params_per_second <= 0) {
      lines.push_back("  CPU optimizer: not predicted (its rate is unknown here: pass --cpu-adam-rate RATE)");
      lines.push_back(format("  whole step: %.4f s and the CPU optimizer's", p.total_seconds));
      return lines;
    }
    std::string s = format("  CPU optimizer exposed: %.4f s (AdamW over %.3g parameters at %.3g a second, states %s: "
                           "%.4f s",
                           t.exposed_seconds, static_cast<double>(o.parameters), o.params_per_second,
                           to_string(o.states), t.kernel_seconds);
    if (o.nvme_state_bytes && t.nvme_read_seconds == 0) {
      s += "; NVMe states' reads and writes not predicted (no --nvme-gbps)";
    } else if (o.nvme_state_bytes) {
      s += format("; NVMe states read %.4f s + written %.4f s", t.nvme_read_seconds, t.nvme_write_seconds);
    }
    s += o.steps_during_backward ? format("; overlaps backward's %.4f s, only the excess counts)", p.backward_seconds)
                                 : std::string("; after backward, not overlapped)");
    lines.push_back(s);
  }
  if (p.rest_seconds != 0) lines.push_back(format("  rest of the step (measured): %.4f s", p.rest_seconds));
  lines.push_back(format("  whole step: %.4f s", p.total_seconds));
  return lines;
}

namespace {
std::mutex rate_mutex;
std::array<double, 3> measured_rates{0, 0, 0};  // per StateFormat, 0: not measured yet
}  // namespace

void set_cpu_adam_rate_source(CpuAdamRateSource source) noexcept {
  rate_source.store(source);
  const std::lock_guard<std::mutex> lock(rate_mutex);
  measured_rates = {0, 0, 0};
}

double cpu_adam_rate(double given, StateFormat states, int dtype_bytes) {
  if (given > 0) return cpu_adam_rate_in(given, StateFormat::kFp32, states, dtype_bytes);
  const auto source = rate_source.load();
  if (source == nullptr) return 0;
  const std::lock_guard<std::mutex> lock(rate_mutex);
  double& rate = measured_rates[static_cast<std::size_t>(states)];
  if (rate == 0) rate = source(states);
  return rate;
}

}  // namespace tierflow::tiering
