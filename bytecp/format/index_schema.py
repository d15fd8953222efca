"""The version-2 chunk index: one file of Parquet segments and its directory
(docs/FORMAT.md, section 5; the normative text).

```
index/<save_id>/index.bin   segment after segment, each a complete Parquet file
metadata.json "index"       the directory: where each segment is, its rows, its crc32c,
                            and which part of which tensors it holds
```

A tensor is either *banded* -- its chunks are listed by where they lie
along one dimension (``band_dim`` in its ``tensors`` entry): the dimension
is cut into ``buckets`` equal bands, and band segment ``b`` lists every chunk
of every banded tensor that meets band ``b`` -- or *wide* (0-dim tensors,
and tensors with a chunk spanning more than :data:`MAX_SPAN` bands), whose
chunks are listed by name in the wide segments. A rank reads only the
segments its targets meet: O(its share of the index), whatever the world
size. Built by :mod:`bytecp.format.index_build` (coordinator, at commit), read by
:mod:`bytecp.format.index_read`.

This module holds the schema, the constants and the directory; it imports
neither torch nor the rest of the format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from bytecp.errors import CorruptCheckpointError

__all__ = [
    "CHUNK_FIELDS",
    "INDEX_SCHEMA_V2",
    "INDEX_FILE_NAME",
    "ROWS_PER_BUCKET",
    "MAX_BUCKETS",
    "MAX_SPAN",
    "WIDE_ROWS",
    "IndexDirectory",
    "bucket_range",
    "columns",
]

#: rows of the index per band, aimed at when the number of bands is chosen
ROWS_PER_BUCKET = 512
#: most bands a checkpoint cuts each banded tensor into
MAX_BUCKETS = 1024
#: a tensor with a chunk spanning more bands than this is wide
MAX_SPAN = 8
#: most rows of one wide segment
WIDE_ROWS = 4096
INDEX_FILE_NAME = "index.bin"

#: where a chunk lies: the columns every index version's rows share after ``fqn``
#: (version 1's single index file adds ``dtype`` and ``global_shape`` before them)
CHUNK_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("offsets", pa.list_(pa.int64())),
    ("lengths", pa.list_(pa.int64())),
    ("file", pa.string()),
    ("byte_offset", pa.int64()),
    ("nbytes", pa.int64()),
    ("crc32c", pa.uint32()),
)

INDEX_SCHEMA_V2 = pa.schema([("fqn", pa.string()), *CHUNK_FIELDS], metadata={b"bytecp.format_version": b"2"})

_BAND_KEYS = ("bucket", "offset", "nbytes", "rows", "crc32c")
_WIDE_KEYS = ("first", "last", "offset", "nbytes", "rows", "crc32c")


def bucket_range(offset: int, length: int, dim_size: int, buckets: int) -> tuple[int, int]:
    """The first and last band (inclusive) that elements ``[offset,
    offset+length)`` of a dimension of ``dim_size`` meet (``length > 0``)."""
    return offset * buckets // dim_size, (offset + length - 1) * buckets // dim_size


@dataclasses.dataclass
class IndexDirectory:
    """``metadata.json``'s ``index`` member: the segments of the index file.

    ``band[k]`` and ``wide[k]`` are parallel lists (columns), one element
    per segment; band segments ascend by bucket, wide segments by name.
    """

    file: str
    nbytes: int
    buckets: int
    band: dict[str, list[int]]
    wide: dict[str, list[Any]]

    @property
    def segments(self) -> int:
        return len(self.band["bucket"]) + len(self.wide["first"])

    @property
    def rows(self) -> int:
        return sum(self.band["rows"]) + sum(self.wide["rows"])

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "nbytes": self.nbytes, "buckets": self.buckets,
                "band": self.band, "wide": self.wide}

    @classmethod
    def from_json(cls, d: Any, where: str) -> IndexDirectory:
        """Parse and check the directory: columns of equal length, integers in
        range, segments inside the index file and not overlapping, bands
        ascending, wide segments in name order."""

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: metadata.json's index directory {why}")

        if not isinstance(d, dict):
            raise bad("is not an object")
        file, nbytes, buckets = d.get("file"), d.get("nbytes"), d.get("buckets")
        if not isinstance(file, str) or type(nbytes) is not int or nbytes < 0:
            raise bad("lacks its file name or size")
        if type(buckets) is not int or not 1 <= buckets <= MAX_BUCKETS:
            raise bad(f"says {buckets!r:.40} buckets (want 1..{MAX_BUCKETS})")
        band = columns(d.get("band"), _BAND_KEYS, bad, ints=_BAND_KEYS)
        wide = columns(d.get("wide"), _WIDE_KEYS, bad, ints=_WIDE_KEYS[2:])
        if any(not isinstance(x, str) for x in wide["first"] + wide["last"]):
            raise bad("names a wide segment's tensors with non-strings")
        b = band["bucket"]
        if any(not 0 <= x < buckets for x in b) or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise bad("lists band segments out of order or outside the buckets")
        names = list(zip(wide["first"], wide["last"], strict=True))
        if any(f > la for f, la in names) or any(a[1] > c[0] for a, c in zip(names, names[1:], strict=False)):
            raise bad("lists wide segments out of name order")
        spans = sorted(zip(band["offset"] + wide["offset"], band["nbytes"] + wide["nbytes"], strict=True))
        end = 0
        for off, n in spans:
            if off < end or n <= 0 or off + n > nbytes:
                raise bad(f"places a segment at bytes {off}..{off + n} (file of {nbytes} bytes, "
                          "segments must not overlap)")
            end = off + n
        if any(r <= 0 for r in band["rows"] + wide["rows"]):
            raise bad("lists a segment without rows")
        return cls(file, nbytes, buckets, band, wide)


def columns(d: Any, keys: Sequence[str], bad: Any, *, ints: Sequence[str]) -> dict[str, list[Any]]:
    if not isinstance(d, dict) or set(d) != set(keys):
        raise bad(f"lacks the columns {list(keys)}")
    cols = {k: d[k] for k in keys}
    if any(not isinstance(v, list) for v in cols.values()) or len({len(v) for v in cols.values()}) > 1:
        raise bad("has columns of different lengths")
    for k in ints:
        if any(type(x) is not int or x < 0 for x in cols[k]):
            raise bad(f"has a non-integer or negative {k!r}")
    return cols
