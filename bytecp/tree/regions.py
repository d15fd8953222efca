"""Boxes in a tensor's global index space (pure functions, no torch).

A :class:`Region` is an n-d box (``offsets``, ``lengths``). Everything the
planner, the format and the pipelines handle is a box. Irregular shards — a flat
``[start, end)`` range of a row-major tensor, as FSDP1 flat parameters, ZeRO
and Megatron's distributed optimizer produce — are decomposed by
:func:`flat_range_to_boxes` into at most ``2*ndim-1`` boxes, each contiguous
in row-major order, so the bytes of a flat shard are the concatenation of its
boxes' bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

__all__ = [
    "Region",
    "full_region",
    "flat_range_to_boxes",
    "row_major_strides",
    "element_span",
]


@dataclasses.dataclass(frozen=True, order=True, slots=True)
class Region:
    """An n-d box: ``offsets[d] <= i[d] < offsets[d] + lengths[d]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"region rank mismatch: offsets {self.offsets} vs lengths {self.lengths}")
        # min() of a tuple runs in C: every save builds a region per tensor
        if self.lengths and (min(self.offsets) < 0 or min(self.lengths) < 0):
            raise ValueError(f"negative offset or length in region {self}")

    @classmethod
    def of(cls, offsets: Sequence[int], lengths: Sequence[int]) -> Region:
        return cls(tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def is_empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: Region) -> Region | None:
        """The common box, or ``None`` when they do not overlap (or it is empty)."""
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect regions of rank {self.ndim} and {other.ndim}")
        offs, lens = [], []
        for o1, n1, o2, n2 in zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True):
            lo, hi = max(o1, o2), min(o1 + n1, o2 + n2)
            if hi <= lo:
                return None
            offs.append(lo)
            lens.append(hi - lo)
        return Region(tuple(offs), tuple(lens))

    def contains(self, other: Region) -> bool:
        return all(
            o1 <= o2 and o2 + n2 <= o1 + n1
            for o1, n1, o2, n2 in zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True)
        )

    def relative_to(self, outer: Region) -> Region:
        """This box in ``outer``'s local coordinates (``outer`` must contain it)."""
        return Region(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.lengths)

    def shifted(self, base: Sequence[int]) -> Region:
        return Region(tuple(a + b for a, b in zip(self.offsets, base, strict=True)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))

    def subtract(self, other: Region) -> list[Region]:
        """This box without ``other``: at most ``2*ndim`` disjoint boxes (none
        when ``other`` covers it, itself when they do not overlap)."""
        if self.numel == 0:
            return []
        inter = self.intersect(other) if self.ndim else (other if other.ndim == 0 else None)
        if inter is None:
            return [self]
        out: list[Region] = []
        offs, lens = list(self.offsets), list(self.lengths)
        for d in range(self.ndim):
            lo, hi = offs[d], offs[d] + lens[d]
            ilo, ihi = inter.offsets[d], inter.offsets[d] + inter.lengths[d]
            if ilo > lo:
                out.append(Region(tuple(offs[:d] + [lo] + offs[d + 1 :]), tuple(lens[:d] + [ilo - lo] + lens[d + 1 :])))
            if ihi < hi:
                out.append(Region(tuple(offs[:d] + [ihi] + offs[d + 1 :]), tuple(lens[:d] + [hi - ihi] + lens[d + 1 :])))
            offs[d], lens[d] = ilo, ihi - ilo
        return out

    def split(self, parts: int) -> list[Region]:
        """Split along the first dimension longer than 1 into up to ``parts`` boxes."""
        for d, n in enumerate(self.lengths):
            if n > 1:
                k = min(parts, n)
                bounds = [n * i // k for i in range(k + 1)]
                out = []
                for a, b in zip(bounds, bounds[1:], strict=False):
                    offs = list(self.offsets)
                    lens = list(self.lengths)
                    offs[d] += a
                    lens[d] = b - a
                    out.append(Region(tuple(offs), tuple(lens)))
                return out
        return [self]

    def __str__(self) -> str:
        if not self.lengths:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths, strict=True)) + "]"


def full_region(shape: Sequence[int]) -> Region:
    """The box of a whole tensor of ``shape`` (one shared, immutable value per shape)."""
    return _full_region(tuple(shape))


@functools.lru_cache(maxsize=8192)
def _full_region(shape: tuple[int, ...]) -> Region:
    # every save describes each tensor by its full box: the same few shapes again and again
    return Region((0,) * len(shape), tuple(int(s) for s in shape))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Region]:
    """Decompose the flat range ``[start, end)`` of a row-major tensor.

    Returns at most ``2*ndim-1`` boxes, in order, each contiguous in
    row-major order; their element counts add up to ``end - start``.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of {total} elements {shape}")
    if start == end:
        return []
    return _decompose(shape, start, end)


def _decompose(shape: tuple[int, ...], a: int, b: int) -> list[Region]:
    nd = len(shape)
    if nd == 0:
        return [Region((), ())]
    if nd == 1:
        return [Region((a,), (b - a,))]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * (nd - 1)
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    if i0 == i1:  # inside one row of dim 0
        return [Region((i0, *r.offsets), (1, *r.lengths)) for r in _decompose(rest, r0, r1)]
    out: list[Region] = []
    if r0:
        out += [Region((i0, *r.offsets), (1, *r.lengths)) for r in _decompose(rest, r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append(Region((i0, *zeros), (i1 - i0, *rest)))
    if r1:
        out += [Region((i1, *r.offsets), (1, *r.lengths)) for r in _decompose(rest, 0, r1)]
    return out


def element_span(inner: Region, outer_lengths: Sequence[int]) -> tuple[int, int]:
    """``[first, end)`` element offsets that ``inner`` (in local coordinates of a
    row-major box of ``outer_lengths``) spans: from its first element to one
    past its last. The span holds exactly ``inner.numel`` elements when
    ``inner`` is contiguous inside the outer box."""
    if inner.numel == 0:
        return (0, 0)
    strides = row_major_strides(outer_lengths)
    first = sum(o * s for o, s in zip(inner.offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(inner.offsets, inner.lengths, strides, strict=True))
    return first, last + 1
