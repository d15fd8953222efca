"""Reading the chunk index of either version (docs/FORMAT.md section 5):
rows decoded and checked, nothing else.

Version 2: the segments a rank's targets meet, and nothing else. Called
through the opened checkpoint (:mod:`bytecp.loading.opened`): on every rank
of a load once it knows the boxes it reads (:func:`wanted_segments`, then
:func:`read_segments`), and in the one-process tools (export, inspect,
verify) for every segment. A rank whose targets are empty reads nothing.
Every segment's crc32c (from ``metadata.json``) is checked before it is
decoded, and its footer against the hostile-input budget
(:mod:`bytecp.format.limits`).

Version 1: :func:`read_index` decodes whole per-rank index files (the
opened checkpoint's coordinator reads them all).

Table, footer and placement checks are :mod:`bytecp.format.index_check`'s,
shared by both versions; rows are checked against ``metadata.json`` by the
opened checkpoint.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from bytecp.errors import CorruptCheckpointError, one_line
from bytecp.format import arrow_numpy, limits, parts_fetch
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.format.index_check import Place, check_place, decode_table
from bytecp.format.index_schema import INDEX_SCHEMA_V2, MAX_SPAN, IndexDirectory, bucket_range
from bytecp.storage_api import Storage
from bytecp.tree.regions import Region

__all__ = ["read_index", "wanted_segments", "read_segments", "all_segments", "max_rows", "check_budget",
           "rows_to_records"]

_STRINGS = ("fqn", "file")
_STRINGS_V1 = ("fqn", "dtype", "file")


def read_index(
    blobs: Iterable[tuple[str, bytes]],
    *,
    where: str = "",
    row_budget: Callable[[], int] | None = None,
) -> list[fmt.ChunkRecord]:
    """(version 1) Decode index files (``(name, bytes)`` pairs) into chunk records.

    ``where`` (the checkpoint URL) prefixes file names in errors. Each
    file's footer is checked against the hostile-input budget before any
    column is decoded; ``row_budget`` gives the most rows the checkpoint may
    have, and is called at most once, only for an index file above
    :data:`bytecp.format.limits.FIXED_ROWS` rows (it may look up the data
    files' real sizes).
    """
    budget: list[int] = []

    def once() -> int:
        if not budget:
            assert row_budget is not None
            budget.append(row_budget())
        return budget[0]

    out: list[fmt.ChunkRecord] = []
    for name, data in blobs:
        label = f"{where.rstrip('/')}/{name}" if where else name
        table = decode_table(f"index file {label}", label, data, fmt.INDEX_SCHEMA, _STRINGS_V1,
                             row_budget=once if row_budget is not None else None)
        try:
            chunks = fmt.table_to_chunks(table)
        except (pa.ArrowException, ValueError, TypeError, IndexError) as e:
            raise CorruptCheckpointError(f"index file {label} is unreadable ({one_line(e)})") from e
        limits.check_chunk_records(label, chunks)
        out.extend(chunks)
    return out


def all_segments(md: fmt.Metadata) -> list[int]:
    assert isinstance(md.index, IndexDirectory)
    return list(range(md.index.segments))


def max_rows(md: fmt.Metadata, real: Mapping[str, int | None] | None) -> int:
    """Rows the index may hold: a chunk is listed once per band it meets (at
    most :data:`MAX_SPAN`), the distinct chunks bounded as in version 1."""
    return MAX_SPAN * limits.max_index_rows(md, real)


def check_budget(storage: Storage, md: fmt.Metadata, budget: int, rows: int | None = None) -> None:
    """The directory lists at most ``budget`` rows (all of them, or ``rows``)."""
    assert md.index is not None
    n = md.index.rows if rows is None else rows
    if n > budget:
        raise CorruptCheckpointError(
            f"{storage.url.rstrip('/')}/{md.index.file}: the index directory lists {n} rows, more than the "
            f"{budget} the data files can hold"
        )


def wanted_segments(md: fmt.Metadata, wanted: Mapping[str, Sequence[Region]]) -> list[int]:
    """(every rank) The segments that may list chunks of the boxes ``wanted``
    (fqn -> boxes): for a banded tensor the bands its boxes meet along its
    band dimension, for a wide one the wide segments its name falls in.
    Segment numbers count the band segments first, then the wide ones."""
    d = md.index
    assert isinstance(d, IndexDirectory)
    bands = d.band["bucket"]
    nb = len(bands)
    out: set[int] = set()
    for fqn, boxes in wanted.items():
        info = md.tensors[fqn]
        dim = info.get("band_dim")
        if dim is None:
            lo = bisect.bisect_left(d.wide["last"], fqn)
            hi = bisect.bisect_right(d.wide["first"], fqn)
            out.update(nb + k for k in range(lo, hi))
            continue
        size = info["shape"][dim]
        for box in boxes:
            if box.numel == 0:
                continue
            first, last = bucket_range(box.offsets[dim], box.lengths[dim], size, d.buckets)
            out.update(range(bisect.bisect_left(bands, first), bisect.bisect_right(bands, last)))
    return sorted(out)


def read_segments(
    storage: Storage,
    md: fmt.Metadata,
    segments: Sequence[int],
    *,
    fqns: set[str] | None = None,
    budget: int | None = None,
) -> list[fmt.ChunkRecord]:
    """(every rank) The chunk records of ``segments``, each chunk once,
    only those of tensors in ``fqns`` (None: all). One ranged read per
    segment (backends coalesce neighbours); crc32c checked first."""
    d = md.index
    assert isinstance(d, IndexDirectory)
    nb = len(d.band["bucket"])
    where = f"{storage.url.rstrip('/')}/{d.file}"
    spans = []
    places: list[Place] = []
    for s in segments:
        col = d.band if s < nb else d.wide
        k = s if s < nb else s - nb
        spans.append((col["offset"][k], col["nbytes"][k], col["rows"][k], col["crc32c"][k]))
        places.append((d.band["bucket"][k], None, None) if s < nb else (None, d.wide["first"][k], d.wide["last"][k]))
    if budget is not None:
        check_budget(storage, md, budget, sum(sp[2] for sp in spans))
    # (one request; a transient storage error raised as it is, to be retried)
    bufs = parts_fetch.read(storage, d.file, [(off, n) for off, n, _, _ in spans], f"{where}: the index file") \
        if spans else []
    seen: set[fmt.ChunkRecord] = set()
    out: list[fmt.ChunkRecord] = []
    for s, (off, n, rows, crc), buf, place in zip(segments, spans, bufs, places, strict=True):
        label = f"{where} segment {s} (bytes {off}..{off + n})"
        if crc32c(buf) != crc:
            raise CorruptCheckpointError(f"{label}: checksum mismatch; the index is damaged")
        for c in _decode(label, buf, rows, md, fqns, place):
            if c not in seen:  # a chunk meeting several bands is listed, the same, in each
                seen.add(c)
                out.append(c)
    return out


def _decode(
    label: str, data: bytes | bytearray, rows: int, md: fmt.Metadata, fqns: set[str] | None, place: Place
) -> list[fmt.ChunkRecord]:
    """One segment's rows (of the tensors in ``fqns``) as chunk records."""
    table = decode_table(label, label, data, INDEX_SCHEMA_V2, _STRINGS, rows=rows)
    try:
        names = table.column("fqn").combine_chunks()
        if not pa.types.is_dictionary(names.type):
            names = names.dictionary_encode()
        values = names.dictionary.to_pylist()
        if fqns is not None:
            keep = np.flatnonzero(np.isin(arrow_numpy.indices(names.indices), [i for i, v in enumerate(values) if v in fqns]))
            table = _rows(table, keep)
        return _records(table, md, label, place)
    except CorruptCheckpointError:
        raise
    except (pa.ArrowException, ValueError, TypeError, IndexError, KeyError) as e:
        raise CorruptCheckpointError(f"{label} is unreadable ({one_line(e)})") from e


def _rows(table: pa.Table, keep: np.ndarray) -> pa.Table:
    """The rows ``keep`` (ascending) of ``table``, as zero-copy slices of its
    runs: ``Table.filter`` would import ``pyarrow.compute`` and pandas."""
    if len(keep) == table.num_rows:
        return table
    if not len(keep):
        return table.slice(0, 0)
    runs = np.split(keep, np.flatnonzero(np.diff(keep) != 1) + 1)
    return pa.concat_tables([table.slice(int(r[0]), len(r)) for r in runs])


def _records(table: pa.Table, md: fmt.Metadata, label: str, place: Place) -> list[fmt.ChunkRecord]:
    out = rows_to_records(table, md, label)
    check_place(label, md, out, place)
    return out


def rows_to_records(table: pa.Table, md: fmt.Metadata, label: str,
                    fqns: set[str] | None = None) -> list[fmt.ChunkRecord]:
    """A segment's rows (the version-2 columns, which version 4's parts
    share) as chunk records of the tensors in ``fqns`` (None: all), each
    row's tensor looked up in ``metadata.json`` and its box checked as well formed."""
    cols = [fmt.column_values(table, name) for name in INDEX_SCHEMA_V2.names]
    out = []
    for fqn, of, ln, f, bo, nb, crc in zip(*cols, strict=True):
        info = md.tensors.get(fqn)
        if info is None:
            raise CorruptCheckpointError(f"{label}: a row names tensor {fqn!r:.80}, which metadata.json lacks")
        if fqns is not None and fqn not in fqns:
            continue
        out.append(fmt.chunk_record(fqn, info["dtype"], tuple(info["shape"]), tuple(of), tuple(ln), f,
                                   int(bo), int(nb), int(crc)))
    limits.check_chunk_records(label, out)
    return out
