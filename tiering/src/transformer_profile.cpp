// Estimates of a transformer's block profiles and state bytes; see Note [Transformer estimate].
#include "tierflow/tiering/transformer_profile.hpp"

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {
namespace {

constexpr std::uint64_t kFp32Bytes = 4;
constexpr std::uint64_t kLayerNormStatBytes = 2 * kFp32Bytes;  // mean and rstd per token

// A shape comes from the user (the command line): a bad one is a config_error.
void check_shape(const TransformerShape& s) {
  if (!(s.layers > 0 && s.hidden > 0 && s.heads > 0 && s.seq > 0 && s.batch > 0 && s.vocab > 0 && s.ffn_mult > 0)) {
    throw config_error("transformer shape: layers, hidden, heads, seq, batch, vocab and ffn_mult must be positive");
  }
  if (s.hidden % s.heads != 0) {
    throw config_error("transformer shape: hidden " + std::to_string(s.hidden) + " is not a multiple of heads " +
                       std::to_string(s.heads));
  }
  if (s.dtype_bytes != 2 && s.dtype_bytes != 4) {
    throw config_error("transformer shape: dtype_bytes must be 2 (bf16, fp16) or 4 (fp32), not " +
                       std::to_string(s.dtype_bytes));
  }
}

}  // namespace

std::vector<BlockProfile> estimate_transformer(const TransformerShape& s, double flops_per_second) {
  check_shape(s);
  if (!(flops_per_second > 0)) throw config_error("estimate_transformer: flops_per_second must be positive");
  const auto tokens = static_cast<std::uint64_t>(s.tokens());
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto f = static_cast<std::uint64_t>(s.ffn_mult);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const double hd = static_cast<double>(h);
  const double tok = static_cast<double>(tokens);

  BlockProfile p;
  p.input_bytes = tokens * h * d;
  p.whole_bytes = tokens * (h * d + static_cast<std::uint64_t>(s.heads) * kFp32Bytes);
  p.split_bytes = tokens * (3 + f) * h * d;
  p.cheap_bytes = tokens * ((3 + f) * h * d + 2 * kLayerNormStatBytes);
  p.transient_bytes = tokens * (2 * f + 1) * h * d;

  const double qkv_flops = 2 * hd * 3 * hd, proj_flops = 2 * hd * hd;
  const double mlp_flops = 2 * 2 * hd * static_cast<double>(f) * hd;      // fc and its projection
  const double attention_flops = 2 * static_cast<double>(s.seq) * hd;    // causal: half of 4 * seq * h
  const double per_token = qkv_flops + proj_flops + mlp_flops + attention_flops;
  p.forward_seconds = tok * per_token / flops_per_second;
  p.backward_seconds = 2 * p.forward_seconds;
  p.split_recompute_seconds = tok * (qkv_flops + mlp_flops / 2) / flops_per_second;
  p.cheap_recompute_seconds = tok * proj_flops / flops_per_second;
  p.splittable = true;
  return std::vector<BlockProfile>(static_cast<std::size_t>(s.layers), p);
}

std::uint64_t transformer_parameters(const TransformerShape& s) {
  check_shape(s);
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto f = static_cast<std::uint64_t>(s.ffn_mult);
  const auto v = static_cast<std::uint64_t>(s.vocab);
  const std::uint64_t block = 2 * 2 * h              // two LayerNorms
                              + 3 * h * h + 3 * h    // qkv
                              + h * h + h            // attention projection
                              + f * h * h + f * h    // MLP up
                              + f * h * h + h;       // MLP down
  return v * h + static_cast<std::uint64_t>(s.seq) * h + static_cast<std::uint64_t>(s.layers) * block + 2 * h +
         v * h;
}

StateBytes estimate_training_state(const TransformerShape& s, OffloadTarget optimizer) {
  TIERFLOW_EXPECTS(optimizer != OffloadTarget::kAuto,
                   "estimate_training_state: the optimizer goes to none, host or nvme, not auto");
  const std::uint64_t n = transformer_parameters(s);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const std::uint64_t master = d < kFp32Bytes ? n * kFp32Bytes : 0;  // fp32 parameters are their own master
  const std::uint64_t adam = 2 * n * kFp32Bytes;
  StateBytes out;
  out.device = 2 * n * d;  // parameters and gradients
  switch (optimizer) {
    case OffloadTarget::kNone: out.device += master + adam; break;
    case OffloadTarget::kHost: out.host = master + adam; break;
    case OffloadTarget::kNvme: out.nvme = master + adam; break;
    case OffloadTarget::kAuto: break;
  }
  return out;
}

std::uint64_t estimate_head_device_bytes(const TransformerShape& s) {
  check_shape(s);
  const auto tokens = static_cast<std::uint64_t>(s.tokens());
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto v = static_cast<std::uint64_t>(s.vocab);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const std::uint64_t saved = tokens * (2 * h * d + kLayerNormStatBytes + v * kFp32Bytes);
  const std::uint64_t transient = tokens * (v * d + 2 * v * kFp32Bytes);
  return saved + transient;
}

}  // namespace tierflow::tiering
