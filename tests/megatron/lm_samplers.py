"""What Megatron-LM's pretraining samplers read, as their source defines it
(``megatron/training/datasets/data_samplers.py``; Megatron-LM's training
package is not on the package index, so the rules are written out here
from that source, not imported), and Megatron-LM's resume: its loaders
built after the load from ``args.consumed_train_samples``.

- ``single`` (``MegatronPretrainingSampler``): indices from ``consumed`` in
  blocks of ``m * D``; rank ``r`` takes ``block[r*m : (r+1)*m]``; a last
  partial block is dropped.
- ``cyclic`` (``MegatronPretrainingRandomSampler``): each ``__iter__`` puts
  its count in epoch ``C // A`` at ``C % A`` (``A = N - N % (m*D)``, and
  the offset must be whole blocks of ``m*D``); without data sharding rank
  ``r`` reads ``randperm((N // m) * m, seed=epoch)[offset:][r::D]``, with
  it ``r*B + randperm(B, seed=epoch)[offset // D:]`` (``B = (N // (m*D)) *
  m``), ``m`` at a time, adding ``m*D`` to its count per micro-batch;
  Megatron-LM's training loop calls ``__iter__`` again when one ends.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import torch

__all__ = ["Job", "rank_batches", "global_steps", "args_of"]


@dataclasses.dataclass(frozen=True)
class Job:
    """One Megatron-LM data layout: ``dp`` ranks of micro-batch ``m``,
    ``micro`` micro-batches per global step, a dataset of ``n`` samples."""

    dp: int
    m: int
    micro: int = 1
    n: int = 144
    kind: str = "single"
    sharding: bool = True

    @property
    def gbs(self) -> int:
        return self.dp * self.m * self.micro


def args_of(job: Job, consumed: int = 0) -> argparse.Namespace:
    """Megatron-LM's arguments for ``job`` (as ``megatron.training.get_args()`` holds them)."""
    return argparse.Namespace(consumed_train_samples=consumed, skipped_train_samples=0, consumed_valid_samples=0,
                              micro_batch_size=job.m, global_batch_size=job.gbs, data_parallel_size=job.dp,
                              dataloader_type=job.kind, data_sharding=job.sharding)


def _single(job: Job, consumed: int, r: int) -> Iterator[list[int]]:
    block = job.m * job.dp
    for start in range(consumed, job.n - block + 1, block):
        yield list(range(start + r * job.m, start + (r + 1) * job.m))


def _cyclic(job: Job, consumed: int, r: int) -> Iterator[list[int]]:
    m, dp, n = job.m, job.dp, job.n
    while True:  # Megatron-LM's cyclic iterator: a new __iter__ whenever one ends
        active = n - n % (m * dp)
        epoch, offset = divmod(consumed, active)
        assert offset % (m * dp) == 0, "Megatron's sampler asserts whole micro-batches"
        g = torch.Generator()
        g.manual_seed(epoch)
        if job.sharding:
            bucket = (n // (m * dp)) * m
            mine = [r * bucket + x for x in torch.randperm(bucket, generator=g).tolist()[offset // dp:]]
        else:
            mine = torch.randperm((n // m) * m, generator=g).tolist()[offset:][r::dp]
        for i in range(0, len(mine) - m + 1, m):
            consumed += m * dp
            yield mine[i:i + m]


def rank_batches(job: Job, consumed: int, r: int) -> Iterator[list[int]]:
    """Rank ``r``'s micro-batches from a loader built at ``consumed``."""
    return _single(job, consumed, r) if job.kind == "single" else _cyclic(job, consumed, r)


def global_steps(job: Job, consumed: int, steps: int) -> list[tuple[int, ...]]:
    """The next ``steps`` global steps (each rank's ``micro`` micro-batches), samples sorted."""
    its = [rank_batches(job, consumed, r) for r in range(job.dp)]
    out = []
    for _ in range(steps):
        got = [x for it in its for _ in range(job.micro) for x in next(it)]
        out.append(tuple(sorted(got)))
    return out
