"""One rank's share of a replica set's boxes, without planning the others'.

Called by :func:`~bytecp.plan.exchange.planned_locally` (every rank, a first
save's plan phase) for each sound replica set it is in. The answer is
exactly ``plan_replicated(items, ranks, base_load)[rank]``
(:func:`~bytecp.plan.planner.plan_replicated`: largest box first, a box of at
least ``split_bytes`` cut into pieces, each piece to the least-loaded member,
ties to the lowest rank), but only this rank's pieces are built: the others
are counted as sizes, and the members nobody has written to yet are taken in
order of their starting load from one NumPy sort instead of a heap of every
member. With experts replicated over 2,048 ranks (a DeepSeek-V3-like MoE at
131,072 ranks) that was ~117,000 pieces of which a rank built ~60; such a
large set (:func:`~bytecp.plan.runs.uses_runs`) now gives each member one
contiguous run (:func:`~bytecp.plan.runs.run_share`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
from collections.abc import Sequence

import numpy as np

from bytecp.plan.planner import MIN_PIECE_BYTES, WriteItem
from bytecp.plan.runs import run_share, uses_runs
from bytecp.tree.regions import Region

__all__ = ["share_of"]


@functools.lru_cache(maxsize=4096)
def _pieces(lengths: tuple[int, ...], parts: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    """(index of the piece in ``Region.split(parts)``, its bytes) of a box of
    ``lengths``, largest first (ties: in split order), as the planner takes them."""
    for n in lengths:
        if n > 1:
            k = min(parts, n)
            inner = math.prod(lengths) // n * itemsize
            sizes = [(n * (i + 1) // k - n * i // k) * inner for i in range(k)]
            return tuple(sorted(enumerate(sizes), key=lambda p: -p[1]))
    return ((0, math.prod(lengths) * itemsize),)


def share_of(items: Sequence[WriteItem], ranks: Sequence[int], base_load: Sequence[int] | np.ndarray, rank: int,
             *, split_bytes: int) -> list[WriteItem]:
    """(every member of a replica set, alone) The boxes ``rank`` writes of
    ``items``, which every rank of ``ranks`` (sorted) holds, starting from
    ``base_load[r]`` bytes per rank (an int64 array is used as it is); sorted by (tensor, region)."""
    i = bisect.bisect_left(ranks, rank)
    if i == len(ranks) or ranks[i] != rank:
        return []
    if len(ranks) == 1:
        return sorted(items, key=lambda w: (w.fqn, w.region))
    if uses_runs(items, len(ranks), split_bytes, MIN_PIECE_BYTES):  # a large set: one run per member
        return run_share(items, ranks, base_load, i, split_bytes=split_bytes, min_piece=MIN_PIECE_BYTES)
    order = sorted(items, key=lambda it: (-it.nbytes, it.fqn, it.region))
    cuts = [min(len(ranks), max(1, it.nbytes // MIN_PIECE_BYTES)) if it.nbytes >= split_bytes else 0
            for it in order]
    pieces = [_pieces(it.region.lengths, k, it.itemsize) if k else ((0, it.nbytes),)
              for it, k in zip(order, cuts, strict=True)]
    # members not written to yet, by (starting load, rank): only as many as there are pieces matter
    members = np.asarray(ranks, dtype=np.int64)
    loads = np.asarray(base_load, dtype=np.int64)[members]
    first = np.lexsort((members, loads))[:sum(map(len, pieces))]
    fresh = list(zip(loads[first].tolist(), members[first].tolist(), strict=True))
    written: list[tuple[int, int]] = []  # (load, rank) of members written to: a heap
    u = 0
    mine: list[WriteItem] = []
    for it, k, its in zip(order, cuts, pieces, strict=True):
        got = []
        for index, nbytes in its:
            if written and (u == len(fresh) or written[0] < fresh[u]):
                load, r = written[0]
                heapq.heapreplace(written, (load + nbytes, r))
            else:
                load, r = fresh[u]
                u += 1
                heapq.heappush(written, (load + nbytes, r))
            if r == rank:
                got.append(index)
        if got and len(its) == 1:
            mine.append(it)
        elif got:
            boxes: list[Region] = it.region.split(k)
            mine.extend(dataclasses.replace(it, region=boxes[index]) for index in got)
    mine.sort(key=lambda w: (w.fqn, w.region))
    return mine
