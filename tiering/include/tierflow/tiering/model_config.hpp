// A transformers config.json read torch-free into the planner's model
// description (TransformerShape): `python -m tierflow plan --model PATH`.
//
// Note [Model families]
// ~~~~~~~~~~~~~~~~~~~~~
// The families of the model zoo, by config.json's model_type, with the fields
// read and the defaults of transformers' config classes (4.57) where a field
// may be absent (a config saved by save_pretrained leaves out only fields
// equal to PretrainedConfig's and the class's defaults):
//   llama, mistral, qwen2, qwen3, gemma, phi3   RMSNorm, rotary positions, gated
//       MLP (gate, up, down), grouped-query attention: hidden_size,
//       num_hidden_layers, num_attention_heads, intermediate_size, vocab_size
//       (required); num_key_value_heads (num_attention_heads), head_dim
//       (hidden_size / num_attention_heads; qwen3 128, gemma 256; null: the
//       quotient), tie_word_embeddings (gemma true, else false),
//       max_position_embeddings, torch_dtype (or transformers 5's dtype).
//       Biases: llama's attention_bias (q, k, v and o) and mlp_bias; qwen2's q,
//       k and v always; qwen3's attention_bias; none for mistral, gemma, phi3.
//       qwen3 adds an RMSNorm over each head of q and k (q_norm, k_norm).
//   gpt2    LayerNorm, learned positions, biases, GELU MLP: n_embd, n_layer,
//       n_head, vocab_size (required); n_inner (null: 4 * n_embd),
//       n_positions (1024), tie_word_embeddings (true), activation_function
//       (gelu_new: its tanh form in Python ops saves 3 tensors of the MLP's
//       width beyond its input; measured: without them the estimate was 28%
//       under the run's saved bytes).
//   mixtral    llama's block with every MLP num_local_experts experts of
//       intermediate_size units, num_experts_per_tok routed (all required).
//   qwen3_moe  qwen3's attention with num_experts experts of
//       moe_intermediate_size units, num_experts_per_tok routed (required);
//       decoder_sparse_step 1 and no mlp_only_layers (a dense layer among the
//       sparse ones is refused: every block has the same shape).
// What each family's block saves for backward, its parameters and flops are
// Note [Transformer estimate]'s, with: an RMSNorm saves its fp32 upcast (of a
// 16-bit input), rstd, the normalized and the scaled outputs; SDPA saves q,
// k and v after the rotary embedding (k and v repeated to every head, as
// transformers' sdpa attention does before the kernel); a gated MLP saves
// gate and up (split: recomputable per row), the activation's output and the
// product; an MoE block saves the router's fp32 softmax and, per routed
// token, the expert's input rows, gate, up, activation, product and weighted
// output, and its blocks are not splittable (the routing depends on the
// data). Parameters count every weight of the model, the tied head once;
// tests/cpp/test_model_config.cpp compares them with transformers' models
// built on the meta device from the default configs.
//
// Errors. A file that cannot be read, is not JSON, has an unknown
// model_type, misses a required field or holds one of another type is a
// config_error naming the file and the field and saying what is accepted.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/tiering/transformer_profile.hpp"

namespace tierflow::tiering {

/// A config.json as the planner reads it.
struct ModelConfig {
  std::string path;        ///< the file read
  std::string model_type;  ///< config.json's model_type, e.g. "llama"
  std::string family;      ///< its family's name, e.g. "Llama"
  TransformerShape shape;  ///< seq and batch 0 (the command's); dtype_bytes from `dtype`, else 2
  std::optional<std::string> dtype;  ///< "fp32", "bf16" or "fp16" from torch_dtype (or dtype); none: absent
  std::int64_t max_positions = 0;    ///< max_position_embeddings (GPT-2: n_positions)
};

/// The model_type values read (Note [Model families]), in the order errors list them.
const std::vector<std::string>& model_types();

/// `text` (a config.json's contents) read from `path` (as errors name it); config_error as the Note says.
ModelConfig parse_model_config(std::string_view text, const std::string& path);

/// The config.json at `path`, or in it when `path` is a directory.
ModelConfig load_model_config(const std::string& path);

/// The plan command's tokens per sequence when --seq is not given: max_positions, at most 4096.
std::int64_t default_seq(const ModelConfig& config) noexcept;

}  // namespace tierflow::tiering
