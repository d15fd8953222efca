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

__all__ = ["sampler_sizes", "ORDER"]

#: what must match between the saved and the loading sampler for the epoch's order to be the same
ORDER = ("dataset_len", "shuffle", "seed", "drop_last")


def sampler_sizes(n: int, ranks: int, drop_last: bool) -> tuple[int, int]:
    """``DistributedSampler``'s per-rank count and epoch length for ``n`` samples on ``ranks``."""
    per = math.ceil((n - ranks) / ranks) if drop_last and n % ranks else math.ceil(n / ranks)
    return max(0, per), max(0, per) * ranks
