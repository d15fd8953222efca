"""Test tools for the version-2 index: read every row of a checkpoint's index,
and rewrite it (as crafted checkpoints would) with a valid directory.

A rewritten index is one wide segment holding the given rows (or the given
raw bytes), and every tensor becomes wide (no ``band_dim``): a layout the
format allows, so the readers reach the rows themselves. The directory's
crc32c is recomputed, as an attacker would; tests of the checksum itself
damage the bytes after.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bytecp.format.checksum import crc32c
from bytecp.format.index_schema import INDEX_SCHEMA_V2

__all__ = ["index_rows", "rewrite_index", "index_file", "encode_rows", "metadata"]


def metadata(ck: Path) -> dict[str, Any]:
    return json.loads((ck / "metadata.json").read_text())


def index_file(ck: Path) -> Path:
    return ck / metadata(ck)["index"]["file"]


def index_rows(ck: Path) -> pa.Table:
    """Every row of every segment (chunks meeting several bands repeat)."""
    md = metadata(ck)
    d = md["index"]
    raw = (ck / d["file"]).read_bytes()
    tables = [pq.ParquetFile(pa.BufferReader(raw[o : o + n])).read(use_threads=False)
              for col in (d["band"], d["wide"]) for o, n in zip(col["offset"], col["nbytes"], strict=True)]
    tables = [t.cast(INDEX_SCHEMA_V2) for t in tables]
    return pa.concat_tables(tables) if tables else INDEX_SCHEMA_V2.empty_table()


def encode_rows(table: pa.Table | dict[str, list[Any]], schema: pa.Schema = INDEX_SCHEMA_V2) -> bytes:
    if isinstance(table, dict):
        table = pa.table(table, schema=schema)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def rewrite_index(ck: Path, rows: pa.Table | dict[str, list[Any]] | bytes, *, nrows: int | None = None) -> None:
    """Replace the index by one wide segment: ``rows`` (a table, columns, or
    raw segment bytes with ``nrows`` declared in the directory)."""
    md = metadata(ck)
    blob = rows if isinstance(rows, bytes) else encode_rows(rows)
    if nrows is None:
        assert not isinstance(rows, bytes)
        nrows = rows.num_rows if isinstance(rows, pa.Table) else len(next(iter(rows.values())))
    names = sorted(md["tensors"])
    md["index"] = {
        "file": md["index"]["file"], "nbytes": len(blob), "buckets": 1,
        "band": {"bucket": [], "offset": [], "nbytes": [], "rows": [], "crc32c": []},
        "wide": {"first": [names[0]], "last": [names[-1]], "offset": [0], "nbytes": [len(blob)],
                 "rows": [nrows], "crc32c": [crc32c(blob)]},
    }
    for info in md["tensors"].values():
        info.pop("band_dim", None)
    (ck / md["index"]["file"]).write_bytes(blob)
    (ck / "metadata.json").write_text(json.dumps(md))
