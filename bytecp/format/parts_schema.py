"""The version-4 chunk index: one part per saving rank, and a directory of
their segments (docs/FORMAT.md, section 5.6; the normative text).

```
index/<save_id>/<rank>.bin      that rank's segments, each a block of 64-bit words (segment_wire)
index/<save_id>/directory.bin   pages of directory entries (band segments; wide tensors' segments;
                                0-dim chunks, listed there and in no part)
metadata.json "index"           the parts, and the directory's pages
```

Every rank writes its own part at commit (:mod:`bytecp.format.parts_build`),
so no process ever holds every chunk: the coordinator receives a few
directory entries per rank and writes the directory. Rows are placed as in
version 2 but by their *linear* position: band ``b`` of a tensor of ``N``
elements holds the elements ``i`` with ``floor(i * B / N) == b``, so a rank
decides where each of its rows goes without knowing any other rank's
chunks. A row spanning more than :func:`span_limit` bands is *wide*: the
directory lists, by name, each tensor a wide segment holds rows of. A 0-dim
chunk (an optimizer's ``step``) is in no part: the directory's scalar pages
list it by name, so a reader of every ``step`` reads a page or two, not one
segment per rank that wrote one. A reader (:mod:`bytecp.format.parts_read`) reads the
directory pages its targets meet, then only the segments they name.

This module holds the schemas, the constants and the ``index`` member of
``metadata.json``; it imports neither torch nor the rest of the format.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from bytecp.errors import CorruptCheckpointError
from bytecp.format.index_schema import CHUNK_FIELDS, columns

__all__ = [
    "PART_SCHEMA",
    "BAND_ENTRY_SCHEMA",
    "WIDE_ENTRY_SCHEMA",
    "MAX_BUCKETS_V4",
    "PAGE_ENTRIES",
    "SEGMENT_ROWS",
    "MIN_BUCKETS_V4",
    "DIRECTORY_NAME",
    "MIN_BLOCK",
    "MAX_BLOCK",
    "buckets_for",
    "span_limit",
    "part_file",
    "box_bands",
    "check_spans",
    "PartsDirectory",
]

#: most bands of a version-4 index (a row's band is computed as ``i * B // N``
#: in 64 bits: ``N * B`` stays below 2**63 for tensors of up to 2**45 elements)
MAX_BUCKETS_V4 = 1 << 18
#: most entries of one directory page
PAGE_ENTRIES = 4096
#: most rows of one segment of a part
SEGMENT_ROWS = 4096
#: fewest bands of a version-4 index
MIN_BUCKETS_V4 = 1024
DIRECTORY_NAME = "directory.bin"
#: the block sizes a version-5 index may name (``block_bytes``)
MIN_BLOCK, MAX_BLOCK = 4096, 1 << 30
FORMAT_V4 = b"4"
_SAVE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")

#: the version-2 columns, as a table: a directory's scalar pages (Parquet); a part's segments hold the same
#: columns in the encoding of :mod:`bytecp.format.segment_wire`
PART_SCHEMA = pa.schema([("fqn", pa.string()), *CHUNK_FIELDS], metadata={b"bytecp.format_version": FORMAT_V4})
_ENTRY_TAIL: tuple[tuple[str, pa.DataType], ...] = (
    ("rank", pa.int64()),
    ("offset", pa.int64()),
    ("nbytes", pa.int64()),
    ("rows", pa.int64()),
    ("crc32c", pa.uint32()),
)
#: a directory page of band segments: the bands ``[lo, hi]`` its rows meet, where the segment is
BAND_ENTRY_SCHEMA = pa.schema([("lo", pa.int64()), ("hi", pa.int64()), *_ENTRY_TAIL],
                              metadata={b"bytecp.format_version": FORMAT_V4})
#: a directory page of wide segments: the names ``[first, last]`` its rows have, where the segment is
WIDE_ENTRY_SCHEMA = pa.schema([("first", pa.string()), ("last", pa.string()), *_ENTRY_TAIL],
                              metadata={b"bytecp.format_version": FORMAT_V4})

_PAGE_INTS = ("offset", "nbytes", "rows", "crc32c")


def buckets_for(world_size: int) -> int:
    """``B`` for a save by ``world_size`` ranks: four bands per rank (a
    power of two, :data:`MIN_BUCKETS_V4` to :data:`MAX_BUCKETS_V4`), so that
    a rank's even share of a tensor meets about four bands at any world size
    from 256 ranks on (fewer ranks: their shares are wide, listed by name)."""
    b = MIN_BUCKETS_V4
    while b < 4 * world_size and b < MAX_BUCKETS_V4:
        b *= 2
    return b


def span_limit(buckets: int) -> int:
    """Most bands a banded row may meet: 8, or 1/64 of the bands when more
    (a 2-D shard -- rows of a data-parallel share, columns of a tensor-parallel
    one -- meets about ``4 * tp`` bands and stays banded at scale)."""
    return max(8, buckets // 64)


def box_bands(offsets: Sequence[int], lengths: Sequence[int], shape: Sequence[int], buckets: int) -> tuple[int, int]:
    """The bands ``[lo, hi]`` a non-empty box of a tensor of ``shape`` meets:
    those of its first and last elements' row-major indices (``i * B // N``).
    The one scalar form of the rule (readers: each wanted box, each row read);
    :func:`bytecp.format.parts_build.linear_bands` is its vectorized twin."""
    n = math.prod(shape)
    if n == 0:  # (a tensor of no elements: no band; a row the index lists in it is refused by the row checks)
        return 0, 0
    first = last = 0
    for o, ln, s in zip(offsets, lengths, shape, strict=True):
        first, last = first * s + o, last * s + o + ln - 1
    return first * buckets // n, last * buckets // n


def part_file(save_id: str, rank: int) -> str:
    return f"index/{save_id}/{rank}.bin"


@dataclasses.dataclass
class PartsDirectory:
    """``metadata.json``'s ``index`` member in version 4 (``"layout": "parts"``).

    ``parts``: the rank and size of every part file (ranks ascending); the
    pages: parallel lists (columns), band pages by ascending ``lo``, wide
    pages (and scalar pages: rows of 0-dim chunks) by ascending ``first``.
    A page's ``[lo, hi]`` (``[first, last]``) contains the interval of
    every entry on it.
    """

    save_id: str
    buckets: int
    ranks: list[int]
    part_nbytes: list[int]
    directory_nbytes: int
    band_pages: dict[str, list[int]]
    wide_pages: dict[str, list[Any]]
    scalar_pages: dict[str, list[Any]]
    #: version 5: the block size of the chunks' block checksums (each row of a part's segments records
    #: one per block of a chunk of more than one block); None: version 4 (none recorded)
    block_bytes: int | None = None

    @property
    def file(self) -> str:
        """The directory file (what version 2 calls the index file)."""
        return f"index/{self.save_id}/{DIRECTORY_NAME}"

    @property
    def nbytes(self) -> int:
        """The directory file's size."""
        return self.directory_nbytes

    @property
    def files(self) -> list[str]:
        return [self.file, *(part_file(self.save_id, r) for r in self.ranks)]

    @property
    def rows(self) -> int:
        """Entries of the directory (each a segment; its rows are in the entry)."""
        return sum(self.band_pages["rows"]) + sum(self.wide_pages["rows"]) + sum(self.scalar_pages["rows"])

    def part_size(self, rank: int) -> int | None:
        """The size of rank ``rank``'s part, None when it wrote none."""
        i = bisect.bisect_left(self.ranks, rank)
        return self.part_nbytes[i] if i < len(self.ranks) and self.ranks[i] == rank else None

    def to_json(self) -> dict[str, Any]:
        blocks = {} if self.block_bytes is None else {"block_bytes": self.block_bytes}
        return {"layout": "parts", "buckets": self.buckets, **blocks,
                "parts": {"rank": self.ranks, "nbytes": self.part_nbytes},
                "directory": {"file": self.file, "nbytes": self.directory_nbytes},
                "band_pages": self.band_pages, "wide_pages": self.wide_pages, "scalar_pages": self.scalar_pages}

    @classmethod
    def from_json(cls, d: Any, where: str) -> PartsDirectory:
        """Parse and check: columns of equal length, integers in range, parts
        ascending, pages inside the directory file, not overlapping, in order."""

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: metadata.json's index (layout parts) {why}")

        if not isinstance(d, dict) or d.get("layout") != "parts":
            raise bad("is not an object with \"layout\": \"parts\"")
        buckets = d.get("buckets")
        if type(buckets) is not int or not 1 <= buckets <= MAX_BUCKETS_V4:
            raise bad(f"says {buckets!r:.40} buckets (want 1..{MAX_BUCKETS_V4})")
        block_bytes = d.get("block_bytes")
        if block_bytes is not None and (type(block_bytes) is not int or not MIN_BLOCK <= block_bytes <= MAX_BLOCK
                                        or block_bytes & (block_bytes - 1)):
            raise bad(f"says block_bytes {block_bytes!r:.40} (want a power of two, {MIN_BLOCK}..{MAX_BLOCK})")
        parts = columns(d.get("parts"), ("rank", "nbytes"), bad, ints=("rank", "nbytes"))
        ranks, sizes = parts["rank"], parts["nbytes"]
        if any(a >= b for a, b in zip(ranks, ranks[1:], strict=False)) or any(n <= 0 for n in sizes):
            raise bad("lists its parts' ranks out of order, twice, or an empty part")
        if any(not 0 <= v < 2**63 for v in ranks + sizes):  # (numpy's int64 holds them: the readers' arrays)
            raise bad("lists a part's rank or size beyond 2**63 or below 0")
        dirs = d.get("directory")
        file = dirs.get("file") if isinstance(dirs, dict) else None
        folder = file.split("/") if isinstance(file, str) else []
        if len(folder) != 3 or folder[0] != "index" or folder[2] != DIRECTORY_NAME or not _SAVE_ID.fullmatch(folder[1]):
            raise bad(f"names a directory file other than index/<save_id>/{DIRECTORY_NAME} ({file!r:.80})")
        save_id = folder[1]  # the save that wrote the index (metadata.json's own save_id, unless it was tampered with)
        assert isinstance(dirs, dict)
        nbytes = dirs.get("nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise bad("lacks the directory file's size")
        band = columns(d.get("band_pages"), ("lo", "hi", *_PAGE_INTS), bad, ints=("lo", "hi", *_PAGE_INTS))
        wide = columns(d.get("wide_pages"), ("first", "last", *_PAGE_INTS), bad, ints=_PAGE_INTS)
        scalar = columns(d.get("scalar_pages"), ("first", "last", *_PAGE_INTS), bad, ints=_PAGE_INTS)
        if any(not isinstance(x, str) for x in wide["first"] + wide["last"] + scalar["first"] + scalar["last"]):
            raise bad("names a wide or scalar page's tensors with non-strings")
        if any(not lo <= hi < buckets for lo, hi in zip(band["lo"], band["hi"], strict=True)) or any(
                a > b for a, b in zip(band["lo"], band["lo"][1:], strict=False)):
            raise bad("lists band pages out of order or outside the buckets")
        for kind, col in (("wide", wide), ("scalar", scalar)):
            if any(f > la for f, la in zip(col["first"], col["last"], strict=True)) or any(
                    a > b for a, b in zip(col["first"], col["first"][1:], strict=False)):
                raise bad(f"lists {kind} pages out of name order")
        # scalar pages hold one row per 0-dim tensor: they never share a name
        if any(a >= b for a, b in zip(scalar["last"], scalar["first"][1:], strict=False)):
            raise bad("lists scalar pages whose names overlap")
        check_spans(band["offset"] + wide["offset"] + scalar["offset"], band["nbytes"] + wide["nbytes"] + scalar["nbytes"],
                    nbytes, lambda why: bad(f"places a page {why}"))
        if any(r <= 0 for r in band["rows"] + wide["rows"] + scalar["rows"]):
            raise bad("lists a page without entries")
        return cls(save_id, buckets, ranks, sizes, nbytes, band, wide, scalar, block_bytes)


def check_spans(offsets: Sequence[int], sizes: Sequence[int], total: int, bad: Any) -> None:
    """Byte ranges inside ``[0, total)``, not overlapping, none empty (the
    pages of the directory file; the segments of one part a reader reads)."""
    end = 0
    for off, n in sorted(zip(offsets, sizes, strict=True)):
        if off < end or n <= 0 or off + n > total:
            raise bad(f"at bytes {off}..{off + n} (file of {total} bytes; ranges must not overlap)")
        end = off + n
