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
  std::uint64_t head_saved = 0;  // its saved part (estimate_head_saved_bytes)
  // The derived widths (Note [Model families]): attention (heads * head_dim), keys and values, MLP units.
  std::uint64_t attention = 0, kv = 0, intermediate = 0, expert_intermediate = 0;
  std::uint64_t norm_saved = 0;  // bytes one norm saves per token beside its input (output included)
};

void check_range(std::int64_t value, std::int64_t least, std::int64_t most, const char* field) {
  if (value < least || value > most) {
    throw config_error("transformer shape: " + std::string(field) + " " + std::to_string(value) +
                       " is not valid; accepted: an integer from " + std::to_string(least) + " to " +
                       std::to_string(most));
  }
}

// A shape comes from the user (the command line, a config.json): a bad one is a config_error.
void check_shape(const TransformerShape& s) {
  const std::int64_t values[] = {s.layers, s.hidden, s.heads, s.seq, s.batch, s.vocab, s.ffn_mult};
  const auto& limits = transformer_shape_limits();
  for (std::size_t i = 0; i < limits.size(); ++i) {
    if (values[i] < 1 || values[i] > limits[i].max) {
      throw config_error("transformer shape: " + std::string(limits[i].field) + " " + std::to_string(values[i]) +
                         " is not valid; accepted: an integer from 1 to " + std::to_string(limits[i].max));
    }
  }
  check_range(s.kv_heads, 0, s.heads, "kv_heads");
  check_range(s.head_dim, 0, 1 << 16, "head_dim");
  check_range(s.intermediate, 0, 1 << 24, "intermediate");
  check_range(s.positions, -1, 1 << 24, "positions");
  check_range(s.experts, 0, 1 << 12, "experts");
  if (s.experts > 0) check_range(s.experts_per_token, 1, s.experts, "experts_per_token");
  check_range(s.expert_intermediate, 0, 1 << 24, "expert_intermediate");
  check_range(s.activation_saved, 0, 8, "activation_saved");
  if (s.head_dim == 0 && s.hidden % s.heads != 0) {
    throw config_error("transformer shape: hidden " + std::to_string(s.hidden) + " is not a multiple of heads " +
                       std::to_string(s.heads));
  }
  if (s.kv_heads > 0 && s.heads % s.kv_heads != 0) {
    throw config_error("transformer shape: heads " + std::to_string(s.heads) + " is not a multiple of kv_heads " +
                       std::to_string(s.kv_heads));
  }
  if (s.dtype_bytes != 2 && s.dtype_bytes != 4) {
    throw config_error("transformer shape: dtype_bytes must be 2 (bf16, fp16) or 4 (fp32), not " +
                       std::to_string(s.dtype_bytes));
  }
}

// Each head's width: head_dim, or hidden / heads when it is 0.
std::uint64_t head_dim_of(const TransformerShape& s) {
  return s.head_dim > 0 ? static_cast<std::uint64_t>(s.head_dim)
                        : static_cast<std::uint64_t>(s.hidden) / static_cast<std::uint64_t>(s.heads);
}

// The derived widths of a checked shape (Note [Model families]).
void fill_widths(const TransformerShape& s, Counts& n) {
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto heads = static_cast<std::uint64_t>(s.heads);
  const std::uint64_t head_dim = head_dim_of(s);
  const std::uint64_t kv_heads = s.kv_heads > 0 ? static_cast<std::uint64_t>(s.kv_heads) : heads;
  // All below 2^40 (2^16 * 2^16, 2^24 * 64): their small products fit without checks.
  n.attention = heads * head_dim;
  n.kv = kv_heads * head_dim;
  n.intermediate = s.intermediate > 0 ? static_cast<std::uint64_t>(s.intermediate)
                                      : static_cast<std::uint64_t>(s.ffn_mult) * h;
  n.expert_intermediate = s.expert_intermediate > 0 ? static_cast<std::uint64_t>(s.expert_intermediate)
                                                    : n.intermediate;
}

// The tokens per step and one block's saved and transient bytes, checked for every layer at once.
void fill_activations(const TransformerShape& s, const Checked& c, Counts& n) {
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const auto layers = static_cast<std::uint64_t>(s.layers);
  const auto heads = static_cast<std::uint64_t>(s.heads);
  const std::uint64_t a = n.attention, kv = n.kv, i = n.intermediate, ie = n.expert_intermediate;
  const auto experts = static_cast<std::uint64_t>(s.experts);
  const auto routed = static_cast<std::uint64_t>(s.experts > 0 ? s.experts_per_token : 0);
  const char* act = "activation bytes";
  n.tokens = c.mul(static_cast<std::uint64_t>(s.seq), static_cast<std::uint64_t>(s.batch), "tokens per step");
  // Per token, in bytes (Note [Transformer estimate]; Note [Model families] for the RMSNorm, gated and MoE terms).
  std::uint64_t input = h * d, whole = a * d + heads * kFp32Bytes, split = 0, cheap = 0, transient = 0;
  if (!s.rms_norm && !s.gated && s.experts == 0) {  // the GPT-2-style block
    n.norm_saved = h * d + kLayerNormStatBytes;
    split = (a + 2 * kv + i) * d;
    // gelu_new (GPT-2's tanh form in Python ops) saves tanh's output, 1 + tanh and x / 2 beside its input.
    cheap = (3 * h + i + static_cast<std::uint64_t>(s.activation_saved) * i) * d + 2 * kLayerNormStatBytes;
    transient = (2 * i + h) * d;
  } else {
    // RMSNorm in fp32: the fp32 upcast of its input (a 16-bit model's), rstd, the normalized and scaled outputs.
    n.norm_saved = s.rms_norm ? (d < kFp32Bytes ? kFp32Bytes * h : 0) + kFp32Bytes + 2 * h * d
                              : h * d + kLayerNormStatBytes;
    split = 3 * a * d;  // SDPA's q, k, v after the rotary embedding (k and v repeated to every head)
    cheap = 2 * n.norm_saved + h * d;  // both norms, and the residual sum the second one takes
    if (s.qk_norm) cheap += (a + kv) * ((d < kFp32Bytes ? kFp32Bytes : d) + 2 * d);
    if (s.experts == 0) {
      const std::uint64_t up = s.gated ? 2 * i : i;  // gate and up (the activation's input), or fc
      split += up * d;
      cheap += (s.gated ? 2 * i : i) * d;  // the activation's output and the product (or GELU's output)
      transient = (3 * i + 2 * h) * d;
    } else {
      // The router's fp32 softmax, and per routed token one expert's input rows, its gate and up outputs, the
      // activation and product, and its weighted output.
      split += c.mul(routed, 2 * ie * d, act);
      cheap += experts * kFp32Bytes + c.mul(routed, 2 * h * d + 2 * ie * d + kFp32Bytes, act);
      transient = c.add(c.mul(routed, 3 * ie * d, act), 2 * h * d, act);
    }
  }
  n.input = c.mul(n.tokens, input, act);
  n.whole = c.mul(n.tokens, whole, act);
  n.split = c.mul(n.tokens, split, act);
  n.cheap = c.mul(n.tokens, cheap, act);
  n.transient = c.mul(n.tokens, transient, act);
  // Every layer's saved and transient bytes at once: what the planner adds up.
  const std::uint64_t block = c.add(c.add(c.add(n.input, n.whole, act), c.add(n.split, n.cheap, act), act),
                                    n.transient, act);
  c.mul(block, layers, act);
}

// One block's and the model's parameters; the training state's bytes checked.
void fill_parameters(const TransformerShape& s, const Checked& c, Counts& n) {
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const auto v = static_cast<std::uint64_t>(s.vocab);
  const auto layers = static_cast<std::uint64_t>(s.layers);
  const std::uint64_t head_dim = head_dim_of(s);
  const std::uint64_t a = n.attention, kv = n.kv, i = n.intermediate, ie = n.expert_intermediate;
  const auto experts = static_cast<std::uint64_t>(s.experts);
  const char* par = "parameters";
  const std::uint64_t norm = s.rms_norm ? h : 2 * h;
  std::uint64_t per_block = 2 * norm + h * (a + 2 * kv) + a * h;  // norms, q k v, the output projection
  if (s.qkv_bias) per_block += a + 2 * kv;
  if (s.output_bias) per_block += h;
  if (s.qk_norm) per_block += 2 * head_dim;
  if (s.experts == 0) {
    per_block = c.add(per_block, (s.gated ? 3 : 2) * h * i, par);
    if (s.mlp_bias) per_block += (s.gated ? 2 * i : i) + h;
  } else {  // the router (no bias) and every expert's gate, up and down projections
    per_block = c.add(c.add(per_block, h * experts, par), c.mul(experts, 3 * h * ie, par), par);
  }
  n.block_parameters = per_block;
  const std::uint64_t positions = s.positions < 0 ? static_cast<std::uint64_t>(s.seq)
                                                  : static_cast<std::uint64_t>(s.positions);
  n.parameters = c.add(c.add(c.mul(s.tied ? 1 : 2, c.mul(v, h, par), par), c.mul(positions, h, par), par),
                       c.add(c.mul(layers, per_block, par), norm, par), par);
  // Training state: parameters and gradients, the fp32 master and Adam's m and v (all on the device at most).
  const char* state = "training-state bytes";
  c.add(c.mul(c.mul(2, n.parameters, state), d, state), c.mul(n.parameters, 3 * kFp32Bytes, state), state);
}

// The head's device bytes and their saved part.
void fill_head(const TransformerShape& s, const Checked& c, Counts& n) {
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto d = static_cast<std::uint64_t>(s.dtype_bytes);
  const auto v = static_cast<std::uint64_t>(s.vocab);
  const char* head = "head activation bytes";
  const std::uint64_t saved = c.mul(n.tokens, c.add(h * d + n.norm_saved, v * kFp32Bytes, head), head);
  const std::uint64_t transient_head = c.mul(n.tokens, v * d + 2 * v * kFp32Bytes, head);
  n.head = c.add(saved, transient_head, head);
  n.head_saved = saved;
}

// Every count of a shape, each part checked against 64 bits.
Counts counts(const TransformerShape& s) {
  check_shape(s);
  const Checked c{s};
  Counts n;
  fill_widths(s, n);
  fill_activations(s, c, n);
  fill_parameters(s, c, n);
  fill_head(s, c, n);
  return n;
}

// Forward flops per token of one block: a Linear of n -> m costs 2nm.
struct Flops {
  double qkv = 0, proj = 0, attention = 0, mlp_up = 0, mlp_down = 0;
  double total() const { return qkv + proj + attention + mlp_up + mlp_down; }
};

Flops flops_of(const TransformerShape& s, const Counts& n) {
  const double h = s.hidden, a = static_cast<double>(n.attention), kv = static_cast<double>(n.kv);
  Flops f;
  f.qkv = 2 * h * (a + 2 * kv);
  f.proj = 2 * a * h;
  f.attention = 2 * static_cast<double>(s.seq) * a;  // causal: half of 4 * seq * a
  if (s.experts > 0) {
    const double ie = static_cast<double>(n.expert_intermediate), k = s.experts_per_token;
    f.mlp_up = 2 * h * s.experts + k * 2 * 2 * h * ie;  // the router, and each routed expert's gate and up
    f.mlp_down = k * 2 * ie * h;
  } else {
    const double i = static_cast<double>(n.intermediate);
    f.mlp_up = (s.gated ? 2 : 1) * 2 * h * i;
    f.mlp_down = 2 * i * h;
  }
  return f;
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
  // In the order of check_shape()'s `values`.
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
  const double tok = static_cast<double>(n.tokens);

  BlockProfile p;
  p.input_bytes = n.input;
  p.whole_bytes = n.whole;
  p.split_bytes = n.split;
  p.cheap_bytes = n.cheap;
  p.transient_bytes = n.transient;
  p.parameter_bytes = n.block_parameters * static_cast<std::uint64_t>(s.dtype_bytes);  // checked in counts

  const Flops f = flops_of(s, n);
  p.forward_seconds = tok * f.total() / flops_per_second;
  p.backward_seconds = 2 * p.forward_seconds;
  p.split_recompute_seconds = tok * (f.qkv + f.mlp_up) / flops_per_second;
  // The replay runs every recorded op again, the MLP's down projection included (Note [Activation plans]).
  p.cheap_recompute_seconds = tok * (f.proj + f.mlp_down) / flops_per_second;
  // A router's choice of experts depends on the data: no exact token split (the zoo's MoE blocks swap whole).
  p.splittable = s.experts == 0;
  return std::vector<BlockProfile>(static_cast<std::size_t>(s.layers), p);
}

std::uint64_t transformer_parameters(const TransformerShape& s) { return counts(s).parameters; }

std::uint64_t transformer_block_parameters(const TransformerShape& s) { return counts(s).block_parameters; }

std::vector<std::uint64_t> transformer_parameter_numels(const TransformerShape& s) {
  const Counts n = counts(s);  // checked: every product below fits
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto v = static_cast<std::uint64_t>(s.vocab);
  const std::uint64_t a = n.attention, kv = n.kv, i = n.intermediate, ie = n.expert_intermediate;
  const auto experts = static_cast<std::uint64_t>(s.experts);
  const std::uint64_t positions = s.positions < 0 ? static_cast<std::uint64_t>(s.seq)
                                                  : static_cast<std::uint64_t>(s.positions);
  const int norm_tensors = s.rms_norm ? 1 : 2;  // weight, and LayerNorm's bias
  std::vector<std::uint64_t> block;
  for (int k = 0; k < 2 * norm_tensors; ++k) block.push_back(h);
  for (const std::uint64_t w : {h * a, h * kv, h * kv, a * h}) block.push_back(w);  // q, k, v, the output proj.
  if (s.qkv_bias)
    for (const std::uint64_t w : {a, kv, kv}) block.push_back(w);
  if (s.output_bias) block.push_back(h);
  if (s.qk_norm) block.insert(block.end(), 2, head_dim_of(s));
  if (s.experts == 0) {
    block.insert(block.end(), s.gated ? 3 : 2, h * i);
    if (s.mlp_bias) {
      block.insert(block.end(), s.gated ? 2 : 1, i);
      block.push_back(h);
    }
  } else {
    block.push_back(h * experts);  // the router
    // Each expert's gate, up and down; past a million tensors in all, each kind's experts as one (the pool's
    // page rounding of a few bytes a tensor aside, the same bytes, and no list of a hundred million entries).
    const bool each = experts * 3 * static_cast<std::uint64_t>(s.layers) <= (1u << 20);
    block.insert(block.end(), each ? 3 * experts : 3, each ? h * ie : experts * h * ie);
  }
  std::vector<std::uint64_t> out{v * h};  // the embedding
  if (positions > 0) out.push_back(positions * h);
  for (std::int64_t l = 0; l < s.layers; ++l) out.insert(out.end(), block.begin(), block.end());
  for (int k = 0; k < norm_tensors; ++k) out.push_back(h);  // the final norm
  if (!s.tied) out.push_back(v * h);  // the head
  return out;
}

double transformer_block_flops_per_token(const TransformerShape& s) { return flops_of(s, counts(s)).total(); }

// The CPU AdamW keeps a host master of every parameter it steps, fp32 ones included: the parameter itself is the
// device's (measured: optimizer.states.bytes is 12 bytes an fp32 parameter, tests/python/test_plan_model.py).
double cpu_optimizer_bytes_per_param(StateFormat states, int dtype_bytes) noexcept {
  (void)dtype_bytes;
  const double master = kFp32Bytes;
  switch (states) {
    case StateFormat::kFp32: return master + 2.0 * kFp32Bytes;
    case StateFormat::kBf16:
    case StateFormat::k8bit: return master + moments_bytes_per_param(states);
  }
  return master + 2.0 * kFp32Bytes;
}

std::uint64_t cpu_optimizer_state_bytes(StateFormat states, std::uint64_t n, int dtype_bytes) noexcept {
  (void)dtype_bytes;
  const std::uint64_t master = n * kFp32Bytes;
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

std::uint64_t estimate_head_saved_bytes(const TransformerShape& s) { return counts(s).head_saved; }

OffloadTarget parse_optimizer_placement(std::string_view text) {
  if (text == "none") return OffloadTarget::kNone;
  if (text == "host") return OffloadTarget::kHost;
  if (text == "nvme") return OffloadTarget::kNvme;
  throw config_error("optimizer placement '" + std::string(text) + "' is not one of none, host, nvme");
}

}  // namespace tierflow::tiering
