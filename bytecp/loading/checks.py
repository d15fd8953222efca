"""What a load checks of the bytes it reads: which bytes to read so that every
byte it places is covered by a checksum, and the check itself.

Called by the reader (:mod:`bytecp.loading.reader`, :mod:`bytecp.loading.device_reads`)
for each ranged read, with ``verify`` on. A read of part of a chunk of a
version-5 checkpoint is widened to whole blocks (:func:`cover`: at most one
block more at each edge; a chunk of one block or less is read whole) and
each block is checked against its own crc32c (docs/FORMAT.md §8); so is a
whole chunk that has block checksums (the error then names the block). A
chunk without them (a version-5 chunk of one block or less, any chunk of an
older checkpoint) read whole is checked against its crc32c; older
checkpoints record no block checksums, so a partial read of theirs is not
checked.

A :class:`Verifier` takes the bytes of its cover in order, in any pieces,
from whichever thread holds them (the thread that reads them, range by
range as they arrive: :meth:`bytecp.storage_api.Storage.read_ranges`'
``each``), and raises :class:`~bytecp.errors.CorruptCheckpointError` at the
first block (or chunk) whose bytes do not match, naming the file, the
tensor, the chunk's region, the block's bytes and the region being loaded.
A whole chunk with block checksums is summed as one run and compared with
the chunk's crc32c at :meth:`Verifier.done` (one call a piece, not one a
block); only on a mismatch are its blocks summed again, from the pieces
fed, to name the first bad one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format.checksum import block_crc, crc32c
from bytecp.format.metadata import ChunkRecord, Metadata
from bytecp.tree.regions import Region

__all__ = ["cover", "Verifier", "block_bytes_of"]


def block_bytes_of(md: Metadata) -> int | None:
    """The block size of ``md``'s block checksums (format version 5), else None."""
    return getattr(md.index, "block_bytes", None)


def cover(c: ChunkRecord, lo: int, hi: int, block_bytes: int | None) -> tuple[int, int] | None:
    """The chunk-relative bytes ``[start, end)`` to read so that a checksum
    covers the wanted bytes ``[lo, hi)`` of chunk ``c``: the whole chunk when
    it is wanted whole or has no block checksums (a version-5 chunk of one
    block or less), else ``[lo, hi)`` widened to whole blocks of
    ``block_bytes``. None: nothing can check a part of this chunk (a
    checkpoint of format version 4 or older: ``block_bytes`` None)."""
    if lo == 0 and hi == c.nbytes:
        return 0, c.nbytes
    if block_bytes is None:
        return None
    if not c.blocks:
        return 0, c.nbytes
    return lo - lo % block_bytes, min(c.nbytes, -(-hi // block_bytes) * block_bytes)


class Verifier:
    """Checks the bytes ``[start, end)`` of chunk ``c`` (a :func:`cover`), fed
    in order: a part of a chunk block by block, each as soon as its last byte
    arrives; the whole chunk at :meth:`done` (its crc32c; with block
    checksums, the first bad block named). ``url`` and ``box`` (the region
    being loaded) name what failed."""

    __slots__ = ("c", "end", "url", "box", "bb", "whole", "pos", "crc", "k", "fed")

    def __init__(self, c: ChunkRecord, start: int, end: int, block_bytes: int | None, url: str, box: Region) -> None:
        self.c, self.end, self.url, self.box = c, end, url, box
        blocks = bool(c.blocks and block_bytes)
        self.bb = int(block_bytes) if blocks else c.nbytes  # type: ignore[arg-type]
        #: summed as one run, checked against the chunk's crc32c at done()
        self.whole = not blocks or (start, end) == (0, c.nbytes)
        if not blocks and (start, end) != (0, c.nbytes):
            raise ValueError(f"a check of the whole chunk of {c.nbytes} bytes given bytes {start}..{end}")
        self.pos, self.crc, self.k = start, 0, start // max(1, self.bb)
        #: (a whole chunk with block checksums) the pieces fed, to name the bad block after a mismatch
        self.fed: list[memoryview] | None = [] if blocks and self.whole else None

    def feed(self, data: Any, kept: bool = True) -> None:
        """The next bytes of the cover (a bytes-like object). ``kept=False``:
        its memory is reused before :meth:`done` (a pinned slab), so a whole
        chunk is checked block by block from here on."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if not kept and self.fed is not None:
            self._by_blocks()
        at, n = 0, len(view)
        if self.pos + n > self.end:
            raise ValueError(f"{n} bytes fed past the end of a check at {self.pos}..{self.end}")
        if self.whole:
            self.crc = crc32c(view, self.crc)
            self.pos += n
            if self.fed is not None:
                self.fed.append(view)
            return
        while at < n:
            block_end = min(self.c.nbytes, (self.k + 1) * self.bb)
            take = min(n - at, block_end - self.pos)
            self.crc = crc32c(view[at : at + take], self.crc)
            at += take
            self.pos += take
            if self.pos == block_end:
                if self.crc != block_crc(self.c.blocks, self.k):
                    raise self._mismatch(self.k)
                self.k, self.crc = self.k + 1, 0

    def spans(self, base: int) -> tuple[list[int], list[int]]:
        """For a storage that sums as it reads (:meth:`~bytecp.storage_api.Storage.read_ranges_summed`;
        ``base``: the chunk's file offset): the file byte spans this check sums, ``[lo, hi)`` pairs
        flat -- its cover as one span when it is checked whole, else each of its blocks -- and the
        checksum each span must have (-1: none recorded, a row with fewer block checksums than blocks)."""
        if self.whole:
            return [base + self.pos, base + self.end], [self.c.crc32c]
        bb, end = self.bb, base + self.end
        starts = range(base + self.k * bb, end, bb)
        spans = [x for lo in starts for x in (lo, min(lo + bb, end))]
        n = len(starts)
        have = min(n, max(0, len(self.c.blocks) // 4 - self.k))
        return spans, [*struct.unpack_from(f"<{have}I", self.c.blocks, 4 * self.k), *[-1] * (n - have)]

    def mismatch(self, j: int, pieces: Sequence[memoryview]) -> CorruptCheckpointError:
        """The error for span ``j`` of :meth:`spans` not having its checksum
        (``pieces``: the cover's bytes in order, summed again block by block
        to name the bad block of a whole chunk)."""
        if not self.whole:
            return self._mismatch(self.k + j)
        if self.fed is not None:
            self.fed = [p for p in pieces if len(p)]
            try:
                self._by_blocks()  # raises at the first bad block
            except CorruptCheckpointError as e:
                return e
        return self._mismatch(None)  # (or every block sound, the chunk's sum not: its row disagrees)

    def done(self) -> None:
        """Every byte of the cover was fed: the whole chunk's checksum."""
        if self.pos != self.end:
            raise ValueError(f"a check of bytes ..{self.end} ended at {self.pos}")
        if self.whole and self.crc != self.c.crc32c:
            if self.fed is not None:
                self._by_blocks()  # names the first bad block
            raise self._mismatch(None)  # (or every block sound, the chunk's sum not: its row disagrees)

    def _by_blocks(self) -> None:
        """Check the pieces fed so far block by block (raising at the first bad
        block), and every later piece as it arrives."""
        fed, self.fed = self.fed or [], None
        self.whole, self.pos, self.crc, self.k = False, 0, 0, 0
        for view in fed:
            self.feed(view)

    def _mismatch(self, k: int | None) -> CorruptCheckpointError:
        c = self.c
        url = self.url.rstrip('/')
        where = f"{url}/{c.file}: checksum mismatch in tensor {c.fqn!r} region {Region(c.offsets, c.lengths)}"
        # what to do: the bytes changed after the save wrote them (a disk, a copy, a hand)
        todo = f"; the file changed since the save: `bytecp verify {url}` lists every damaged chunk, or load an earlier checkpoint"
        if k is None:
            return CorruptCheckpointError(f"{where} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes}){todo}")
        lo, hi = k * self.bb, min(c.nbytes, (k + 1) * self.bb)
        return CorruptCheckpointError(
            f"{where}, block {k} of {-(-c.nbytes // self.bb)} (bytes {c.byte_offset + lo}..{c.byte_offset + hi}), "
            f"read to load its region {self.box}{todo}")
