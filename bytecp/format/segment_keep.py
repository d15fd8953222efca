"""Which rows of a version-4 index segment a reader keeps (docs/FORMAT.md
section 5.6, "Reading" and "What a reader checks"), as columns.

Called by :func:`bytecp.format.parts_read.read_parts` for each segment it
reads, after :func:`bytecp.format.segment_wire.kept_rows` has kept the rows
of the tensors it wants: each of those rows' bands, checked against the
segment's directory entries (a band segment's rows banded inside its
``[lo, hi]``, a wide segment's rows wide and named by one of its entries
read), then only the rows whose bands meet the bands of their tensor's
wanted boxes. A row whose bands miss them holds no element of those boxes
(bands are monotone in the row-major index), so dropping it changes no
read; a reader of a band finds there the rows of every rank whose shards
of its tensors lie near its own (FSDP shards of one tensor in neighbouring
bands), most of which it would otherwise turn into records, check and
plan, one by one. The bands are computed in 64-bit integers where that is
exact (a row inside its tensor, ``numel * buckets < 2**63``), in Python
integers (:func:`~bytecp.format.parts_schema.box_bands`) elsewhere.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

import numpy as np

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format import segment_wire
from bytecp.format.parts_schema import box_bands

__all__ = ["keep", "keep_records", "merged", "FEW_ROWS"]

_INT64 = np.iinfo(np.int64).max
#: a segment of at most this many rows is kept a record at a time (:func:`keep_records`): the
#: columns' fixed cost is more than theirs
FEW_ROWS = 32


def merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Band intervals ``[lo, hi]`` merged into disjoint ascending ones (touching ones joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def keep(seg: segment_wire.SegmentRows, kept: segment_wire.Kept, entry: tuple[int, int, tuple[list[str], list[str]]],
         buckets: int, limit: int, label: str, bands: Mapping[str, list[tuple[int, int]]] | None) -> np.ndarray:
    """Of ``kept.rows``, those whose bands meet their tensor's ``bands``
    (None, or no tensor listed: all of them; a tensor not listed: all of its), after every one of ``kept.rows`` is checked to lie
    where the segment's ``entry`` (band ``lo``, ``hi``; -1 for a wide
    segment, then the names its entries read) says, with ``limit`` the span
    limit. A row that does not is one line naming it and ``label``."""
    rows = kept.rows
    if not len(rows):
        return rows
    lo, hi, slow = _bands(seg, kept, buckets)
    nid = seg.name_id[rows]
    fqn = [h[0] if h else "" for h in kept.heads]
    if entry[0] >= 0:
        ok = (hi - lo + 1 <= limit) & (entry[0] <= lo) & (hi <= entry[1])
    else:
        named = np.zeros(len(fqn), bool)
        for k in np.unique(nid).tolist():
            named[k] = _named(entry[2], fqn[k])
        ok = (hi - lo + 1 > limit) & named[nid]
    spans: list[tuple[int, int] | None] = [None] * len(rows)
    for i, (o, m, shape) in slow.items():  # exactly as box_bands, in Python integers
        spans[i] = box_bands(o, m, shape, buckets) if m and all(x > 0 for x in m) else None
        a, b = spans[i] or (0, -1)
        ok[i] = spans[i] is not None and ((entry[0] <= a and b <= entry[1] and b - a + 1 <= limit) if entry[0] >= 0
                                          else (b - a + 1 > limit and _named(entry[2], fqn[int(nid[i])])))
    if not ok.all():
        c = segment_wire.records(seg, kept, rows[np.flatnonzero(~ok)[:1]])[0]
        raise CorruptCheckpointError(
            f"{label}: the row of tensor {c.fqn!r:.80} region {list(c.offsets)[:8]}+{list(c.lengths)[:8]} does "
            "not belong in it (FORMAT.md §5.6); the index is corrupt")
    if not bands:  # (every row of every tensor)
        return rows
    first = np.zeros(len(fqn), np.int64)  # each tensor's one interval (a tensor not in bands: every band)
    last = np.full(len(fqn), _INT64, np.int64)
    several = np.zeros(len(fqn), bool)
    for k in np.unique(nid).tolist():
        got = bands.get(fqn[k])
        if got is None:
            continue
        if len(got) == 1:
            first[k], last[k] = got[0]
        else:
            first[k], last[k] = 1, 0  # (none: an empty one)
        several[k] = len(got) > 1
    meets = (lo <= last[nid]) & (hi >= first[nid])
    for i in sorted({*np.flatnonzero(several[nid]).tolist(), *slow}):
        a, b = spans[i] if i in slow else (int(lo[i]), int(hi[i]))  # type: ignore[misc]
        meets[i] = _meets_any(bands, fqn[int(nid[i])], a, b)
    return rows[meets]


def keep_records(label: str, chunks: list[fmt.ChunkRecord], entry: tuple[int, int, tuple[list[str], list[str]]],
                 buckets: int, limit: int, bands: Mapping[str, list[tuple[int, int]]] | None) -> list[fmt.ChunkRecord]:
    """:func:`keep` of a few rows as records (:func:`segment_wire.to_records`),
    one at a time in Python integers."""
    out = []
    for c in chunks:
        shape = c.global_shape
        ok = len(shape) > 0 and len(c.offsets) == len(c.lengths) == len(shape) and all(n > 0 for n in c.lengths)
        lo, hi = box_bands(c.offsets, c.lengths, shape, buckets) if ok else (0, -1)
        if ok:
            ok = (entry[0] <= lo and hi <= entry[1] and hi - lo + 1 <= limit) if entry[0] >= 0 \
                else (hi - lo + 1 > limit and _named(entry[2], c.fqn))
        if not ok:
            raise CorruptCheckpointError(
                f"{label}: the row of tensor {c.fqn!r:.80} region {list(c.offsets)[:8]}+{list(c.lengths)[:8]} does "
                "not belong in it (FORMAT.md §5.6); the index is corrupt")
        if bands is None or _meets_any(bands, c.fqn, lo, hi):
            out.append(c)
    return out


def _bands(seg: segment_wire.SegmentRows, kept: segment_wire.Kept, buckets: int
           ) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[list[int], list[int], tuple[int, ...]]]]:
    """Each kept row's bands ``lo``, ``hi`` as :func:`box_bands` gives them,
    where 64 bits are exact (a row inside its tensor, at least one element,
    ``numel * buckets < 2**63``); the others (their lo/hi are meaningless
    there): row -> its offsets, lengths and shape, for Python integers."""
    rows = kept.rows
    n = len(rows)
    nid, nd = seg.name_id[rows], seg.ndim[rows]
    k = max(1, int(nd.max()))
    uniq = np.unique(nid)
    local = np.searchsorted(uniq, nid)
    shapes = np.ones((len(uniq), k), np.int64)  # right-aligned, leading dimensions of 1
    numel = np.zeros(len(uniq), np.int64)  # 0: not in 64 bits (or no element)
    for j, name in enumerate(uniq.tolist()):
        shape = kept.heads[name][2]
        size = math.prod(shape)
        if shape and 0 < size <= _INT64 // max(1, buckets):
            shapes[j, k - len(shape):] = shape
            numel[j] = size
    # (kept_rows checked each row's ndim against its tensor's)
    start = seg.start[rows]
    at = np.repeat(np.arange(n), nd)
    src, dim = seg.dims_of(rows)
    col = np.repeat(k - nd, nd) + dim
    off = np.zeros((n, k), np.int64)
    ln = np.ones((n, k), np.int64)
    off[at, col], ln[at, col] = seg.offsets[src], seg.lengths[src]
    size = shapes[local]
    fast = (numel[local] > 0) & (nd > 0) & (ln > 0).all(axis=1) & (ln <= size).all(axis=1) & (off <= size - ln).all(axis=1)
    off[~fast], ln[~fast], size[~fast] = 0, 1, 1
    first = np.zeros(n, np.int64)
    last = np.zeros(n, np.int64)
    for d in range(k):  # inside the tensor: every index below numel, numel * buckets below 2**63
        first = first * size[:, d] + off[:, d]
        last = last * size[:, d] + off[:, d] + ln[:, d] - 1
    count = np.maximum(numel[local], 1)
    slow = {i: (seg.offsets[start[i]: start[i] + nd[i]].tolist(), seg.lengths[start[i]: start[i] + nd[i]].tolist(),
                kept.heads[int(nid[i])][2]) for i in np.flatnonzero(~fast).tolist()}  # type: ignore[index]
    return first * buckets // count, last * buckets // count, slow


def _meets_any(bands: Mapping[str, list[tuple[int, int]]], fqn: str, lo: int, hi: int) -> bool:
    """Whether ``[lo, hi]`` meets one of ``fqn``'s ``bands`` (every band where it has none listed)."""
    got = bands.get(fqn)
    return got is None or _meets(got, lo, hi)


def _meets(intervals: list[tuple[int, int]], lo: int, hi: int) -> bool:
    k = bisect.bisect_left(intervals, (lo, -1))
    return (k < len(intervals) and intervals[k][0] <= hi) or (k > 0 and intervals[k - 1][1] >= lo)


def _named(names: tuple[list[str], list[str]], fqn: str) -> bool:
    """Whether one of a wide segment's entries read names ``fqn``: the entry
    of greatest ``last`` among those whose ``first <= fqn`` reaches it (O(log entries))."""
    firsts, reach = names
    k = bisect.bisect_right(firsts, fqn) - 1
    return k >= 0 and reach[k] >= fqn
