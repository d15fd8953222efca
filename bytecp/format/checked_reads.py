"""Checked reads of local files (``bytecp/format/_reads.c``), when this install has them.

A load that checks what it reads sums every byte it places (crc32c: whole
chunks, or the blocks of a part of one, :mod:`bytecp.loading.checks`). Summed
once a read call returned, a range of megabytes had left the CPU's cache, so
the sum read it again from memory, and with more reader threads than cores
each range's sum queued for the GIL. ``bytecp.format._reads.read_sums`` reads
a batch's ranges of one file with the GIL released throughout, cut into
pieces at the checked spans' edges (and at :data:`PIECE_BYTES`), each piece
summed as it is read. The local backend's buffered reads use it
(:meth:`bytecp.storage_api.Storage.read_ranges_summed`); every other storage
keeps summing ranges as they arrive.

By default it does not ``pread``: it maps the file 16 MiB at a time and
copies each piece out of the mapping (``BYTECP_MAPPED_READS``, :func:`mapped`)
with streaming stores, which do not read the destination into the cache
first, and on AVX-512 sums it from the copy's own registers: a warm 1 GiB
read here runs faster so, summed, than ``pread`` into the same buffers
unsummed (docs/benchmarks.md). Whatever cannot be mapped is read with
``pread``, and a copy that faults (the file cut short meanwhile, a device
error) is read again with ``pread`` to report it. ``BYTECP_MAPPED_READS=0``
reads everything with ``pread``. The same copy makes a save's staging copies
of large boxes, a lazy save's summed block by block (``copy_summed``,
``crc_of_blocks``: :mod:`bytecp.saving.hostcopy`).

Its crc32c is SSE4.2's crc32 instruction (three streams at once), or
AVX-512 VPCLMULQDQ folding where the CPU has it: built at install time where
a C compiler is (pyproject.toml's ``ext-modules``, optional) and used on
x86-64 CPUs that have the instruction, after it gave the values of
:mod:`bytecp.format.checksum`'s engine on a self-check (lengths around its
stream sizes, unaligned starts, sums continued from a value, the copies on
both paths, and a read of a file through spans that cross ranges, by
``pread`` and mapped). Where it is not built, fails the check or the CPU
lacks the instruction, :func:`compiled` is None and loads sum as before.
``BYTECP_CHECKED_READS=0`` turns it off; ``1`` requires it (its absence is
then a :class:`ConfigError`).
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from bytecp.errors import ConfigError
from bytecp.format import checksum
from bytecp.format.extensions import Extension, first

__all__ = ["compiled", "mapped", "ABI", "PIECE_BYTES", "load", "sums_of_spans"]

log = logging.getLogger("bytecp.format.checked_reads")

#: the interface this Python expects of ``bytecp.format._reads`` (its ``ABI``)
ABI = 5
_EXTENSION = Extension("bytecp.format._reads", ABI, "BYTECP_CHECKED_READS", "checked reads",
                       "loads sum what they read in Python", "sum reads in Python", log)

#: why a build is not used where that is no fault of it (loads then sum in Python, without a warning)
QUIET = "its reads could not be checked in this process"

#: the largest piece read and summed at once: small enough to be summed from the cache (a core's L2
#: holds it with room for the rest), large enough that a ``pread`` a piece costs nothing measurable
PIECE_BYTES = 256 << 10


def mapped() -> bool:
    """Whether the local backend's checked reads copy from a mapping of the
    file (``BYTECP_MAPPED_READS``, default 1) rather than ``pread``."""
    want = os.environ.get("BYTECP_MAPPED_READS", "").strip()
    if want not in ("", "0", "1"):
        raise ConfigError(f"BYTECP_MAPPED_READS={want!r}: use 0 (read with pread) or 1 (copy from a mapping of the "
                          "file, the default)")
    return want != "0"


def _self_check(k: Any) -> str | None:
    """Why ``k`` cannot be used (None: it agrees with :func:`bytecp.format.checksum.crc32c`)."""
    if not k.HW:
        return "unusable on this CPU (no SSE4.2 crc32 instruction)"
    data = memoryview(random.Random(0x5EED).randbytes(140_000))
    for n in (0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 2000, 24575, 24576, 24577, 24583, 65537):
        for at in (0, 1, 5):
            piece = data[at:at + n]
            for value in (0, 0x1234ABCD):
                if k.crc32c(piece, value) != checksum.crc32c(piece, value):
                    return f"its crc32c differs from the {checksum.ENGINE} engine's ({n} bytes at {at})"
    # the mapped reads' copy: plain below 64 KiB, streamed (and summed in the copy) above, any alignment
    for n in (1_000, 65_535, 65_536, 65_536 + 255, 65_536 + 256 + 63, 131_073):
        for at, to in ((0, 0), (3, 61), (64, 5)):
            src, dst = data[at:at + n], memoryview(bytearray(n + 64))[to:to + n]
            for value, summed in ((0, True), (0x1234ABCD, True), (7, False)):
                expected = checksum.crc32c(src, value) if summed else value
                for wide in (True, False) if k.WIDE else (False,):
                    if k.copy_sum(dst, src, value, summed, wide) != expected or dst != src:
                        return f"its mapped reads' copy differs from Python's ({n} bytes at {at} to {to})"
    # a save's staging copies, summed block by block (bytecp.saving.hostcopy)
    src_a = np.frombuffer(data, np.uint8)[3:131_076]
    dst_a = np.zeros(131_073, np.uint8)
    blocks = np.zeros(2, np.uint32)
    k.copy_summed(np.asarray([dst_a.ctypes.data, src_a.ctypes.data, 131_073], np.int64), 70_000, blocks)
    if dst_a.tobytes() != data[3:131_076] or blocks.tolist() != [checksum.crc32c(data[3:70_003]),
                                                                  checksum.crc32c(data[70_003:131_076])]:
        return "its staging copies summed by blocks differ from Python's"
    if k.crc_of_blocks(blocks, 70_000, 131_073) != checksum.crc32c(data[3:131_076]):
        return "its crc32c combined from blocks differs from Python's"
    try:  # a file of 8,000 bytes (a process may be allowed little more: RLIMIT_FSIZE)
        f = os.fdopen(os.memfd_create("bytecp-self-check"), "w+b") if hasattr(os, "memfd_create") \
            else tempfile.TemporaryFile()
        with f:
            f.write(data[:8_000])
            f.flush()
            spans = np.asarray([100, 900, 2_500, 6_000, 7_000, 7_001], np.int64)
            want = [checksum.crc32c(data[s:e]) for s, e in zip(spans[::2].tolist(), spans[1::2].tolist(), strict=True)]
            # pread, and mapped unless mapped reads are off: the mapped read installs the guard over SIGBUS's
            # handler, which a process that turned them off (BYTECP_MAPPED_READS=0) keeps as it was
            for way in (False, True) if os.environ.get("BYTECP_MAPPED_READS", "").strip() != "0" else (False,):
                a, b = bytearray(3_000), bytearray(4_000)
                out = np.zeros(3, np.uint32)
                short = k.read_sums(f.fileno(), [(100, a), (3_100, b)], spans, out, 1024, way)
                if short is not None or bytes(a) != data[100:3_100] or bytes(b) != data[3_100:7_100] \
                        or out.tolist() != want:
                    return f"read_sums ({'mapped' if way else 'pread'}) read or summed otherwise than Python"
                if k.read_sums(f.fileno(), [(7_000, bytearray(2_000))], spans[:0], out[:0], 1024, way) != (0, 1_000):
                    return f"read_sums ({'mapped' if way else 'pread'}) does not report a read past the end of the file"
    except OSError as e:
        return f"{QUIET}: {e}"
    return None


def load() -> ModuleType | None:
    """``bytecp.format._reads`` when it is built, current and agrees (see the module's docstring); else None."""
    return _EXTENSION.load(lambda k: _self_check(k),
                           quiet=lambda k, why: not getattr(k, "HW", 1) or why.startswith(QUIET))


def sums_of_spans(ranges: Sequence[tuple[int, Any]], spans: Any) -> np.ndarray:
    """The crc32c of each file byte span ``[spans[2k], spans[2k + 1])`` of
    bytes already read into ``ranges`` ((file offset, bytes-like) in file
    order), as ``read_sums`` returns them: for a storage that reads without
    summing (a sibling checkpoint on another backend, tests' reference)."""
    out = np.zeros(len(spans) // 2, np.uint32)
    views = [(int(o), b if isinstance(b, memoryview) and b.format == "B" else memoryview(b).cast("B"))
             for o, b in ranges]
    i = 0
    for k in range(len(out)):
        lo, hi, crc = int(spans[2 * k]), int(spans[2 * k + 1]), 0
        while lo < hi:
            while i < len(views) and views[i][0] + len(views[i][1]) <= lo:
                i += 1
            if i == len(views) or views[i][0] > lo:
                raise ValueError(f"span {k} ({spans[2 * k]}..{spans[2 * k + 1]}) is not inside the ranges read")
            at, view = views[i]
            take = min(hi, at + len(view)) - lo
            crc = checksum.crc32c(view[lo - at : lo - at + take], crc)
            lo += take
        out[k] = crc
    return out


_LOADED: list[ModuleType | None] = []


def compiled() -> ModuleType | None:
    """The checked reads to use (None: none), loaded and checked at the first call."""
    return first(_LOADED, load)
