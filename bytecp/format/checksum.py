"""crc32c of stored bytes (hardware-accelerated: the ``crc32c-rs`` package
where it is installed and checks out, else the ``crc32c`` package), and the
block checksums of large chunks (format version 5).

Computed by the writer while it lays out each data file (or the staging
copy, or the memory tier's process) and checked by the reader and ``bytecp
verify``. A chunk of more than :data:`BLOCK_BYTES` bytes (256 KiB) also records the
crc32c of each of its blocks (bytes ``k * B .. (k+1) * B`` of the chunk, the
last one shorter), so a load that reads part of the chunk checks every
block it reads whole (docs/FORMAT.md §8). :class:`Summer` computes both in
one pass: each block's crc32c over its bytes, the chunk's combined from them
(:func:`crc32c_combine`, a few microseconds a block) instead of a second
pass over the data.

The engine: ``crc32c-rs`` picks an implementation for the CPU it runs on
(AVX-512 with VPCLMULQDQ where the CPU has them): 1.5-2.5x the ``crc32c``
package's speed on the benchmark host (31.7 against 18.9 GB/s for 256 KiB in
the CPU's cache, 15.6 against 9.0 GB/s for 256 MiB from memory), and both
let go of the GIL. It is used only after it gave the same values as the
``crc32c`` package at import (:func:`_agrees`: the RFC 3720 vectors, lengths
across its implementations' thresholds, unaligned starts, continued runs);
otherwise (with a warning), or where it is not installed, the ``crc32c``
package computes every checksum. ``BYTECP_CRC32C=crc32c`` (or ``crc32c-rs``:
then an engine that is missing or disagrees is a :class:`ConfigError`)
forces one (:data:`ENGINE` names the one in use).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from typing import Any, NamedTuple

import crc32c as _crc32c_pkg
import numpy as np

from bytecp.errors import ConfigError

__all__ = [
    "crc32c", "crc32c_combine", "ENGINE", "BLOCK_BYTES", "writer_block_bytes", "block_count", "block_crc", "Sums", "Summer",
    "sums", "sums_of_ranges", "sums_from_blocks", "PIECE_BYTES",
]

#: the block size a version-5 writer records block checksums at (``index.block_bytes``); read at each
#: call (a golden file and some tests write other sizes; readers use the value recorded). 256 KiB:
#: a resharded read of the main benchmark's state reads about 3% more bytes (1 MiB: 12%), and the
#: index a rank of the scale benchmark's MoE reads grows by about half (1 MiB: a tenth; 64 KiB: 3x)
BLOCK_BYTES = 256 << 10


def writer_block_bytes() -> int:
    """The block size a save records now (:data:`BLOCK_BYTES`)."""
    return BLOCK_BYTES


_LOG = logging.getLogger(__name__)
_ENGINES = ("crc32c-rs", "crc32c")


def _agrees(fn: Callable[..., int]) -> bool:
    """Whether ``fn`` gives the ``crc32c`` package's values: the RFC 3720
    vectors, then lengths on both sides of its implementations' thresholds
    (1 KiB and up: the vector paths), at unaligned starts, run on from a
    value; microseconds."""
    ref = _crc32c_pkg.crc32c
    if fn(b"123456789") != 0xE3069283 or fn(bytes(32)) != 0x8A9136AA or fn(b"\xff" * 32) != 0x62A8AB43:
        return False
    view = memoryview(random.Random(0x5EED).randbytes(70_000))
    for n in (0, 1, 7, 15, 16, 63, 64, 255, 256, 1023, 1024, 1025, 2048, 4095, 4096, 4097, 8191, 16384, 65537):
        for at in (0, 1, 5):
            piece = view[at:at + n]
            if fn(piece) != ref(piece) or fn(piece, 0x1234ABCD) != ref(piece, 0x1234ABCD):
                return False
    return True


def _pick() -> tuple[Callable[..., int], str]:
    """(the crc32c function, its package's name): :data:`ENGINE`, chosen once at import."""
    want = os.environ.get("BYTECP_CRC32C", "").strip().lower()
    if want and want not in _ENGINES:
        raise ConfigError(f"BYTECP_CRC32C={want!r:.40} names no crc32c engine: set it to one of "
                          f"{', '.join(_ENGINES)}, or unset it (crc32c-rs where it is installed, else crc32c)")
    if want == "crc32c":
        return _crc32c_pkg.crc32c, "crc32c"
    why = ""
    try:
        import crc32c_rs

        fn = crc32c_rs.crc32c
        if _agrees(fn):
            return fn, "crc32c-rs"
        why = f"crc32c-rs {getattr(crc32c_rs, '__version__', '?')} computed other checksums than the crc32c package here"
    except ImportError as e:
        if e.name != "crc32c_rs":  # installed, but it does not import (a broken build)
            why = f"crc32c-rs failed its check here (ImportError: {e})"
        elif want:
            raise ConfigError("BYTECP_CRC32C=crc32c-rs but the crc32c-rs package is not installed: "
                              "pip install 'bytecp[fast]', or unset BYTECP_CRC32C") from None
        else:
            return _crc32c_pkg.crc32c, "crc32c"
    except Exception as e:  # noqa: BLE001 - a broken install: the crc32c package does the work
        why = f"crc32c-rs failed its check here ({type(e).__name__}: {e})"
    if want:
        raise ConfigError(f"BYTECP_CRC32C=crc32c-rs but {why}: unset BYTECP_CRC32C (the crc32c package is used)")
    _LOG.warning("bytecp: %s; using the crc32c package", why)
    return _crc32c_pkg.crc32c, "crc32c"


_crc, ENGINE = _pick()


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from ``value`` (its low 32 bits)."""
    return int(_crc(data, value & 0xFFFFFFFF))


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


def _advance(crc: int, n: int) -> int:
    """``crc`` advanced over ``n`` zero bytes (the matrix way: about 32 steps of Python a set bit of ``n``)."""
    k = 0
    while n:
        if n & 1:
            crc = _times(_op(k), crc)
        n >>= 1
        k += 1
    return crc


#: the operator for a length as four tables of 256 (one per byte of the crc), made once per length a
#: :class:`Summer` or :func:`sums_of_ranges` combines whole blocks of; a combine over one of them is
#: four lookups (the matrix way costs about 5 us a block: 20% of the checksum of a 256 KiB block)
_SHIFTS: dict[int, tuple[tuple[int, ...], ...]] = {}


def _shift_tables(n: int) -> tuple[tuple[int, ...], ...]:
    tables = _SHIFTS.get(n)
    if tables is None:
        cols = [_advance(1 << i, n) for i in range(32)]
        made = []
        for j in range(4):
            t = [0] * 256
            for v in range(1, 256):
                low = (v & -v).bit_length() - 1
                t[v] = t[v & (v - 1)] ^ cols[8 * j + low]
            made.append(tuple(t))
        tables = tuple(made)
        with _OPS_LOCK:
            if len(_SHIFTS) < 64:  # block sizes: a handful in any process
                _SHIFTS[n] = tables
    return tables


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of ``A + B`` given ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    t = _SHIFTS.get(len_b)
    if t is not None:
        return t[0][crc_a & 255] ^ t[1][(crc_a >> 8) & 255] ^ t[2][(crc_a >> 16) & 255] ^ t[3][crc_a >> 24] ^ crc_b
    return _advance(crc_a, len_b) ^ crc_b


class Sums(NamedTuple):
    """A chunk's crc32c and its block checksums (packed little-endian 32-bit
    values; empty for a chunk of at most one block). A tuple: one is made
    for every box of every save (a frozen dataclass cost 3x the crc32c of a
    small box)."""

    crc: int
    blocks: bytes = b""


class Summer:
    """The :class:`Sums` of bytes fed in order, in any pieces (one pass: each
    block summed as its bytes pass, the chunk's crc combined from the blocks')."""

    __slots__ = ("block_bytes", "_crc", "_block", "_filled", "_blocks", "_total")

    def __init__(self, block_bytes: int | None = None) -> None:
        self.block_bytes = block_bytes or writer_block_bytes()
        _shift_tables(self.block_bytes)
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
    view = data if isinstance(data, memoryview) else memoryview(data)
    block_bytes = block_bytes or writer_block_bytes()
    if view.nbytes <= block_bytes:  # (most boxes)
        return Sums(_crc(view))
    s = Summer(block_bytes)
    s.update(view)
    return s.result()


#: the bytes one task of :func:`sums_of_ranges` sums (a whole number of blocks)
PIECE_BYTES = 32 << 20

def sums_of_ranges(view: memoryview, ranges: Sequence[tuple[int, int]], pool: Executor | None = None,
                   block_bytes: int | None = None) -> list[Sums]:
    """The :class:`Sums` of each ``(offset, nbytes)`` of ``view``, the same as
    :func:`sums` of each, with the summing cut into pieces of whole blocks
    (:data:`PIECE_BYTES`) that ``pool`` runs (a ``ThreadPoolExecutor``: on
    its threads at once; both engines let go of the GIL; None: here).
    Each range's crc is combined from its blocks' in order. Every piece has
    ended when it returns or raises (the caller may then close the mapping
    ``view`` is of).

    Used by the memory tier's keeper on a rank's adopted staging arena,
    where the sums are the one pass over bytes the GPU copied in: on a
    host of many cores, one thread per data file left most of them idle
    while the training job waited for the save."""
    b = block_bytes or writer_block_bytes()
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    step = max(b, PIECE_BYTES // b * b)
    pieces: list[tuple[int, int]] = []
    for o, n in ranges:
        pieces.extend((o + at, min(step, n - at)) for at in range(0, n, step))

    def piece_blocks(piece: tuple[int, int]) -> list[int]:
        o, n = piece
        with view[o:o + n] as mv:
            return [int(_crc(mv[at:at + b])) for at in range(0, n, b)]

    if pool is None or len(pieces) < 2:
        got = iter([piece_blocks(p) for p in pieces])
    else:
        futures = [pool.submit(piece_blocks, p) for p in pieces]
        try:
            got = iter([f.result() for f in futures])
        finally:  # on an error too: no piece still reads the view
            for f in futures:
                f.cancel()
            wait(futures)
    out: list[Sums] = []
    for _, n in ranges:
        blocks: list[int] = []
        for _ in range(0, n, step):
            blocks.extend(next(got))
        out.append(sums_from_blocks(blocks, b, n))
    return out


def sums_from_blocks(blocks: Sequence[int] | np.ndarray, block_bytes: int, nbytes: int,
                     crc: int | None = None) -> Sums:
    """The :class:`Sums` of ``nbytes`` bytes from their blocks' crc32c (``block_bytes`` each, the
    last the rest): their crc32c combined (``crc``, where the caller combined it already: the
    compiled copies' ``crc_of_blocks``), the blocks' kept where there is more than one."""
    if nbytes <= block_bytes:
        return Sums(int(blocks[0]) if len(blocks) else 0)
    if crc is None:
        _shift_tables(block_bytes)  # (the combine's tables for this block size: 0.5 us a block, not 13)
        crc = 0
        for c in blocks[:-1]:
            crc = crc32c_combine(crc, int(c), block_bytes)
        crc = crc32c_combine(crc, int(blocks[-1]), nbytes - (len(blocks) - 1) * block_bytes)
    return Sums(crc, np.asarray(blocks, "<u4").tobytes())
