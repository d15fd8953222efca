"""Reading the version-4 index (docs/FORMAT.md section 5.6): the directory
pages a rank's targets meet, then the segments of the parts they name.

Called through the opened checkpoint (:mod:`bytecp.loading.opened`): on
every rank of a load once it knows its boxes (``wanted``), and in the
one-process tools for every segment (``wanted=None``). A rank reads
O(its share of the index) whatever the world size that wrote it: a few
pages of the directory, and the segments that may hold its rows. Every
page and segment is checked before it is trusted: its crc32c, its footer
against the hostile-input budget, that it belongs to this save, that it
lies inside its file without overlapping another, that each row lies where
the directory says. Each failure is one line naming the file at fault.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence

import pyarrow as pa

from bytecp.errors import CorruptCheckpointError, StorageError
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.format.index_check import decode_table
from bytecp.format.index_read import rows_to_records
from bytecp.format.parts_schema import (
    BAND_ENTRY_SCHEMA,
    PART_SCHEMA,
    WIDE_ENTRY_SCHEMA,
    PartsDirectory,
    box_bands,
    check_spans,
    part_file,
    span_limit,
)
from bytecp.storage_api import Storage
from bytecp.tree.regions import Region

__all__ = ["read_parts", "wanted_bands"]

#: one segment to read: (rank, offset, nbytes, rows, crc32c, band lo, band hi, first name, last name)
Entry = tuple[int, int, int, int, int, int, int, str, str]


def wanted_bands(md: fmt.Metadata, wanted: Mapping[str, Sequence[Region]]) -> list[tuple[int, int]]:
    """The bands the boxes ``wanted`` meet, as merged ``[lo, hi]`` intervals."""
    d = md.index
    assert isinstance(d, PartsDirectory)
    spans = [box_bands(box.offsets, box.lengths, md.tensors[fqn]["shape"], d.buckets)
             for fqn, boxes in wanted.items() for box in boxes if box.numel]
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


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
    None: every row), each chunk once, only of tensors in ``wanted``;
    and how many segments were read."""
    d = md.index
    assert isinstance(d, PartsDirectory)
    where = storage.url.rstrip("/")
    if d.save_id != md.save_id:
        raise CorruptCheckpointError(f"{where}: metadata.json of save {md.save_id!r} names the index of save "
                                     f"{d.save_id!r} ({d.file}); the checkpoint is corrupt")
    bands = None if wanted is None else wanted_bands(md, wanted)
    names = None if wanted is None else sorted(wanted)
    entries: list[Entry] = []
    pages = [("band", k) for k in range(len(d.band_pages["lo"]))
             if bands is None or _meets(bands, d.band_pages["lo"][k], d.band_pages["hi"][k])]
    pages += [("wide", k) for k in range(len(d.wide_pages["first"]))
              if names is None or _names_in(names, d.wide_pages["first"][k], d.wide_pages["last"][k])]
    for kind, k, table in _read_pages(storage, d, pages, where):
        entries += _entries(table, kind, k, d, bands, names, where)
    if budget is not None and sum(e[3] for e in entries) > budget:
        raise CorruptCheckpointError(f"{where}/{d.file}: the index directory lists {sum(e[3] for e in entries)} "
                                     f"rows, more than the {budget} the data files can hold")
    fqns = None if wanted is None else set(wanted)
    seen: set[fmt.ChunkRecord] = set()
    out: list[fmt.ChunkRecord] = []
    by_rank: dict[int, list[Entry]] = defaultdict(list)
    for e in entries:
        by_rank[e[0]].append(e)
    for rank, mine in sorted(by_rank.items()):
        for c in _read_segments(storage, md, d, rank, mine, fqns, where):
            if c not in seen:
                seen.add(c)
                out.append(c)
    return out, len(entries)


def _read(storage: Storage, path: str, spans: Sequence[tuple[int, int]], what: str) -> list[bytearray]:
    bufs = [bytearray(n) for _, n in spans]
    try:
        storage.read_ranges(path, [(off, memoryview(b)) for (off, _), b in zip(spans, bufs, strict=True)])
    except (FileNotFoundError, StorageError) as e:
        raise CorruptCheckpointError(f"{what} named in metadata.json is missing or short ({e})") from e
    return bufs


def _check_save(label: str, table: pa.Table, save_id: str) -> None:
    got = (table.schema.metadata or {}).get(b"bytecp.save_id", b"").decode(errors="replace")
    if got != save_id:
        raise CorruptCheckpointError(f"{label} belongs to save {got[:40]!r}, not to this checkpoint's {save_id!r}; "
                                     "the index is corrupt")


def _read_pages(storage: Storage, d: PartsDirectory, pages: list[tuple[str, int]], where: str
                ) -> list[tuple[str, int, pa.Table]]:
    cols = {"band": d.band_pages, "wide": d.wide_pages}
    spans = [(cols[kind]["offset"][k], cols[kind]["nbytes"][k]) for kind, k in pages]
    bufs = _read(storage, d.file, spans, f"{where}: the index directory {d.file}") if spans else []
    out = []
    for (kind, k), (off, n), buf in zip(pages, spans, bufs, strict=True):
        label = f"{where}/{d.file} page {kind} {k} (bytes {off}..{off + n})"
        if crc32c(buf) != cols[kind]["crc32c"][k]:
            raise CorruptCheckpointError(f"{label}: checksum mismatch; the index is damaged")
        schema = BAND_ENTRY_SCHEMA if kind == "band" else WIDE_ENTRY_SCHEMA
        strings = () if kind == "band" else ("first", "last")
        table = decode_table(label, label, bytes(buf), schema, strings, rows=cols[kind]["rows"][k])
        _check_save(label, table, d.save_id)
        out.append((kind, k, table))
    return out


def _entries(table: pa.Table, kind: str, k: int, d: PartsDirectory, bands: list[tuple[int, int]] | None,
             names: list[str] | None, where: str) -> list[Entry]:
    """A page's entries, checked against the page and the parts; those ``bands``/``names`` meet."""
    label = f"{where}/{d.file} page {kind} {k}"
    cols = {n: fmt.column_values(table, n) for n in table.schema.names}
    page = d.band_pages if kind == "band" else d.wide_pages
    out: list[Entry] = []
    keys = ("lo", "hi") if kind == "band" else ("first", "last")
    prev = None
    for i, (a, b) in enumerate(zip(cols[keys[0]], cols[keys[1]], strict=True)):
        rank, off, n, rows, crc = (int(cols[c][i]) for c in ("rank", "offset", "nbytes", "rows", "crc32c"))
        size = d.part_size(rank)
        if not (a <= b and page[keys[0]][k] <= a and b <= page[keys[1]][k]) or (prev is not None and a < prev) \
                or (kind == "band" and not 0 <= a <= b < d.buckets):
            raise CorruptCheckpointError(f"{label}: entry {i} ({a!r:.60}..{b!r:.60}) lies outside its page or out "
                                         "of order; the index is corrupt")
        if size is None or rows <= 0 or n <= 0 or off < 0 or off + n > size:
            raise CorruptCheckpointError(f"{label}: entry {i} places a segment at bytes {off}..{off + n} of the "
                                         f"part of rank {rank}, which metadata.json lists "
                                         f"{'not at all' if size is None else f'with {size} bytes'}")
        prev = a
        if kind == "band" and (bands is None or _meets(bands, a, b)):
            out.append((rank, off, n, rows, crc, a, b, "", ""))
        elif kind == "wide" and (names is None or _names_in(names, a, b)):
            out.append((rank, off, n, rows, crc, -1, -1, a, b))
    return out


def _read_segments(storage: Storage, md: fmt.Metadata, d: PartsDirectory, rank: int, entries: list[Entry],
                   fqns: set[str] | None, where: str) -> list[fmt.ChunkRecord]:
    path = part_file(d.save_id, rank)
    label = f"{where}/{path}"
    entries = sorted(set(entries))
    check_spans([e[1] for e in entries], [e[2] for e in entries], d.part_size(rank) or 0,
                lambda why: CorruptCheckpointError(f"{label}: the directory places two segments {why}"))
    bufs = _read(storage, path, [(e[1], e[2]) for e in entries], f"{where}: index part {path}")
    out: list[fmt.ChunkRecord] = []
    limit = span_limit(d.buckets)
    for e, buf in zip(entries, bufs, strict=True):
        seg = f"{label} segment at bytes {e[1]}..{e[1] + e[2]}"
        if crc32c(buf) != e[4]:
            raise CorruptCheckpointError(f"{seg}: checksum mismatch; the index is damaged")
        table = decode_table(seg, seg, bytes(buf), PART_SCHEMA, ("fqn", "file"), rows=e[3])
        _check_save(seg, table, d.save_id)
        try:
            chunks = rows_to_records(table, md, seg, fqns)
        except CorruptCheckpointError:
            raise
        except (pa.ArrowException, ValueError, TypeError, IndexError, KeyError) as x:
            raise CorruptCheckpointError(f"{seg} is unreadable ({str(x)[:300]})") from x
        for c in chunks:
            _check_place(seg, md, d, c, e, limit)
        out.extend(chunks)
    return out


def _check_place(label: str, md: fmt.Metadata, d: PartsDirectory, c: fmt.ChunkRecord, e: Entry, limit: int) -> None:
    """The row lies where the directory entry says (FORMAT.md §5.6): a
    band segment's rows meet at most ``limit`` bands, inside its ``[lo,
    hi]``; a wide segment's rows meet more, named inside its ``[first, last]``."""
    shape = c.global_shape
    ok = len(c.offsets) == len(c.lengths) == len(shape) and all(n > 0 for n in c.lengths)
    if ok:
        lo, hi = box_bands(c.offsets, c.lengths, shape, d.buckets)
        banded = hi - lo + 1 <= limit
        ok = (e[5] <= lo and hi <= e[6]) if e[5] >= 0 else (not banded and e[7] <= c.fqn <= e[8])
        ok = ok and banded == (e[5] >= 0)
    if not ok:
        raise CorruptCheckpointError(
            f"{label}: the row of tensor {c.fqn!r:.80} region {list(c.offsets)[:8]}+{list(c.lengths)[:8]} does "
            "not belong in it (FORMAT.md §5.6); the index is corrupt")

