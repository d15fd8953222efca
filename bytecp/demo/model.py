"""The demo's model and data: a small GPT-like model with shapes that do not
divide evenly, and a learnable next-token map so the loss visibly falls."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyGPT", "batch", "train_steps", "say"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 3 * dim + 1), nn.GELU(), nn.Linear(3 * dim + 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT-like model with shapes that do not divide evenly."""

    def __init__(self, vocab: int = 97, dim: int = 30, layers: int = 2, heads: int = 2, seq: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(step: int, vocab: int = 97, seq: int = 13, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, (x * 3 + 1) % vocab  # a learnable map, so the loss visibly falls


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> list[float]:
    losses = []
    for step in range(start, start + n):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


