"""crc32c of stored bytes (hardware-accelerated by the ``crc32c`` package),
and the block checksums of large chunks (format version 5).

Computed by the writer while it lays out each data file (or the staging
copy, or the memory tier's process) and checked by the reader and ``bytecp
verify``. A chunk of more than :data:`BLOCK_BYTES` bytes (256 KiB) also records the
crc32c of each of its blocks (bytes ``k * B .. (k+1) * B`` of the chunk, the
last one shorter), so a load that reads part of the chunk checks every
block it reads whole (docs/FORMAT.md §8). :class:`Summer` computes both in
one pass: each block's crc32c over its bytes, the chunk's combined from them
(:func:`crc32c_combine`, a few microseconds a block) instead of a second
pass over the data.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c", "crc32c_combine", "BLOCK_BYTES", "writer_block_bytes", "block_count", "block_crc", "Sums", "Summer", "sums"]

#: the block size a version-5 writer records block checksums at (``index.block_bytes``); read at each
#: call (a golden file and some tests write other sizes; readers use the value recorded). 256 KiB:
#: a resharded read of the main benchmark's state reads about 3% more bytes (1 MiB: 12%), and the
#: index a rank of the scale benchmark's MoE reads grows by about half (1 MiB: a tenth; 64 KiB: 3x)
BLOCK_BYTES = 256 << 10


def writer_block_bytes() -> int:
    """The block size a save records now (:data:`BLOCK_BYTES`)."""
    return BLOCK_BYTES


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def block_count(nbytes: int, block_bytes: int) -> int:
    """Block checksums a chunk of ``nbytes`` records: none up to one block, else one per block."""
    return -(-nbytes // block_bytes) if nbytes > block_bytes else 0


def block_crc(blocks: bytes, k: int) -> int:
    """The ``k``-th of the packed little-endian 32-bit block checksums ``blocks``."""
    return int.from_bytes(blocks[4 * k : 4 * k + 4], "little")


# -- combining: crc32c(A + B) from crc32c(A), crc32c(B) and len(B) ------------
# zlib's crc32_combine (Mark Adler) over CRC-32C's reflected polynomial: a
# 32x32 matrix over GF(2) (a list of 32 columns) advances a crc over n zero
# bytes; the operators for 2**k bytes are squares of each other, made once.
_POLY = 0x82F63B78
_OPS: list[list[int]] = []
_OPS_LOCK = threading.Lock()


def _times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _op(k: int) -> list[int]:
    """The operator for ``2**k`` zero bytes."""
    if k < len(_OPS):
        return _OPS[k]
    with _OPS_LOCK:
        while len(_OPS) <= k:
            if not _OPS:
                m = [_POLY, *(1 << i for i in range(31))]  # one zero bit
                for _ in range(3):  # -> 8 bits
                    m = [_times(m, c) for c in m]
            else:
                m = [_times(_OPS[-1], c) for c in _OPS[-1]]
            _OPS.append(m)
    return _OPS[k]


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of ``A + B`` given ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(_op(k), crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b


@dataclasses.dataclass(frozen=True, slots=True)
class Sums:
    """A chunk's crc32c and its block checksums (packed little-endian 32-bit
    values; empty for a chunk of at most one block)."""

    crc: int
    blocks: bytes = b""


class Summer:
    """The :class:`Sums` of bytes fed in order, in any pieces (one pass: each
    block summed as its bytes pass, the chunk's crc combined from the blocks')."""

    __slots__ = ("block_bytes", "_crc", "_block", "_filled", "_blocks", "_total")

    def __init__(self, block_bytes: int | None = None) -> None:
        self.block_bytes = block_bytes or writer_block_bytes()
        self._crc = 0  # of the completed blocks
        self._block = 0  # of the bytes of the current block so far
        self._filled = 0
        self._blocks: list[int] = []
        self._total = 0

    def update(self, data: Any) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        b, at, n = self.block_bytes, 0, len(view)
        self._total += n
        while at < n:
            take = min(n - at, b - self._filled)
            self._block = crc32c(view[at : at + take], self._block)
            self._filled += take
            at += take
            if self._filled == b:
                self._close()

    def _close(self) -> None:
        self._blocks.append(self._block)
        self._crc = crc32c_combine(self._crc, self._block, self._filled)
        self._block, self._filled = 0, 0

    def result(self) -> Sums:
        """The sums of every byte fed (block checksums only beyond one block)."""
        blocks, crc = list(self._blocks), self._crc
        if self._filled:
            blocks.append(self._block)
            crc = crc32c_combine(crc, self._block, self._filled)
        if self._total <= self.block_bytes:
            return Sums(crc)
        return Sums(crc, b"".join(c.to_bytes(4, "little") for c in blocks))


def sums(data: Any, block_bytes: int | None = None) -> Sums:
    """The :class:`Sums` of one bytes-like object (blocks of ``block_bytes``, default :data:`BLOCK_BYTES`)."""
    block_bytes = block_bytes or writer_block_bytes()
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.nbytes <= block_bytes:
        return Sums(crc32c(view))
    s = Summer(block_bytes)
    s.update(view)
    return s.result()
