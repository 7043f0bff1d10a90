"""The GPT that bench_gpu_offload.py trains: pre-LN blocks of causal SDPA attention and a 4x GELU MLP
(or, with GPTConfig.mlp="swiglu", Llama's gated SiLU MLP of width mlp_hidden, without biases).

No dropout, so every mode computes the same function and losses can be compared
step by step. The blocks are an ``nn.ModuleList`` of identical ``Block``
modules (a planner may look for repeated blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int
    tie_head: bool = False
    mlp_hidden: Optional[int] = None  # the MLP's inner width (default 4 * d_model)
    mlp: str = "gelu"                  # "gelu": fc, GELU, proj; "swiglu": proj(silu(gate(x)) * up(x)), no biases

    @property
    def hidden(self) -> int:
        return self.mlp_hidden if self.mlp_hidden is not None else 4 * self.d_model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class SwiGLU(nn.Module):
    """Llama's MLP: proj(silu(gate(x)) * up(x)), three bias-free matrices of width cfg.hidden."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp {cfg.mlp!r}: accepted, 'gelu' or 'swiglu'")
        self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_head:
            self.head.weight = self.tok.weight
        self.checkpoint_blocks = False  # recompute each block in backward (torch.utils.checkpoint)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, residual_std if name.endswith(".proj") else 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 (a bf16 loss near 10 is quantized to 1/16, too coarse to compare modes)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def parameter_count(cfg: GPTConfig) -> int:
    """Parameters of GPT(cfg), from the shapes alone."""
    d, h = cfg.d_model, cfg.hidden
    mlp = (3 * d * h if cfg.mlp == "swiglu"   # gate, up, down; no biases
           else d * h + h + h * d + d)      # up and down with biases
    block = (2 * 2 * d            # two LayerNorms
             + 3 * d * d + 3 * d  # qkv
             + d * d + d          # attention projection
             + mlp)
    head = 0 if cfg.tie_head else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layer * block + 2 * d + head
