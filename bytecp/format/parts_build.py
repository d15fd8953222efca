"""Writing the version-4 index: each rank its part, the coordinator the directory.

Called by the save pipeline's commit: every rank, before the commit's
gather, checks its own chunks and lays out its part (:func:`build_part`),
writes it and sends the coordinator only the part's :class:`PartEntries`
(encoded: :mod:`bytecp.format.parts_wire`); the coordinator decodes every
rank's together and turns them into the directory (:func:`build_directory`).
A rank handles its own rows; the coordinator one entry per band segment,
per (wide tensor, segment) pair and per 0-dim chunk -- not every chunk,
but as many entries as a planner spreads pieces of whole tensors over
ranks (FORMAT.md §5.6 says why that is the floor of a by-name lookup).
Like :mod:`bytecp.format.index_build`, all on NumPy columns.
docs/FORMAT.md section 5.6 is the spec; :mod:`bytecp.format.parts_schema`
holds the schemas.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bytecp.errors import ConfigError
from bytecp.format.checksum import crc32c, writer_block_bytes
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.index_build import check_chunks, encode_segment
from bytecp.format.metadata import ChunkRecord
from bytecp.format.parts_schema import (
    BAND_ENTRY_SCHEMA,
    PAGE_ENTRIES,
    PART_SCHEMA,
    SEGMENT_ROWS,
    WIDE_ENTRY_SCHEMA,
    PartsDirectory,
    buckets_for,
    part_file,
    span_limit,
)
from bytecp.format.parts_wire import EntryColumns, NameTable, PartEntries, Scalar, decode_all
from bytecp.format.segment_wire import encode_rows

__all__ = ["PartEntries", "Scalar", "BuiltPart", "build_part", "build_directory", "build_whole", "linear_bands"]


@dataclasses.dataclass
class BuiltPart:
    """A rank's part: the segments (in file order) and their entries."""

    blobs: list[bytes]
    entries: PartEntries


#: threads writing the directory's pages at commit (each page is a Parquet file of its own)
PAGE_WRITERS = min(8, os.cpu_count() or 1)

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
    block_bytes: int | None = None,
) -> BuiltPart:
    """(every rank, at commit) Check this rank's chunks (inside their
    tensors and data files, no two overlapping, each chunk over one block
    with its block checksums) and lay out its part: band segments, then
    wide segments, each row with its block checksums; its 0-dim chunks go
    to the entries (the directory lists them). ``tensors``: this rank's
    tensor specs (every tensor it wrote chunks of). Raises
    :class:`ConfigError` naming the tensor, the rank and the region."""
    rows = check_chunks([batch], tensors, data_files, ranks=[rank], whole=False)
    names = rows.names
    n = len(rows.fid)
    if not n:
        return BuiltPart([], PartEntries(rank))
    blocks = _block_sums(batch, rows.src, rows.nbytes, block_bytes or writer_block_bytes(),
                         lambda i: (names[rows.fid[i]], rank))
    last = ((rows.O + rows.L - 1) * rows.strides[rows.fid]).sum(axis=1)
    lo, hi = linear_bands(rows.lin, last, rows.shape.prod(axis=1)[rows.fid], buckets)
    limit = span_limit(buckets)
    scalar = rows.ndim == 0
    banded = ~scalar & ((hi - lo + 1) <= limit)
    bi = np.flatnonzero(banded)
    bi = bi[np.lexsort((rows.lin[bi], rows.fid[bi], lo[bi]))]
    band_groups = _cut_bands(bi, lo, limit)
    wi = np.flatnonzero(~scalar & ~banded)
    wi = wi[np.lexsort((rows.lin[wi], rows.fid[wi]))]
    wide_groups = [wi[s : s + SEGMENT_ROWS] for s in range(0, len(wi), SEGMENT_ROWS)]
    groups = band_groups + wide_groups
    si = np.flatnonzero(scalar)  # (columns to lists first: numpy scalars cost a conversion each)
    entries = PartEntries(rank=rank, elements=int(rows.L.prod(axis=1).sum()), scalars=list(map(
        Scalar, [names[f] for f in rows.fid[si].tolist()], [rows.files[f] for f in rows.file[si].tolist()],
        rows.byte_offset[si].tolist(), rows.nbytes[si].tolist(), rows.crc[si].tolist())))
    for j, g in enumerate(wide_groups):
        fids = np.unique(rows.fid[g])
        entries.names += [names[f] for f in fids]
        entries.name_seg += [j] * len(fids)
    if not groups:
        return BuiltPart([], entries)
    blobs = [encode_rows(save_id, names, rows.files, rows.fid[g], rows.file[g], rows.ndim[g], rows.byte_offset[g],
                         rows.nbytes[g], rows.crc[g], rows.O[g], rows.L[g], blocks(g)) for g in groups]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(int).tolist()
    entries.nbytes = int(offsets[-1])
    entries.lo, entries.hi = [int(lo[g].min()) for g in band_groups], [int(hi[g].max()) for g in band_groups]
    entries.offset, entries.size = offsets[:-1], [len(b) for b in blobs]
    entries.rows, entries.crc = [len(g) for g in groups], [crc32c(b) for b in blobs]
    return BuiltPart(blobs, entries)


def _block_sums(batch: ChunkBatch, src: np.ndarray, nbytes: np.ndarray, block_bytes: int,
                name: Callable[[int], tuple[str, int]]) -> Callable[[np.ndarray], np.ndarray]:
    """Checks that each row (``src``: its place in ``batch``) carries one block
    checksum per block of a chunk of more than ``block_bytes`` bytes, none
    otherwise; -> the block checksums of rows ``g`` (indices into ``src``), one row's after the other."""
    want = np.where(nbytes > block_bytes, -(-nbytes // block_bytes), 0)
    have = batch.nblocks[src] if len(batch.nblocks) == len(batch) else np.zeros(len(src), np.int64)
    if len(wrong := np.flatnonzero(have != want)):
        i = int(wrong[0])
        fqn, rank = name(i)
        raise ConfigError(f"tensor {fqn!r}: rank {rank} recorded {int(have[i])} block checksums for a chunk of "
                          f"{int(nbytes[i])} bytes, not {int(want[i])} (one per {block_bytes} bytes beyond one block)")
    starts = batch.block_starts()

    def of(g: np.ndarray) -> np.ndarray:
        count = want[g]
        total = int(count.sum())
        if not total:
            return np.zeros(0, np.uint32)
        first = starts[src[g]]
        before = np.cumsum(count) - count
        return batch.blocks[np.repeat(first - before, count) + np.arange(total)]

    return of


def _cut_bands(order: np.ndarray, lo: np.ndarray, limit: int) -> list[np.ndarray]:
    """Banded rows (sorted by first band) into segments of at most
    :data:`SEGMENT_ROWS` rows whose first bands lie within ``limit`` of each
    other and leave no gap of more than ``limit / 16`` bands (64 at least)
    between two rows -- once a segment has 16 rows (a segment per row or two
    would cost a read and a check per row), or at once across a gap of more
    than ``limit`` between two rows or 4 times ``limit`` from the first (rows
    far apart: readers of one need not read the other; a rank's 6 rows of
    an embedding are not glued to its experts' rows 15,000 bands further).
    A reader reads every segment whose bands meet its own: a rank's
    rows of tensors sharded differently (an expert's 2,048 rows over its
    data-parallel group, an embedding's 129,280 over every rank) lie at
    different bands, and one segment spanning both would be read by the
    readers of everything between."""
    out: list[np.ndarray] = []
    step = max(64, limit // 16)
    s = 0
    while s < len(order):
        e = min(len(order), s + SEGMENT_ROWS)
        first = lo[order[s:e]]
        gap = first - first[0]
        jump = np.zeros(len(first), np.int64)
        jump[1:] = np.diff(first)
        far = np.flatnonzero(((gap > limit) | (jump > step)) & ((np.arange(len(gap)) >= 16) | (gap > 4 * limit))
                             | (jump > limit))
        e = s + int(far[0]) if len(far) else e
        out.append(order[s:e])
        s = e
    return out


def build_directory(entries: Sequence[PartEntries | bytes] | EntryColumns, save_id: str, buckets: int,
                    names: Iterable[str], hashes: np.ndarray | None = None, block_bytes: int | None = None,
                    ) -> tuple[list[bytes], PartsDirectory]:
    """(coordinator, at commit) Every rank's part entries (as gathered:
    :meth:`PartEntries.encode`'s bytes, or already decoded by
    :func:`~bytecp.format.parts_wire.decode_all`; objects are encoded first) as the
    directory file's pages and ``metadata.json``'s ``index``. ``names``: every
    tensor of the state (``hashes``: their hashes, when the caller has them). Checks what a rank could get wrong: segments
    inside its part, not overlapping, bands in range, names it does not
    know, a 0-dim tensor written by two ranks. O(entries), vectorized."""
    cols = entries if isinstance(entries, EntryColumns) else decode_all(
        [e if isinstance(e, bytes) else e.encode() for e in entries])
    table = NameTable.of(names, hashes)
    _check(cols, buckets)
    sid = save_id.encode()
    band = cols.band
    order = np.lexsort((band["rank"], band["lo"]))
    band = {k: v[order] for k, v in band.items()}
    with concurrent.futures.ThreadPoolExecutor(PAGE_WRITERS, "bytecp-pages") as pool:  # (pages encoded meanwhile)
        band_pages = _pages(pool, len(order), BAND_ENTRY_SCHEMA, sid, "lo", "hi", lambda s, e: (
            [band[f.name][s:e].astype(np.uint32 if f.name == "crc32c" else np.int64) for f in BAND_ENTRY_SCHEMA],
            int(band["lo"][s]), int(band["hi"][s:e].max())))
        seg, wide = cols.segments, cols.wide
        ids = table.ids(wide["name"], lambda i: int(seg["rank"][wide["seg"][i]]), "wide rows")
        at = np.empty(len(seg["rank"]), np.int64)  # each segment's position in (rank, offset) order
        at[np.lexsort((seg["offset"], seg["rank"]))] = np.arange(len(at))
        order = np.argsort(ids * max(1, len(at)) + at[wide["seg"]])  # entries by (name, rank, offset): one sort
        ids, where = ids[order], wide["seg"][order]
        del order

        def wide_page(s: int, e: int) -> tuple[list[Any], Any, Any]:
            fqn = _strings(ids[s:e], table)
            k = where[s:e]
            return ([fqn, fqn, *(seg[c][k].astype(np.uint32 if c == "crc32c" else np.int64)
                                 for c in ("rank", "offset", "nbytes", "rows", "crc32c"))],
                    table.names[ids[s]], table.names[ids[e - 1]])

        wide_pages = _pages(pool, len(ids), WIDE_ENTRY_SCHEMA, sid, "first", "last", wide_page)
        scalar_pages = _scalar_pages(pool, cols, table, sid)
    blobs: list[bytes] = []
    base = 0
    for pages in (band_pages, wide_pages, scalar_pages):
        rows, offset, nbytes, crcs = pages.pop("rows"), [], [], []
        for blob, crc in (f.result() for f in pages.pop("written")):
            offset.append(base)
            nbytes.append(len(blob))
            crcs.append(crc)
            blobs.append(blob)
            base += len(blob)
        pages.update(offset=offset, nbytes=nbytes, rows=rows, crc32c=crcs)  # (the members in their order)
    return blobs, PartsDirectory(
        save_id=save_id, buckets=buckets, ranks=cols.rank.tolist(), part_nbytes=cols.nbytes.tolist(),
        directory_nbytes=base, band_pages=band_pages, wide_pages=wide_pages, scalar_pages=scalar_pages,
        block_bytes=block_bytes or writer_block_bytes(),
    )


def _check(cols: EntryColumns, buckets: int) -> None:
    """The coordinator's checks of every rank's entries (ConfigError naming a rank)."""
    def fail(mask: np.ndarray, ranks: np.ndarray, why: str) -> None:
        if bool(mask.any()):
            raise ConfigError(f"rank {int(ranks[np.flatnonzero(mask)[0]])}: its index part {why}")

    fail(cols.rank[1:] == cols.rank[:-1], cols.rank[1:], "was sent twice")
    b = cols.band
    fail((b["lo"] < 0) | (b["lo"] > b["hi"]) | (b["hi"] >= buckets), b["rank"],
         f"lists a segment outside the {buckets} bands")
    seg = cols.segments
    pos = np.searchsorted(cols.rank, seg["rank"]) if len(cols.rank) else np.zeros(len(seg["rank"]), np.int64)
    pos = np.minimum(pos, max(0, len(cols.rank) - 1))
    size = np.where(cols.rank[pos] == seg["rank"], cols.nbytes[pos], 0) if len(cols.rank) else pos * 0
    fail((seg["rows"] <= 0) | (seg["named"] <= 0), seg["rank"], "lists an empty segment, or a wide one naming no tensor")
    o = np.lexsort((seg["offset"], seg["rank"]))
    r, off, n = seg["rank"][o], seg["offset"][o], seg["nbytes"][o]
    fail((off < 0) | (n <= 0) | (off + n > size[o]), r, "places a segment outside the part")
    fail((r[1:] == r[:-1]) & (off[1:] < off[:-1] + n[:-1]), r[1:], "places two segments at overlapping bytes")


def _strings(ids: np.ndarray, table: NameTable) -> pa.Array:
    """The names of ``ids`` as a string column (taken from the table's
    names as one Arrow column, made once per table and kept with it)."""
    return table.strings(ids)


def _scalar_pages(pool: concurrent.futures.Executor, cols: EntryColumns, table: NameTable, sid: bytes,
                  ) -> dict[str, list[Any]]:
    """The 0-dim chunks, sorted by name, as pages of rows of the part schema."""
    sc = cols.scalars
    ids = table.ids(sc.hash, lambda i: int(sc.rank[i]), "a 0-dim chunk")
    order = np.argsort(ids, kind="stable")
    ids, ranks = ids[order], sc.rank[order]
    twice = np.flatnonzero(ids[1:] == ids[:-1])
    if len(twice):
        k = int(twice[0])
        raise ConfigError(f"tensor {table.names[ids[k]]!r}: ranks {int(ranks[k])} and {int(ranks[k + 1])} both wrote "
                          "its value (a 0-dim tensor is written once)")
    files = sc.files_at(order)
    empty = pa.Array.from_buffers(pa.list_(pa.int64()), len(order), [None, pa.py_buffer(np.zeros(len(order) + 1, np.int32))],
                                  children=[pa.Array.from_buffers(pa.int64(), 0, [None, pa.py_buffer(b"")])])

    def page(s: int, e: int) -> tuple[list[Any], Any, Any]:
        at = order[s:e]
        return ([_strings(ids[s:e], table), empty.slice(s, e - s), empty.slice(s, e - s), files.slice(s, e - s),
                 sc.offset[at], sc.nbytes[at], sc.crc32c[at].astype(np.uint32)],
                table.names[ids[s]], table.names[ids[e - 1]])

    return _pages(pool, len(order), PART_SCHEMA, sid, "first", "last", page)


def _pages(pool: concurrent.futures.Executor, n: int, schema: pa.Schema, save_id: bytes, lo: str, hi: str,
           page: Callable[[int, int], tuple[list[Any], Any, Any]]) -> dict[str, list[Any]]:
    """``n`` sorted entries as pages of :data:`PAGE_ENTRIES`: ``page(s, e)``
    gives the columns of entries ``s..e-1`` and the page's bounds ``lo``,
    ``hi``; each page's Parquet file and its checksum made by ``pool``
    (:data:`PAGE_WRITERS` threads, the writer runs without the GIL: 130
    pages of a 131,072-rank MoE's directory took 0.2 s one at a time) while
    the next pages' columns are built. The pages' bounds and rows, and
    ``written``: each page's (file, crc32c) to come."""
    schema = schema.with_metadata({**(schema.metadata or {}), b"bytecp.save_id": save_id})
    out: dict[str, list[Any]] = {lo: [], hi: [], "rows": [], "written": []}
    for s in range(0, n, PAGE_ENTRIES):
        e = min(n, s + PAGE_ENTRIES)
        arrays, a, b = page(s, e)
        table = pa.table([_numbers(x, f.type) if isinstance(x, np.ndarray) else x
                          for x, f in zip(arrays, schema, strict=True)], schema=schema)
        out["written"].append(pool.submit(_written, table))
        out[lo].append(a)
        out[hi].append(b)
        out["rows"].append(e - s)
    return out


#: the NumPy dtype of each Arrow type a page's number columns have
_NUMPY = {pa.int64(): np.int64, pa.uint32(): np.uint32, pa.int32(): np.int32, pa.uint64(): np.uint64}


def _numbers(x: np.ndarray, kind: pa.DataType) -> pa.Array:
    """``x`` (already of ``kind``'s NumPy dtype) as an Arrow column from its buffer (``pa.array`` would import pandas)."""
    if x.dtype != _NUMPY[kind]:
        raise TypeError(f"a page column of {kind} given as {x.dtype}")
    return pa.Array.from_buffers(kind, len(x), [None, pa.py_buffer(np.ascontiguousarray(x))])


def _written(table: pa.Table) -> tuple[bytes, int]:
    blob = encode_segment(table)
    return blob, crc32c(blob)


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
    pages, directory = build_directory([part.entries], save_id, buckets, tensors)
    files = {directory.file: pages}
    if part.blobs:
        files[part_file(save_id, 0)] = part.blobs
    return files, directory
