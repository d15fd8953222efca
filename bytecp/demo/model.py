"""The demo's model and data, in plain torch and torchdata (no bytecp, no torch.distributed).

Used by the training job (:mod:`bytecp.demo.train`), the uninterrupted
reference run (:mod:`bytecp.demo.story`) and the evaluation job
(:mod:`bytecp.demo.evaluate`), so all three compute the same thing.

The data is a fixed set of token sequences and a learnable task (each token
maps to another), so the loss visibly falls in a few steps. The training job
reads it as real jobs do: torchdata's ``StatefulDataLoader`` with torch's
``DistributedSampler`` (:func:`data_loader`), ``GLOBAL_BATCH // world``
sequences per process. The sampler deals the epoch's shuffled order out to
the processes in turn, so global step ``s`` holds positions
``[(s-1)*GLOBAL_BATCH, s*GLOBAL_BATCH)`` of that order whatever the number
of processes (:func:`global_batch`, the reference run's batches); bytecp
saves the loader with the checkpoint and reshards its position when a job
resumes on another number of processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = [
    "TinyGPT",
    "GLOBAL_BATCH",
    "DATASET_SIZE",
    "STEPS_PER_EPOCH",
    "SEED",
    "global_batch",
    "data_loader",
    "eval_batch",
    "loss_of",
    "say",
]

VOCAB, SEQ = 97, 13
#: sequences per optimizer step, over all processes
GLOBAL_BATCH = 12
#: sequences in the training set
DATASET_SIZE = 240
STEPS_PER_EPOCH = DATASET_SIZE // GLOBAL_BATCH
#: the sampler's seed: epoch ``e`` is ordered by ``torch.randperm`` seeded ``SEED + e``, as DistributedSampler does
SEED = 5000


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
        # (a copy, not the view a linear layer returns for 3-d input: FSDP2 warns of a wrapped module
        # returning a view, which an in-place op would cut from its pre-backward hook)
        return self.head(self.ln(x)).clone()


def _sequences(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB  # the task: a token-to-token map the model learns


_TRAIN = _sequences(1234, DATASET_SIZE)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``GLOBAL_BATCH`` training sequences of global step ``step`` (1-based),
    as the training job's processes draw them together: positions
    ``[pos*G, (pos+1)*G)`` of epoch ``e``'s order (``e, pos = divmod(step - 1,
    STEPS_PER_EPOCH)``), the order ``DistributedSampler(shuffle=True,
    seed=SEED)`` gives every process."""
    epoch, pos = divmod(step - 1, STEPS_PER_EPOCH)
    order = torch.randperm(DATASET_SIZE, generator=torch.Generator().manual_seed(SEED + epoch))
    idx = order[pos * GLOBAL_BATCH : (pos + 1) * GLOBAL_BATCH]
    return _TRAIN[0][idx], _TRAIN[1][idx]


def data_loader(rank: int, world: int) -> StatefulDataLoader:
    """Process ``rank``'s loader: torchdata's ``StatefulDataLoader`` over the
    training set with torch's ``DistributedSampler`` (its epoch set by the
    training loop), ``GLOBAL_BATCH // world`` sequences per step."""
    if GLOBAL_BATCH % world:
        raise ValueError(f"the demo's global batch of {GLOBAL_BATCH} does not split over {world} processes")
    try:  # (imported here: the evaluation job needs only the model, plain torch)
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ModuleNotFoundError as e:
        from bytecp.plugins import missing_extra

        raise missing_extra(e, "demo", __name__) from None
    data = TensorDataset(*_TRAIN)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    return StatefulDataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out sequences (never trained on) for the evaluation loss."""
    return _sequences(999, 24)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions."""
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)
