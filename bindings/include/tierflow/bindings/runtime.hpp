// The C++ API a LibTorch trainer embeds: one Runtime owns the tiers, the copy
// engine, the activation offloader and the CPU optimizer of a wrapped model.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/core/stall.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/kernel_arrays.hpp"
#include "tierflow/optimizer/nvme_adam.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/tiering/runtime_stats.hpp"
#include "tierflow/tiering/tiers.hpp"

namespace tierflow::bindings {

/// The format of a CPU Adam moment: its dtype (Note [Optimizer state formats]): float32 (fp32),
/// bfloat16 (bf16) or uint8 (8bit: one buffer of moment_bytes(k8bit, numel) bytes); nullopt for any other.
std::optional<optimizer::StateFormat> moment_format(const at::Tensor& moment) noexcept;

/// The dtype of a moment of format `f`: float32, bfloat16 or uint8.
at::ScalarType moment_dtype(optimizer::StateFormat f) noexcept;

/// The shape of a moment of format `f` for a parameter (or shard) of shape `like`: `like` itself (fp32,
/// bf16), or one dimension of moment_bytes(k8bit, numel) bytes (8bit).
std::vector<std::int64_t> moment_shape(optimizer::StateFormat f, at::IntArrayRef like);

/// `m` and `v` (any floating dtype, `numel` elements each) encoded into format `f`, written into `m_out`
/// and `v_out` (contiguous CPU tensors of that format; fp32 copies).
void encode_moments(optimizer::StateFormat f, const at::Tensor& m, const at::Tensor& v, const at::Tensor& m_out,
                    const at::Tensor& v_out);

/// Moments `m` and `v` of one format (their dtype), `numel` elements each, decoded into fp32 `m_out` and
/// `v_out` (contiguous CPU float32 tensors of `numel` elements).
void decode_moments(const at::Tensor& m, const at::Tensor& v, std::size_t numel, const at::Tensor& m_out,
                    const at::Tensor& v_out);

/// Statistics of the optimizer side (tiering/runtime_stats.hpp: its fields in the runtime's statistics).
using OptimizerStats = tiering::CpuOptimizerStats;

/// One tierflow runtime: the tiers (tiering::Tiers, Note [Tiers from the
/// configuration]) with torch's tensors on top. Construct it from a validated Config.
class Runtime {
 public:
  /// Builds the tiers for `config`; throws config_error for settings this
  /// version cannot serve (naming the variable and what is accepted).
  /// `nvme_faults` (tests only; must outlive the runtime) injects I/O failures
  /// into the NVMe tier, `copy_faults` (tests only) delays into the emulated copy engine.
  /// `ranks`: this process's share of the machine (Note [Ranks on one machine]).
  explicit Runtime(Config config, swap::NvmeFaults* nvme_faults = nullptr,
                   std::shared_ptr<const swap::CopyFaults> copy_faults = nullptr, tiering::RankShare ranks = {});
  ~Runtime();

  /// The configuration in force.
  const Config& config() const noexcept { return config_; }
  /// The GPU tier's backend (CUDA when a GPU is present, else emulated).
  allocator::DeviceKind device_kind() const noexcept { return tiers_.device(); }
  /// True on the adversarial emulated device (Note [Adversarial emulated device]).
  bool adversarial() const noexcept { return adversarial_; }
  /// The pinned host pool (host tier).
  const std::shared_ptr<allocator::PinnedHostPool>& host_pool() const noexcept { return tiers_.host_pool(); }
  /// The copy engine between the GPU tier and the host tier.
  const std::shared_ptr<swap::CopyEngine>& copy_engine() const noexcept { return tiers_.copy_engine(); }
  /// The tiers and their budgets.
  const tiering::Tiers& tiers() const noexcept { return tiers_; }
  /// The saved-activation hooks.
  const std::shared_ptr<ActivationOffloader>& activations() const noexcept { return offloader_; }

  /// A CPU tensor whose memory comes from the pinned host pool (zeroed when `zero`).
  at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, bool zero);

  /// A fresh moment in the pinned host pool for a parameter (or shard) of shape `like`, in format `f`
  /// (moment_shape, moment_dtype), zeroed: all-zero 8-bit codes and scales decode to 0.
  at::Tensor host_moment(at::IntArrayRef like, optimizer::StateFormat f);

  /// Out-of-place outputs for adam_step (all undefined: in place).
  struct AdamOutputs {
    std::vector<at::Tensor> masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  };

  /// One Adam/AdamW step over CPU tensors: fp32 contiguous masters, moments
  /// in the format of their dtype (moment_format: exp_avg and exp_avg_sq of one
  /// format; out-of-place outputs in it too), gradients in fp32/bf16/fp16,
  /// optional copy-outs (undefined tensors skip). Throws logic_error naming
  /// the offending tensor.
  void adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                 const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& params_out, const AdamOutputs& outputs = {});
  /// The same step over host arrays (the step engine's: optimizer::adam_tensors checks them), out of place for
  /// each array whose master_out is defined.
  void adam_step(const optimizer::AdamOptions& options, std::int64_t step,
                 const std::vector<optimizer::KernelArrays>& arrays);

  /// True for a tensor of this runtime's device (CUDA tensors on CUDA; CPU
  /// tensors, the emulated device's, on the emulated device).
  bool on_device(const at::Tensor& t) const;
  /// Copies device tensor `src` into host tensor `dst` (contiguous, same
  /// bytes) through the copy engine, after the work queued on the current
  /// stream (Note [Copy ordering]). Wait on the handle before reading `dst`;
  /// keep both alive until it is ready.
  swap::TransferHandle copy_to_host(const at::Tensor& dst, const at::Tensor& src);
  /// Copies host tensor `src` into device tensor `dst` after the work queued
  /// on the current stream; that stream waits for the copy before its next
  /// kernel. Keep `src` alive until the handle is ready.
  swap::TransferHandle copy_to_device(const at::Tensor& dst, const at::Tensor& src);
  /// Copies host `src` into device `dst` after the work queued on `dst`'s compute stream (its allocation),
  /// without making that stream wait for it: await_on_device does, when the copy is needed (a prefetch).
  swap::TransferHandle fetch_to_device(const at::Tensor& dst, const at::Tensor& src);
  /// Work queued on `device`'s compute stream from now on waits for copy `h`.
  void await_on_device(const swap::TransferHandle& h, const at::Device& device);

  /// The optimizer states on NVMe (TIERFLOW_OFFLOAD_OPTIMIZER=nvme).
  optimizer::NvmeAdamStore& nvme_adam();
  /// Removes the NVMe swap files' names now (process exit); descriptors stay valid.
  void unlink_nvme_files() noexcept {
    if (tiers_.nvme_engine()) tiers_.nvme_engine()->unlink_files();
  }
  /// True when an NVMe engine exists for this runtime.
  bool has_nvme() const noexcept { return tiers_.nvme_engine() != nullptr; }
  /// The NVMe engine (null unless an offload target is nvme).
  const std::shared_ptr<swap::NvmeEngine>& nvme_engine() const noexcept { return tiers_.nvme_engine(); }

  /// Optimizer counters.
  OptimizerStats optimizer_stats() const noexcept { return opt_stats_; }
  /// Threads of the CPU optimizer.
  int cpu_threads() const;
  /// SIMD path of the CPU optimizer (kAuto until the first step picks one).
  optimizer::CpuIsa cpu_isa() const;

 private:
  // The host-to-device copy of copy_to_device and fetch_to_device, after the compute stream's earlier work;
  // `what` names the caller in its errors.
  swap::TransferHandle queue_to_device(const at::Tensor& dst, const at::Tensor& src, const char* what);
  // Both adam_steps' kernel call over checked tensors, timed into opt_stats_.
  void run_adam(const optimizer::AdamOptions& options, std::int64_t step, std::vector<optimizer::AdamTensor> tensors,
                std::uint64_t elements);
  Config config_;
  StallTimeoutClaim stall_claim_;  // the process's one stall limit, held while this runtime lives (Note [Stall timeout])
  tiering::Tiers tiers_;
  bool adversarial_ = false;
  std::shared_ptr<ActivationOffloader> offloader_;
  std::unique_ptr<optimizer::CpuAdam> adam_;
  std::mutex adam_mutex_;  // one step at a time on the arena; guards opt_stats_
  OptimizerStats opt_stats_;
  std::unique_ptr<optimizer::NvmeAdamStore> nvme_adam_;
};

}  // namespace tierflow::bindings
