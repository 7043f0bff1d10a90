// bf16 and 8-bit moments (Note [Optimizer state formats]): the kernels against
// a scalar reference written from the Note, the SIMD paths against the
// portable one bit for bit, out-of-place steps, conversions and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/state_format.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;

namespace {

// ---- The reference: the Note's maps as tables, nearest entry by search ------

// Decoded magnitudes: m's 121 (code q: the half with bits q << 7), v's 241.
std::vector<float> magnitudes(int count) {
  std::vector<float> t;
  for (int q = 0; q < count; ++q) t.push_back(fp16_to_float(static_cast<std::uint16_t>(q << 7)));
  return t;
}

// The entry nearest to the half of `y` (ties to the even code), by search.
int nearest(const std::vector<float>& table, float y) {
  const float h = fp16_to_float(float_to_fp16(y));
  int best = 0;
  for (int q = 1; q < static_cast<int>(table.size()); ++q) {
    const double d = std::fabs(static_cast<double>(table[q]) - h), e = std::fabs(static_cast<double>(table[best]) - h);
    if (d < e || (d == e && q % 2 == 0)) best = q;
  }
  return best;
}

// One fp32 AdamW element, the operations of Note [Adam semantics] written out.
void reference_element(const AdamOptions& o, std::int64_t step, float g, float& p, float& m, float& v) {
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  if (o.maximize) g = -g;
  if (o.weight_decay != 0) {
    if (o.decoupled_weight_decay) p = p * static_cast<float>(1.0 - o.lr * o.weight_decay);
    else g = std::fma(static_cast<float>(o.weight_decay), p, g);
  }
  m = std::fma(static_cast<float>(1.0 - o.beta1), g - m, m);
  v = std::fma(static_cast<float>(1.0 - o.beta2) * g, g, v * static_cast<float>(o.beta2));
  const float denom = std::sqrt(v) * static_cast<float>(1.0 / std::sqrt(bc2)) + static_cast<float>(o.eps);
  p = p + (static_cast<float>(-(o.lr / bc1)) * m) / denom;
}

struct Packed {
  StateFormat format;
  std::size_t n;
  std::vector<std::uint8_t> m, v;  // bytes: codes, or bf16 bits
  std::vector<float> m_absmax, v_absmax;
  Packed(StateFormat f, std::size_t n_)
      : format(f), n(n_), m(moment_bytes(f, n_)), v(moment_bytes(f, n_)), m_absmax(quant_blocks(n_)),
        v_absmax(quant_blocks(n_)) {}
  PackedMoment pm() { return {m.data(), format == StateFormat::k8bit ? m_absmax.data() : nullptr}; }
  PackedMoment pv() { return {v.data(), format == StateFormat::k8bit ? v_absmax.data() : nullptr}; }
  bool operator==(const Packed& o) const {
    return m == o.m && v == o.v && std::memcmp(m_absmax.data(), o.m_absmax.data(), 4 * m_absmax.size()) == 0 &&
           std::memcmp(v_absmax.data(), o.v_absmax.data(), 4 * v_absmax.size()) == 0;
  }
};

// The reference step of packed moments: decode by the Note, update, encode by table search.
void reference_step(const AdamOptions& o, std::int64_t step, Packed& s, std::vector<float>& master,
                    const std::vector<float>& grad) {
  static const std::vector<float> mt = magnitudes(121), vt = magnitudes(241);
  std::vector<float> m(s.n), v(s.n);
  for (std::size_t i = 0; i < s.n; ++i) {
    if (s.format == StateFormat::kBf16) {
      std::uint16_t a, b;
      std::memcpy(&a, &s.m[2 * i], 2);
      std::memcpy(&b, &s.v[2 * i], 2);
      m[i] = bf16_to_float(a);
      v[i] = bf16_to_float(b);
    } else {
      const std::uint8_t c = s.m[i];
      m[i] = (c & 0x80 ? -mt[c & 0x7f] : mt[c & 0x7f]) * s.m_absmax[i / kQuantBlock];
      v[i] = (vt[s.v[i]] * 0x1p-15f) * s.v_absmax[i / kQuantBlock];
    }
    reference_element(o, step, grad[i], master[i], m[i], v[i]);
  }
  if (s.format == StateFormat::kBf16) {
    for (std::size_t i = 0; i < s.n; ++i) {
      const std::uint16_t a = float_to_bf16(m[i]), b = float_to_bf16(v[i]);
      std::memcpy(&s.m[2 * i], &a, 2);
      std::memcpy(&s.v[2 * i], &b, 2);
    }
    return;
  }
  for (std::size_t b = 0; b < s.n; b += kQuantBlock) {
    const std::size_t e = std::min(s.n, b + kQuantBlock);
    float am = 0, av = 0;
    for (std::size_t i = b; i < e; ++i) {
      am = std::max(am, std::fabs(m[i]));
      av = std::max(av, v[i]);
    }
    // Scales below the smallest normal float (m) or 2^-100 (v) encode as zeros.
    if (am < std::numeric_limits<float>::min()) am = 0;
    if (av < 0x1p-100f) av = 0;
    const float mi = am > 0 ? 1.f / am : 0.f, vi = av > 0 ? 1.f / av : 0.f;
    for (std::size_t i = b; i < e; ++i) {
      const float y = m[i] * mi;
      s.m[i] = static_cast<std::uint8_t>(mi == 0 ? 0 : nearest(mt, std::fabs(y)) | (std::signbit(y) ? 0x80 : 0));
      s.v[i] = static_cast<std::uint8_t>(vi == 0 ? 0 : nearest(vt, (v[i] * vi) * 32768.f));
      // Under a non-zero m, v's smallest non-zero code at least: never a denominator of eps.
      if (vi != 0 && s.v[i] == 0 && (s.m[i] & 0x7f) != 0) s.v[i] = 1;
    }
    s.m_absmax[b / kQuantBlock] = am;
    s.v_absmax[b / kQuantBlock] = av;
  }
}

AdamTensor tensor_of(Packed& s, std::vector<float>& master, const void* grad, ScalarType grad_type) {
  AdamTensor t;
  t.master = master.data();
  t.grad = grad;
  t.grad_type = grad_type;
  t.numel = s.n;
  t.state_format = s.format;
  t.m = s.pm();
  t.v = s.pv();
  return t;
}

std::vector<float> normal(std::size_t n, unsigned seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = d(rng);
  return x;
}

std::vector<CpuIsa> every_isa() {
  if (best_cpu_isa() == CpuIsa::kAvx512) return {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512};
  if (best_cpu_isa() == CpuIsa::kAvx2) return {CpuIsa::kPortable, CpuIsa::kAvx2};
  return {CpuIsa::kPortable};
}

}  // namespace

TEST(StateFormat, NamesParseAndBytes) {
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::k8bit})
    EXPECT_EQ(parse_state_format(to_string(f)), f);
  EXPECT_EQ(parse_state_format("int8"), std::nullopt);
  EXPECT_EQ(moment_bytes(StateFormat::k8bit, 257), 272u + 8u);  // codes padded to 16 bytes, then 2 scales
  EXPECT_EQ(moment_bytes(StateFormat::kBf16, 10), 20u);
  EXPECT_LE(4.0 + moments_bytes_per_param(StateFormat::k8bit), 6.5);  // the target
  EXPECT_LE(4.0 + moments_bytes_per_param(StateFormat::kBf16), 8.5);
}

// Each path, several steps from fresh and from random states, equals the
// reference (decode, the fp32 update, nearest-entry encode) bit for bit.
TEST(StateFormat, EveryPathMatchesTheScalarReference) {
  for (StateFormat f : {StateFormat::kBf16, StateFormat::k8bit}) {
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{255}, std::size_t{256}, std::size_t{1000},
                          std::size_t{2053}}) {
      for (int flags = 0; flags < 4; ++flags) {
        AdamOptions o;
        o.lr = 1e-2;
        o.weight_decay = (flags & 1) ? 0.1 : 0.0;
        o.decoupled_weight_decay = flags & 2;
        o.maximize = flags == 3;
        Packed ref(f, n);
        std::vector<float> ref_master = normal(n, 2, 1.f);
        for (CpuIsa isa : every_isa()) {
          CpuAdam adam(2, isa);
          Packed got(f, n);
          std::vector<float> master = normal(n, 2, 1.f);
          Packed want(f, n);
          std::vector<float> want_master = master;
          for (int step = 1; step <= 5; ++step) {
            // Gradients spanning five decades inside a block exercise small codes.
            std::vector<float> g = normal(n, 100 + step, 1.f);
            for (std::size_t i = 0; i < n; ++i) g[i] *= std::pow(10.f, -static_cast<float>(i % 5));
            adam.step(o, step, {tensor_of(got, master, g.data(), ScalarType::kFloat32)});
            reference_step(o, step, want, want_master, g);
            ASSERT_TRUE(got == want) << to_string(f) << " " << to_string(isa) << " n " << n << " flags " << flags
                                     << " step " << step;
            ASSERT_EQ(master, want_master) << to_string(f) << " " << to_string(isa);
          }
        }
      }
    }
  }
}

// Every grad type and copy-out (and, for bf16 ones, across a chunk boundary:
// 2^20 elements, two chunks on two threads): the SIMD paths write what the
// portable path writes, bit for bit.
TEST(StateFormat, EverySimdPathIsBitIdenticalToThePortableOne) {
  const auto isas = every_isa();
  if (isas.size() == 1) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512: only the portable path exists";
  for (StateFormat f : {StateFormat::kBf16, StateFormat::k8bit}) {
    for (ScalarType gt : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
      for (ScalarType ot : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
        const bool across = gt == ScalarType::kBFloat16 && ot == ScalarType::kBFloat16;
        const std::size_t n = across ? (std::size_t{1} << 20) + 300 : 3000 + 37;
        std::vector<Packed> states;
        std::vector<std::vector<float>> masters;
        std::vector<std::vector<std::uint8_t>> outs;
        for (CpuIsa isa : isas) {
          CpuAdam adam(2, isa);
          Packed s(f, n);
          std::vector<float> master = normal(n, 4, 1.f);
          std::vector<std::uint8_t> out(n * element_size(ot));
          for (int step = 1; step <= 3; ++step) {
            std::vector<float> g = normal(n, 50 + step, 0.5f);
            std::vector<std::uint16_t> g16(n);
            for (std::size_t i = 0; i < n; ++i)
              g16[i] = gt == ScalarType::kBFloat16 ? float_to_bf16(g[i]) : float_to_fp16(g[i]);
            AdamTensor t = tensor_of(s, master, gt == ScalarType::kFloat32 ? static_cast<const void*>(g.data())
                                                                          : g16.data(), gt);
            t.param_out = out.data();
            t.param_type = ot;
            AdamOptions o;
            o.weight_decay = 0.01;
            o.grad_scale = 0.5;
            adam.step(o, step, {t});
          }
          states.push_back(s);
          masters.push_back(master);
          outs.push_back(out);
        }
        for (std::size_t k = 1; k < isas.size(); ++k) {
          EXPECT_TRUE(states[k] == states[0]) << to_string(f) << " " << to_string(isas[k]) << " grad "
                                              << to_string(gt) << " out " << to_string(ot);
          EXPECT_EQ(masters[k], masters[0]) << to_string(isas[k]);
          EXPECT_EQ(outs[k], outs[0]) << to_string(isas[k]);
        }
      }
    }
  }
}

// Out of place (Note [Step during backward]): the inputs stay as they were,
// and the outputs equal an in-place step's.
TEST(StateFormat, OutOfPlaceLeavesInputsAndMatchesInPlace) {
  const std::size_t n = 3000;
  for (StateFormat f : {StateFormat::kBf16, StateFormat::k8bit}) {
    for (CpuIsa isa : every_isa()) {
      CpuAdam adam(2, isa);
      Packed s(f, n);
      std::vector<float> master = normal(n, 6, 1.f);
      const std::vector<float> g1 = normal(n, 7, 1.f), g2 = normal(n, 8, 1.f);
      adam.step({}, 1, {tensor_of(s, master, g1.data(), ScalarType::kFloat32)});
      const Packed before = s;
      const std::vector<float> master_before = master;
      Packed out(f, n);
      std::vector<float> master_out(n);
      AdamTensor t = tensor_of(s, master, g2.data(), ScalarType::kFloat32);
      t.master_out = master_out.data();
      t.m_out = out.pm();
      t.v_out = out.pv();
      adam.step({}, 2, {t});
      EXPECT_TRUE(s == before);
      EXPECT_EQ(master, master_before);
      adam.step({}, 2, {tensor_of(s, master, g2.data(), ScalarType::kFloat32)});
      EXPECT_TRUE(s == out) << to_string(f) << " " << to_string(isa);
      EXPECT_EQ(master, master_out);
    }
  }
}

// Decoding then encoding gives back the codes and scales (a checkpoint may carry fp32 moments).
TEST(StateFormat, DecodeThenEncodeIsTheIdentity) {
  const std::size_t n = 5000;
  for (StateFormat f : {StateFormat::kBf16, StateFormat::k8bit}) {
    Packed s(f, n);
    std::vector<float> master = normal(n, 9, 1.f);
    CpuAdam adam(1);
    for (int step = 1; step <= 3; ++step) {
      std::vector<float> g = normal(n, 20 + step, 1.f);
      for (std::size_t i = 0; i < n; ++i) g[i] *= std::pow(10.f, -static_cast<float>(i % 7));
      for (std::size_t i = 512; i < 768; ++i) g[i] = 0.f;  // an all-zero block
      adam.step({}, step, {tensor_of(s, master, g.data(), ScalarType::kFloat32)});
    }
    std::vector<float> m(n), v(n);
    decode_moments(f, s.pm(), s.pv(), n, m.data(), v.data());
    Packed again(f, n);
    encode_moments(f, m.data(), v.data(), n, again.pm(), again.pv());
    EXPECT_TRUE(again == s) << to_string(f);
  }
}

// Packed moments stay close to fp32 ones: the masters of 200 steps on noisy
// gradients spanning four decades agree to a small fraction of the distance
// they moved (measured: bf16 0.9%, 8-bit 5.3%; a wrong code or scale moves
// them apart by the whole distance).
double drift_from_fp32(StateFormat f) {
  const std::size_t n = 4096;
  std::vector<float> p32 = normal(n, 10, 1.f), m32(n), v32(n);
  const std::vector<float> start = p32;
  std::vector<float> pq = p32;
  Packed s(f, n);
  CpuAdam adam(2);
  AdamOptions o;
  o.lr = 1e-3;
  for (int step = 1; step <= 200; ++step) {
    std::vector<float> noise = normal(n, 1000 + step, 1.f), g32(n), gq(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float scale = std::pow(10.f, -static_cast<float>(i % 4));
      g32[i] = scale * (p32[i] + noise[i]);
      gq[i] = scale * (pq[i] + noise[i]);
    }
    AdamTensor t;
    t.master = p32.data();
    t.exp_avg = m32.data();
    t.exp_avg_sq = v32.data();
    t.grad = g32.data();
    t.numel = n;
    adam.step(o, step, {t, tensor_of(s, pq, gq.data(), ScalarType::kFloat32)});
  }
  double moved = 0, apart = 0;
  for (std::size_t i = 0; i < n; ++i) {
    moved += std::fabs(p32[i] - start[i]);
    apart += std::fabs(pq[i] - p32[i]);
  }
  EXPECT_GT(moved / n, 0.05);
  return apart / moved;
}

TEST(StateFormat, PackedMomentsTrackFp32) {
  const double bf16 = drift_from_fp32(StateFormat::kBf16), q8 = drift_from_fp32(StateFormat::k8bit);
  EXPECT_LT(bf16, 0.02);
  EXPECT_LT(q8, 0.08);
  std::printf("drift from fp32: bf16 %.4f, 8bit %.4f of the distance moved\n", bf16, q8);
}

// A NaN or infinite gradient makes its block's moments NaN (scale NaN, codes
// 0; its own master is NaN as in fp32), and no other block's. A finite
// gradient whose square overflows keeps its block: its v codes as +inf (248),
// so its step is 0 as in fp32, and the other elements step as before.
TEST(StateFormat, NonFiniteMomentsPoisonTheirBlockOnly) {
  const std::size_t n = 1280;
  for (CpuIsa isa : every_isa()) {
    Packed s(StateFormat::k8bit, n);
    std::vector<float> master = normal(n, 11, 1.f), g = normal(n, 12, 1.f);
    g[300] = NAN;
    g[600] = std::numeric_limits<float>::infinity();
    g[800] = 1e30f;  // finite; (1 - b2) g^2 overflows
    std::fill(g.begin() + 1024, g.end(), 0.f);  // a block of zeros but one NaN: encodes as zeros, still NaN
    g[1100] = NAN;
    CpuAdam adam(1, isa);
    adam.step({}, 1, {tensor_of(s, master, g.data(), ScalarType::kFloat32)});
    EXPECT_TRUE(std::isnan(s.m_absmax[1]) && std::isnan(s.v_absmax[1])) << to_string(isa);
    EXPECT_TRUE(std::isnan(s.m_absmax[2])) << to_string(isa);  // m = inf
    EXPECT_TRUE(std::all_of(s.m.begin() + 256, s.m.begin() + 768, [](std::uint8_t c) { return c == 0; }));
    EXPECT_TRUE(std::isnan(s.m_absmax[4]) && std::isnan(s.v_absmax[4])) << to_string(isa);
    EXPECT_TRUE(std::isfinite(s.m_absmax[0]) && std::isfinite(s.m_absmax[3]) && std::isfinite(s.v_absmax[3]));
    EXPECT_GT(s.m_absmax[0], 0.f);
    EXPECT_EQ(s.v[800], 248) << to_string(isa);  // +inf
    // The next step: the overflowed element does not move, its block's others do, all finite.
    const std::vector<float> before = master;
    std::vector<float> g2 = normal(n, 13, 1.f);
    adam.step({}, 2, {tensor_of(s, master, g2.data(), ScalarType::kFloat32)});
    EXPECT_EQ(master[800], before[800]) << to_string(isa);
    for (std::size_t i = 768; i < 1024; ++i) EXPECT_TRUE(std::isfinite(master[i])) << i << " " << to_string(isa);
    EXPECT_NE(master[801], before[801]);
  }
}

// An element whose m codes non-zero at the bottom of m's range has a v below
// v's range (v ~ m^2): its v codes 1, not 0, so a later step with a zero
// gradient divides by sqrt(v's smallest code), not by eps (the review's case:
// a 360x lr jump). Its step stays within fp32's order.
TEST(StateFormat, AVCodedZeroNeverSitsUnderANonZeroM) {
  const std::size_t n = 256;
  for (CpuIsa isa : every_isa()) {
    Packed s(StateFormat::k8bit, n);
    std::vector<float> p8(n, 0.f), p32(n, 0.f), m32(n), v32(n);
    CpuAdam adam(1, isa);
    AdamOptions o;
    o.weight_decay = 0;
    for (int step = 1; step <= 3; ++step) {
      std::vector<float> g(n, 0.f);
      g[0] = 1.f;
      if (step == 1) g[1] = 1e-5f;
      AdamTensor t;
      t.master = p32.data();
      t.exp_avg = m32.data();
      t.exp_avg_sq = v32.data();
      t.grad = g.data();
      t.numel = n;
      adam.step(o, step, {t, tensor_of(s, p8, g.data(), ScalarType::kFloat32)});
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_FALSE((s.m[i] & 0x7f) != 0 && s.v[i] == 0) << "element " << i << " step " << step;
    }
    EXPECT_LT(std::fabs(p8[1]), 3 * std::fabs(p32[1])) << to_string(isa) << ": " << p8[1] << " vs " << p32[1];
  }
}

TEST(StateFormat, BadInputIsRefusedByName) {
  const std::size_t n = 300;
  Packed s(StateFormat::k8bit, n);
  std::vector<float> master(n), g(n);
  CpuAdam adam(1);
  AdamOptions ams;
  ams.amsgrad = true;
  try {
    adam.step(ams, 1, {tensor_of(s, master, g.data(), ScalarType::kFloat32)});
    FAIL() << "amsgrad with 8-bit moments was accepted";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("amsgrad"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("optimizer_states=8bit"), std::string::npos) << e.what();
  }
  AdamTensor t = tensor_of(s, master, g.data(), ScalarType::kFloat32);
  t.m.absmax = nullptr;
  EXPECT_THROW(adam.step({}, 1, {t}), logic_error);
  t = tensor_of(s, master, g.data(), ScalarType::kFloat32);
  std::vector<float> out(n);
  t.master_out = out.data();  // without m_out and v_out
  EXPECT_THROW(adam.step({}, 1, {t}), logic_error);
  EXPECT_THROW(encode_moments(StateFormat::kFp32, master.data(), master.data(), n, s.pm(), s.pv()), logic_error);
}

// TIERFLOW_OPTIMIZER_STATES by name: each format reads back; anything else is refused naming what is accepted.
TEST(StateFormat, NamedFormatsReadBackAndOthersAreRefusedNamingTheAccepted) {
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::k8bit})
    EXPECT_EQ(state_format_named(to_string(f)), f);
  try {
    state_format_named("int4");
    FAIL() << "int4 was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer state format 'int4'; accepted: fp32, bf16, 8bit"),
              std::string::npos) << e.what();
  }
}
