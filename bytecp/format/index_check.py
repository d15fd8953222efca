"""Index validation, written once for both index versions: the stored table
against its schema, each row against ``metadata.json``, the rows against
each other (tiling), and each version-2 row against the segment it is
listed in (placement).

Who calls what, in this order:

1. :func:`decode_table` -- :mod:`bytecp.format.index_read`, on every
   version-1 index file and every version-2 segment before a row is
   trusted: footer within the hostile-input budget, columns present, typed
   and free of nulls.
2. :func:`check_place` -- :mod:`bytecp.format.index_read`, on the rows of
   each version-2 segment (FORMAT.md §5.4).
3. :func:`check_rows` -- the opened checkpoint
   (:mod:`bytecp.loading.opened`), on the rows a rank reads.
4. :func:`check_index` -- the opened checkpoint, on a whole index (one-process
   tools, a version-1 load's coordinator): :func:`check_rows`, then every
   tensor tiled exactly.
5. :func:`uncovered` -- :func:`bytecp.format.parts_read.read_parts`, on the
   wide rows a rank read: which of its boxes they do not tile exactly (those
   it looks up in the bands).

Every failure is a :class:`~bytecp.errors.CorruptCheckpointError` naming the
file (or checkpoint) and the row at fault.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bytecp.errors import CorruptCheckpointError, one_line
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.format.index_schema import bucket_range
from bytecp.format.segment_wire import Kept, SegmentRows
from bytecp.format.tensor_table import TensorTable, spec_of
from bytecp.plan.planner import find_overlap
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.regions import Region, element_span, row_major_strides

__all__ = ["Place", "decode_table", "check_place", "check_rows", "rows_agree", "check_index", "Tiling", "uncovered"]

#: the largest int64 (a data file's size is held to it in :func:`rows_agree`'s columns)
_INT64 = (1 << 63) - 1

#: where a version-2 segment's rows belong: (its band, None, None) or (None, first name, last name)
Place = tuple[int | None, str | None, str | None]


def decode_table(
    prefix: str,
    name: str,
    data: bytes | bytearray,
    schema: pa.Schema,
    strings: Sequence[str],
    *,
    rows: int | None = None,
    row_budget: Callable[[], int] | None = None,
) -> pa.Table:
    """``data`` (one index file or segment, read in place: never copied) as a table of ``schema``.

    Before any column is decoded, the footer is checked against the
    hostile-input budget (:func:`bytecp.format.limits.check_index_metadata`,
    its errors naming ``name``): at most ``rows`` rows (version 2: exactly
    the directory's count) or, above :data:`~bytecp.format.limits.FIXED_ROWS`,
    ``row_budget()`` (version 1). ``strings``: the string columns, read
    dictionary-encoded. Errors of this module start with ``prefix``.
    """
    try:
        # ParquetFile.read without threads: read_table's dataset scanner
        # leaves threads that can abort the interpreter at exit when torch
        # is loaded (apache/arrow#34314)
        pf = pq.ParquetFile(pa.BufferReader(data), read_dictionary=list(strings))
        n = pf.metadata.num_rows
        if rows is not None and n != rows:
            raise CorruptCheckpointError(f"{prefix} has {n} rows, the directory says {rows}")
        limit = rows
        if limit is None and row_budget is not None and n > limits.FIXED_ROWS:
            limit = row_budget()
        limits.check_index_metadata(name, pf.metadata, len(data), limit, data)
        missing = [f.name for f in schema if f.name not in pf.schema_arrow.names]
        if missing:
            raise CorruptCheckpointError(f"{prefix} lacks columns {missing}")
        table = pf.read(columns=schema.names, use_threads=False)
    except CorruptCheckpointError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError, KeyError) as e:
        raise CorruptCheckpointError(f"{prefix} is unreadable ({one_line(e)})") from e
    for f in schema:
        col = table.column(f.name)
        got = col.type.value_type if pa.types.is_dictionary(col.type) and f.name in strings else col.type
        # (the list's values, not .flatten(): that imports pyarrow.compute)
        nulls = col.null_count + (col.combine_chunks().values.null_count if pa.types.is_list(got) else 0)
        if got != f.type or nulls:
            raise CorruptCheckpointError(f"{prefix}: column {f.name!r} is {got}{' with nulls' if nulls else ''}, "
                                         f"expected {f.type}")
    return table


def check_place(label: str, md: fmt.Metadata, chunks: Sequence[fmt.ChunkRecord], place: Place) -> None:
    """Every row is where §5.4 puts it: a band segment lists chunks of banded
    tensors that meet its band, a wide segment chunks of wide tensors named
    within its range. (A misplaced row would make a load depend on which
    other segments a rank happens to read.)"""
    assert md.index is not None
    band, first, last = place
    for c in chunks:
        info = md.tensors[c.fqn]
        dim, shape = info.get("band_dim"), info["shape"]
        if band is None:
            ok = dim is None and first is not None and last is not None and first <= c.fqn <= last
        elif dim is None or not len(c.offsets) == len(c.lengths) == len(shape) or c.lengths[dim] <= 0:
            ok = False
        else:
            lo, hi = bucket_range(c.offsets[dim], c.lengths[dim], shape[dim], md.index.buckets)
            ok = lo <= band <= hi
        if not ok:
            where = f"band {band}" if band is not None else f"the wide segment of names {first!r}..{last!r}"
            raise CorruptCheckpointError(
                f"{label}: the row of tensor {c.fqn!r:.80} region {list(c.offsets)[:8]}+{list(c.lengths)[:8]} "
                f"does not belong in {where} (FORMAT.md §5.4); the index is corrupt"
            )


def check_rows(where: str, md: fmt.Metadata, chunks: Sequence[fmt.ChunkRecord]) -> None:
    """Each index row agrees with metadata.json: a listed tensor, its dtype
    and shape, a box inside it, the bytes the box needs, inside a listed data
    file (every rank checks the rows it reads). ``where``: the checkpoint's URL.
    (A decoded segment's rows are checked as columns first, :func:`rows_agree`,
    its twin: a rule added to one belongs in the other.)"""

    def bad(c: fmt.ChunkRecord, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: index row of tensor {c.fqn!r} region {Region(c.offsets, c.lengths)}: {why}"
        )

    tensors = md.tensors
    for c in chunks:
        try:
            dtype, shape = spec_of(tensors, c.fqn)
        except KeyError:
            raise bad(c, "tensor not listed in metadata.json") from None
        if c.dtype != dtype or tuple(c.global_shape) != shape:
            raise bad(c, f"says {c.dtype} {list(c.global_shape)}, metadata.json {dtype} {list(shape)}")
        whole = tuple(c.lengths) == shape and len(c.offsets) == len(shape) and not any(c.offsets)  # (most rows)
        if not whole and (len(c.offsets) != len(shape) or len(c.lengths) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.lengths, shape, strict=True))):
            raise bad(c, f"region outside the tensor's shape {list(shape)}")
        if c.nbytes != math.prod(c.lengths) * ITEMSIZES[c.dtype]:  # (metadata.json's dtypes are known ones)
            raise bad(c, f"{c.nbytes} bytes do not match the region's size")
        file_size = md.data_files.get(c.file)
        if file_size is None:
            fmt.check_path(c.file, "data", where)
            raise bad(c, f"data file {c.file} is not listed in metadata.json")
        if c.byte_offset < 0 or c.byte_offset + c.nbytes > file_size:
            raise bad(c, f"bytes outside data file {c.file}")


def rows_agree(seg: SegmentRows, kept: Kept, rows: np.ndarray, md: fmt.Metadata) -> bool:
    """Whether rows ``rows`` (of ``kept.rows``, a decoded segment's) pass
    :func:`check_rows` -- each box inside its tensor, its bytes the box's
    size, inside a data file ``metadata.json`` lists -- computed as columns (a load's rows, thousands, were checked one
    record at a time for 2 us each). False where one may not, or where the
    tensors are not a table: the caller then checks their records one by one,
    which names the row at fault. (Their dtypes and shapes are the
    metadata's, :func:`~bytecp.format.segment_wire.records` takes them from there, and each row's number
    of dimensions its tensor's: :func:`~bytecp.format.segment_wire.kept_rows` checked it.)

    The twin of :func:`check_rows`: a rule added to one belongs in the other."""
    table = md.tensors
    if kept.table_rows is None or not isinstance(table, TensorTable):
        return False
    n = len(rows)
    if not n:
        return True
    t = kept.table_rows[seg.name_id[rows]]
    nd = seg.ndim[rows].astype(np.int64)
    first = np.cumsum(nd) - nd  # each row's first dimension among the rows' dimensions
    src, dim = seg.dims_of(rows)
    o, ln = seg.offsets[src], seg.lengths[src]
    dims = table.dims[np.repeat(table.start[t], nd) + dim]
    if bool((ln > dims - o).any()):  # (offsets and lengths >= 0: decode; dims >= 0: the table)
        return False
    shaped = nd > 0
    numel = np.ones(n, np.int64)
    approx = np.ones(n, np.float64)
    if len(ln):
        with np.errstate(over="ignore"):
            numel[shaped] = np.multiply.reduceat(ln, first[shaped])
            approx[shaped] = np.multiply.reduceat(ln.astype(np.float64), first[shaped])
    sizes = np.asarray([ITEMSIZES[d] for d in table.dtypes], np.int64)[table.dtype[t]]
    if bool((approx * sizes >= 2.0**61).any()):  # (not exact in 64 bits: one by one, in Python integers)
        return False
    nbytes, offset = seg.nbytes[rows], seg.byte_offset[rows]
    # (a size past int64, from a crafted metadata.json, held to its largest: exact for every row's end)
    files = np.asarray([min(md.data_files.get(f, -1), _INT64) for f in seg.files], np.int64)[seg.file_id[rows]]
    return not bool(((numel * sizes != nbytes) | (files < 0) | (offset > files - nbytes)).any())


def check_index(where: str, md: fmt.Metadata, chunks: Sequence[fmt.ChunkRecord], *, checked: bool = False) -> None:
    """A whole index: every row agrees with metadata.json (:func:`check_rows`;
    ``checked``: its reader checked them already), and each tensor's chunks
    tile it exactly (no gap, no overlap): a tampered or mixed-up index is
    corrupt, never trusted."""
    tiling = Tiling(where, md, len(chunks))
    tiling.add(chunks, checked=checked)
    tiling.finish()


class Tiling:
    """The tiling check over rows that arrive in batches (:func:`check_index`:
    one batch; ``bytecp inspect``/``verify`` of a version-4 checkpoint: a part
    at a time): each batch's rows are
    checked as they come (:func:`check_rows`, and no two of a batch overlap),
    each tensor's elements are added up; the boxes are kept for the exact
    overlap check across batches while at most ``keep_rows`` rows have come
    (then :meth:`finish` is :func:`check_index`), dropped beyond (then each
    tensor's elements must still add up to its size, and overlaps are
    found within each part only: :attr:`exact` says which)."""

    def __init__(self, where: str, md: fmt.Metadata, keep_rows: int) -> None:
        self.where, self.md, self.keep_rows = where, md, keep_rows
        self.rows = 0
        self.held: dict[str, int] = {}
        self.boxes: dict[str, list[Region]] | None = {}

    @property
    def exact(self) -> bool:
        return self.boxes is not None

    def add(self, chunks: Sequence[fmt.ChunkRecord], *, checked: bool = False) -> None:
        if not checked:
            check_rows(self.where, self.md, chunks)
        self.rows += len(chunks)
        if self.boxes is not None and self.rows > self.keep_rows:  # the boxes so far checked, then dropped
            for fqn, bs in self.boxes.items():
                if len(bs) > 1:
                    self._overlap(fqn, bs)
            self.boxes = None
        mine: dict[str, list[Region]] = {}
        for c in chunks:
            n = math.prod(c.lengths)
            if n:
                self.held[c.fqn] = self.held.get(c.fqn, 0) + n
                mine.setdefault(c.fqn, []).append(Region(c.offsets, c.lengths))
        for fqn, bs in mine.items():
            if self.boxes is not None:
                self.boxes.setdefault(fqn, []).extend(bs)
            elif len(bs) > 1:
                self._overlap(fqn, bs)

    def finish(self) -> None:
        """Each tensor's chunks hold its elements (no gap), without overlaps
        (named before a count); a tensor of no elements has no chunk that holds any."""
        for fqn, info in self.md.tensors.items():
            total, held = math.prod(info["shape"]), self.held.get(fqn, 0)
            if held >= total and self.boxes is not None and len(self.boxes.get(fqn, ())) > 1:
                self._overlap(fqn, self.boxes[fqn], int(info.get("band_dim") or 0))  # (null: no band, as elsewhere)
            if held != total:
                raise CorruptCheckpointError(f"{self.where}: tensor {fqn!r}: chunks hold {held} of {total} elements")

    def _overlap(self, fqn: str, boxes: list[Region], dim: int = 0) -> None:
        pair = find_overlap(boxes, dim=dim)
        if pair is not None:
            raise CorruptCheckpointError(f"{self.where}: tensor {fqn!r}: chunks {pair[0]} and {pair[1]} overlap")


def uncovered(wanted: Mapping[str, Sequence[Region]], rows: list[fmt.ChunkRecord]) -> dict[str, list[Region]]:
    """The boxes of ``wanted`` that ``rows`` (wide rows) do not tile: every
    element of the box in one row, none in two (the rows' parts in the box
    hold as many elements as the box, at row-major index ranges that do not
    overlap). Those that they tile need no band lookup."""
    by: dict[str, list[fmt.ChunkRecord]] = defaultdict(list)
    for c in rows:
        by[c.fqn].append(c)
    out: dict[str, list[Region]] = {}
    for fqn, boxes in wanted.items():
        mine = by.get(fqn, [])
        left = [b for b in boxes if not mine or not _tiled(b, mine)]
        if left:
            out[fqn] = left
    return out


def _tiled(box: Region, rows: list[fmt.ChunkRecord]) -> bool:
    if len(rows) == 1 and box.numel:  # one row (most tensors of most checkpoints): it tiles the box if it holds it
        row = rows[0]
        return (row.lengths == box.lengths and row.offsets == box.offsets) or Region(row.offsets, row.lengths).contains(box)
    shape = rows[0].global_shape
    if not any(box.offsets) and tuple(box.lengths) == tuple(shape):  # the whole tensor (a replicated one, often)
        strides = row_major_strides(shape)
        spans = sorted((sum(o * s for o, s in zip(c.offsets, strides, strict=True)),
                        sum((o + n - 1) * s for o, n, s in zip(c.offsets, c.lengths, strides, strict=True)) + 1)
                       for c in rows)
        held = sum(math.prod(c.lengths) for c in rows)
    else:
        parts = [x for c in rows if (x := Region(c.offsets, c.lengths).intersect(box)) is not None and x.numel]
        spans = sorted(element_span(x.relative_to(box), box.lengths) for x in parts)
        held = sum(x.numel for x in parts)
    return held == box.numel and all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
