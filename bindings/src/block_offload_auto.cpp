// See Note [C++ auto activations] in block_offload.hpp.
#include "block_offload_auto.hpp"

#include <ATen/DeviceAccelerator.h>

#include <algorithm>
#include <fstream>
#include <limits>

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::bindings {

namespace {
constexpr std::uint64_t kLinkProbeBytes = 4ull << 20;  // a few MiB: the C++ trainer's probe is short
constexpr const char* kInputPlace = "block 0 input";   // a forward's size: its first block's input (Note [Batch growth])

double seconds_now() { return static_cast<double>(now_ns()) / 1e9; }

// The best of three timed calls of `fn` after one untimed.
template <class Fn>
double best_seconds(Fn fn) {
  fn();
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    const double t0 = seconds_now();
    fn();
    best = std::min(best, seconds_now() - t0);
  }
  return std::max(best, 1e-9);
}
}  // namespace

void settle_device(const at::Device& device) {
  if (device.is_cuda()) at::accelerator::synchronizeDevice(device.index());
}

BlockAutoPlan::BlockAutoPlan(std::shared_ptr<Runtime> runtime, std::function<void(const tiering::Plan&)> apply)
    : runtime_(std::move(runtime)),
      apply_(std::move(apply)),
      // A BlockOffload is driven by block calls, so the model has blocks; how many the driver learns from the
      // timed step's records (the count here only says that there are some).
      driver_(tiering::PlanDriverSettings::of(runtime_->config(), 1)) {}

void BlockAutoPlan::before_call(std::size_t block, const at::Tensor& input) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!measures_.starts_forward(block)) return;
    if (!device_) device_ = input.device();
  }
  driver_.before_forward({{kInputPlace, static_cast<std::uint64_t>(input.numel())}}, *this);
}

bool BlockAutoPlan::measuring() const { return !driver_.plan().has_value(); }

void BlockAutoPlan::forward_measured(std::size_t block, std::uint64_t input_bytes, std::uint64_t parameter_bytes,
                                     double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  measures_.forward(block, input_bytes, parameter_bytes, seconds);
}

void BlockAutoPlan::rerun_measured(std::size_t block, std::uint64_t saved_bytes, double backward_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  measures_.rerun(block, saved_bytes, backward_seconds);  // one class saved: C++ has no split
}

void BlockAutoPlan::set_model_parameter_bytes(std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  model_parameter_bytes_ = bytes;
}

std::string BlockAutoPlan::summary() const { return driver_.plan() ? driver_.plan()->summary : std::string(); }

std::vector<std::string> BlockAutoPlan::lines() const {
  return driver_.plan() ? driver_.plan()->lines : std::vector<std::string>{};
}

tiering::SessionBudgetInputs BlockAutoPlan::budget_inputs() {
  tiering::SessionBudgetInputs in;
  const tiering::Tiers& tiers = runtime_->tiers();
  in.device_budget_bytes = tiers.device_budget_bytes();
  in.host_budget_bytes = tiers.host_budget_bytes();
  in.host_in_use_bytes = static_cast<std::uint64_t>(std::max<std::int64_t>(0, runtime_->host_pool()->stats().in_use.current));
  in.nvme_available_bytes = runtime_->has_nvme() ? tiers.nvme_available_bytes() : 0;
  std::lock_guard<std::mutex> lock(mutex_);
  // Every parameter counted on the device, those fetched from the host included: the plan is then conservative
  // about a trainer's offload_parameters.
  in.parameter_bytes = measures_.parameter_bytes(model_parameter_bytes_);
  return in;
}

std::vector<std::size_t> BlockAutoPlan::inexact_splits(const std::vector<tiering::BlockPlan>& blocks) {
  return tiering::split_blocks(blocks);  // C++ has no split action: every split is inexact
}

std::optional<std::uint64_t> BlockAutoPlan::apply(const tiering::DrivenPlan& plan) {
  if (!plan.without_blocks) apply_(plan.plan);
  return std::nullopt;
}

void BlockAutoPlan::start_timing() {
  std::lock_guard<std::mutex> lock(mutex_);
  measures_.start_timing();
}

tiering::TimedStepMeasures BlockAutoPlan::measure_timed_step() {
  const tiering::Links links = measure_links();
  std::lock_guard<std::mutex> lock(mutex_);
  tiering::TimedStepMeasures m = measures_.timed_step();
  m.links = links;
  return m;
}

double BlockAutoPlan::now_seconds() { return seconds_now(); }

void BlockAutoPlan::write_profile(const tiering::AutoProfile& profile) {
  const std::string& path = runtime_->config().profile_path;
  if (path.empty()) return;
  std::ofstream out(path, std::ios::trunc);
  out << tiering::auto_profile_json(profile) << "\n";
  if (!out) throw config_error("TIERFLOW_PROFILE=" + path + ": the profile could not be written");
}

tiering::Links BlockAutoPlan::measure_links() {
  // A pinned copy each way and both at once through the copy engine, best of three (as _links.py).
  tiering::Links links;
  const at::Device device = device_.value_or(at::Device(at::kCPU));
  const std::int64_t n = static_cast<std::int64_t>(kLinkProbeBytes / 4);
  const at::Tensor src = at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device));
  const at::Tensor back = at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(device));
  const at::Tensor host = runtime_->host_empty({n}, at::kFloat, false);
  const at::Tensor host2 = runtime_->host_empty({n}, at::kFloat, true);
  const double bytes = static_cast<double>(kLinkProbeBytes);
  links.d2h = bytes / best_seconds([&] { runtime_->copy_to_host(host, src).wait(); });
  links.h2d = bytes / best_seconds([&] { runtime_->copy_to_device(back, host2).wait(); });
  links.duplex = 2 * bytes / best_seconds([&] {
                   auto a = runtime_->copy_to_host(host, src);
                   auto b = runtime_->copy_to_device(back, host2);
                   a.wait();
                   b.wait();
                 });
  settle_device(device);
  return links;
}

}  // namespace tierflow::bindings
