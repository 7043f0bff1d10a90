#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/stream_rules.hpp"

using namespace tierflow::optimizer;

TEST(StreamRules, AParameterStreamsOnlyAsADenseLeafOfAKernelDtypeOnTheDevice) {
  ParamFacts p{true, true, true, true, ScalarType::kBFloat16};
  EXPECT_EQ(param_not_streamable(p), nullptr);
  auto why = [&](ParamFacts q) { return std::string(param_not_streamable(q)); };
  ParamFacts q = p;
  q.requires_grad = false;
  EXPECT_EQ(why(q), "it does not require grad");
  q = p;
  q.leaf = false;
  EXPECT_EQ(why(q), "it is not a leaf tensor");
  q = p;
  q.contiguous = false;
  EXPECT_EQ(why(q), "it is not contiguous");
  q = p;
  q.type.reset();
  EXPECT_EQ(why(q), "its dtype is not float32, bfloat16 or float16");
  q = p;
  q.on_device = false;
  EXPECT_EQ(why(q), "it is not on the runtime's device");
}

TEST(StreamRules, AGradientStreamsOnlyWhenItCanBeCopiedAsItsParametersBytes) {
  GradFacts g{true, false, true, 12, 12, ScalarType::kFloat32, true};
  EXPECT_EQ(grad_not_streamable(g), nullptr);
  auto why = [&](GradFacts h) { return std::string(grad_not_streamable(h)); };
  EXPECT_EQ(why(GradFacts{}), "it has no gradient");  // the facts after the first that fails are not read
  GradFacts h = g;
  h.sparse = true;
  EXPECT_EQ(why(h), "its gradient is sparse");
  h = g;
  h.contiguous = false;
  EXPECT_EQ(why(h), "its gradient is not contiguous");
  h = g;
  h.numel = 6;  // an expanded or reshaped gradient
  EXPECT_EQ(why(h), "its gradient's numel differs from the parameter's");
  h = g;
  h.type.reset();
  EXPECT_EQ(why(h), "its gradient's dtype is not float32, bfloat16 or float16");
  h = g;
  h.on_device = false;
  EXPECT_EQ(why(h), "its gradient is not on the runtime's device");
}

TEST(StreamRules, OneKernelCallPerStepGroupAndHyperparametersInOrderOfFirstAppearance) {
  AdamOptions a, b;
  b.lr = a.lr * 2;
  const std::vector<KernelStep> steps = {{3, a}, {4, a}, {3, b}, {3, a}, {4, a, -1, true}, {4, a}};
  EXPECT_EQ(group_kernel_calls(steps), (std::vector<std::vector<std::size_t>>{{0, 3}, {1, 5}, {2}}));
  EXPECT_TRUE(group_kernel_calls({}).empty());
  EXPECT_TRUE(group_kernel_calls({{1, a, -1, true}}).empty());  // held: steps in no call
  // Per group: equal options in two groups still make two calls.
  EXPECT_EQ(group_kernel_calls({{1, a, 0}, {1, a, 1}, {1, a, 0}}),
            (std::vector<std::vector<std::size_t>>{{0, 2}, {1}}));
}

TEST(StreamRules, ClipCoefficientsGroupAsBitsSoANaNGroupsWithItself) {
  AdamOptions half, nan, other_nan;
  half.grad_scale = 0.5;
  nan.grad_scale = std::numeric_limits<double>::quiet_NaN();
  other_nan.grad_scale = std::nan("1");
  EXPECT_EQ(group_kernel_calls({{2, nan, 0}, {2, half, 0}, {2, nan, 0}, {2, AdamOptions{}, 0}}),
            (std::vector<std::vector<std::size_t>>{{0, 2}, {1}, {3}}));
  if (std::memcmp(&nan.grad_scale, &other_nan.grad_scale, sizeof(double)) != 0) {
    EXPECT_EQ(group_kernel_calls({{2, nan, 0}, {2, other_nan, 0}}).size(), 2u);
  }
}

// GradStream::set_state's refusals: each wrong array of a slot's state is named, and the moments' format is
// their dtype's (8-bit: one buffer of moment_bytes).
TEST(StreamRules, AStreamedStateIsRefusedNamingTheArrayThatIsWrong) {
  constexpr std::size_t n = 300;
  const StateArrayFacts master{true, true, true, StateFormat::kFp32, 4 * n};
  const StateArrayFacts m8{true, true, true, StateFormat::k8bit, moment_bytes(StateFormat::k8bit, n)};
  const StateArrayFacts bf{true, true, true, StateFormat::kBf16, 2 * n};
  const StateArrayFacts none;
  EXPECT_EQ(check_stream_state(0, n, master, m8, m8, none, true), StateFormat::k8bit);
  EXPECT_EQ(check_stream_state(0, n, master, bf, bf, master, true), StateFormat::kBf16);
  auto refused = [&](const StateArrayFacts& ms, const StateArrayFacts& m, const StateArrayFacts& v,
                     const StateArrayFacts& vmax, bool step, const char* words) {
    try {
      check_stream_state(7, n, ms, m, v, vmax, step);
      ADD_FAILURE() << "accepted; expected: " << words;
    } catch (const tierflow::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  StateArrayFacts device_master = master;
  device_master.host = false;
  refused(device_master, bf, bf, none, true, "slot 7 needs a contiguous fp32 CPU master of the parameter's size");
  refused(bf, bf, bf, none, true, "fp32 CPU master");
  refused(master, bf, m8, none, true, "slot 7 needs contiguous CPU moments of one format");
  StateArrayFacts short_m8 = m8;
  short_m8.bytes = n;  // the codes without their scales
  refused(master, short_m8, short_m8, none, true, "8bit's uint8 buffer of moment_bytes");
  refused(master, none, none, none, true, "CPU moments of one format");
  refused(master, bf, bf, bf, true, "slot 7 needs a contiguous fp32 CPU max_exp_avg_sq");
  refused(master, bf, bf, none, false, "the step counter must be a one-element CPU tensor");
}

// The moments of an NVMe state handed in or out: one format, host, contiguous, moment_bytes each.
TEST(StreamRules, MomentsAreOfOneFormatAndTheirSize) {
  constexpr std::size_t n = 300;
  const StateArrayFacts m8{true, true, true, StateFormat::k8bit, moment_bytes(StateFormat::k8bit, n)};
  const StateArrayFacts fp{true, true, true, StateFormat::kFp32, 4 * n};
  EXPECT_EQ(moments_format(n, m8, m8), StateFormat::k8bit);
  EXPECT_EQ(moments_format(n, fp, fp), StateFormat::kFp32);
  EXPECT_FALSE(moments_format(n, fp, m8));
  EXPECT_FALSE(moments_format(n + 1, fp, fp));
  StateArrayFacts strided = fp;
  strided.contiguous = false;
  EXPECT_FALSE(moments_format(n, fp, strided));
  StateArrayFacts no_format = fp;
  no_format.format.reset();  // a dtype no format has (float16)
  EXPECT_FALSE(moments_format(n, no_format, no_format));
}
