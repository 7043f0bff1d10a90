#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"

#include "sanitizers.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;

namespace {

// Straightforward double-precision Adam/AdamW, written from the paper's
// equations and torch's documentation, independent of the kernel.
struct Reference {
  std::vector<double> p, m, v, vmax;
  void step(const AdamOptions& o, int t, const std::vector<float>& grad) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = o.maximize ? -grad[i] : grad[i];
      if (o.weight_decay != 0) {
        if (o.decoupled_weight_decay) p[i] *= 1 - o.lr * o.weight_decay;
        else g += o.weight_decay * p[i];
      }
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      double vv = v[i];
      if (o.amsgrad) vv = vmax[i] = std::max(vmax[i], v[i]);
      double mhat_scale = o.lr / (1 - std::pow(o.beta1, t));
      double denom = std::sqrt(vv) / std::sqrt(1 - std::pow(o.beta2, t)) + o.eps;
      p[i] -= mhat_scale * m[i] / denom;
    }
  }
};

struct Fixture {
  explicit Fixture(std::size_t n, unsigned seed = 1) : master(n), m(n), v(n), vmax(n), grad(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    for (auto& x : master) x = d(rng);
    ref.p.assign(master.begin(), master.end());
    ref.m.assign(n, 0);
    ref.v.assign(n, 0);
    ref.vmax.assign(n, 0);
  }
  AdamTensor tensor() {
    AdamTensor t;
    t.master = master.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.max_exp_avg_sq = vmax.data();
    t.grad = grad.data();
    t.numel = master.size();
    return t;
  }
  std::vector<float> master, m, v, vmax, grad;
  Reference ref;
};

void run_against_reference(AdamOptions o, std::size_t n, int steps, int threads) {
  Fixture f(n);
  CpuAdam adam(threads);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 1.f);
  for (int t = 1; t <= steps; ++t) {
    for (auto& g : f.grad) g = d(rng);
    adam.step(o, t, {f.tensor()});
    f.ref.step(o, t, f.grad);
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(f.master[i], f.ref.p[i], 1e-5 * std::max(1.0, std::abs(f.ref.p[i]))) << "element " << i;
    ASSERT_NEAR(f.m[i], f.ref.m[i], 1e-5 * std::max(1.0, std::abs(f.ref.m[i])));
  }
}

// The first element where `a` and `b` differ bit for bit, or b.size() when
// none does. One memcmp per array, not an assertion per element: the
// streaming-store test compares millions of elements, under TSan too.
std::size_t first_difference(const float* a, const std::vector<float>& b) {
  if (std::memcmp(a, b.data(), b.size() * sizeof(float)) == 0) return b.size();
  std::size_t i = 0;
  while (std::memcmp(a + i, b.data() + i, sizeof(float)) == 0) ++i;
  return i;
}

}  // namespace

TEST(CpuAdam, AdamWMatchesReference) {
  AdamOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  run_against_reference(o, 100003, 20, 2);
}

TEST(CpuAdam, AdamL2AmsgradMaximizeMatchReference) {
  AdamOptions o;
  o.lr = 3e-3;
  o.weight_decay = 0.05;
  o.decoupled_weight_decay = false;
  o.amsgrad = true;
  run_against_reference(o, 1001, 15, 1);
  o.amsgrad = false;
  o.maximize = true;
  run_against_reference(o, 17, 15, 2);
}

TEST(CpuAdam, ResultsDoNotDependOnThreadCount) {
  Fixture a(300000), b(300000);
  a.grad = b.grad = std::vector<float>(300000, 0.25f);
  for (std::size_t i = 0; i < a.grad.size(); ++i) a.grad[i] = b.grad[i] = std::sin(float(i));
  CpuAdam one(1), two(2);
  AdamOptions o;
  o.weight_decay = 0.01;
  for (int t = 1; t <= 3; ++t) {
    one.step(o, t, {a.tensor()});
    two.step(o, t, {b.tensor()});
  }
  EXPECT_EQ(a.master, b.master);
  EXPECT_EQ(a.v, b.v);
}

TEST(CpuAdam, Bf16GradientsAndCopyOut) {
  const std::size_t n = 4099;
  Fixture f(n);
  std::vector<std::uint16_t> grad16(n), out16(n);
  std::vector<float> grad32(n);
  for (std::size_t i = 0; i < n; ++i) {
    grad16[i] = float_to_bf16(std::cos(float(i)) * 3.f);
    grad32[i] = bf16_to_float(grad16[i]);
  }
  AdamTensor t = f.tensor();
  t.grad = grad16.data();
  t.grad_type = ScalarType::kBFloat16;
  t.param_out = out16.data();
  t.param_type = ScalarType::kBFloat16;
  CpuAdam adam(2);
  AdamOptions o;
  adam.step(o, 1, {t});
  // Same step with the exactly-representable fp32 gradient gives the same master.
  Fixture g(n);
  AdamTensor u = g.tensor();
  u.grad = grad32.data();
  adam.step(o, 1, {u});
  EXPECT_EQ(f.master, g.master);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out16[i], float_to_bf16(f.master[i]));
}

TEST(CpuAdam, Fp16CopyOut) {
  Fixture f(100);
  std::vector<std::uint16_t> out(100);
  AdamTensor t = f.tensor();
  t.param_out = out.data();
  t.param_type = ScalarType::kFloat16;
  CpuAdam(1).step(AdamOptions{}, 1, {t});
  for (std::size_t i = 0; i < 100; ++i) {
    float back = fp16_to_float(out[i]);
    ASSERT_NEAR(back, f.master[i], std::abs(f.master[i]) * 1e-3 + 1e-7);
  }
}

TEST(CpuAdam, EmptyTensorsAndBadInput) {
  CpuAdam adam(1);
  AdamTensor empty;  // numel 0, no buffers: allowed and untouched
  EXPECT_NO_THROW(adam.step(AdamOptions{}, 1, {empty}));
  Fixture f(4);
  AdamTensor t = f.tensor();
  t.exp_avg = nullptr;
  EXPECT_THROW(adam.step(AdamOptions{}, 1, {t}), logic_error);
  EXPECT_THROW(adam.step(AdamOptions{}, 0, {f.tensor()}), logic_error);
  AdamOptions bad;
  bad.beta1 = 1.0;
  EXPECT_THROW(adam.step(bad, 1, {f.tensor()}), logic_error);
  AdamOptions ams;
  ams.amsgrad = true;
  AdamTensor no_max = f.tensor();
  no_max.max_exp_avg_sq = nullptr;
  EXPECT_THROW(adam.step(ams, 1, {no_max}), logic_error);
}

TEST(ScalarType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(ScalarType, Fp16RoundTripsEveryHalf) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    std::uint16_t bits = static_cast<std::uint16_t>(h);
    float f = fp16_to_float(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f))));
      continue;
    }
    ASSERT_EQ(float_to_fp16(f), bits) << std::hex << h;
  }
  EXPECT_EQ(float_to_fp16(65520.f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(float_to_fp16(65504.f), 0x7bff);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(float_to_fp16(std::ldexp(1.5f, -25)), 0x0001);
}

namespace {

// Runs `steps` steps of one configuration on one ISA and returns all outputs.
struct Outputs {
  std::vector<float> master, m, v, vmax;
  std::vector<std::uint16_t> out16;
  std::vector<float> out32;
};

Outputs run_isa(CpuIsa isa, AdamOptions o, ScalarType grad_type, ScalarType out_type, std::size_t n,
                int threads) {
  Fixture f(n, 11);
  std::vector<float> g32(n);
  std::vector<std::uint16_t> g16(n);
  Outputs out;
  out.out16.resize(n);
  out.out32.resize(n);
  CpuAdam adam(threads, isa);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.f, 2.f);
  for (int step = 1; step <= 4; ++step) {
    AdamTensor t = f.tensor();
    for (std::size_t i = 0; i < n; ++i) {
      float g = d(rng);
      g32[i] = g;
      g16[i] = grad_type == ScalarType::kBFloat16 ? float_to_bf16(g) : float_to_fp16(g);
    }
    t.grad_type = grad_type;
    t.grad = grad_type == ScalarType::kFloat32 ? static_cast<const void*>(g32.data()) : g16.data();
    t.param_type = out_type;
    t.param_out = out_type == ScalarType::kFloat32 ? static_cast<void*>(out.out32.data()) : out.out16.data();
    adam.step(o, step, {t});
  }
  out.master = f.master;
  out.m = f.m;
  out.v = f.v;
  out.vmax = f.vmax;
  return out;
}

}  // namespace

TEST(CpuAdam, EverySimdPathIsBitIdenticalToThePortableOne) {
  std::vector<CpuIsa> isas{CpuIsa::kPortable};
  if (best_cpu_isa() == CpuIsa::kAvx512) isas = {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512};
  else if (best_cpu_isa() == CpuIsa::kAvx2) isas = {CpuIsa::kPortable, CpuIsa::kAvx2};
  if (isas.size() == 1) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512: only the portable path exists";
  for (ScalarType g : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    for (ScalarType out : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
      for (int flags = 0; flags < 16; ++flags) {
        AdamOptions o;
        o.lr = 1e-2;
        o.weight_decay = (flags & 1) ? 0.1 : 0.0;
        o.decoupled_weight_decay = flags & 2;
        o.amsgrad = flags & 4;
        o.maximize = flags & 8;
        const std::size_t n = 1000 + 37;  // tails for 8 and 16 lanes
        Outputs ref = run_isa(CpuIsa::kPortable, o, g, out, n, 1);
        for (CpuIsa isa : isas) {
          Outputs got = run_isa(isa, o, g, out, n, 2);
          for (std::size_t i = 0; i < n; ++i)
            ASSERT_EQ(got.master[i], ref.master[i]) << to_string(isa) << " flags " << flags << " grad "
                                                    << to_string(g) << " out " << to_string(out)
                                                    << " element " << i;
          ASSERT_EQ(got.m, ref.m);
          ASSERT_EQ(got.v, ref.v);
          ASSERT_EQ(got.vmax, ref.vmax);
          ASSERT_EQ(got.out16, ref.out16);
          ASSERT_EQ(got.out32, ref.out32);
        }
      }
    }
  }
}

TEST(CpuAdam, RefusesAPathThisCpuLacks) {
  if (best_cpu_isa() == CpuIsa::kAvx512) GTEST_SKIP() << "this CPU runs every path";
  EXPECT_THROW(CpuAdam(1, CpuIsa::kAvx512), logic_error);
}

TEST(CpuAdam, OutOfPlaceLeavesInputsAndMatchesInPlace) {
  const std::size_t n = 1037;
  for (CpuIsa isa : {CpuIsa::kPortable, best_cpu_isa()}) {
    Fixture a(n, 3), b(n, 3);
    for (std::size_t i = 0; i < n; ++i) a.grad[i] = b.grad[i] = std::sin(float(i)) * 0.3f;
    AdamOptions o;
    o.amsgrad = true;
    o.weight_decay = 0.02;
    o.grad_scale = 0.37;
    CpuAdam adam(2, isa);
    adam.step(o, 1, {a.tensor()});
    std::vector<float> p(n), m(n), v(n), vmax(n);
    const auto before = b.master;
    AdamTensor t = b.tensor();
    t.master_out = p.data();
    t.exp_avg_out = m.data();
    t.exp_avg_sq_out = v.data();
    t.max_exp_avg_sq_out = vmax.data();
    adam.step(o, 1, {t});
    EXPECT_EQ(b.master, before) << "out-of-place must not touch the inputs";
    EXPECT_EQ(p, a.master);
    EXPECT_EQ(m, a.m);
    EXPECT_EQ(v, a.v);
    EXPECT_EQ(vmax, a.vmax);
    t.exp_avg_sq_out = nullptr;
    EXPECT_THROW(adam.step(o, 1, {t}), logic_error);
  }
}

// Note [Streaming stores]: chunks of 64K elements and more whose outputs are
// aligned take non-temporal stores; the values are the same as with ordinary
// stores (misaligned by one element: the ordinary path), in place or not.
TEST(CpuAdam, StreamingStoresWriteWhatOrdinaryStoresWrite) {
  const std::size_t n = (std::size_t{1} << 20) + (std::size_t{1} << 17) + 37;  // two chunks, both streamed, a tail
  auto aligned = [](std::vector<float>& v, std::size_t skew) {
    auto addr = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((64 - addr % 64) % 64) / sizeof(float) + skew;
  };
  for (CpuIsa isa : {CpuIsa::kPortable, best_cpu_isa()}) {
    Fixture ref(n, 7);
    for (std::size_t i = 0; i < n; ++i) ref.grad[i] = std::cos(float(i) * 0.01f) * 0.2f;
    AdamOptions o;
    o.amsgrad = true;
    o.weight_decay = 0.01;
    // The subject is the streamed stores, not the threads: one thread under TSan (tests/cpp/sanitizers.hpp).
    CpuAdam adam(tierflow::testing::kAdamThreads, isa);
    std::vector<std::uint16_t> ref16(n);
    AdamTensor r = ref.tensor();
    r.param_type = ScalarType::kBFloat16;
    r.param_out = ref16.data();
    adam.step(o, 1, {r});  // small-pointer alignment of std::vector: not the streaming path's
    for (std::size_t skew : {0, 1}) {
      Fixture f(n, 7);
      f.grad = ref.grad;
      std::vector<float> p(n + 32), m(n + 32), v(n + 32), vmax(n + 32), out32(n + 32);
      AdamTensor t = f.tensor();
      t.master_out = aligned(p, skew);
      t.exp_avg_out = aligned(m, skew);
      t.exp_avg_sq_out = aligned(v, skew);
      t.max_exp_avg_sq_out = aligned(vmax, skew);
      t.param_type = ScalarType::kFloat32;
      t.param_out = aligned(out32, skew);
      adam.step(o, 1, {t});
      const std::string where = std::string(to_string(isa)) + " skew " + std::to_string(skew);
      EXPECT_EQ(first_difference(t.master_out, ref.master), n) << where << ": master";
      EXPECT_EQ(first_difference(t.exp_avg_out, ref.m), n) << where << ": exp_avg";
      EXPECT_EQ(first_difference(t.exp_avg_sq_out, ref.v), n) << where << ": exp_avg_sq";
      EXPECT_EQ(first_difference(t.max_exp_avg_sq_out, ref.vmax), n) << where << ": max_exp_avg_sq";
      EXPECT_EQ(first_difference(static_cast<const float*>(t.param_out), ref.master), n) << where << ": param_out";
      // In place, with the 16-bit copy-out (32-byte aligned when skew is 0) streamed.
      Fixture g(n, 7);
      g.grad = ref.grad;
      std::vector<float> buf((n + 64) / 2);
      auto* out16 = reinterpret_cast<std::uint16_t*>(aligned(buf, 0)) + skew;
      AdamTensor u = g.tensor();
      u.param_type = ScalarType::kBFloat16;
      u.param_out = out16;
      adam.step(o, 1, {u});
      EXPECT_EQ(g.master, ref.master);
      EXPECT_TRUE(std::equal(ref16.begin(), ref16.end(), out16)) << to_string(isa) << " skew " << skew;
    }
  }
}

TEST(CpuAdam, GradScaleEqualsScaledGradients) {
  const std::size_t n = 333;
  Fixture a(n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    a.grad[i] = std::cos(float(i));
    b.grad[i] = a.grad[i] * 0.25f;
  }
  AdamOptions scaled;
  scaled.grad_scale = 0.25;
  CpuAdam adam(1);
  adam.step(scaled, 1, {a.tensor()});
  adam.step(AdamOptions{}, 1, {b.tensor()});
  EXPECT_EQ(a.master, b.master);
}

TEST(AdamOptionsCheck, NamesTheFirstInvalidHyperparameterAsTorchDoes) {
  AdamOptions o;
  EXPECT_FALSE(adam_options_problem(o).has_value());
  o.lr = -0.5;
  o.eps = -1;  // lr is checked first
  EXPECT_EQ(adam_options_problem(o).value_or(""), "Invalid learning rate: -0.5");
  o.lr = 0;
  EXPECT_EQ(adam_options_problem(o).value_or(""), "Invalid epsilon value: -1");
  o.eps = 0;
  o.beta1 = 1.0;
  EXPECT_EQ(adam_options_problem(o).value_or(""), "Invalid beta parameter at index 0");
  o.beta1 = 0;
  o.beta2 = -1e-9;
  EXPECT_EQ(adam_options_problem(o).value_or(""), "Invalid beta parameter at index 1");
  o.beta2 = 0.999;
  o.weight_decay = -0.01;
  EXPECT_EQ(adam_options_problem(o).value_or(""), "Invalid weight_decay value: -0.01");
  o.weight_decay = std::nan("");
  EXPECT_EQ(adam_options_problem(o).value_or(""), "Invalid weight_decay value: nan");
  o.weight_decay = 0;
  EXPECT_FALSE(adam_options_problem(o).has_value());
}

TEST(StepGroups, OneGroupPerStepNumberInOrderOfFirstAppearance) {
  const auto g = group_by_step({3, 1, 3, 2, 1});
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0].step, 3);
  EXPECT_EQ(g[0].members, (std::vector<std::size_t>{0, 2}));
  EXPECT_EQ(g[1].step, 1);
  EXPECT_EQ(g[1].members, (std::vector<std::size_t>{1, 4}));
  EXPECT_EQ(g[2].step, 2);
  EXPECT_EQ(g[2].members, (std::vector<std::size_t>{3}));
  EXPECT_TRUE(group_by_step({}).empty());
}
