// tierflow's CPU AdamW as a torch::optim::Optimizer, for C++ trainers.
//
// Note [C++ CpuAdamW]
// ~~~~~~~~~~~~~~~~~~~
// CpuAdamW is used like torch::optim::AdamW: the same constructors (a
// parameter list or param groups, torch::optim::AdamWOptions), step(closure),
// zero_grad(), param_groups() (so torch::optim::LRScheduler works) and
// save/load. The update is the oneTBB kernel of Note [Adam semantics], which
// follows torch's Python AdamW operation by operation; LibTorch's C++ AdamW
// rounds differently (mul and add where Python lerps), so the two agree to a
// few ulp per step, not bit for bit.
// Where the state lives and which parameters are their own master is
// Note [CPU AdamW state placement] (optimizer/state_placement.hpp): with
// `nvme` the states are streamed through the pool for each step (Note
// [Optimizer states on NVMe]). A parameter that is not its own master (CUDA,
// 16-bit) has its gradient copied to the host and the updated value copied
// back through the runtime's copy engine (Note [Copy ordering]), and step()
// returns once the parameter holds it.
// save() writes torch::optim::AdamW's archive layout (states read back from
// NVMe first), so either optimizer loads the other's checkpoints. The archive
// carries no fp32 master: after load() a 16-bit parameter's master is its
// current value.
// The moments are kept in the format of Note [Optimizer state formats]:
// the runtime's TIERFLOW_OPTIMIZER_STATES (Config::optimizer_states), or
// set_state_format before the first step; amsgrad is refused with bf16 and
// 8-bit moments. In state_ the moments are tensors of their format
// (Runtime::host_moment); an archive always holds them decoded to fp32
// (torch's layout), and load() encodes them again: decoding then encoding is
// the identity, so a resume is bit for bit.
// A step that fails for some parameters: Note [C++ CpuAdamW faults] in
// optimizer/partial_step.hpp (the retry steps only those).
//
// Note [C++ steps during backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With CpuAdamWOptions::step_during_backward (TIERFLOW_OVERLAP_STEP=on, the
// default, as Python's CPUAdamW) and states on the host, the parameters of
// the runtime's device that GradStream can carry (a leaf that requires grad,
// contiguous, fp32/bf16/fp16) stream their gradients to the CPU and step
// during backward (Note [Gradient streaming], Note [Step ledger]); step()
// confirms them (GradStream's prepare_finish then commit_finish), steps here
// the rest and the slots the stream left (a gradient changed, not streamed,
// a load), and ends the window. This is the adapter the Python CPUAdamW is:
// the same calls in the same order (set_callbacks: each backward's first
// gradient pushes the groups' hyperparameters and turns streaming off while
// the masters are stale; a slot's first stream makes its state; set_state,
// state_of after a commit; note_written after this path wrote a carried
// parameter). A carried parameter keeps an fp32 master of its own (the early
// step is out of place), so it steps from that master here too, and its step
// counter is a float tensor the stream shares, copied into torch's
// AdamWParamState after each step(). TIERFLOW_MAX_GRAD_NORM and
// TIERFLOW_SKIP_NONFINITE take clip_grad_norm_'s norm over every gradient
// (released ones by the norm the stream took before freeing them,
// TIERFLOW_OFFLOAD_GRADIENTS=on), in both modes. TIERFLOW_WEIGHTS_RETURN=forward
// is refused: a C++ module has no forward pre-hook to wait for its weights.
// A step during backward is not atomic across the two paths: the stream
// commits before this path steps what it left (Python's Note [Atomic step]
// prepares both first). Parameters that live on the host between uses
// (BlockOffload::offload_parameters) get their committed weights written into
// their host copies: use_host_copies.
//
// Note [C++ GPU share] (the CUDA parameters that step on the GPU): optimizer/cpu_adamw_steps.hpp.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <unordered_map>
#include <vector>

#include "tierflow/bindings/grad_stream.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/cpu_adamw_steps.hpp"
#include "tierflow/optimizer/partial_step.hpp"

namespace tierflow::bindings {

class Runtime;
class BlockOffload;

/// How a CpuAdamW steps, its counters, and the text of its steps during backward: torch-free, in
/// optimizer/cpu_adamw_steps.hpp and step_engine.hpp.
using CpuAdamWOptions = optimizer::CpuAdamWOptions;
using CpuAdamWStats = optimizer::CpuAdamWStats;
using optimizer::describe_steps_during_backward;

/// torch's AdamW options as the CPU kernel's (decoupled weight decay).
optimizer::AdamOptions adam_options_of(const torch::optim::AdamWOptions& o);

/// AdamW over tierflow's CPU kernel, with states on the host or NVMe tier.
class CpuAdamW : public torch::optim::Optimizer {
 public:
  /// Param groups without options take `defaults`; `options` unset: CpuAdamWOptions::from_config(runtime's).
  /// Throws config_error for TIERFLOW_WEIGHTS_RETURN=forward and for TIERFLOW_OFFLOAD_GRADIENTS=on without
  /// steps during backward.
  CpuAdamW(std::shared_ptr<Runtime> runtime, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
           torch::optim::AdamWOptions defaults = {}, std::optional<CpuAdamWOptions> options = std::nullopt);
  /// One group of `params`.
  CpuAdamW(std::shared_ptr<Runtime> runtime, std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {},
           std::optional<CpuAdamWOptions> options = std::nullopt);
  ~CpuAdamW() override;

  /// One AdamW step of every parameter with a gradient; evaluates `closure` first (with grad mode) if given.
  at::Tensor step(LossClosure closure = nullptr) override;
  /// Writes torch::optim::AdamW's archive layout.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads an archive of CpuAdamW or torch::optim::AdamW.
  void load(torch::serialize::InputArchive& archive) override;

  /// Keeps the moments in format `f` from now on; only before any state exists (throws logic_error after),
  /// and refused (config_error) with a group's amsgrad unless fp32.
  void set_state_format(optimizer::StateFormat f);
  /// The moments' format.
  optimizer::StateFormat state_format() const noexcept { return format_; }

  /// True when the states live on the NVMe tier.
  bool states_on_nvme() const noexcept { return on_nvme_; }
  /// Counters.
  CpuAdamWStats stats() const noexcept { return records_.stats(); }

  /// True when parameters step during backward (Note [C++ steps during backward]).
  bool steps_during_backward() const noexcept { return stream_ != nullptr; }
  /// The gradient stream's counters (early_steps, committed, redone, taken_back, held, buckets...); zeros when off.
  GradStreamStats stream_stats() const;
  /// Parameters stepping on the GPU (Note [C++ GPU share]).
  std::size_t gpu_share_size() const noexcept { return records_.gpu_share_size(); }
  /// The settings in force.
  const CpuAdamWOptions& options() const noexcept { return options_; }
  /// Parameters `offload` keeps on the host between uses: their committed weights go into their host copies
  /// (GradStream::set_home). Call after offload.offload_parameters and before training.
  void use_host_copies(const BlockOffload& offload);
  /// As torch's; also ends the window of steps during backward (takes back early steps no step() confirmed).
  /// (torch::optim::Optimizer::zero_grad is not virtual: through a base reference only the gradients go,
  /// which is enough after a step(), which ends the window itself.)
  void zero_grad(bool set_to_none = true);
  /// Waits for every weight the stream still sends back.
  void synchronize();

 private:
  struct Slot {
    at::Tensor master;        // fp32 host master; undefined when the parameter is its own master
    std::uint64_t nvme_key = 0;
    at::Tensor step_count;    // carried by the stream: the step counter it shares (float, one element)
    bool registered = false;  // carried: the stream has its current state tensors
  };
  using Route = optimizer::CpuAdamWSteps::Route;
  bool own_master(const at::Tensor& p) const;
  Slot& slot_of(const at::Tensor& p) { return slots_[p.unsafeGetTensorImpl()]; }
  // slot_of with its master made: on NVMe, or in the pinned pool unless `p` is its own master.
  Slot& slot(const at::Tensor& p, const torch::optim::AdamWOptions& options);
  // A fresh state of `p` on the host: its moments in format_ (Note [Optimizer state formats]).
  std::unique_ptr<torch::optim::AdamWParamState> new_state(const at::Tensor& p, bool amsgrad) const;
  // false: nothing had a gradient. Parameters that could not step go to records_.unstepped.
  bool step_group(torch::optim::OptimizerParamGroup& group, std::size_t group_index);
  // One step number's parameters of a group: in `by_index`, each one's index in the group.
  struct Batch {
    std::int64_t step = 0;
    std::vector<at::Tensor> params;
    std::size_t group = 0;
    const std::unordered_map<const void*, std::size_t>* by_index = nullptr;
  };
  // The kernel over a batch whose gradients are on the host; false where a parameter did not step.
  std::vector<bool> run_kernel(const Batch& batch, const torch::optim::AdamWOptions& o,
                               const optimizer::AdamOptions& ao, const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& params_out);
  void step_batch(const Batch& batch, const torch::optim::AdamWOptions& o, const optimizer::AdamOptions& ao);
  void adopt_loaded_state();
  // Refuses amsgrad in any group unless the moments are fp32.
  void check_amsgrad() const;
  // Note [C++ steps during backward] (cpu_adamw_stream.cpp).
  void start_streaming();
  bool carried(const at::Tensor& p) const { return records_.carried(p.unsafeGetTensorImpl()); }
  void push_groups();
  void on_backward_begin();
  void init_slot(std::size_t slot);
  void register_states(const void* fresh = nullptr);  // `fresh`: the TensorImpl whose state is made now
  std::pair<double, bool> clip_coefficient() const;  // (coefficient, every gradient finite)
  bool step_streamed(double scale);  // the stream's part of step(); false when nothing was left to step here
  void adopt_stream_states(const std::vector<std::size_t>& slots);
  void reconcile_master(const at::Tensor& p, at::Tensor& master) const;
  // Note [C++ GPU share] (cpu_adamw_stream.cpp).
  void assign_gpu_share();
  bool on_gpu(const at::Tensor& p) const { return records_.on_gpu(p.unsafeGetTensorImpl()); }
  void gpu_step(const std::vector<at::Tensor>& params, const torch::optim::AdamWOptions& o,
                const optimizer::AdamOptions& ao);

  std::shared_ptr<Runtime> runtime_;
  bool on_nvme_ = false;
  optimizer::StateFormat format_ = optimizer::StateFormat::kFp32;
  std::unordered_map<const void*, Slot> slots_;  // by TensorImpl, as state_
  optimizer::CpuAdamWSteps records_;             // where each parameter steps; this step()'s records; counters
  CpuAdamWOptions options_;
  std::shared_ptr<GradStream> stream_;      // null when nothing steps during backward
  std::vector<at::Tensor> stream_params_;   // carried parameters, by stream slot
};

}  // namespace tierflow::bindings
