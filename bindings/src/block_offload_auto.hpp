// TIERFLOW_OFFLOAD_ACTIVATIONS=auto for a C++ trainer's BlockOffload: the
// front end of tiering::PlanDriver (Note [C++ auto activations] in
// block_offload.hpp). Private to block_offload.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/tiering/block_measures.hpp"
#include "tierflow/tiering/plan_driver.hpp"

namespace tierflow::bindings {

class Runtime;

/// What the blocks' calls measure while no plan is in force, and the driver they feed.
class BlockAutoPlan final : public tiering::PlanFrontEnd {
 public:
  /// `apply` puts a plan's blocks in force (BlockOffload's action table); called inside before_call.
  BlockAutoPlan(std::shared_ptr<Runtime> runtime, std::function<void(const tiering::Plan&)> apply);

  /// A block call with a graph: when it starts a forward pass, the driver counts it and acts (records, times,
  /// plans, grows, re-plans) before the block's action is read. The trainer's thread.
  void before_call(std::size_t block, const at::Tensor& input);
  /// No plan in force yet: the blocks' forwards and reruns are measured.
  bool measuring() const;
  /// Block `block`'s forward (autograd off) took `seconds` on `input_bytes` with `parameter_bytes`.
  void forward_measured(std::size_t block, std::uint64_t input_bytes, std::uint64_t parameter_bytes, double seconds);
  /// Its rerun in backward (a kept forward) left `saved_bytes` for its backward, which took `backward_seconds`.
  void rerun_measured(std::size_t block, std::uint64_t saved_bytes, double backward_seconds);
  /// The whole model's parameter bytes (BlockOffload::set_model_parameters); 0: the blocks' own.
  void set_model_parameter_bytes(std::uint64_t bytes);
  /// The plan in force's summary and its per-block lines ("" and none before the plan).
  std::string summary() const;
  std::vector<std::string> lines() const;
  /// The driver (its phases, plan, timed step).
  const tiering::PlanDriver& driver() const { return driver_; }

  // tiering::PlanFrontEnd
  tiering::SessionBudgetInputs budget_inputs() override;
  std::vector<std::size_t> inexact_splits(const std::vector<tiering::BlockPlan>& blocks) override;
  std::optional<std::uint64_t> apply(const tiering::DrivenPlan& plan) override;
  void start_timing() override;
  tiering::TimedStepMeasures measure_timed_step() override;
  std::uint64_t first_step_saved_bytes() override { return 0; }
  void write_profile(const tiering::AutoProfile& profile) override;
  double now_seconds() override;

 private:
  tiering::Links measure_links();

  std::shared_ptr<Runtime> runtime_;
  std::function<void(const tiering::Plan&)> apply_;
  tiering::PlanDriver driver_;
  mutable std::mutex mutex_;  // the blocks' measures (a rerun runs on autograd's thread)
  tiering::BlockMeasures measures_;  // the blocks' records and the timed step's sums
  std::optional<at::Device> device_;
  std::uint64_t model_parameter_bytes_ = 0;
};

}  // namespace tierflow::bindings

namespace tierflow::bindings {
/// Waits for `device`'s queued work (CUDA; nothing on the emulated device, whose kernels run in the call): a
/// measured block's time is its kernels'.
void settle_device(const at::Device& device);
}  // namespace tierflow::bindings
