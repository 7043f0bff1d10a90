// The CPU Adam's argument checks and assembly (optimizer/adam_args.hpp), without torch: what the torch adapter
// (Runtime::adam_step, encode_moments, decode_moments) hands over as KernelArg.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/adam_args.hpp"

using namespace tierflow;
using namespace tierflow::optimizer;

namespace {

KernelArg arg(std::vector<float>& v) {
  return {true, true, true, v.size(), 4 * v.size(), ArgDtype::kFloat32, "Float", v.data()};
}

KernelArg bytes_arg(std::vector<std::uint8_t>& b, std::size_t numel, ArgDtype d, const char* name) {
  return {true, true, true, numel, b.size(), d, name, b.data()};
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    // TIERFLOW_EXPECTS names its source ("adam_args.cpp:57: "): the message is what follows.
    const std::string what = e.what();
    const auto at = what.find(".cpp:");
    return at == std::string::npos ? what : what.substr(what.find(": ", at) + 2);
  }
  return "";
}

struct Fp32Call {
  std::vector<float> master{1, 2, 3}, m{0, 0, 0}, v{0, 0, 0}, g{0.5f, 0.5f, 0.5f};
  AdamArgs args() { return {{arg(master)}, {arg(m)}, {arg(v)}, {}, {arg(g)}, {KernelArg{}}, {}, {}, {}, {}}; }
};

}  // namespace

TEST(AdamArgs, Fp32InPlacePointsAtEachBuffer) {
  Fp32Call c;
  std::uint64_t elements = 0;
  const auto t = adam_tensors(c.args(), &elements);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].numel, 3u);
  EXPECT_EQ(elements, 3u);
  EXPECT_EQ(t[0].master, c.master.data());
  EXPECT_EQ(t[0].exp_avg, c.m.data());
  EXPECT_EQ(t[0].exp_avg_sq, c.v.data());
  EXPECT_EQ(t[0].grad, c.g.data());
  EXPECT_EQ(t[0].grad_type, ScalarType::kFloat32);
  EXPECT_EQ(t[0].param_out, nullptr);
  EXPECT_EQ(t[0].master_out, nullptr);
  EXPECT_EQ(t[0].state_format, StateFormat::kFp32);
}

TEST(AdamArgs, ListsOfDifferentLengthsAreRefused) {
  Fp32Call c;
  AdamArgs a = c.args();
  a.grads.clear();
  EXPECT_NE(error_of([&] { adam_tensors(a); }).find("the tensor lists differ in length"), std::string::npos);
}

TEST(AdamArgs, EachWrongTensorIsNamedWithWhatIsAccepted) {
  {
    Fp32Call c;
    AdamArgs a = c.args();
    a.masters[0].cpu = false;
    EXPECT_EQ(error_of([&] { adam_tensors(a); }), "tierflow CPU Adam: master 0 must be a contiguous CPU tensor");
  }
  {
    Fp32Call c;
    AdamArgs a = c.args();
    a.exp_avg_sqs[0].numel = 2;
    EXPECT_EQ(error_of([&] { adam_tensors(a); }), "tierflow CPU Adam: exp_avg_sq 0 has 2 elements, expected 3");
  }
  {
    Fp32Call c;
    AdamArgs a = c.args();
    a.exp_avgs[0].dtype = ArgDtype::kOther;
    a.exp_avgs[0].dtype_name = "Double";
    EXPECT_EQ(error_of([&] { adam_tensors(a); }),
              std::string("tierflow CPU Adam: exp_avg 0 has dtype Double; ") + kAcceptedMoments);
  }
  {
    Fp32Call c;
    AdamArgs a = c.args();
    a.grads[0].dtype = ArgDtype::kOther;
    a.grads[0].dtype_name = "Double";
    try {
      adam_tensors(a);
      FAIL() << "a float64 gradient was accepted";
    } catch (const config_error& e) {
      EXPECT_STREQ(e.what(), "tierflow CPU Adam: grad 0: dtype Double; accepted: float32, bfloat16, float16");
    }
  }
  {
    Fp32Call c;
    AdamArgs a = c.args();
    a.exp_avg_sqs[0].dtype = ArgDtype::kBFloat16;
    EXPECT_NE(error_of([&] { adam_tensors(a); }).find("master and moments must be float32 (tensor 0)"),
              std::string::npos);
  }
}

TEST(AdamArgs, ParamCopyOutTakesItsType) {
  Fp32Call c;
  std::vector<std::uint8_t> out(6);
  AdamArgs a = c.args();
  a.params_out[0] = bytes_arg(out, 3, ArgDtype::kBFloat16, "BFloat16");
  const auto t = adam_tensors(a);
  EXPECT_EQ(t[0].param_out, out.data());
  EXPECT_EQ(t[0].param_type, ScalarType::kBFloat16);
}

TEST(AdamArgs, EightBitMomentsArePackedAndOutputsTakeTheirFormat) {
  std::vector<float> master(40, 1.0f), g(40, 0.5f), master_out(40);
  const std::size_t bytes = moment_bytes(StateFormat::k8bit, 40);
  std::vector<std::uint8_t> m(bytes), v(bytes), m_out(bytes), v_out(bytes), wrong(moment_bytes(StateFormat::kBf16, 40));
  AdamArgs a{{arg(master)},
             {bytes_arg(m, bytes, ArgDtype::kUint8, "Byte")},
             {bytes_arg(v, bytes, ArgDtype::kUint8, "Byte")},
             {},
             {arg(g)},
             {KernelArg{}},
             {arg(master_out)},
             {bytes_arg(m_out, bytes, ArgDtype::kUint8, "Byte")},
             {bytes_arg(v_out, bytes, ArgDtype::kUint8, "Byte")},
             {KernelArg{}}};
  const auto t = adam_tensors(a);
  EXPECT_EQ(t[0].state_format, StateFormat::k8bit);
  EXPECT_EQ(t[0].exp_avg, nullptr);
  EXPECT_EQ(t[0].m.data, m.data());
  EXPECT_EQ(reinterpret_cast<std::uint8_t*>(t[0].m.absmax), m.data() + absmax_offset(40));
  EXPECT_EQ(t[0].v_out.data, v_out.data());
  EXPECT_EQ(t[0].master_out, master_out.data());
  // An output of another format than its input is refused, naming both.
  a.exp_avg_sqs_out[0] = bytes_arg(wrong, 40, ArgDtype::kBFloat16, "BFloat16");
  EXPECT_EQ(error_of([&] { adam_tensors(a); }),
            "tierflow CPU Adam: exp_avg_sq_out 0 has dtype BFloat16 where a 8bit moment (Byte) is expected: "
            "exp_avg, exp_avg_sq and their outputs take one format");
}

TEST(AdamArgs, AMomentOfTheWrongSizeIsRefused) {
  std::vector<std::uint8_t> m(moment_bytes(StateFormat::kBf16, 10) - 2);
  EXPECT_EQ(error_of([&] {
              check_moment(bytes_arg(m, 9, ArgDtype::kBFloat16, "BFloat16"), StateFormat::kBf16, "exp_avg", 2, 10);
            }),
            "tierflow CPU Adam: exp_avg 2 (bf16 moment) has 18 bytes, expected 20 for 10 elements");
}

TEST(AdamArgs, CpuIsaNames) {
  EXPECT_EQ(parse_cpu_isa("avx512"), CpuIsa::kAvx512);
  EXPECT_EQ(parse_cpu_isa("avx2"), CpuIsa::kAvx2);
  EXPECT_EQ(parse_cpu_isa("portable"), CpuIsa::kPortable);
  EXPECT_EQ(parse_cpu_isa("auto"), std::nullopt);
}
