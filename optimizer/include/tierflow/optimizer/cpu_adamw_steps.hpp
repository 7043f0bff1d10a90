// The torch-free part of the C++ CpuAdamW (Note [C++ CpuAdamW] in bindings/include/tierflow/bindings/
// cpu_adamw.hpp): its settings and their refusals, the GPU share it picks, and the per-parameter records of
// its step(): where each parameter steps (carried by the gradient stream, on the GPU, or by the CPU kernel
// in step()), which ones this step() left to the kernel, the retry marks of a step that failed part way
// (Note [C++ CpuAdamW faults] in partial_step.hpp) and the counters. The adapter in bindings/ reads tensors
// and calls these; it decides nothing of its own.
//
// Note [C++ GPU share]
// ~~~~~~~~~~~~~~~~~~~~
// With CpuAdamWOptions::gpu_fraction > 0 (TIERFLOW_GPU_OPTIMIZER_FRACTION as a
// number) the CUDA parameters that optimizer::GpuShareChoice::assign picks for
// that share of the elements (decided once, at construction, before the
// stream takes the rest) keep fp32 states on the device and step there in
// step(), with tierflow's CUDA AdamW (optimizer/cuda_adam.hpp, torch's fused
// AdamW bit for bit in fp32) on the current stream: the same placement as
// Python's GpuShare with a fixed fraction. `auto` (choosing from a measured
// step and the activation plan's room) is not served from C++ yet: it reads
// as 0. Built and compiled; never run on a GPU (unmeasured).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/optimizer/partial_step.hpp"
#include "tierflow/optimizer/state_placement.hpp"
#include "tierflow/optimizer/step_engine.hpp"
#include "tierflow/optimizer/step_ledger.hpp"

namespace tierflow::optimizer {

/// How a CpuAdamW steps (Note [C++ steps during backward]); from_config reads the TIERFLOW_* table as
/// Python's CPUAdamW does.
struct CpuAdamWOptions {
  bool step_during_backward = true;   ///< TIERFLOW_OVERLAP_STEP (host-tier states only)
  std::size_t grad_bucket_bytes = 0;  ///< TIERFLOW_GRAD_BUCKET_BYTES; 0: auto
  bool offload_gradients = false;     ///< TIERFLOW_OFFLOAD_GRADIENTS: p.grad is None from backward to step()
  double max_grad_norm = 0.0;         ///< TIERFLOW_MAX_GRAD_NORM; 0: no clipping
  bool skip_nonfinite = false;        ///< TIERFLOW_SKIP_NONFINITE
  int accumulation_steps = 1;         ///< TIERFLOW_GRAD_ACCUMULATION_STEPS (backward passes per step())
  bool weights_in_forward = false;    ///< TIERFLOW_WEIGHTS_RETURN=forward: refused from C++ (config_error)
  /// TIERFLOW_GPU_OPTIMIZER_FRACTION as a number from 0 to 1: that share of the CUDA parameters' elements steps
  /// on the GPU (Note [C++ GPU share]); `auto` (the table's default) reads as 0 from C++.
  double gpu_fraction = 0.0;
  /// The settings of `config`.
  static CpuAdamWOptions from_config(const Config& config);
};

/// Statistics of a CpuAdamW.
struct CpuAdamWStats {
  std::uint64_t steps = 0;          ///< step() calls that updated something
  std::uint64_t elements = 0;       ///< parameters updated, summed over steps
  std::uint64_t kernel_ns = 0;      ///< time in the CPU kernel (host states) or the NVMe pipeline
  std::uint64_t skipped_steps = 0;  ///< steps skipped for a non-finite gradient (TIERFLOW_SKIP_NONFINITE)
};

/// Throws config_error, naming the TIERFLOW_* variable, the CpuAdamWOptions field and what is accepted, for
/// settings a C++ CpuAdamW cannot serve: TIERFLOW_WEIGHTS_RETURN=forward, a negative or non-finite
/// max_grad_norm, accumulation_steps below 1, TIERFLOW_OFFLOAD_GRADIENTS=on without steps during backward
/// (offload_gradients_refusal; `offload_optimizer` is TIERFLOW_OFFLOAD_OPTIMIZER). Returns whether parameters
/// step during backward: step_during_backward with states on the host (`states_on_nvme` false).
bool check_stream_options(const CpuAdamWOptions& o, bool states_on_nvme, OffloadTarget offload_optimizer);

/// The gradient stream's settings for steps during backward with `o`.
StreamOptions stream_options(const CpuAdamWOptions& o);

/// Throws config_error naming the first param group with amsgrad (`amsgrad[g]`) unless the moments' format `f`
/// is fp32: amsgrad keeps fp32 moments (set_state_format, TIERFLOW_OPTIMIZER_STATES).
void check_amsgrad_format(const std::vector<bool>& amsgrad, StateFormat f);

/// Note [C++ GPU share]: which of the CUDA parameters (their `numels`, in group order) step on the GPU at
/// TIERFLOW_GPU_OPTIMIZER_FRACTION `fraction` (GpuShareChoice::assign). Throws config_error for a fraction
/// outside [0, 1], and for one above 0 with CUDA parameters in a build without the CUDA AdamW.
std::vector<bool> choose_gpu_share(double fraction, const std::vector<std::size_t>& numels);

/// The per-parameter records of a CpuAdamW and of its step() (see the file comment), keyed by the front
/// end's id of a parameter (its TensorImpl).
class CpuAdamWSteps {
 public:
  using ParamId = const void*;
  /// Where step() takes a parameter.
  enum class Route {
    kSkip,  ///< no gradient, or the stream stepped it this step()
    kGpu,   ///< the GPU share steps it
    kCpu,   ///< the CPU kernel steps it here
  };

  // Where each parameter steps, decided when the optimizer is made.
  /// The gradient stream carries `p` in its slot `stream_slot`.
  void carry(ParamId p, std::size_t stream_slot) { carried_[p] = stream_slot; }
  bool carried(ParamId p) const { return carried_.count(p) != 0; }
  /// The stream slot of a carried `p` (throws std::out_of_range otherwise).
  std::size_t stream_slot(ParamId p) const { return carried_.at(p); }
  /// Every carried parameter's stream slot.
  const std::unordered_map<ParamId, std::size_t>& carried_slots() const noexcept { return carried_; }
  /// `p` steps on the GPU (Note [C++ GPU share]).
  void share_on_gpu(ParamId p) { gpu_.emplace(p, true); }
  bool on_gpu(ParamId p) const { return gpu_.count(p) != 0; }
  std::size_t gpu_share_size() const noexcept { return gpu_.size(); }
  /// True when `p`, laid out as `layout`, is its own fp32 master (Note [CPU AdamW state placement]); a carried
  /// parameter never is: it steps out of place during backward from a master of its own.
  bool own_master(ParamId p, const ParamLayout& layout) const { return !carried(p) && is_own_master(layout); }
  /// Where the kernel writes `p`'s new weight: weight_update(layout), but a carried parameter in host memory
  /// (fp32, contiguous) is written from its own master, not updated in place.
  WeightUpdate weight_update(ParamId p, const ParamLayout& layout) const;
  /// `p`'s index for the retry marks (the next one at its first use; never reused).
  std::size_t index_of(ParamId p);

  // One step().
  /// A step() that steps (not skipped) begins, with TIERFLOW_MAX_GRAD_NORM's coefficient `scale`.
  void begin(double scale);
  /// The clip coefficient of the step() under way (1: none).
  double scale() const noexcept { return scale_; }
  /// The stream confirmed `p` this step() (committed, redone, or nothing to step).
  void stream_confirmed(ParamId p) { by_stream_.emplace(p, true); }
  /// The stream's step() is done: every carried parameter but those of the stream slots `left` (to this path:
  /// a gradient changed, not streamed, stale) is confirmed.
  void stream_finished(const std::vector<std::size_t>& left);
  /// The user wrote carried `p` since tierflow did: its master is re-read this step() (Note [Weight content]).
  void reread(ParamId p) { reread_.emplace(p, true); }
  /// reread() of the carried parameters of stream slots `slots` (the stream's weights_changed).
  void reread_slots(const std::vector<std::size_t>& slots);
  bool rereads(ParamId p) const { return reread_.count(p) != 0; }
  /// Where step() takes `p` (`has_grad`: p.grad is defined).
  Route route(ParamId p, bool has_grad) const;
  /// True when `p` stepped with `grad` in a step() that failed for others: the retry skips it.
  bool stepped_before(ParamId p, const GradIdentity& grad) const;
  /// `p` (of `numel` elements) stepped here with `grad`: marked for a retry, counted, and when carried its
  /// stream slot noted as written here (take_written).
  void stepped(ParamId p, const GradIdentity& grad, std::size_t numel);
  /// `numel` more elements updated (the stream's commits, the GPU share).
  void count_elements(std::size_t numel) noexcept { stats_.elements += numel; }
  /// `p` did not step (its state and weight are as before); `error`: the store's first error of its call.
  void unstepped(UnsteppedParameter p, const std::string& error);
  /// The carried slots stepped here this step() (the stream's note_written), emptied.
  std::vector<std::size_t> take_written();
  /// Ends step(): this step()'s records go and the masters are fresh again; then throws io_error
  /// (unstepped_message) when parameters did not step, else clears the retry marks and, when `stepped`,
  /// counts the step.
  void finish(bool stepped);
  /// A step skipped for a non-finite gradient.
  void skipped() noexcept { stats_.skipped_steps += 1; }

  /// A load(): every carried parameter's master is re-read at the next step() (and the stream is off until then).
  void set_masters_stale() noexcept { masters_stale_ = true; }
  bool masters_stale() const noexcept { return masters_stale_; }

  CpuAdamWStats& stats() noexcept { return stats_; }
  const CpuAdamWStats& stats() const noexcept { return stats_; }

 private:
  std::unordered_map<ParamId, std::size_t> carried_, index_;
  std::unordered_map<ParamId, bool> gpu_, by_stream_, reread_;
  std::vector<std::size_t> written_;
  std::vector<UnsteppedParameter> unstepped_;
  std::string first_error_;
  StepRetryMarks retry_marks_;
  CpuAdamWStats stats_;
  double scale_ = 1.0;
  bool masters_stale_ = false;
};

}  // namespace tierflow::optimizer
