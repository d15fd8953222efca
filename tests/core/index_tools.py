"""Test tools for the version-4 index: read every row of a checkpoint's
index, and rewrite it (as crafted checkpoints would) with a valid directory.

A rewritten index is one part (rank 0's) holding one wide segment with the
given rows (or the given raw bytes), and a directory of one wide page
naming it: a layout the format allows for rows that meet more bands than a
banded row may, so the readers reach the rows themselves. The directory's
and the segment's crc32c are recomputed, as an attacker would; tests of
the checksum itself damage the bytes after.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bytecp.format.checksum import crc32c
from bytecp.format.parts_schema import PART_SCHEMA, WIDE_ENTRY_SCHEMA, part_file

from .helpers import tensor_specs

__all__ = ["index_rows", "rewrite_index", "index_file", "encode_rows", "metadata", "part_schema"]


def metadata(ck: Path) -> dict[str, Any]:
    return json.loads((ck / "metadata.json").read_text())


def index_file(ck: Path) -> Path:
    """The part of the lowest rank that wrote one (a one-process save's only part)."""
    md = metadata(ck)
    return ck / part_file(md["save_id"], md["index"]["parts"]["rank"][0])


def part_schema(save_id: str, schema: pa.Schema = PART_SCHEMA) -> pa.Schema:
    return schema.with_metadata({**(schema.metadata or {}), b"bytecp.save_id": save_id.encode()})


def index_rows(ck: Path) -> pa.Table:
    """Every row of every part (each chunk once)."""
    md = metadata(ck)
    tables = []
    for rank in md["index"]["parts"]["rank"]:
        tables += _segments((ck / part_file(md["save_id"], rank)).read_bytes())
    tables = [t.cast(PART_SCHEMA) for t in tables]
    return pa.concat_tables(tables) if tables else PART_SCHEMA.empty_table()


def _segments(raw: bytes) -> list[pa.Table]:
    """A part's segments: Parquet files one after the other (each ends in its footer and ``PAR1``)."""
    out = []
    start = 0
    while start < len(raw):
        pos = start + 4
        while True:
            end = raw.index(b"PAR1", pos) + 4
            size = int.from_bytes(raw[end - 8 : end - 4], "little")
            if end - start >= size + 12:
                break
            pos = end
        out.append(pq.ParquetFile(pa.BufferReader(raw[start:end])).read(use_threads=False))
        start = end
    return out


def encode_rows(table: pa.Table | dict[str, list[Any]], schema: pa.Schema = PART_SCHEMA) -> bytes:
    if isinstance(table, dict):
        table = pa.table(table, schema=schema)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def rewrite_index(ck: Path, rows: pa.Table | dict[str, list[Any]] | bytes, *, nrows: int | None = None) -> None:
    """Replace the index by one part holding one wide segment: ``rows`` (a
    table, columns, or raw segment bytes with ``nrows`` declared in the directory)."""
    md = metadata(ck)
    sid = md["save_id"]
    blob = rows if isinstance(rows, bytes) else encode_rows(
        rows.replace_schema_metadata(part_schema(sid).metadata) if isinstance(rows, pa.Table) else rows,
        part_schema(sid))
    if nrows is None:
        assert not isinstance(rows, bytes)
        nrows = rows.num_rows if isinstance(rows, pa.Table) else len(next(iter(rows.values())))
    names = sorted(tensor_specs(md))
    entry = {"first": [names[0]], "last": [names[-1]], "rank": [0], "offset": [0], "nbytes": [len(blob)],
             "rows": [nrows], "crc32c": [crc32c(blob)]}
    page = encode_rows(entry, part_schema(sid, WIDE_ENTRY_SCHEMA))
    for rank in md["index"]["parts"]["rank"]:
        (ck / part_file(sid, rank)).unlink()
    md["index"].update(
        parts={"rank": [0], "nbytes": [len(blob)]},
        directory={"file": md["index"]["directory"]["file"], "nbytes": len(page)},
        band_pages={"lo": [], "hi": [], "offset": [], "nbytes": [], "rows": [], "crc32c": []},
        wide_pages={"first": [names[0]], "last": [names[-1]], "offset": [0], "nbytes": [len(page)], "rows": [1],
                    "crc32c": [crc32c(page)]},
    )
    (ck / part_file(sid, 0)).write_bytes(blob)
    (ck / md["index"]["directory"]["file"]).write_bytes(page)
    (ck / "metadata.json").write_text(json.dumps(md))
