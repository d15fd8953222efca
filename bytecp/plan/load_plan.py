"""Load planning: pure functions over regions and chunk records, no I/O.

Called by the load pipeline on every rank (and by ``bytecp export`` in one
process) with its own target boxes and the chunks that may hold them:
:func:`plan_load` intersects them and turns each intersection into ranged
reads of only the needed bytes; a sub-box that is not contiguous in its
chunk is read as one span when the waste is small, else split row by row.
A load that checks block checksums (``block_bytes``: the reader then reads
whole blocks, :mod:`bytecp.loading.checks`) splits only where whole blocks
lie between the pieces: pieces closer than a block would read the same
blocks again.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from bytecp.errors import CorruptCheckpointError, StateMismatchError
from bytecp.format.metadata import ChunkRecord
from bytecp.plan.planner import find_overlap
from bytecp.tree.regions import Region, element_span

__all__ = ["ReadRequest", "plan_load"]


class ReadRequest(NamedTuple):
    """Read ``nbytes`` at ``byte_offset`` of ``chunk.file``, holding chunk
    elements ``[span_first, span_first + nbytes/itemsize)``, and copy the
    sub-box ``box`` (global coordinates) into target ``target``'s view.
    (A named tuple: a load plans one per chunk it reads, tens of thousands
    on a MoE rank, and a frozen dataclass's constructor costs four times more.)"""

    target: int
    chunk: int
    box: Region
    byte_offset: int
    nbytes: int
    span_first: int
    whole_chunk: bool


def plan_load(
    targets: Sequence[tuple[str, Region]],
    chunks: Sequence[ChunkRecord],
    *,
    itemsizes: dict[str, int],
    max_waste: float = 0.5,
    max_gap_bytes: int = 1 << 20,
    block_bytes: int | None = None,
) -> list[ReadRequest]:
    """Ranged reads that fill every target box from the saved chunks.

    ``targets`` are ``(fqn, box)`` in global coordinates; ``block_bytes``:
    the reads will be widened to whole blocks of this size (a checked load
    of a version-5 checkpoint), so no box is split into pieces less than a
    block apart. Raises
    :class:`StateMismatchError` for a target box the checkpoint does not fully
    cover and :class:`CorruptCheckpointError` for overlapping chunks.
    """
    index = _ChunkIndex(chunks)
    reqs: list[ReadRequest] = []
    for ti, (fqn, box) in enumerate(targets):
        numel = box.numel
        if numel == 0:
            continue
        size = itemsizes[fqn]
        got = 0
        parts: list[Region] = []  # what each chunk gives of the box
        for ci in index.overlapping(fqn, box):
            c = chunks[ci]
            if c.offsets == box.offsets and c.lengths == box.lengths:  # the chunk is the box (most loads)
                got += numel
                parts.append(box)
                reqs.append(ReadRequest(ti, ci, box, c.byte_offset, numel * size, 0, True))
                continue
            cbox = Region(c.offsets, c.lengths)
            inter = cbox.intersect(box)
            if inter is None:
                continue
            got += inter.numel
            parts.append(inter)
            _reads_for(reqs, ti, ci, c, cbox, inter, size, max_waste, max_gap_bytes, block_bytes)
        if got == numel and len(parts) > 1:  # counts that add up hide overlaps beside gaps (a crafted index)
            pair = find_overlap(parts, dim=_split_dim(parts))
            if pair is not None:
                raise CorruptCheckpointError(
                    f"tensor {fqn!r}: the checkpoint's chunks overlap: {pair[0]} and {pair[1]} of target region "
                    f"{box} (a damaged or crafted index; `bytecp verify` the checkpoint, or load an earlier one)")
        if got != numel:
            if got > numel:
                raise CorruptCheckpointError(
                    f"tensor {fqn!r}: the checkpoint's chunks overlap: they cover {got} of the {box.numel} "
                    f"elements of target region {box}"
                )
            raise StateMismatchError(
                f"tensor {fqn!r}: the checkpoint's chunks cover {got} of the {box.numel} "
                f"elements of target region {box}"
            )
    return reqs


def _split_dim(boxes: Sequence[Region]) -> int:
    """The dimension ``boxes`` start at the most places along (the overlap sweep's: few active at once)."""
    if not boxes[0].ndim:
        return 0
    return max(range(boxes[0].ndim), key=lambda d: len({b.offsets[d] for b in boxes}))


class _ChunkIndex:
    """Chunks of each tensor sorted by their start along dimension 0, with a
    running maximum of their ends: the chunks that may overlap a target box
    are found by bisection instead of scanning every chunk of the tensor."""

    def __init__(self, chunks: Sequence[ChunkRecord]) -> None:
        by_fqn: dict[str, list[int]] = defaultdict(list)
        for i, c in enumerate(chunks):
            by_fqn[c.fqn].append(i)
        self._starts: dict[str, list[int]] = {}
        self._maxend: dict[str, list[int]] = {}
        self._ids: dict[str, list[int]] = {}
        for fqn, ids in by_fqn.items():
            if not chunks[ids[0]].offsets:  # 0-dim
                self._ids[fqn] = ids
                continue
            ids.sort(key=lambda i: chunks[i].offsets[0])
            self._ids[fqn] = ids
            self._starts[fqn] = [chunks[i].offsets[0] for i in ids]
            run, ends = 0, []
            for i in ids:
                run = max(run, chunks[i].offsets[0] + chunks[i].lengths[0])
                ends.append(run)
            self._maxend[fqn] = ends

    def overlapping(self, fqn: str, box: Region) -> list[int]:
        ids = self._ids.get(fqn, [])
        starts = self._starts.get(fqn)
        if starts is None or not box.ndim:
            return ids
        lo, hi = box.offsets[0], box.offsets[0] + box.lengths[0]
        j = bisect.bisect_left(starts, hi)  # chunks starting before the box ends
        # earliest chunk whose running max end passes the box start
        k = bisect.bisect_right(self._maxend[fqn], lo, 0, j)
        return ids[k:j]


def _reads_for(
    reqs: list[ReadRequest],
    ti: int,
    ci: int,
    c: ChunkRecord,
    cbox: Region,
    inter: Region,
    size: int,
    max_waste: float,
    max_gap: int,
    block_bytes: int | None = None,
) -> None:
    local = inter.relative_to(cbox)
    first, end = element_span(local, cbox.lengths)
    span_bytes = (end - first) * size
    need = inter.numel * size
    waste = span_bytes - need
    dim0 = next((d for d, n in enumerate(inter.lengths) if n > 1), None)
    if (waste <= max(max_waste * need, 0) or waste <= max_gap or dim0 is None
            or (block_bytes is not None and _gap(inter, cbox, dim0, size) < block_bytes)):
        reqs.append(
            ReadRequest(
                ti, ci, inter, c.byte_offset + first * size, span_bytes, first, inter == cbox
            )
        )
        return
    # too much waste: split along the first dimension longer than one
    for piece in inter.split(inter.lengths[dim0]):
        _reads_for(reqs, ti, ci, c, cbox, piece, size, max_waste, max_gap, block_bytes)


def _gap(inter: Region, cbox: Region, dim: int, size: int) -> int:
    """Bytes between two pieces of ``inter`` split along ``dim`` (one index of
    ``dim`` each) in chunk ``cbox``: the chunk's stride along ``dim`` less a piece's span."""
    piece = Region(inter.offsets, tuple(1 if d == dim else n for d, n in enumerate(inter.lengths)))
    first, end = element_span(piece.relative_to(cbox), cbox.lengths)
    return (math.prod(cbox.lengths[dim + 1 :]) - (end - first)) * size
