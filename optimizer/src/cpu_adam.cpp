// See Note [Adam semantics] in cpu_adam.hpp.
#include "tierflow/optimizer/cpu_adam.hpp"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <unordered_map>

#include "adam_kernel.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {
namespace {

using detail::kChunkElements;

struct Chunk {
  std::size_t tensor;
  std::size_t begin;
  std::size_t end;
};

using RangeFn = void (*)(const AdamTensor&, const detail::AdamScalars&, std::size_t, std::size_t);

bool supports(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kPortable:
    case CpuIsa::kAuto:
      return true;
  }
  return false;
}

RangeFn kernel_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return detail::adam_range_avx512;
    case CpuIsa::kAvx2: return detail::adam_range_avx2;
    default: return detail::adam_range_portable;
  }
}

RangeFn packed_kernel_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return detail::adam_range_avx512_packed;
    case CpuIsa::kAvx2: return detail::adam_range_avx2_packed;
    default: return detail::adam_range_portable_packed;
  }
}

// Throws naming tensor `i` unless its packed moments (Note [Optimizer state formats]) are complete.
void check_packed(const AdamTensor& t, const AdamOptions& o, std::size_t i) {
  const std::string who = "CpuAdam::step: tensor " + std::to_string(i) + " (" + to_string(t.state_format) + " moments)";
  TIERFLOW_EXPECTS(!o.amsgrad, "tierflow CPU Adam: amsgrad keeps fp32 moments; optimizer_states=" +
                                   std::string(to_string(t.state_format)) + " is refused with it (accepted: fp32)");
  const bool q8 = t.state_format == StateFormat::k8bit;
  TIERFLOW_EXPECTS(t.m.data && t.v.data && (!q8 || (t.m.absmax && t.v.absmax)),
                   who + " is missing its moments" + (q8 ? " or their block scales" : ""));
  TIERFLOW_EXPECTS(!t.exp_avg && !t.exp_avg_sq && !t.exp_avg_out && !t.exp_avg_sq_out,
                   who + " also sets fp32 moments");
  const bool out = t.m_out.data && t.v_out.data && (!q8 || (t.m_out.absmax && t.v_out.absmax));
  const bool some = t.m_out.data || t.v_out.data || t.m_out.absmax || t.v_out.absmax;
  TIERFLOW_EXPECTS((t.master_out != nullptr) == out && (out || !some),
                   who + " sets some out-of-place outputs but not all");
}

}  // namespace

std::optional<std::string> adam_options_problem(const AdamOptions& options) {
  std::ostringstream why;  // doubles printed as torch's TORCH_CHECK prints them
  if (!(options.lr >= 0)) {
    why << "Invalid learning rate: " << options.lr;
  } else if (!(options.eps >= 0)) {
    why << "Invalid epsilon value: " << options.eps;
  } else if (!(0 <= options.beta1 && options.beta1 < 1.0)) {
    why << "Invalid beta parameter at index 0";
  } else if (!(0 <= options.beta2 && options.beta2 < 1.0)) {
    why << "Invalid beta parameter at index 1";
  } else if (!(options.weight_decay >= 0)) {
    why << "Invalid weight_decay value: " << options.weight_decay;
  } else {
    return std::nullopt;
  }
  return why.str();
}

std::vector<StepGroup> group_by_step(const std::vector<std::int64_t>& steps) {
  std::vector<StepGroup> groups;
  std::unordered_map<std::int64_t, std::size_t> at;  // step number -> its group
  for (std::size_t i = 0; i < steps.size(); ++i) {
    auto [it, fresh] = at.try_emplace(steps[i], groups.size());
    if (fresh) groups.push_back(StepGroup{steps[i], {}});
    groups[it->second].members.push_back(i);
  }
  return groups;
}

void check_kernel_tensor(const KernelTensorFacts& t, std::string_view what, std::size_t index, std::size_t numel) {
  const std::string who = "tierflow CPU Adam: " + std::string(what) + " " + std::to_string(index);
  TIERFLOW_EXPECTS(t.defined && t.cpu && t.contiguous, who + " must be a contiguous CPU tensor");
  TIERFLOW_EXPECTS(t.numel == numel,
                   who + " has " + std::to_string(t.numel) + " elements, expected " + std::to_string(numel));
}

void check_kernel_states_fp32(bool all_float32, std::size_t index) {
  TIERFLOW_EXPECTS(all_float32,
                   "tierflow CPU Adam: master and moments must be float32 (tensor " + std::to_string(index) + ")");
}

void check_kernel_lists(std::size_t n, const std::vector<std::size_t>& sizes,
                        const std::vector<std::size_t>& optional_sizes) {
  const bool same = std::all_of(sizes.begin(), sizes.end(), [n](std::size_t k) { return k == n; }) &&
                    std::all_of(optional_sizes.begin(), optional_sizes.end(),
                                [n](std::size_t k) { return k == 0 || k == n; });
  TIERFLOW_EXPECTS(same, "tierflow CPU Adam: the tensor lists differ in length");
}

const char* to_string(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::kAuto: return "auto";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kPortable: return "portable";
  }
  return "?";
}

CpuIsa best_cpu_isa() noexcept {
  if (supports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (supports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kPortable;
}

struct CpuAdam::Impl {
  Impl(int threads, CpuIsa isa_)
      : arena(threads > 0 ? threads : tbb::task_arena::automatic),
        isa(isa_),
        kernel(kernel_for(isa_)),
        packed(packed_kernel_for(isa_)) {
    arena.initialize();
  }
  tbb::task_arena arena;
  CpuIsa isa;
  RangeFn kernel;
  RangeFn packed;  // bf16 and 8-bit moments
  std::vector<Chunk> chunks;  // reused across steps: no allocation once warm
};

CpuAdam::CpuAdam(int threads, CpuIsa isa) {
  TIERFLOW_EXPECTS(threads >= 0, "CpuAdam: threads must be >= 0 (0 = all cores), got " +
                                     std::to_string(threads));
  if (isa == CpuIsa::kAuto) isa = best_cpu_isa();
  TIERFLOW_EXPECTS(supports(isa), std::string("CpuAdam: this CPU cannot run the ") + to_string(isa) +
                                      " path; best available: " + to_string(best_cpu_isa()));
  impl_ = std::make_unique<Impl>(threads, isa);
}

CpuIsa CpuAdam::isa() const noexcept { return impl_->isa; }

CpuAdam::~CpuAdam() = default;

int CpuAdam::threads() const noexcept { return impl_->arena.max_concurrency(); }

void CpuAdam::step(const AdamOptions& o, std::int64_t step, const std::vector<AdamTensor>& tensors) {
  TIERFLOW_EXPECTS(step >= 1, "CpuAdam::step: step must be >= 1, got " + std::to_string(step));
  TIERFLOW_EXPECTS(o.lr >= 0.0, "CpuAdam: lr must be >= 0, got " + std::to_string(o.lr));
  TIERFLOW_EXPECTS(o.beta1 >= 0.0 && o.beta1 < 1.0 && o.beta2 >= 0.0 && o.beta2 < 1.0,
                   "CpuAdam: betas must be in [0, 1)");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const AdamTensor& t = tensors[i];
    if (t.numel == 0) continue;
    if (t.state_format != StateFormat::kFp32) {
      TIERFLOW_EXPECTS(t.master && t.grad, "CpuAdam::step: tensor " + std::to_string(i) +
                                               " is missing its master or grad buffer");
      check_packed(t, o, i);
      continue;
    }
    TIERFLOW_EXPECTS(t.master && t.exp_avg && t.exp_avg_sq && t.grad,
                     "CpuAdam::step: tensor " + std::to_string(i) +
                         " is missing its master, exp_avg, exp_avg_sq or grad buffer");
    TIERFLOW_EXPECTS(!o.amsgrad || t.max_exp_avg_sq,
                     "CpuAdam::step: amsgrad needs max_exp_avg_sq for tensor " + std::to_string(i));
    const bool some_out = t.master_out || t.exp_avg_out || t.exp_avg_sq_out || t.max_exp_avg_sq_out;
    const bool all_out = t.master_out && t.exp_avg_out && t.exp_avg_sq_out &&
                         (!o.amsgrad || t.max_exp_avg_sq_out);
    TIERFLOW_EXPECTS(!some_out || all_out, "CpuAdam::step: tensor " + std::to_string(i) +
                                               " sets some out-of-place outputs but not all");
  }
  const detail::AdamScalars s = detail::make_scalars(o, step);

  auto& chunks = impl_->chunks;
  const RangeFn kernel = impl_->kernel, packed = impl_->packed;
  chunks.clear();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    for (std::size_t b = 0; b < tensors[i].numel; b += kChunkElements)
      chunks.push_back({i, b, std::min(tensors[i].numel, b + kChunkElements)});
  }
  // Work stealing, not a static split: during backward the kernel shares the
  // cores with the training thread and the CUDA driver, and a static split
  // makes every bucket wait for its slowest (descheduled) thread.
  impl_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, chunks.size(), 1),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        for (std::size_t c = r.begin(); c != r.end(); ++c) {
                          const Chunk& ch = chunks[c];
                          const AdamTensor& t = tensors[ch.tensor];
                          (t.state_format == StateFormat::kFp32 ? kernel : packed)(t, s, ch.begin, ch.end);
                        }
                      },
                      tbb::auto_partitioner());
  });
}

}  // namespace tierflow::optimizer
