"""Every row of a version-4 index a part at a time (docs/FORMAT.md section 5.6).

Called by the one-process tools (``bytecp inspect``, ``bytecp verify``:
:mod:`bytecp.tools.inspect`) on checkpoints of any size: they need every
row once, never all of them at the same time. Every page, segment and row
is checked as :func:`bytecp.format.parts_read.read_parts` checks it.
"""

from __future__ import annotations

from collections.abc import Iterator

from bytecp.format import metadata as fmt
from bytecp.format.parts_fetch import by_part, each_part
from bytecp.format.parts_read import _budget, _decode_segments, _directory, _page_entries, _segments
from bytecp.storage_api import Storage

__all__ = ["iter_parts"]


def iter_parts(storage: Storage, md: fmt.Metadata, *, budget: int | None = None
               ) -> tuple[int, Iterator[list[fmt.ChunkRecord]]]:
    """(one-process tools: ``inspect``, ``verify``) Every row, a part at a
    time, then the 0-dim rows of the scalar pages: memory for the
    directory's entries and one part, not for every row of a checkpoint of
    131,072 ranks. Returns the number of rows the directory lists (checked
    against ``budget`` first) and the parts' rows; each part's rows are
    checked as :func:`~bytecp.format.parts_read.read_parts` checks them."""
    d, where, parts = _directory(storage, md)
    pages = [(kind, k) for kind, col in (("wide", d.wide_pages), ("band", d.band_pages), ("scalar", d.scalar_pages))
             for k in range(len(col["offset"]))]
    scalars, entries = _page_entries(storage, md, d, pages, None, None, parts, where)
    segments = _segments(entries, d, where)
    del entries
    listed = sum(s[3] for s in segments) + len(scalars)
    _budget(listed, budget, d, where)
    parts_of = by_part(segments)

    def rows() -> Iterator[list[fmt.ChunkRecord]]:
        for got in each_part(storage, d, parts_of, where,
                             lambda rank, mine, bufs: _decode_segments(md, d, rank, mine, bufs, None, where)):
            yield list(dict.fromkeys(got))  # each chunk once
        if scalars:
            yield scalars

    return listed, rows()
