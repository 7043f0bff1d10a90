// See Note [Adam semantics] in cpu_adam.hpp.
#include "tierflow/optimizer/cpu_adam.hpp"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {
namespace {

// Elements per task: large enough to amortise scheduling, small enough to balance.
constexpr std::size_t kChunkElements = 1 << 16;

struct Scalars {
  float decay;           // 1 - lr*wd (AdamW) or unused
  float wd;              // wd (Adam's L2 term)
  float one_minus_b1;    // lerp weight
  float b2;
  float one_minus_b2;
  float bc2_sqrt;
  float eps;
  float neg_step_size;   // -lr / (1 - b1^t)
};

inline float load(const void* p, ScalarType t, std::size_t i) noexcept {
  switch (t) {
    case ScalarType::kFloat32: return static_cast<const float*>(p)[i];
    case ScalarType::kBFloat16: return bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case ScalarType::kFloat16: return fp16_to_float(static_cast<const std::uint16_t*>(p)[i]);
  }
  return 0.f;
}

// The loop is written so each (grad type, flags) instantiation vectorizes.
template <ScalarType G, bool kDecoupled, bool kMaximize, bool kAmsgrad>
void update_range(const AdamTensor& t, const Scalars& s, bool has_wd, std::size_t begin,
                  std::size_t end) {
  float* __restrict p = t.master;
  float* __restrict m = t.exp_avg;
  float* __restrict v = t.exp_avg_sq;
  float* __restrict vmax = t.max_exp_avg_sq;
  for (std::size_t i = begin; i < end; ++i) {
    float g = load(t.grad, G, i);
    if (kMaximize) g = -g;
    float param = p[i];
    if (has_wd) {
      if (kDecoupled) param = param * s.decay;
      else g = g + s.wd * param;
    }
    // torch's lerp_ with weight < 0.5: m + w*(g - m)
    float mi = m[i] + s.one_minus_b1 * (g - m[i]);
    float vi = v[i] * s.b2;
    vi = vi + (s.one_minus_b2 * g) * g;
    m[i] = mi;
    v[i] = vi;
    float vd = vi;
    if (kAmsgrad) {
      vd = std::max(vmax[i], vi);
      // torch.maximum propagates NaN; std::max(a, NaN) returns a, so keep it explicit.
      if (std::isnan(vi)) vd = vi;
      vmax[i] = vd;
    }
    float denom = std::sqrt(vd) / s.bc2_sqrt + s.eps;
    p[i] = param + (s.neg_step_size * mi) / denom;
  }
}

void write_out(const AdamTensor& t, std::size_t begin, std::size_t end) {
  if (!t.param_out) return;
  const float* src = t.master;
  switch (t.param_type) {
    case ScalarType::kFloat32: {
      auto* dst = static_cast<float*>(t.param_out);
      std::copy(src + begin, src + end, dst + begin);
      break;
    }
    case ScalarType::kBFloat16: {
      auto* dst = static_cast<std::uint16_t*>(t.param_out);
      for (std::size_t i = begin; i < end; ++i) dst[i] = float_to_bf16(src[i]);
      break;
    }
    case ScalarType::kFloat16: {
      auto* dst = static_cast<std::uint16_t*>(t.param_out);
      for (std::size_t i = begin; i < end; ++i) dst[i] = float_to_fp16(src[i]);
      break;
    }
  }
}

template <ScalarType G>
void update_dispatch_flags(const AdamTensor& t, const Scalars& s, const AdamOptions& o,
                           std::size_t b, std::size_t e) {
  const bool wd = o.weight_decay != 0.0;
  const int key = (o.decoupled_weight_decay ? 4 : 0) | (o.maximize ? 2 : 0) | (o.amsgrad ? 1 : 0);
  switch (key) {
    case 0: update_range<G, false, false, false>(t, s, wd, b, e); break;
    case 1: update_range<G, false, false, true>(t, s, wd, b, e); break;
    case 2: update_range<G, false, true, false>(t, s, wd, b, e); break;
    case 3: update_range<G, false, true, true>(t, s, wd, b, e); break;
    case 4: update_range<G, true, false, false>(t, s, wd, b, e); break;
    case 5: update_range<G, true, false, true>(t, s, wd, b, e); break;
    case 6: update_range<G, true, true, false>(t, s, wd, b, e); break;
    case 7: update_range<G, true, true, true>(t, s, wd, b, e); break;
  }
}

void update(const AdamTensor& t, const Scalars& s, const AdamOptions& o, std::size_t b,
            std::size_t e) {
  switch (t.grad_type) {
    case ScalarType::kFloat32: update_dispatch_flags<ScalarType::kFloat32>(t, s, o, b, e); break;
    case ScalarType::kBFloat16: update_dispatch_flags<ScalarType::kBFloat16>(t, s, o, b, e); break;
    case ScalarType::kFloat16: update_dispatch_flags<ScalarType::kFloat16>(t, s, o, b, e); break;
  }
  write_out(t, b, e);
}

struct Chunk {
  std::size_t tensor;
  std::size_t begin;
  std::size_t end;
};

}  // namespace

struct CpuAdam::Impl {
  explicit Impl(int threads)
      : arena(threads > 0 ? threads : tbb::task_arena::automatic) {
    arena.initialize();
  }
  tbb::task_arena arena;
  std::vector<Chunk> chunks;  // reused across steps
};

CpuAdam::CpuAdam(int threads) : impl_(std::make_unique<Impl>(threads)) {
  TIERFLOW_EXPECTS(threads >= 0, "CpuAdam: threads must be >= 0 (0 = all cores), got " +
                                     std::to_string(threads));
}

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
    TIERFLOW_EXPECTS(t.master && t.exp_avg && t.exp_avg_sq && t.grad,
                     "CpuAdam::step: tensor " + std::to_string(i) +
                         " is missing its master, exp_avg, exp_avg_sq or grad buffer");
    TIERFLOW_EXPECTS(!o.amsgrad || t.max_exp_avg_sq,
                     "CpuAdam::step: amsgrad needs max_exp_avg_sq for tensor " + std::to_string(i));
  }
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  Scalars s;
  s.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  s.wd = static_cast<float>(o.weight_decay);
  s.one_minus_b1 = static_cast<float>(1.0 - o.beta1);
  s.b2 = static_cast<float>(o.beta2);
  s.one_minus_b2 = static_cast<float>(1.0 - o.beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(o.eps);
  s.neg_step_size = static_cast<float>(-(o.lr / bc1));

  auto& chunks = impl_->chunks;
  chunks.clear();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    for (std::size_t b = 0; b < tensors[i].numel; b += kChunkElements)
      chunks.push_back({i, b, std::min(tensors[i].numel, b + kChunkElements)});
  }
  impl_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, chunks.size(), 1),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        for (std::size_t c = r.begin(); c != r.end(); ++c) {
                          const Chunk& ch = chunks[c];
                          update(tensors[ch.tensor], s, o, ch.begin, ch.end);
                        }
                      });
  });
}

}  // namespace tierflow::optimizer
