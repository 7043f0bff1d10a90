// A small GPT in torch::nn: token and position embeddings, N blocks of causal
// self-attention and an MLP (pre-LayerNorm, residual, dropout), a final
// LayerNorm and a linear head. forward() runs each block through tierflow's
// BlockOffload when one is given, and directly otherwise.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <tierflow/bindings/block_offload.hpp>

struct GPTConfig {
  int64_t vocab = 64;
  int64_t seq = 64;
  int64_t width = 64;
  int64_t heads = 4;
  int64_t layers = 4;
  double dropout = 0.1;
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c)
      : heads(c.heads),
        qkv(register_module("qkv", torch::nn::Linear(c.width, 3 * c.width))),
        proj(register_module("proj", torch::nn::Linear(c.width, c.width))),
        attn_drop(register_module("attn_drop", torch::nn::Dropout(c.dropout))),
        resid_drop(register_module("resid_drop", torch::nn::Dropout(c.dropout))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto parts = qkv(x).chunk(3, -1);
    auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    auto q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    auto att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    auto future = torch::ones({T, T}, torch::dtype(torch::kBool).device(x.device())).triu(1);
    att = attn_drop(torch::softmax(att.masked_fill(future, -INFINITY), -1));
    auto y = att.matmul(v).transpose(1, 2).contiguous().view({B, T, C});
    return resid_drop(proj(y));
  }

  int64_t heads;
  torch::nn::Linear qkv, proj;
  torch::nn::Dropout attn_drop, resid_drop;
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        attn(register_module("attn", CausalSelfAttention(c))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        fc(register_module("fc", torch::nn::Linear(c.width, 4 * c.width))),
        fc_out(register_module("fc_out", torch::nn::Linear(4 * c.width, c.width))),
        drop(register_module("drop", torch::nn::Dropout(c.dropout))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + drop(fc_out(torch::gelu(fc(ln2(x)))));
  }

  torch::nn::LayerNorm ln1;
  CausalSelfAttention attn;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, fc_out;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c)
      : tok(register_module("tok", torch::nn::Embedding(c.vocab, c.width))),
        pos(register_module("pos", torch::nn::Embedding(c.seq, c.width))),
        drop(register_module("drop", torch::nn::Dropout(c.dropout))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        head(register_module("head", torch::nn::Linear(c.width, c.vocab))) {
    for (int64_t i = 0; i < c.layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
  }

  /// Logits for token ids `idx` [B, T]; each block goes through `offload` when given.
  torch::Tensor forward(const torch::Tensor& idx, tierflow::bindings::BlockOffload* offload = nullptr) {
    auto positions = torch::arange(idx.size(1), torch::dtype(torch::kLong).device(idx.device()));
    auto x = drop(tok(idx) + pos(positions));
    for (std::size_t i = 0; i < blocks.size(); ++i)
      x = offload ? offload->forward(i, blocks[i], x) : blocks[i]->forward(x);
    return head(ln_f(x));
  }

  torch::nn::Embedding tok, pos;
  torch::nn::Dropout drop;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(GPT);
