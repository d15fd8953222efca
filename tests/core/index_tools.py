"""Test tools for the version-4 index: read every row of a checkpoint's
index, and rewrite it (as crafted checkpoints would) with a valid directory.

A rewritten index is one part (rank 0's) holding one wide segment with the
given rows (or the given raw bytes), and a directory of one wide page
naming it: a layout the format allows for rows that meet more bands than a
banded row may, so the readers reach the rows themselves. The directory's
and the segment's crc32c are recomputed, as an attacker would; tests of
the checksum itself damage the bytes after. Rows carry a ``blocks`` column
(each row's block checksums; empty in a version-4 checkpoint), and a
version-5 checkpoint's segments are rewritten in encoding 2 with them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bytecp.format import checksum, segment_wire
from bytecp.format.checksum import crc32c
from bytecp.format.parts_schema import PART_SCHEMA, WIDE_ENTRY_SCHEMA, part_file

from .helpers import tensor_specs

__all__ = ["index_rows", "rewrite_index", "index_file", "encode_rows", "encode_segment", "segment_table", "split_part",
           "metadata", "part_schema", "block_bytes", "ROW_SCHEMA"]


def metadata(ck: Path) -> dict[str, Any]:
    return json.loads((ck / "metadata.json").read_text())


def index_file(ck: Path) -> Path:
    """The part of the lowest rank that wrote one (a one-process save's only part)."""
    md = metadata(ck)
    return ck / part_file(md["save_id"], md["index"]["parts"]["rank"][0])


def part_schema(save_id: str, schema: pa.Schema = PART_SCHEMA) -> pa.Schema:
    return schema.with_metadata({**(schema.metadata or {}), b"bytecp.save_id": save_id.encode()})


#: the part schema and each row's block checksums
ROW_SCHEMA = PART_SCHEMA.append(pa.field("blocks", pa.list_(pa.int64())))


def block_bytes(ck: Path) -> int | None:
    """A version-5 checkpoint's block size (None: version 4)."""
    return metadata(ck)["index"].get("block_bytes")


def index_rows(ck: Path) -> pa.Table:
    """Every row of every part (each chunk once), with its block checksums."""
    md = metadata(ck)
    tables = []
    for rank in md["index"]["parts"]["rank"]:
        tables += [segment_table(b, block_bytes=md["index"].get("block_bytes"))
                   for b in split_part((ck / part_file(md["save_id"], rank)).read_bytes())]
    return pa.concat_tables(tables) if tables else ROW_SCHEMA.empty_table()


def _size(raw: bytes, start: int) -> int:
    """The size of the segment at ``start`` (from its header, either encoding)."""
    blocks = raw[start : start + 8] == segment_wire.MAGIC_BLOCKS.to_bytes(8, "little")
    n, m, f, dims, nstr, *k = np.frombuffer(raw, "<i8", 5 + blocks, start + 8).tolist()
    head = segment_wire.HEADER_WORDS + blocks
    return 8 * (head + 6 * n + 2 * dims + -(-(k[0] if k else 0) // 2) + 1 + m + f) + -(-nstr // 8) * 8


def split_part(raw: bytes) -> list[bytes]:
    """A part's segments, back to back (each one's size from its header)."""
    out = []
    start = 0
    while start < len(raw):
        size = _size(raw, start)
        out.append(raw[start : start + size])
        start += size
    return out


def segment_table(blob: bytes, save_id: str | None = None, block_bytes: int | None = None) -> pa.Table:
    """A segment's rows as a table of :data:`ROW_SCHEMA` (its own save id unless ``save_id``;
    ``block_bytes``: a version-5 segment's)."""
    blocks = blob[:8] == segment_wire.MAGIC_BLOCKS.to_bytes(8, "little")
    n, m, f, dims, _, *k = np.frombuffer(blob, "<i8", 5 + blocks, 8).tolist()
    at = segment_wire.HEADER_WORDS + blocks + 6 * n + 2 * dims + -(-(k[0] if k else 0) // 2)  # the string lengths
    if save_id is None:
        s0 = 8 * (at + 1 + m + f)
        save_id = blob[s0 : s0 + int(np.frombuffer(blob, "<i8", 1, 8 * at)[0])].decode()
    seg = segment_wire.decode("segment", blob, n, save_id,
                              block_bytes=(block_bytes or checksum.BLOCK_BYTES) if blocks else None)
    start = seg.start.tolist()
    nd = seg.ndim.tolist()
    return pa.table({
        "fqn": [seg.names[i] for i in seg.name_id.tolist()],
        "offsets": [seg.offsets[s : s + k].tolist() for s, k in zip(start, nd, strict=True)],
        "lengths": [seg.lengths[s : s + k].tolist() for s, k in zip(start, nd, strict=True)],
        "file": [seg.files[i] for i in seg.file_id.tolist()],
        "byte_offset": seg.byte_offset.tolist(), "nbytes": seg.nbytes.tolist(),
        "crc32c": pa.array(seg.crc32c.tolist(), pa.uint32()),
        "blocks": [np.frombuffer(b, "<u4").tolist() for b in seg.blocks_of(np.arange(n))],
    }, schema=ROW_SCHEMA)


def encode_segment(rows: pa.Table | dict[str, list[Any]] | list[dict[str, Any]], save_id: str,
                   blocks: bool = False) -> bytes:
    """Rows (a table, columns or row dicts of the part schema, with or without ``blocks``) as one
    segment, unchecked (``blocks``: encoding 2, version 5's, with each row's ``blocks``)."""
    if isinstance(rows, pa.Table):
        rows = rows.to_pylist()
    elif isinstance(rows, dict):
        cols = {k: v.to_pylist() if isinstance(v, pa.Array) else list(v) for k, v in rows.items()}
        rows = [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]
    names = sorted({r["fqn"] for r in rows})
    files = sorted({r["file"] for r in rows})
    return segment_wire.encode(
        save_id, names, files, np.asarray([names.index(r["fqn"]) for r in rows], np.int64),
        np.asarray([files.index(r["file"]) for r in rows], np.int64),
        np.asarray([len(r["offsets"]) for r in rows], np.int64),
        *(np.asarray([r[k] for r in rows], np.int64) for k in ("byte_offset", "nbytes", "crc32c")),
        np.asarray([x for r in rows for x in r["offsets"]], np.int64),
        np.asarray([x for r in rows for x in r["lengths"]], np.int64),
        np.asarray([x for r in rows for x in r.get("blocks") or []], np.uint32) if blocks else None)


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
    blob = rows if isinstance(rows, bytes) else encode_segment(rows, sid, "block_bytes" in md["index"])
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
