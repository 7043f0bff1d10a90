// Estimated block profiles and training-state bytes of a GPT-2-style transformer,
// from its shape alone: the input of `python -m tierflow plan` when there is no
// measured profile.
//
// Note [Transformer estimate]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The block is benchmarks/gpt_model.py's Block: x + attn(ln1(x)), then
// x2 + mlp(ln2(x2)); attention is qkv Linear, causal SDPA (flash: it saves q,
// k, v, its output and the fp32 logsumexp), proj Linear; the MLP is fc, GELU,
// proj with ffn_mult * hidden units; no dropout. What autograd saves per token,
// in elements of the model's dtype (h = hidden, f = ffn_mult):
//   input  x                                  h      (LayerNorm's input)
//   whole  SDPA output                        h      (+ heads fp32 logsumexp); proj's input is a view of it
//   split  qkv Linear output (SDPA's q, k, v) 3h;  fc output (GELU's input) f*h
//   cheap  ln1 output h, x2 = x + proj(y) h, ln2 output h, GELU output f*h (+ 4 fp32 LayerNorm stats)
// i.e. (8 + 2f) * h elements, 16h for f = 4. Checked against torch 2.x on the
// CPU (hidden 32, heads 4, seq 64, batch 2, fp32): saved_tensors_hooks over one
// Block, counted once per storage with parameters excluded, gave 13 storages of
// 2080 bytes per token = 16h * 4 + 16 + 4 * heads, class by class as above
// (tests/python/test_plan_cli.py repeats this check).
// Times from flops at `flops_per_second`: a Linear of n -> m costs 2nm flops
// per token, causal attention 2 * seq * h per token (4 * seq * h halved); the
// backward is twice the forward; pointwise work is not counted. Recomputing
// the split rows costs the qkv and fc matmuls, the cheap part costs proj's
// matmul (x2 needs it) and the MLP's down projection (the replay runs every
// recorded op again, Note [Activation plans], though backward needs only its
// input). transient_bytes is the backward's gradient buffers of
// the MLP: (2f + 1) * h elements per token.
// Against the H100 figures of issue 9 (bench_gpu_offload's gpt1b, vocab 32000,
// torch AdamW with bf16 states: fixed = 8 bytes per parameter plus
// estimate_head_device_bytes), the planner's model predicts a device peak of
// 25.8 GiB with every block kept and 14.3 GiB with every block recomputed;
// measured: 25.06 GiB (baseline) and 15.04 GiB (checkpoint per block).
// Optimizer states (Note [Optimizer state formats] in optimizer/state_format.hpp): tierflow's CPU AdamW
// (--optimizer host or nvme) keeps on its tier the fp32 master (fp32 parameters too: theirs are the device's;
// measured, tests/python/test_plan_model.py) and m and v in the format TIERFLOW_OPTIMIZER_STATES names (--optimizer-states): 8, 4, or 2
// bytes a parameter plus two fp32 scales per block of 256, i.e. 12, 8 or about 6.03 bytes a bf16
// parameter. The 8-bit scales are counted per whole block of the model's parameters: each tensor's partial
// last block and its codes' padding to 16 bytes (under 1 KiB a tensor) are not. torch's AdamW on the device
// (--optimizer none) keeps its m and v in the parameters' dtype whatever the setting says.
// A shape is checked before anything is built: every field within
// transformer_shape_limits() (far past any real model, and few enough layers
// that one profile per layer is cheap to build and plan), and every byte count
// computed with checked 64-bit arithmetic; a shape whose bytes overflow is a
// config_error, never a wrapped-around count.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "tierflow/core/config.hpp"
#include "tierflow/core/state_format.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

/// The shape of a decoder. The first fields alone are a GPT-2-style one (learned positions, untied head, LayerNorm,
/// biases, GELU MLP of ffn_mult * hidden); the fields after them describe the families of a transformers
/// config.json (Note [Model families] in model_config.hpp), their defaults leaving the GPT-2-style shape as it was.
struct TransformerShape {
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  std::int64_t seq = 0;
  std::int64_t batch = 0;
  int dtype_bytes = 2;   ///< parameters and activations: 4 fp32, 2 bf16/fp16
  std::int64_t vocab = 50304;
  int ffn_mult = 4;
  int kv_heads = 0;               ///< key/value heads (grouped-query attention); 0: heads
  int head_dim = 0;               ///< 0: hidden / heads
  std::int64_t intermediate = 0;  ///< the MLP's units (of one expert: expert_intermediate); 0: ffn_mult * hidden
  bool gated = false;             ///< gate, up and down projections (SwiGLU, GeGLU); else fc and proj
  bool rms_norm = false;          ///< RMSNorm (a weight, fp32 inside); else LayerNorm (weight and bias)
  bool qkv_bias = true;           ///< q, k and v projections have biases
  bool output_bias = true;        ///< the attention's output projection has a bias
  bool mlp_bias = true;           ///< the MLP's projections have biases
  bool qk_norm = false;           ///< RMSNorm over each head of q and k (Qwen3)
  bool tied = false;              ///< the head shares the token embedding's weight
  std::int64_t positions = -1;    ///< learned position embeddings' rows; -1: seq (the GPT-2-style shape); 0: none
  int experts = 0;                ///< MLP experts per block (mixture of experts); 0: a dense MLP
  int experts_per_token = 0;      ///< experts each token is routed to
  std::int64_t expert_intermediate = 0;  ///< one expert's units; 0: intermediate
  int activation_saved = 0;       ///< tensors of the MLP's width its activation saves beyond its input (gelu_new: 3)
  /// Tokens per step; throws config_error when seq * batch overflows 64 bits.
  std::int64_t tokens() const;
};

/// The accepted range of one TransformerShape field, [1, max] (dtype_bytes: 2 or 4).
struct ShapeLimit {
  std::string_view field;  ///< the field's name, e.g. "layers" (the plan command's flag is --layers)
  std::int64_t max;        ///< largest accepted value
};

/// Every field's upper bound (layers 10000, hidden 2^20, heads 2^16, seq, batch and vocab 2^24, ffn_mult
/// 64), checked before anything is built; the plan command checks its arguments against the same table.
const std::vector<ShapeLimit>& transformer_shape_limits();

/// Throws config_error naming the first field outside its limits (or heads not dividing hidden) and what
/// is accepted, or a byte count of the estimates that overflows 64 bits.
void check_transformer_shape(const TransformerShape& shape);

/// One profile per layer, see Note [Transformer estimate]. Throws config_error for a bad shape.
std::vector<BlockProfile> estimate_transformer(const TransformerShape& shape, double flops_per_second);

/// Parameters of the model (embeddings, blocks, final norm, head).
std::uint64_t transformer_parameters(const TransformerShape& shape);
/// Parameters of one repeated block (its BlockProfile::parameter_bytes is this times dtype_bytes).
std::uint64_t transformer_block_parameters(const TransformerShape& shape);
/// Elements of each parameter tensor of the model (embeddings, each block's, final norm, head), adding up to
/// transformer_parameters: what the CPU AdamW's pinned pool is sized by (optimizer::state_pool_need).
std::vector<std::uint64_t> transformer_parameter_numels(const TransformerShape& shape);
/// Forward flops of one block per token (matmuls; an MoE block's routed experts only).
double transformer_block_flops_per_token(const TransformerShape& shape);

/// Bytes of training state per tier.
struct StateBytes {
  std::uint64_t device = 0, host = 0, nvme = 0;
  // The same bytes by kind, wherever they live (device + host + nvme = their sum):
  std::uint64_t parameter_bytes = 0;  ///< the model's parameters, in its dtype
  std::uint64_t gradient_bytes = 0;   ///< their gradients, in the same dtype
  std::uint64_t optimizer_bytes = 0;  ///< Adam's m and v (and fp32 masters on the CPU optimizer's tiers)
};

/// Bytes tierflow's CPU AdamW keeps a parameter of `dtype_bytes` with moments in `states`: the fp32 master
/// (4, for every dtype) and m and v (8, 4, or 2 + 8/256): 12, 8 or 6.03 for bf16 (Note
/// [Transformer estimate], Optimizer states).
double cpu_optimizer_bytes_per_param(StateFormat states, int dtype_bytes) noexcept;

/// The same for `parameters` parameters, in whole bytes (the 8-bit scales of ceil(parameters / 256) blocks).
/// `parameters` with 12 bytes each within 64 bits (transformer_parameters of any accepted shape).
std::uint64_t cpu_optimizer_state_bytes(StateFormat states, std::uint64_t parameters, int dtype_bytes) noexcept;

/// Parameters and optimizer: parameters (dtype) and gradients (dtype) on the device; for `none` torch's AdamW
/// on the device, its m and v in the parameters' dtype (zeros_like; `states` does not apply); for host or NVMe
/// tierflow's CPU AdamW there, cpu_optimizer_state_bytes in `states` (TIERFLOW_OPTIMIZER_STATES).
StateBytes estimate_training_state(const TransformerShape& shape, OffloadTarget optimizer,
                                   StateFormat states = StateFormat::kFp32);
/// The optimizer placement named `text` (none, host, nvme); config_error naming it and the accepted names.
OffloadTarget parse_optimizer_placement(std::string_view text);

/// Device bytes of the activations outside the blocks: final norm, head input, and the loss's fp32
/// logits (log-softmax output saved, plus the logits and their gradient while the loss runs).
std::uint64_t estimate_head_device_bytes(const TransformerShape& shape);
/// Of those, what is saved for backward (final norm, head input, log-softmax output): what a saved-tensor meter
/// measures; the rest is the loss's transient logits and their gradient.
std::uint64_t estimate_head_saved_bytes(const TransformerShape& shape);

}  // namespace tierflow::tiering
