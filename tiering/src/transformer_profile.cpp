// Estimates of a transformer's block profiles and state bytes; see Note [Transformer estimate].
#include "tierflow/tiering/transformer_profile.hpp"

#include <cmath>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {
namespace {

constexpr std::uint64_t kFp32Bytes = 4;
constexpr std::uint64_t kLayerNormStatBytes = 2 * kFp32Bytes;  // mean and rstd per token

std::string describe(const TransformerShape& s) {
  return "layers " + std::to_string(s.layers) + ", hidden " + std::to_string(s.hidden) + ", heads " +
         std::to_string(s.heads) + ", seq " + std::to_string(s.seq) + ", batch " + std::to_string(s.batch) +
         ", vocab " + std::to_string(s.vocab) + ", ffn_mult " + std::to_string(s.ffn_mult) + ", dtype_bytes " +
         std::to_string(s.dtype_bytes);
}

// Products and sums of a shape's byte counts, refused (config_error) rather than wrapped past 64 bits.
struct Checked {
  const TransformerShape& s;
  [[noreturn]] void overflow(const char* what) const {
    throw config_error("transformer shape (" + describe(s) + "): its " + what +
                       " overflow 64 bits; accepted: a shape whose byte counts fit in 64 bits (make seq, "
                       "batch, hidden, vocab or layers smaller)");
  }
  std::uint64_t mul(std::uint64_t a, std::uint64_t b, const char* what) const {
    std::uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) overflow(what);
    return r;
  }
  std::uint64_t add(std::uint64_t a, std::uint64_t b, const char* what) const {
    std::uint64_t r = 0;
    if (__builtin_add_overflow(a, b, &r)) overflow(what);
    return r;
  }
};

// Every byte and element count of the estimates, computed once with checked arithmetic.
struct Counts {
  std::uint64_t tokens = 0;
  std::uint64_t input = 0, whole = 0, split = 0, cheap = 0, transient = 0;  // one block
  std::uint64_t parameters = 0;
  std::uint64_t block_parameters = 0;  // one block's
  std::uint64_t head = 0;  // estimate_head_device_bytes
};

// A shape comes from the user (the command line): a bad one is a config_error.
Counts counts(const TransformerShape& s) {
  const std::int64_t values[] = {s.layers, s.hidden, s.heads, s.seq, s.batch, s.vocab, s.ffn_mult};
  const auto& limits = transformer_shape_limits();
  for (std::size_t i = 0; i < limits.size(); ++i) {
    if (values[i] < 1 || values[i] > limits[i].max) {
      throw config_error("transformer shape: " + std::string(limits[i].field) + " " + std::to_string(values[i]) +
                         " is not valid; accepted: an integer from 1 to " + std::to_string(limits[i].max));
    }
  }
  if (s.hidden % s.heads != 0) {
    throw config_error("transformer shape: hidden " + std::to_string(s.hidden) + " is not a multiple of heads " +
                       std::to_string(s.heads));
  }
  if (s.dtype_bytes != 2 && s.dtype_bytes != 4) {
    throw config_error("transformer shape: dtype_bytes must be 2 (bf16, fp16) or 4 (fp32), not " +
                       std::to_string(s.dtype_bytes));
  }
  const Checked c{s};
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto f = static_cast<std::uint64_t>(s.ffn_mult);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const auto v = static_cast<std::uint64_t>(s.vocab);
  const auto layers = static_cast<std::uint64_t>(s.layers);
  const char* act = "activation bytes";
  Counts n;
  n.tokens = c.mul(static_cast<std::uint64_t>(s.seq), static_cast<std::uint64_t>(s.batch), "tokens per step");
  n.input = c.mul(c.mul(n.tokens, h, act), d, act);
  n.whole = c.mul(n.tokens, c.add(h * d, static_cast<std::uint64_t>(s.heads) * kFp32Bytes, act), act);
  n.split = c.mul(c.mul(n.tokens, (3 + f) * h, act), d, act);
  n.cheap = c.mul(n.tokens, c.add((3 + f) * h * d, 2 * kLayerNormStatBytes, act), act);
  n.transient = c.mul(c.mul(n.tokens, (2 * f + 1) * h, act), d, act);
  // Every layer's saved and transient bytes at once: what the planner adds up.
  const std::uint64_t block = c.add(c.add(c.add(n.input, n.whole, act), c.add(n.split, n.cheap, act), act),
                                    n.transient, act);
  c.mul(block, layers, act);

  const char* par = "parameters";
  const std::uint64_t per_block = 2 * 2 * h              // two LayerNorms
                                  + 3 * h * h + 3 * h    // qkv
                                  + h * h + h            // attention projection
                                  + f * h * h + f * h    // MLP up
                                  + f * h * h + h;       // MLP down (h <= 2^20, f <= 64: < 2^48)
  n.block_parameters = per_block;
  n.parameters = c.add(c.add(c.mul(2, c.mul(v, h, par), par), c.mul(static_cast<std::uint64_t>(s.seq), h, par), par),
                       c.add(c.mul(layers, per_block, par), 2 * h, par), par);
  // Training state: parameters and gradients, the fp32 master and Adam's m and v (all on the device at most).
  const char* state = "training-state bytes";
  c.add(c.mul(c.mul(2, n.parameters, state), d, state), c.mul(n.parameters, 3 * kFp32Bytes, state), state);

  const char* head = "head activation bytes";
  const std::uint64_t saved = c.mul(n.tokens, c.add(2 * h * d + kLayerNormStatBytes, v * kFp32Bytes, head), head);
  const std::uint64_t transient = c.mul(n.tokens, v * d + 2 * v * kFp32Bytes, head);
  n.head = c.add(saved, transient, head);
  return n;
}

}  // namespace

std::int64_t TransformerShape::tokens() const {
  std::int64_t t = 0;
  if (seq < 0 || batch < 0 || __builtin_mul_overflow(seq, batch, &t)) {
    throw config_error("transformer shape: seq " + std::to_string(seq) + " x batch " + std::to_string(batch) +
                       " tokens per step is not valid; accepted: a positive product that fits in 63 bits");
  }
  return t;
}

const std::vector<ShapeLimit>& transformer_shape_limits() {
  // In the order of counts()'s `values`.
  static const std::vector<ShapeLimit> kLimits = {
      {"layers", 10000},      {"hidden", 1 << 20}, {"heads", 1 << 16}, {"seq", 1 << 24},
      {"batch", 1 << 24},     {"vocab", 1 << 24},  {"ffn_mult", 64},
  };
  return kLimits;
}

void check_transformer_shape(const TransformerShape& shape) { counts(shape); }

std::vector<BlockProfile> estimate_transformer(const TransformerShape& s, double flops_per_second) {
  const Counts n = counts(s);
  if (!(flops_per_second > 0) || !std::isfinite(flops_per_second))
    throw config_error("estimate_transformer: flops_per_second must be a positive finite number");
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto f = static_cast<std::uint64_t>(s.ffn_mult);
  const double hd = static_cast<double>(h);
  const double tok = static_cast<double>(n.tokens);

  BlockProfile p;
  p.input_bytes = n.input;
  p.whole_bytes = n.whole;
  p.split_bytes = n.split;
  p.cheap_bytes = n.cheap;
  p.transient_bytes = n.transient;
  p.parameter_bytes = n.block_parameters * static_cast<std::uint64_t>(s.dtype_bytes);  // < 2^48 * 4

  const double qkv_flops = 2 * hd * 3 * hd, proj_flops = 2 * hd * hd;
  const double mlp_flops = 2 * 2 * hd * static_cast<double>(f) * hd;      // fc and its projection
  const double attention_flops = 2 * static_cast<double>(s.seq) * hd;    // causal: half of 4 * seq * h
  const double per_token = qkv_flops + proj_flops + mlp_flops + attention_flops;
  p.forward_seconds = tok * per_token / flops_per_second;
  p.backward_seconds = 2 * p.forward_seconds;
  p.split_recompute_seconds = tok * (qkv_flops + mlp_flops / 2) / flops_per_second;
  // The replay runs every recorded op again, the MLP's down projection included (Note [Activation plans]).
  p.cheap_recompute_seconds = tok * (proj_flops + mlp_flops / 2) / flops_per_second;
  p.splittable = true;
  return std::vector<BlockProfile>(static_cast<std::size_t>(s.layers), p);
}

std::uint64_t transformer_parameters(const TransformerShape& s) { return counts(s).parameters; }

std::uint64_t transformer_block_parameters(const TransformerShape& s) { return counts(s).block_parameters; }

double cpu_optimizer_bytes_per_param(StateFormat states, int dtype_bytes) noexcept {
  const double master = dtype_bytes < static_cast<int>(kFp32Bytes) ? kFp32Bytes : 0.0;
  switch (states) {
    case StateFormat::kFp32: return master + 2.0 * kFp32Bytes;
    case StateFormat::kBf16:
    case StateFormat::k8bit: return master + moments_bytes_per_param(states);
  }
  return master + 2.0 * kFp32Bytes;
}

std::uint64_t cpu_optimizer_state_bytes(StateFormat states, std::uint64_t n, int dtype_bytes) noexcept {
  const std::uint64_t master = dtype_bytes < static_cast<int>(kFp32Bytes) ? n * kFp32Bytes : 0;
  switch (states) {
    case StateFormat::kFp32: return master + 2 * n * kFp32Bytes;
    case StateFormat::kBf16: return master + 2 * n * 2;
    case StateFormat::k8bit: return master + 2 * (n + kFp32Bytes * quant_blocks(n));
  }
  return master + 2 * n * kFp32Bytes;
}

StateBytes estimate_training_state(const TransformerShape& s, OffloadTarget optimizer, StateFormat states) {
  TIERFLOW_EXPECTS(optimizer != OffloadTarget::kAuto,
                   "estimate_training_state: the optimizer goes to none, host or nvme, not auto");
  const std::uint64_t n = transformer_parameters(s);  // checked: every product below fits
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  // tierflow's CPU AdamW (host, nvme) keeps fp32 masters (a narrower dtype's) and m and v in `states` (at most
  // the 12 bytes counts() checked); torch's AdamW on the device (none) makes its moments with zeros_like: in the
  // parameters' dtype, and no masters.
  const std::uint64_t offloaded = cpu_optimizer_state_bytes(states, n, s.dtype_bytes);
  const std::uint64_t on_device = 2 * n * d;
  StateBytes out;
  out.parameter_bytes = out.gradient_bytes = n * d;
  out.optimizer_bytes = optimizer == OffloadTarget::kNone ? on_device : offloaded;
  out.device = 2 * n * d;  // parameters and gradients
  switch (optimizer) {
    case OffloadTarget::kNone: out.device += on_device; break;
    case OffloadTarget::kHost: out.host = offloaded; break;
    case OffloadTarget::kNvme: out.nvme = offloaded; break;
    case OffloadTarget::kAuto: break;
    case OffloadTarget::kRecompute: break;
  }
  return out;
}

std::uint64_t estimate_head_device_bytes(const TransformerShape& s) { return counts(s).head; }

OffloadTarget parse_optimizer_placement(std::string_view text) {
  if (text == "none") return OffloadTarget::kNone;
  if (text == "host") return OffloadTarget::kHost;
  if (text == "nvme") return OffloadTarget::kNvme;
  throw config_error("optimizer placement '" + std::string(text) + "' is not one of none, host, nvme");
}

}  // namespace tierflow::tiering
