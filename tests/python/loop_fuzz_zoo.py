"""The training-loop fuzzer's models (tests/python/loop_fuzz.py, issue 37 part 4): a tiny GPT with tied
weights, MLP blocks with BatchNorm1d and dropout, a small CNN with BatchNorm2d, an nn.TransformerEncoder; each
loop's batches and loss."""

from __future__ import annotations

import loop_fuzz_loop  # noqa: F401  (first: the process's set-up, before torch)
import torch
import torch.nn as nn
import torch.nn.functional as F
from gpt import GPT, GPTConfig
from loop_fuzz_loop import Loop

WIDTH, TOKENS, BATCH, VOCAB = 32, 16, 4, 48


class TiedGPT(GPT):
    """examples/gpt.py's GPT with the head tied to the token embedding (as GPT-2's)."""

    def __init__(self, dropout: float) -> None:
        super().__init__(GPTConfig(vocab_size=VOCAB, block_size=TOKENS, n_layer=2, n_head=4, n_embd=WIDTH,
                                   dropout=dropout))
        self.head.weight = self.tok.weight


class MLPBlock(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        # No bias before BatchNorm: its exact gradient is zero, and Adam turns the rounding noise there into
        # lr-sized steps that differ between any two correct optimizers (harness.assert_close).
        self.fc = nn.Linear(WIDTH, WIDTH, bias=False)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.bn(self.fc(x))))


class MLPNet(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(MLPBlock(dropout) for _ in range(3))
        self.out = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class ConvBlock(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout2d(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.bn(self.conv(x))))


class CNN(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(dropout) for _ in range(2))
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(F.adaptive_avg_pool2d(x, 4).flatten(1))


class Encoder(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=WIDTH, nhead=4, dim_feedforward=2 * WIDTH, dropout=dropout,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def make_model(loop: Loop) -> nn.Module:
    return {"gpt_tied": TiedGPT, "mlp_bn": MLPNet, "cnn_bn": CNN, "encoder": Encoder}[loop.model](loop.dropout)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return model.enc.layers if isinstance(model, Encoder) else model.blocks


def batch(loop: Loop, i: int) -> tuple:
    """Batch `i` of the loop's model: the same tensors in both runs (a generator of their own)."""
    g = torch.Generator().manual_seed(10_000 + 97 * loop.seed + i)
    if loop.model == "gpt_tied":
        x = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    if loop.model == "mlp_bn":
        return torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)
    if loop.model == "cnn_bn":
        return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    return torch.randn(BATCH, TOKENS, WIDTH, generator=g), torch.randint(0, 8, (BATCH, TOKENS), generator=g)


def loss_of(model: nn.Module, b: tuple) -> torch.Tensor:
    out = model(b[0])
    return F.cross_entropy(out.reshape(-1, out.size(-1)).float(), b[1].reshape(-1))
