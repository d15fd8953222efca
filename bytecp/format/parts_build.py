"""Writing the version-4 index: each rank its part, the coordinator the directory.

Called by the save pipeline's commit: every rank, before the commit's
gather, checks its own chunks and lays out its part (:func:`build_part`),
writes it and sends the coordinator only the part's :class:`PartEntries` (a
few per rank); the coordinator turns every rank's entries into the
directory (:func:`build_directory`). Nothing here is O(all chunks) on one
process: a rank handles its own rows, the coordinator O(ranks) entries.
Like :mod:`bytecp.format.index_build`, all on NumPy columns.
docs/FORMAT.md section 5.6 is the spec; :mod:`bytecp.format.parts_schema`
holds the schemas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bytecp.errors import ConfigError
from bytecp.format.checksum import crc32c
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.index_build import check_chunks, encode_segment, rows_table
from bytecp.format.metadata import ChunkRecord
from bytecp.format.parts_schema import (
    BAND_ENTRY_SCHEMA,
    MAX_WIDE_SEGMENTS,
    PAGE_ENTRIES,
    PART_SCHEMA,
    SEGMENT_ROWS,
    WIDE_ENTRY_SCHEMA,
    WIDE_MIN_ROWS,
    PartsDirectory,
    buckets_for,
    check_spans,
    part_file,
    span_limit,
)

__all__ = ["PartEntries", "BuiltPart", "build_part", "build_directory", "build_whole", "linear_bands"]


@dataclasses.dataclass
class PartEntries:
    """What a rank tells the coordinator about its part: its size and one
    entry per segment (columns). ``nbytes == 0``: it wrote no part."""

    rank: int
    nbytes: int = 0
    #: elements of every chunk of the part (the coordinator adds them up)
    elements: int = 0
    #: band segments: the bands [lo, hi] their rows meet; where they are
    lo: list[int] = dataclasses.field(default_factory=list)
    hi: list[int] = dataclasses.field(default_factory=list)
    #: wide segments: the names [first, last] of their rows
    first: list[str] = dataclasses.field(default_factory=list)
    last: list[str] = dataclasses.field(default_factory=list)
    #: band segments then wide segments
    offset: list[int] = dataclasses.field(default_factory=list)
    size: list[int] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)
    crc: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class BuiltPart:
    """A rank's part: the segments (in file order) and their entries."""

    blobs: list[bytes]
    entries: PartEntries


def linear_bands(first: np.ndarray, last: np.ndarray, numel: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """The bands ``[lo, hi]`` of rows whose first and last elements have the
    row-major indices ``first`` and ``last`` in tensors of ``numel``
    elements: ``i * B // N`` (exact: Python integers where 64 bits could overflow)."""
    first, last, numel = (np.asarray(a, np.int64) for a in (first, last, numel))
    big = numel > (np.iinfo(np.int64).max // max(1, buckets))
    lo = np.zeros(len(first), np.int64)
    hi = np.zeros(len(first), np.int64)
    ok = ~big
    lo[ok] = first[ok] * buckets // numel[ok]
    hi[ok] = last[ok] * buckets // numel[ok]
    for i in np.flatnonzero(big):
        lo[i] = int(first[i]) * buckets // int(numel[i])
        hi[i] = int(last[i]) * buckets // int(numel[i])
    return lo, hi


def build_part(
    batch: ChunkBatch,
    tensors: Mapping[str, Mapping[str, Any]],
    data_files: Mapping[str, int],
    save_id: str,
    rank: int,
    buckets: int,
) -> BuiltPart:
    """(every rank, at commit) Check this rank's chunks (inside their
    tensors and data files, no two overlapping) and lay out its part.
    ``tensors``: this rank's tensor specs (every tensor it wrote chunks of).
    Raises :class:`ConfigError` naming the tensor, the rank and the region."""
    names = sorted(tensors)
    rows = check_chunks([batch], tensors, data_files, ranks=[rank], whole=False)
    n = len(rows.fid)
    if not n:
        return BuiltPart([], PartEntries(rank))
    strides = np.ones_like(rows.shape)
    for d in range(rows.D - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * rows.shape[:, d + 1]
    last = ((rows.O + rows.L - 1) * strides[rows.fid]).sum(axis=1)
    lo, hi = linear_bands(rows.lin, last, rows.shape.prod(axis=1)[rows.fid], buckets)
    limit = span_limit(buckets)
    banded = (hi - lo + 1) <= limit
    bi = np.flatnonzero(banded)
    bi = bi[np.lexsort((rows.lin[bi], rows.fid[bi], lo[bi]))]
    band_groups = _cut_bands(bi, lo, limit)
    wi = np.flatnonzero(~banded)
    wi = wi[np.lexsort((rows.lin[wi], rows.fid[wi]))]
    wide_groups = _cut_wide(wi, rows.fid)
    groups = band_groups + wide_groups
    schema = PART_SCHEMA.with_metadata({**(PART_SCHEMA.metadata or {}), b"bytecp.save_id": save_id.encode()})
    table = rows_table(rows, names, np.concatenate(groups), schema)
    blobs, start = [], 0
    for g in groups:
        blobs.append(encode_segment(table.slice(start, len(g))))
        start += len(g)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(int).tolist()
    return BuiltPart(blobs, PartEntries(
        rank=rank, nbytes=int(offsets[-1]), elements=int(rows.L.prod(axis=1).sum()),
        lo=[int(lo[g].min()) for g in band_groups], hi=[int(hi[g].max()) for g in band_groups],
        first=[names[rows.fid[g[0]]] for g in wide_groups], last=[names[rows.fid[g[-1]]] for g in wide_groups],
        offset=offsets[:-1], size=[len(b) for b in blobs], rows=[len(g) for g in groups],
        crc=[crc32c(b) for b in blobs],
    ))


def _cut_bands(order: np.ndarray, lo: np.ndarray, limit: int) -> list[np.ndarray]:
    """Banded rows (sorted by first band) into segments of at most
    :data:`SEGMENT_ROWS` rows whose first bands lie within ``limit`` of each
    other -- once a segment has 16 rows (a Parquet file per row or two
    would cost more than the rows), or at once across a gap of more than
    4 times ``limit`` (a rank's 0-dim values in band 0 and its shards far
    from it: readers of one need not read the other)."""
    out: list[np.ndarray] = []
    s = 0
    while s < len(order):
        e = min(len(order), s + SEGMENT_ROWS)
        gap = lo[order[s:e]] - lo[order[s]]
        far = np.flatnonzero((gap > limit) & ((np.arange(len(gap)) >= 16) | (gap > 4 * limit)))
        e = s + int(far[0]) if len(far) else e
        out.append(order[s:e])
        s = e
    return out


def _cut_wide(order: np.ndarray, fid: np.ndarray) -> list[np.ndarray]:
    """Wide rows (sorted by name) into segments: one per tensor when the
    part has at most :data:`MAX_WIDE_SEGMENTS` wide tensors, else even runs
    of names (at least :data:`WIDE_MIN_ROWS` rows); never more than
    :data:`SEGMENT_ROWS` rows."""
    if not len(order):
        return []
    f = fid[order]
    starts = np.concatenate([[0], np.flatnonzero(f[1:] != f[:-1]) + 1])
    if len(starts) > MAX_WIDE_SEGMENTS:
        per = max(WIDE_MIN_ROWS, -(-len(order) // MAX_WIDE_SEGMENTS))
        starts = np.arange(0, len(order), per)
    cuts = [int(x) for x in starts[1:]]
    out: list[np.ndarray] = []
    for g in np.split(order, cuts):
        out.extend(g[s : s + SEGMENT_ROWS] for s in range(0, len(g), SEGMENT_ROWS))
    return out


def build_directory(entries: Sequence[PartEntries], save_id: str, buckets: int) -> tuple[list[bytes], PartsDirectory]:
    """(coordinator, at commit) Every rank's part entries as the directory
    file's pages and ``metadata.json``'s ``index``. Checks what a rank could
    get wrong: segments inside its part, not overlapping, bands in range."""
    parts = sorted((e for e in entries if e.nbytes), key=lambda e: e.rank)
    for e in parts:
        nb = len(e.lo)
        if len({len(e.lo), len(e.hi)}) != 1 or len({len(e.first), len(e.last)}) != 1 or \
                len({len(e.offset), len(e.size), len(e.rows), len(e.crc), nb + len(e.first)}) != 1:
            raise ConfigError(f"rank {e.rank}: its index part's entries have columns of different lengths")
        if any(not 0 <= a <= b < buckets for a, b in zip(e.lo, e.hi, strict=True)) or any(r <= 0 for r in e.rows):
            raise ConfigError(f"rank {e.rank}: its index part lists a segment outside the {buckets} bands or empty")

        def bad(why: str, rank: int = e.rank) -> ConfigError:
            return ConfigError(f"rank {rank}: its index part places a segment {why}")

        check_spans(e.offset, e.size, e.nbytes, bad)
    sid = save_id.encode()
    band_cols = _band_columns(parts)
    order = np.lexsort((band_cols["rank"], band_cols["lo"]))
    band_blobs, band_pages = _pages({k: v[order] for k, v in band_cols.items()}, BAND_ENTRY_SCHEMA, sid, "lo", "hi")
    wide_rows = sorted((e.first[k], e.rank, e.last[k], e.offset[len(e.lo) + k], e.size[len(e.lo) + k],
                        e.rows[len(e.lo) + k], e.crc[len(e.lo) + k]) for e in parts for k in range(len(e.first)))
    wide_cols: dict[str, np.ndarray] = {
        "first": np.asarray([r[0] for r in wide_rows], object), "last": np.asarray([r[2] for r in wide_rows], object),
        **{k: np.asarray([r[i] for r in wide_rows], np.uint32 if k == "crc32c" else np.int64)
           for k, i in (("rank", 1), ("offset", 3), ("nbytes", 4), ("rows", 5), ("crc32c", 6))}}
    wide_blobs, wide_pages = _pages(wide_cols, WIDE_ENTRY_SCHEMA, sid, "first", "last")
    base = sum(len(b) for b in band_blobs)
    wide_pages["offset"] = [o + base for o in wide_pages["offset"]]
    blobs = band_blobs + wide_blobs
    return blobs, PartsDirectory(
        save_id=save_id, buckets=buckets, ranks=[e.rank for e in parts], part_nbytes=[e.nbytes for e in parts],
        directory_nbytes=sum(len(b) for b in blobs), band_pages=band_pages, wide_pages=wide_pages,
    )


def _band_columns(parts: Sequence[PartEntries]) -> dict[str, np.ndarray]:
    def col(get: Any, dt: Any) -> np.ndarray:
        return np.concatenate([np.asarray(get(e), dt) for e in parts]) if parts else np.zeros(0, dt)

    return {
        "lo": col(lambda e: e.lo, np.int64), "hi": col(lambda e: e.hi, np.int64),
        "rank": col(lambda e: [e.rank] * len(e.lo), np.int64),
        "offset": col(lambda e: e.offset[: len(e.lo)], np.int64), "nbytes": col(lambda e: e.size[: len(e.lo)], np.int64),
        "rows": col(lambda e: e.rows[: len(e.lo)], np.int64), "crc32c": col(lambda e: e.crc[: len(e.lo)], np.uint32),
    }


def _pages(cols: Mapping[str, np.ndarray], schema: pa.Schema, save_id: bytes, lo: str, hi: str
           ) -> tuple[list[bytes], dict[str, list[Any]]]:
    """Sorted entries as pages of :data:`PAGE_ENTRIES`; each page's ``lo``
    (its first entry's) and ``hi`` (the greatest of its entries')."""
    schema = schema.with_metadata({**(schema.metadata or {}), b"bytecp.save_id": save_id})
    n = len(cols["rank"])
    blobs: list[bytes] = []
    page: dict[str, list[Any]] = {lo: [], hi: [], "offset": [], "nbytes": [], "rows": [], "crc32c": []}
    off = 0
    for s in range(0, n, PAGE_ENTRIES):
        sl = {k: v[s : s + PAGE_ENTRIES] for k, v in cols.items()}
        table = pa.table([pa.array(sl[f.name].tolist() if f.type == pa.string() else sl[f.name], f.type)
                          for f in schema], schema=schema)
        blob = encode_segment(table)
        blobs.append(blob)
        page[lo].append(sl[lo].tolist()[0])
        page[hi].append(max(sl[hi].tolist()))
        page["offset"].append(off)
        page["nbytes"].append(len(blob))
        page["rows"].append(len(sl["rank"]))
        page["crc32c"].append(crc32c(blob))
        off += len(blob)
    return blobs, page




def build_whole(
    rows: Sequence[ChunkRecord],
    tensors: Mapping[str, Mapping[str, Any]],
    data_files: Mapping[str, int],
    save_id: str,
) -> tuple[dict[str, list[bytes]], PartsDirectory]:
    """(one process writing a whole checkpoint: ``bytecp materialize``, the
    tests' checkpoint surgery) The index of ``rows`` as one part (rank 0) and
    its directory, checked as a commit checks every rank's chunks.
    -> the files to write (path -> blobs) and ``metadata.json``'s ``index``."""
    batch = ChunkBatch.of(list(rows))
    check_chunks([batch], tensors, data_files)
    buckets = buckets_for(1)
    part = build_part(batch, tensors, data_files, save_id, 0, buckets)
    pages, directory = build_directory([part.entries], save_id, buckets)
    files = {directory.file: pages}
    if part.blobs:
        files[part_file(save_id, 0)] = part.blobs
    return files, directory
