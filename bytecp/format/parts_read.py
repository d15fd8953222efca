"""Reading the version-4 index (docs/FORMAT.md section 5.6): the directory
pages a rank's targets meet, then the segments of the parts they name.

Called through the opened checkpoint (:mod:`bytecp.loading.opened`): on
every rank of a load once it knows its boxes (``wanted``), and in the
one-process tools for every segment (``wanted=None``). A rank reads
O(its share of the index) whatever the world size that wrote it: a few
pages of the directory, and the segments that may hold its rows. Every
page and segment is checked before it is trusted: its crc32c, its encoding
(a page's Parquet footer against the hostile-input budget, a segment's
words by :mod:`bytecp.format.segment_wire`), that it belongs to this save, that it
lies inside its file without overlapping another, that each row lies where
the directory says. Each failure is one line naming the file at fault.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bytecp.errors import CorruptCheckpointError, one_line
from bytecp.format import arrow_numpy, limits, parts_fetch, segment_keep, segment_wire
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.format.index_check import check_rows, decode_table, rows_agree, uncovered
from bytecp.format.index_read import rows_to_records
from bytecp.format.parts_fetch import Segment, by_part
from bytecp.format.parts_schema import (
    BAND_ENTRY_SCHEMA,
    PART_SCHEMA,
    WIDE_ENTRY_SCHEMA,
    PartsDirectory,
    box_bands,
    part_file,
    span_limit,
)
from bytecp.format.tensor_table import TensorTable, spec_of
from bytecp.storage_api import Storage
from bytecp.tree.regions import Region

__all__ = ["read_parts", "wanted_bands"]

#: one directory entry: (rank, offset, nbytes, rows, crc32c, band lo, band hi, first name, last name);
#: a wide entry has lo = hi = -1, a band entry first = last = ""
Entry = tuple[int, int, int, int, int, int, int, str, str]
#: per tensor wanted in part, its boxes' bands as disjoint ascending intervals (None: every row; a
#: tensor left out: its every row)
Bands = Mapping[str, list[tuple[int, int]]] | None


def wanted_bands(md: fmt.Metadata, wanted: Mapping[str, Sequence[Region]]) -> list[tuple[int, int]]:
    """The bands the boxes ``wanted`` meet, as merged ``[lo, hi]`` intervals
    (0-dim tensors are in no band: the directory's scalar pages list them)."""
    d = md.index
    assert isinstance(d, PartsDirectory)
    shapes = {fqn: spec_of(md.tensors, fqn)[1] for fqn in wanted}
    return segment_keep.merged(box_bands(box.offsets, box.lengths, shapes[fqn], d.buckets)
                               for fqn, boxes in wanted.items() if shapes[fqn] for box in boxes if box.numel)


def _meets(intervals: list[tuple[int, int]], lo: int, hi: int) -> bool:
    k = bisect.bisect_left(intervals, (lo, -1))
    return (k < len(intervals) and intervals[k][0] <= hi) or (k > 0 and intervals[k - 1][1] >= lo)


def _names_in(names: list[str], first: str, last: str) -> bool:
    k = bisect.bisect_left(names, first)
    return k < len(names) and names[k] <= last


def read_parts(
    storage: Storage,
    md: fmt.Metadata,
    wanted: Mapping[str, Sequence[Region]] | None,
    *,
    budget: int | None = None,
) -> tuple[list[fmt.ChunkRecord], int]:
    """(every rank) The chunk records that may meet ``wanted`` (fqn -> boxes;
    None: every row), each chunk once, only of tensors in ``wanted``, each
    checked against ``metadata.json`` (:func:`~bytecp.format.index_check.check_rows`);
    and how many segments and pages of 0-dim chunks were read."""
    d, where, parts = _directory(storage, md)
    # each tensor's boxes' bands: a row of it that misses them holds none of their elements
    spans, empty = (None, 0) if wanted is None else _box_bands(md, wanted, d.buckets)
    if not spans and wanted is not None and len(wanted) - empty == len(md.tensors) - limits.empty_tensors(md):
        # every tensor that holds an element wanted whole (a load by one process, a replicated
        # model's): every row, read without filtering by name or band (the keys are the checkpoint's:
        # _box_bands looked each up), so every row is checked -- an empty tensor's too, which a row
        # of elements cannot belong to (a damaged shape in metadata.json is refused, not loaded empty)
        wanted = spans = None
    names = None if wanted is None else sorted(wanted)
    fqns = None if wanted is None else set(wanted)
    # first the wide and scalar pages its names meet, and those wide segments: a box its wide rows
    # tile needs no band (a banded row there would overlap them), so a rank loading whole replicated
    # tensors (cut into wide pieces) does not read every band segment its boxes' bands meet
    pages = [(kind, k) for kind, col in (("wide", d.wide_pages), ("scalar", d.scalar_pages))
             for k in range(len(col["first"])) if names is None or _names_in(names, col["first"][k], col["last"][k])]
    scalars, entries = _page_entries(storage, md, d, pages, fqns, names, parts, where)
    check_rows(storage.url, md, scalars)
    wide = _segments(entries, d, where)
    listed = sum(s[3] for s in wide) + len(scalars)
    _budget(listed, budget, d, where)
    out = _read_all(storage, md, d, wide, fqns, spans, where)
    bands = None if wanted is None else wanted_bands(md, uncovered(wanted, out))
    band_pages = [("band", k) for k in range(len(d.band_pages["lo"]))
                  if bands is None or _meets(bands, d.band_pages["lo"][k], d.band_pages["hi"][k])]
    entries = [e for _, k, table in _read_pages(storage, d, band_pages, where)
               for e in _entries(table, "band", k, d, bands, names, where, parts)]
    band = _segments(entries, d, where)
    _budget(listed + sum(s[3] for s in band), budget, d, where)
    if band:
        seen = set(out)
        out += [c for c in _read_all(storage, md, d, band, fqns, spans, where) if c not in seen]
    return out + scalars, len(wide) + len(band) + sum(kind == "scalar" for kind, _ in pages)


Parts = Callable[[], tuple[np.ndarray, np.ndarray]]


def _box_bands(md: fmt.Metadata, wanted: Mapping[str, Sequence[Region]],
               buckets: int) -> tuple[dict[str, list[tuple[int, int]]], int]:
    """Each wanted tensor's boxes' bands, merged, for the tensors wanted in
    part only: a tensor a box of which is all of it (most of a load's) is
    left out, and every row of a tensor left out is kept
    (:func:`bytecp.format.segment_keep.keep`); 0-dim tensors are in no band.
    And how many of the wanted tensors hold no element (a dimension of 0)."""
    out: dict[str, list[tuple[int, int]]] = {}
    empty = 0
    for fqn, boxes in wanted.items():
        shape = spec_of(md.tensors, fqn)[1]
        if 0 in shape:
            empty += 1
        if not shape or any(b.lengths == shape for b in boxes):  # (a box of the shape's lengths starts at 0)
            continue
        out[fqn] = segment_keep.merged(box_bands(b.offsets, b.lengths, shape, buckets) for b in boxes if b.numel)
    return out, empty



def _directory(storage: Storage, md: fmt.Metadata) -> tuple[PartsDirectory, str, Parts]:
    """The directory (of this save), the checkpoint's URL for errors, and the
    parts' ranks and sizes as arrays, made once for the first page read (not
    per page; never for a rank that reads none)."""
    d = md.index
    assert isinstance(d, PartsDirectory)
    where = storage.url.rstrip("/")
    if d.save_id != md.save_id:
        raise CorruptCheckpointError(f"{where}: metadata.json of save {md.save_id!r} names the index of save "
                                     f"{d.save_id!r} ({d.file}); the checkpoint is corrupt")
    return d, where, functools.cache(lambda: (np.asarray(d.ranks, np.int64), np.asarray(d.part_nbytes, np.int64)))


def _page_entries(storage: Storage, md: fmt.Metadata, d: PartsDirectory, pages: list[tuple[str, int]],
                  fqns: set[str] | None, names: list[str] | None, parts: Parts, where: str,
                  ) -> tuple[list[fmt.ChunkRecord], list[Entry]]:
    """The 0-dim rows of the scalar ``pages`` (of ``fqns``) and the entries of the others (naming ``names``)."""
    scalars: list[fmt.ChunkRecord] = []
    entries: list[Entry] = []
    for kind, k, table in _read_pages(storage, d, pages, where):
        if kind == "scalar":
            scalars += _scalar_rows(table, k, md, d, fqns, where)
        else:
            entries += _entries(table, kind, k, d, None, names, where, parts)
    return scalars, entries


def _budget(listed: int, budget: int | None, d: PartsDirectory, where: str) -> None:
    if budget is not None and listed > budget:
        raise CorruptCheckpointError(f"{where}/{d.file}: the index directory lists {listed} "
                                     f"rows, more than the {budget} the data files can hold")


def _read_all(storage: Storage, md: fmt.Metadata, d: PartsDirectory, segments: list[Segment],
              fqns: set[str] | None, spans: Bands, where: str) -> list[fmt.ChunkRecord]:
    """The rows of ``segments`` (of tensors ``fqns``, meeting their ``spans``), each chunk once."""
    seen: set[fmt.ChunkRecord] = set()
    out: list[fmt.ChunkRecord] = []
    memo = segment_wire.Names()

    def decode(rank: int, mine: list[Segment], bufs: list[bytearray]) -> list[fmt.ChunkRecord]:
        return _decode_segments(md, d, rank, mine, bufs, fqns, where, spans, memo, storage.url)

    for rows in parts_fetch.each_part(storage, d, by_part(segments), where, decode):
        for c in rows:
            if c not in seen:
                seen.add(c)
                out.append(c)
    return out


def _segments(entries: list[Entry], d: PartsDirectory, where: str) -> list[Segment]:
    """The segments the entries name, each once: a band segment has one entry,
    a wide one an entry per tensor it holds rows of, all alike but the names."""
    by: dict[tuple[int, int], list[Entry]] = defaultdict(list)
    for e in entries:
        by[(e[0], e[1])].append(e)
    out: list[Segment] = []
    for (rank, off), es in sorted(by.items()):
        first = es[0]
        if any(e[2:7] != first[2:7] for e in es) or (first[5] >= 0 and len(es) > 1):
            raise CorruptCheckpointError(
                f"{where}/{d.file}: the directory lists the segment at bytes {off}..{off + first[2]} of the part of "
                f"rank {rank} {len(es)} times, not as one band entry or wide entries alike but for their names; "
                "the index is corrupt")
        ranges = sorted((e[7], e[8]) for e in es)
        reach = list(itertools.accumulate((b for _, b in ranges), max))
        out.append((*first[:7], ([a for a, _ in ranges], reach)))
    return out


def _check_save(label: str, table: pa.Table, save_id: str) -> None:
    got = (table.schema.metadata or {}).get(b"bytecp.save_id", b"").decode(errors="replace")
    if got != save_id:
        raise CorruptCheckpointError(f"{label} belongs to save {got[:40]!r}, not to this checkpoint's {save_id!r}; "
                                     "the index is corrupt")


def _read_pages(storage: Storage, d: PartsDirectory, pages: list[tuple[str, int]], where: str
                ) -> list[tuple[str, int, pa.Table]]:
    cols = {"band": d.band_pages, "wide": d.wide_pages, "scalar": d.scalar_pages}
    spans = [(cols[kind]["offset"][k], cols[kind]["nbytes"][k]) for kind, k in pages]
    bufs = parts_fetch.read(storage, d.file, spans, f"{where}: the index directory {d.file}") if spans else []
    out = []
    for (kind, k), (off, n), buf in zip(pages, spans, bufs, strict=True):
        label = f"{where}/{d.file} page {kind} {k} (bytes {off}..{off + n})"
        if crc32c(buf) != cols[kind]["crc32c"][k]:
            raise CorruptCheckpointError(f"{label}: checksum mismatch; the index is damaged")
        schema = {"band": BAND_ENTRY_SCHEMA, "wide": WIDE_ENTRY_SCHEMA, "scalar": PART_SCHEMA}[kind]
        strings = {"band": (), "wide": ("first", "last"), "scalar": ("fqn", "file")}[kind]
        table = decode_table(label, label, buf, schema, strings, rows=cols[kind]["rows"][k])
        _check_save(label, table, d.save_id)
        out.append((kind, k, table))
    return out


def _entries(table: pa.Table, kind: str, k: int, d: PartsDirectory, bands: list[tuple[int, int]] | None,
             names: list[str] | None, where: str, parts: Callable[[], tuple[np.ndarray, np.ndarray]]) -> list[Entry]:
    """A page's entries, checked against the page and the parts; those ``bands``/``names`` meet.
    Vectorized: a reader of whole replicated tensors reads most wide pages, and keeps few of their entries."""
    label = f"{where}/{d.file} page {kind} {k}"
    keys = ("lo", "hi") if kind == "band" else ("first", "last")
    page = d.band_pages if kind == "band" else d.wide_pages
    num = {c: arrow_numpy.numbers(table.column(c)).astype(np.int64) for c in ("rank", "offset", "nbytes", "rows", "crc32c")}
    a, b = (_column(table, c) for c in keys)
    if kind == "band":
        a, b = a.astype(np.int64), b.astype(np.int64)
    bad = ~((a <= b) & (page[keys[0]][k] <= a) & (b <= page[keys[1]][k])).astype(bool)
    bad[1:] |= (a[1:] < a[:-1]).astype(bool)
    if kind == "band":
        bad |= (a < 0) | (b >= d.buckets)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CorruptCheckpointError(f"{label}: entry {i} ({a[i]!r:.60}..{b[i]!r:.60}) lies outside its page or out "
                                     "of order; the index is corrupt")
    ranks, part_nbytes = parts()
    pos = np.minimum(np.searchsorted(ranks, num["rank"]), max(0, len(ranks) - 1))
    listed = ranks[pos] == num["rank"] if len(ranks) else np.zeros(len(pos), bool)
    size = np.where(listed, part_nbytes[pos] if len(ranks) else 0, -1)
    off, n = num["offset"], num["nbytes"]
    bad = ~listed | (num["rows"] <= 0) | (n <= 0) | (off < 0) | (off + n > size)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CorruptCheckpointError(f"{label}: entry {i} places a segment at bytes {off[i]}..{off[i] + n[i]} of the "
                                     f"part of rank {num['rank'][i]}, which metadata.json lists "
                                     f"{'not at all' if not listed[i] else f'with {size[i]} bytes'}")
    if kind == "band":
        keep = np.ones(len(a), bool) if bands is None else _meeting(bands, a, b)
    else:
        keep = np.ones(len(a), bool) if names is None else _naming(names, a, b)
    cols = [num[c][keep].tolist() for c in ("rank", "offset", "nbytes", "rows", "crc32c")]
    lo, hi = a[keep].tolist(), b[keep].tolist()
    if kind == "band":
        return [(*x, p, q, "", "") for *x, p, q in zip(*cols, lo, hi, strict=True)]
    return [(*x, -1, -1, p, q) for *x, p, q in zip(*cols, lo, hi, strict=True)]


def _column(table: pa.Table, name: str) -> np.ndarray:
    """A column as a NumPy array (strings: of ``str`` objects, a dictionary decoded)."""
    col = table.column(name)
    t = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return arrow_numpy.strings(col)
    return arrow_numpy.numbers(col)


def _meeting(intervals: list[tuple[int, int]], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Which ``[lo, hi]`` meet one of the merged (disjoint, ascending) ``intervals``."""
    if not intervals:
        return np.zeros(len(lo), bool)
    starts = np.asarray([x[0] for x in intervals], np.int64)
    ends = np.asarray([x[1] for x in intervals], np.int64)
    j = np.searchsorted(starts, hi, side="right") - 1  # the last interval starting at or before hi
    return (j >= 0) & (ends[np.maximum(j, 0)] >= lo)


def _naming(names: list[str], first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Which ``[first, last]`` contain one of the sorted ``names``."""
    if not names:
        return np.zeros(len(first), bool)
    sorted_names = np.asarray(names, object)
    j = np.searchsorted(sorted_names, first)
    inside = j < len(names)
    return inside & (sorted_names[np.minimum(j, len(names) - 1)] <= last).astype(bool)


def _scalar_rows(table: pa.Table, k: int, md: fmt.Metadata, d: PartsDirectory, fqns: set[str] | None,
                 where: str) -> list[fmt.ChunkRecord]:
    """A scalar page's rows: each of a 0-dim tensor, inside the page's
    names, strictly ascending (each 0-dim tensor listed once); those of ``fqns``."""
    label = f"{where}/{d.file} page scalar {k}"
    first, last = d.scalar_pages["first"][k], d.scalar_pages["last"][k]
    fast = _scalar_fast(table, md, label, first, last, fqns)
    if fast is not None:
        return fast
    every = _records(table, md, label, None)  # something is wrong: find it row by row
    prev = None
    for c in every:
        if c.global_shape or c.offsets or c.lengths or not first <= c.fqn <= last or (prev is not None and c.fqn <= prev):
            raise CorruptCheckpointError(
                f"{label}: the row of tensor {c.fqn!r:.80} does not belong in it (a scalar page lists 0-dim tensors, "
                "each once, in name order inside the page's names; FORMAT.md §5.6); the index is corrupt")
        prev = c.fqn
    return [c for c in every if fqns is None or c.fqn in fqns]


def _scalar_fast(table: pa.Table, md: fmt.Metadata, label: str, first: str, last: str,
                 fqns: set[str] | None) -> list[fmt.ChunkRecord] | None:
    """:func:`_scalar_rows` on columns: every row checked as there, records
    built only for ``fqns``; None if any check fails (the caller then finds
    the row at fault). A reader of every ``step`` reads pages of thousands."""
    try:
        cols = {c: table.column(c).combine_chunks() for c in PART_SCHEMA.names}
        fqn, file = cols["fqn"], cols["file"]
        if not (pa.types.is_dictionary(fqn.type) and pa.types.is_dictionary(file.type)):
            return None
        if len(cols["offsets"].values) or len(cols["lengths"].values):  # not all [] (no nulls: decode_table)
            return None
        values = fqn.dictionary.to_pylist()
        rows = [values[i] for i in arrow_numpy.indices(fqn.indices).tolist()]
        nums = [arrow_numpy.numbers(table.column(c)).astype(np.int64) for c in ("byte_offset", "nbytes", "crc32c")]
    except (pa.ArrowException, ValueError, TypeError, IndexError):
        return None
    if bool((nums[0] < 0).any() or (nums[1] < 0).any()):
        return None
    ascending = all(a < b for a, b in zip(rows, rows[1:], strict=False))  # (each 0-dim tensor once)
    if rows and not (first <= rows[0] and rows[-1] <= last and ascending):
        return None
    dtypes = _scalar_dtypes(md.tensors, rows)
    if dtypes is None:
        return None
    keep = [i for i, name in enumerate(rows) if fqns is None or name in fqns]
    files = file.dictionary.to_pylist()
    fid = arrow_numpy.indices(file.indices)
    out = [fmt.chunk_record(rows[i], dtypes[i], (), (), (), files[int(fid[i])], int(nums[0][i]),
                           int(nums[1][i]), int(nums[2][i])) for i in keep]
    limits.check_chunk_records(label, out)
    return out


def _scalar_dtypes(tensors: Mapping[str, Mapping[str, Any]], names: list[str]) -> list[str] | None:
    """Each named tensor's dtype if every one is a 0-dim tensor of ``tensors``, else None
    (a version-4 table's in a few array lookups: a reader of every ``step`` names 45,000)."""
    if isinstance(tensors, TensorTable):
        i = tensors.rows_of(names)
        if bool((i < 0).any() or tensors.ndim[i].any()):
            return None
        return [tensors.dtypes[k] for k in tensors.dtype[i].tolist()]
    infos = [tensors.get(n) for n in names]
    return None if any(t is None or t["shape"] for t in infos) else [t["dtype"] for t in infos]  # type: ignore[index]


def _records(table: pa.Table, md: fmt.Metadata, label: str, fqns: set[str] | None) -> list[fmt.ChunkRecord]:
    """A decoded segment's or page's rows as chunk records (those of ``fqns``);
    anything unreadable in them is a corrupt index named by ``label``."""
    try:
        return rows_to_records(table, md, label, fqns)
    except CorruptCheckpointError:
        raise
    except (pa.ArrowException, ValueError, TypeError, IndexError, KeyError) as x:
        raise CorruptCheckpointError(f"{label} is unreadable ({one_line(x)})") from x


def _decode_segments(md: fmt.Metadata, d: PartsDirectory, rank: int, segments: list[Segment], bufs: list[bytearray],
                     fqns: set[str] | None, where: str, spans: Bands = None, memo: segment_wire.Names | None = None,
                     url: str | None = None) -> list[fmt.ChunkRecord]:
    """The rows of a part's ``segments`` (their bytes ``bufs``), checked; those of ``fqns`` meeting their
    ``spans``. With ``url`` (the checkpoint's), checked against ``metadata.json`` too
    (:func:`~bytecp.format.index_check.check_rows`, mostly as columns); without, the caller checks them."""
    label = f"{where}/{part_file(d.save_id, rank)}"
    out: list[fmt.ChunkRecord] = []
    limit = span_limit(d.buckets)
    for s, buf in zip(segments, bufs, strict=True):
        seg = f"{label} segment at bytes {s[1]}..{s[1] + s[2]}"
        if crc32c(buf) != s[4]:
            raise CorruptCheckpointError(f"{seg}: checksum mismatch; the index is damaged")
        if s[3] <= segment_keep.FEW_ROWS:  # (a few rows: one at a time)
            few = segment_keep.keep_records(seg, segment_wire.to_records(segment_wire.decode(
                seg, buf, s[3], d.save_id, block_bytes=d.block_bytes), md, seg, fqns), (s[5], s[6], s[7]), d.buckets,
                limit, spans)
            if url is not None:
                check_rows(url, md, few)
            out += few
            continue
        rows = segment_wire.decode(seg, buf, s[3], d.save_id, memo, d.block_bytes)
        kept = segment_wire.kept_rows(rows, md, seg, fqns)
        keep = segment_keep.keep(rows, kept, (s[5], s[6], s[7]), d.buckets, limit, seg, spans)
        got = segment_wire.records(rows, kept, keep)
        if url is not None and not rows_agree(rows, kept, keep, md):  # (one by one: the row at fault named)
            check_rows(url, md, got)
        out += got
    return out
