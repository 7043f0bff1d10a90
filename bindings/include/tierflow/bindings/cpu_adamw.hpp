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
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/partial_step.hpp"

namespace tierflow::bindings {

class Runtime;

/// Statistics of a CpuAdamW.
struct CpuAdamWStats {
  std::uint64_t steps = 0;          ///< step() calls that updated something
  std::uint64_t elements = 0;       ///< parameters updated, summed over steps
  std::uint64_t kernel_ns = 0;      ///< time in the CPU kernel (host states) or the NVMe pipeline
};

/// AdamW over tierflow's CPU kernel, with states on the host or NVMe tier.
class CpuAdamW : public torch::optim::Optimizer {
 public:
  /// Param groups without options take `defaults`.
  CpuAdamW(std::shared_ptr<Runtime> runtime, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
           torch::optim::AdamWOptions defaults = {});
  /// One group of `params`.
  CpuAdamW(std::shared_ptr<Runtime> runtime, std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {});
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
  CpuAdamWStats stats() const noexcept { return stats_; }

 private:
  struct Slot {
    at::Tensor master;        // fp32 host master; undefined when the parameter is its own master
    std::uint64_t nvme_key = 0;
    std::size_t index = 0;    // its slot in retry_marks_
  };
  using Failure = optimizer::UnsteppedParameter;
  bool own_master(const at::Tensor& p) const;
  // The slot of `p`, made (with the next index) on first use.
  Slot& slot_of(const at::Tensor& p);
  Slot& slot(const at::Tensor& p, const torch::optim::AdamWOptions& options);
  // false: nothing had a gradient. Parameters that could not step go to `failed`.
  bool step_group(torch::optim::OptimizerParamGroup& group, std::size_t group_index, std::vector<Failure>& failed,
                  std::string& first_error);
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
                               const std::vector<at::Tensor>& params_out, std::vector<Failure>& failed,
                               std::string& first_error);
  void step_batch(const Batch& batch, const torch::optim::AdamWOptions& o, const optimizer::AdamOptions& ao,
                  std::vector<Failure>& failed, std::string& first_error);
  void adopt_loaded_state();
  // Refuses amsgrad in any group unless the moments are fp32.
  void check_amsgrad() const;

  std::shared_ptr<Runtime> runtime_;
  bool on_nvme_ = false;
  optimizer::StateFormat format_ = optimizer::StateFormat::kFp32;
  std::unordered_map<const void*, Slot> slots_;  // by TensorImpl, as state_
  optimizer::StepRetryMarks retry_marks_;        // by Slot::index (Note [C++ CpuAdamW faults])
  CpuAdamWStats stats_;
};

}  // namespace tierflow::bindings
