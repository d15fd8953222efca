"""torch's ``DistributedSampler`` arithmetic the resharders of loaders drawn by
it share (torchdata's ``StatefulDataLoader``, DeepSpeed's loader): no
framework import beyond torch, so a job without torchdata can use it.

The sampler orders an epoch alike on every rank (a permutation seeded by
``seed + epoch``, padded or cut to a multiple of the ranks) and gives rank
``r`` of ``D`` the positions ``r, r + D, ...``: after each of ``D`` ranks
consumed ``s`` samples the run consumed positions ``[0, D*s)`` of that
order, whatever ``D`` is.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["sampler_sizes", "ORDER", "order_of", "same_order", "epoch_done"]

#: what must match between the saved and the loading sampler for the epoch's order to be the same
ORDER = ("dataset_len", "shuffle", "seed", "drop_last")


def sampler_sizes(n: int, ranks: int, drop_last: bool) -> tuple[int, int]:
    """``DistributedSampler``'s per-rank count and epoch length for ``n`` samples on ``ranks``."""
    per = math.ceil((n - ranks) / ranks) if drop_last and n % ranks else math.ceil(n / ranks)
    return max(0, per), max(0, per) * ranks


def same_order(sampler: Any, position: dict[str, Any]) -> bool:
    """Whether ``sampler`` orders the epoch as the one that recorded
    ``position`` did (each of :data:`ORDER` it recorded): at the same number
    of ranks a loader is restored as saved only then (another seed, dataset
    length, shuffle or drop_last would skip and repeat samples silently).
    A position saved once the epoch had ended (``finished``: the loop saw
    ``StopIteration``) continues with a whole next epoch in any order."""
    if position.get("finished"):
        return True
    here = order_of(sampler)
    return all(position[k] == here[k] for k in ORDER if k in position)


def order_of(sampler: Any) -> dict[str, Any]:
    """The :data:`ORDER` values of a ``DistributedSampler`` (or one that orders alike)."""
    return {"dataset_len": len(sampler.dataset), "shuffle": bool(sampler.shuffle), "seed": int(sampler.seed),
            "drop_last": bool(sampler.drop_last)}


def epoch_done(consumed: int, dataset_len: int, total: int, saved_total: int) -> bool:
    """Whether ``consumed`` positions of the epoch's order (on the saved
    ranks) end the epoch: all ``total`` of the loading ranks' epoch, every
    sample of the dataset (the rest of the loading ranks' epoch would be
    padding, repeats of its first samples), or all ``saved_total`` the saved
    ranks' loaders would yield in it (what a ``drop_last`` left out, the
    uninterrupted run never saw either): it is over."""
    return consumed >= min(total, dataset_len, saved_total)
