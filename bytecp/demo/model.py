"""The demo's model and data, in plain torch (no bytecp, no torch.distributed).

Used by the training job (:mod:`bytecp.demo.train`), the uninterrupted
reference run (:mod:`bytecp.demo.story`) and the evaluation job
(:mod:`bytecp.demo.evaluate`), so all three compute the same thing.

The data is a fixed set of token sequences and a learnable task (each token
maps to another), so the loss visibly falls in a few steps. The sampler is
keyed by the *global* step: step ``s`` always trains on the same
``GLOBAL_BATCH`` sequences, split evenly over however many processes run it
(1, 2, 3, 4, 6 or 12), so a job resumed at step ``s`` on another number of
processes sees exactly the data the interrupted one would have seen.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "TinyGPT",
    "GLOBAL_BATCH",
    "DATASET_SIZE",
    "global_batch",
    "local_batch",
    "eval_batch",
    "loss_of",
    "say",
]

VOCAB, SEQ = 97, 13
#: sequences per optimizer step, over all processes
GLOBAL_BATCH = 12
#: sequences in the training set (an epoch is DATASET_SIZE // GLOBAL_BATCH steps)
DATASET_SIZE = 240


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

    def __init__(self, vocab: int = VOCAB, dim: int = 30, layers: int = 2, heads: int = 2, seq: int = SEQ) -> None:
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


def _sequences(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB  # the task: a token-to-token map the model learns


_TRAIN = _sequences(1234, DATASET_SIZE)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``GLOBAL_BATCH`` training sequences of global step ``step`` (1-based):
    a seeded shuffle per epoch, so the order depends on the step alone."""
    per_epoch = DATASET_SIZE // GLOBAL_BATCH
    epoch, pos = divmod(step - 1, per_epoch)
    order = torch.randperm(DATASET_SIZE, generator=torch.Generator().manual_seed(5000 + epoch))
    idx = order[pos * GLOBAL_BATCH : (pos + 1) * GLOBAL_BATCH]
    return _TRAIN[0][idx], _TRAIN[1][idx]


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of :func:`global_batch`."""
    if GLOBAL_BATCH % world:
        raise ValueError(f"the demo's global batch of {GLOBAL_BATCH} does not split over {world} processes")
    n = GLOBAL_BATCH // world
    x, y = global_batch(step)
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out sequences (never trained on) for the evaluation loss."""
    return _sequences(999, 24)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions."""
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)
