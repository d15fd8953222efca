"""Large replica sets: each holder writes one contiguous run of the set's boxes.

Called by :func:`~bytecp.plan.planner.plan_replicated` (the whole set's plan)
and :func:`~bytecp.plan.share.share_of` (one member's share, computed alone
by every member in a first save's plan phase) when :func:`uses_runs` says the
set is large. Both build their answer from the same helpers here, so a
member's share is exactly its entry in the whole plan.

The rule: the set's boxes, sorted by (tensor, region), are laid end to end as
one stream of ``total`` bytes. Each holder gets a target so that the final
loads are level: the water level ``L`` over the holders' starting loads
(``base_load``) with ``sum(max(0, L - base[r])) == total``, holder ``r``'s
target being ``max(0, L - base[r])`` (a holder already above the level gets
nothing). The holders, in the order of ``ranks``, take consecutive ranges
of the stream; the cut between two holders is the integer
``floor(sum of the targets before it)`` (exact integer arithmetic, so every
member computes the same bytes) moved to the nearest grain bound (ties:
down) of the box it falls in. A box's grains are the pieces the
largest-first rule would cut it into (``Region.split(k)`` along its first
dimension longer than 1, ``k = min(holders, nbytes // MIN_PIECE_BYTES)``; a
box below ``split_bytes`` is one grain): no piece is narrower than that
rule's, so format 4 still lists an expert weight's pieces as wide rows (a
piece under 1/64 of its tensor would go to the band segments, and every
reader of the tensor would look its bands up in every rank's part). A holder
thus writes at most one partial box at each end of its run and whole boxes
between, its bytes within one grain of its target (the MoE's 59 MB expert
weights: 56 grains of ~1 MiB against ~20 MB per holder). A box of no bytes goes to the holder whose range holds its position
(at the very end: the last holder that writes something).

Against the largest-first rule (every box of at least ``split_bytes`` cut
into up to one piece per holder) a set of B boxes over n holders has at most
B + n - 1 pieces instead of up to B * n: for the MoE's expert sets at
131,072 ranks (2,088 boxes over 2,048 holders) 4,097 pieces per set, at
most 3 per holder and each box in at most 4 holders' parts (at 16,384: 2,341
over 256 holders, each box in at most 2).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bytecp.tree.regions import Region

if TYPE_CHECKING:
    from bytecp.plan.planner import WriteItem

__all__ = ["RUN_MIN_BOXES", "uses_runs", "plan_runs", "run_share"]

#: a set of fewer boxes keeps the largest-first rule: its pieces are at most
#: RUN_MIN_BOXES per holder already, and small jobs' files stay as they were
RUN_MIN_BOXES = 8


def uses_runs(items: Sequence[WriteItem], holders: int, split_bytes: int, min_piece: int) -> bool:
    """(``plan_replicated`` and ``share_of``, before planning a set) Whether
    the set is large: at least two holders, at least :data:`RUN_MIN_BOXES`
    boxes, and on average at least ``max(split_bytes, min_piece)`` bytes per
    holder, so a run is no finer than the pieces the other rule would cut."""
    if holders < 2 or len(items) < RUN_MIN_BOXES:
        return False
    return sum(it.nbytes for it in items) // holders >= max(split_bytes, min_piece)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The set's boxes in (tensor, region) order laid end to end."""

    order: list[WriteItem]
    starts: list[int]  # first byte of each box in the stream
    total: int
    holders: int
    split_bytes: int
    min_piece: int

    @classmethod
    def of(cls, items: Sequence[WriteItem], holders: int, split_bytes: int, min_piece: int) -> _Layout:
        order = sorted(items)  # WriteItem orders by (fqn, region, dtype, ...): the same on every member
        starts, at = [], 0
        for it in order:
            starts.append(at)
            at += it.nbytes
        return cls(order, starts, at, holders, split_bytes, min_piece)

    def snap(self, c: int) -> int:
        """Byte ``c`` of the stream moved to the nearest bound (ties: down) of
        the grains of the box it is in: the pieces the largest-first rule
        would cut that box into (``Region.split(k)``, ``k`` up to one per
        holder, none below ``MIN_PIECE_BYTES``; a box below ``split_bytes``
        is one grain), so no piece is narrower than that rule's."""
        if c <= 0 or c >= self.total:
            return max(0, min(c, self.total))
        j = bisect.bisect_right(self.starts, c) - 1
        o = self.starts[j]
        if c == o:
            return c
        it = self.order[j]
        nb = it.nbytes
        rows = _rows(it.region.lengths)[1]
        rb = nb // rows
        k = min(rows, self.holders, max(1, nb // self.min_piece)) if nb >= self.split_bytes else 1
        r = (c - o) // rb  # the row byte c is in; grain i holds rows [rows * i // k, rows * (i + 1) // k)
        i = ((r + 1) * k - 1) // rows
        a, b = rows * i // k * rb, rows * (i + 1) // k * rb
        return o + (b if 2 * (c - o) > a + b else a)

    def run(self, lo: int, hi: int) -> list[WriteItem]:
        """The pieces of stream bytes [lo, hi) (row boundaries), and the
        boxes of no bytes this range owns; sorted by (tensor, region)."""
        out: list[WriteItem] = []
        if lo >= hi:
            return out
        j = bisect.bisect_left(self.starts, lo)
        if j > 0 and self.starts[j - 1] < lo < self.starts[j - 1] + self.order[j - 1].nbytes:
            j -= 1
        n = len(self.order)
        while j < n and (self.starts[j] < hi or (hi == self.total and self.starts[j] == hi)):
            it, o = self.order[j], self.starts[j]
            nb = it.nbytes
            j += 1
            if nb == 0:
                out.append(it)
                continue
            d, rows = _rows(it.region.lengths)
            rb = nb // rows
            a, b = (max(lo, o) - o) // rb, (min(hi, o + nb) - o) // rb
            if a == 0 and b == rows:
                out.append(it)
                continue
            offs, lens = list(it.region.offsets), list(it.region.lengths)
            offs[d] += a
            lens[d] = b - a
            out.append(dataclasses.replace(it, region=Region(tuple(offs), tuple(lens))))
        out.sort(key=lambda w: (w.fqn, w.region))
        return out


def _rows(lengths: tuple[int, ...]) -> tuple[int, int]:
    """(dimension, rows) a box is cut along: its first dimension longer than 1; (-1, 1) when none."""
    for d, n in enumerate(lengths):
        if n > 1:
            return d, n
    return -1, 1


class _Targets:
    """The holders' cumulative targets: ``cut(k)`` is the stream byte where
    holder ``k`` (in the order of ``ranks``) starts, before snapping."""

    def __init__(self, ranks: Sequence[int], base_load: Any, total: int) -> None:
        self.bases = [int(base_load[r]) for r in ranks]
        acc = m = level_num = 0
        for j, v in enumerate(sorted(self.bases)):  # water filling: the most holders below the level
            if v * (j + 1) >= total + acc + v:
                break
            acc += v
            m, level_num = j + 1, total + acc
        self.m, self.num = m, level_num  # the level is num / m; holder r is active when base * m < num

    def cut(self, k: int) -> int:
        active = [b for b in self.bases[:k] if b * self.m < self.num]
        return len(active) * self.num // self.m - sum(active)

    def cuts(self) -> list[int]:
        out, a, s = [0], 0, 0
        for b in self.bases:
            if b * self.m < self.num:
                a, s = a + 1, s + b
            out.append(a * self.num // self.m - s)
        return out


def plan_runs(items: Sequence[WriteItem], ranks: Sequence[int], base_load: Any, *, split_bytes: int,
              min_piece: int) -> dict[int, list[WriteItem]]:
    """(``plan_replicated``, a large set) ``{rank: its run}`` for the ranks
    that write something. O(boxes + holders * log boxes)."""
    lay = _Layout.of(items, len(ranks), split_bytes, min_piece)
    bounds = [lay.snap(c) for c in _Targets(ranks, base_load, lay.total).cuts()]
    out: dict[int, list[WriteItem]] = {}
    for k, r in enumerate(ranks):
        mine = lay.run(bounds[k], bounds[k + 1])
        if mine:
            out[r] = mine
    return out


def run_share(items: Sequence[WriteItem], ranks: Sequence[int], base_load: Any, index: int, *,
              split_bytes: int, min_piece: int) -> list[WriteItem]:
    """(``share_of``, a large set) The run of ``ranks[index]`` alone: the same
    as ``plan_runs(...)[ranks[index]]``, building only its own pieces."""
    lay = _Layout.of(items, len(ranks), split_bytes, min_piece)
    t = _Targets(ranks, base_load, lay.total)
    return lay.run(lay.snap(t.cut(index)), lay.snap(t.cut(index + 1)))
