"""Copies of tensors into host memory for staging: large GIL-free pieces,
optionally checksummed on the way.

Called by :mod:`bytecp.saving.staging` when an asynchronous save copies the boxes
it writes into its reused arena (eager saves on the caller's thread, lazy
saves on the save's background thread). A large contiguous CPU source of
the destination's dtype is copied with the C library's ``memcpy`` through
``ctypes``, which releases the GIL for the call: the training thread's
Python keeps running beside a background copy, and several copy threads run
in parallel on pieces of a box. Above a size threshold (about 20 MB on the
benchmark host) glibc's ``memcpy`` uses non-temporal stores: a 0.3 GB
tensor copied in 0.031-0.040 s there against 0.054-0.078 s for torch's copy
kernel (below the threshold the two are on par). Small boxes (that torch
copies on the calling thread, :data:`SMALL_NUMEL`) go to torch in one
``_foreach_copy_`` call (no Python per box); everything else (strided
views, CUDA tensors, a platform without a C library) through
``Tensor.copy_``.

With ``checksums=True`` the crc32c of each box (and of each of its blocks,
:mod:`bytecp.format.checksum`) is taken on the way; the writer then reuses
the sums instead of reading the bytes again. Where the compiled checked
reads are (:mod:`bytecp.format.checked_reads`), a large contiguous box is
copied block by block in one GIL-free call (``copy_summed``: streaming
stores, each block's crc32c folded into its copy on AVX-512, else taken
from the cache right after it), in pieces of whole blocks that several
threads share, and its crc32c combined from its blocks' at the end: a
1.1 GB state of 1-64 MiB boxes copied and summed in 79-88 ms on two
threads against 150-155 ms before. An eager save's copies (not asked to
sum) go through the same call: streaming stores at every size, where
glibc's ``memcpy`` uses them only above its threshold (the eager
``async_save`` call of a 1 GB state: 62-68 ms against 91-95 ms), not
summed: summing them in the copy too cost the caller a third more (81
against 61 ms a GB on two threads), which the writer's background pass
costs the caller nothing. Without them each piece is summed right
after it is copied, while it is still in the CPU cache (boxes of
:data:`WHOLE_BYTES` or more: copied whole, then summed); the ``crc32c``
package releases the GIL for large buffers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from bytecp.format import checked_reads
from bytecp.format.checksum import Summer, Sums, sums, sums_from_blocks, writer_block_bytes
from bytecp.saving.own_threads import serial_torch
from bytecp.tree.dtypes import host_memoryview

__all__ = ["copy_boxes", "CopyPlan", "CopyRun", "work_on_threads", "fast_copy_available", "PIECE_BYTES", "CRC_PIECE_BYTES", "WHOLE_BYTES", "SMALL_BYTES", "SMALL_NUMEL"]

#: pieces a copy without checksums is split into (spread over the threads)
PIECE_BYTES = 16 << 20
#: pieces of a checksummed copy: small enough to be in cache when summed
CRC_PIECE_BYTES = 256 << 10
#: a checksummed box this large is copied whole, then summed: one large
#: ``memcpy`` takes glibc's non-temporal path, which outran the copy in
#: pieces plus the in-cache sum (measured: 64 MiB boxes 0.068 s vs 0.084 s
#: per 320 MB; 8 MiB boxes 0.088 s vs 0.081 s the other way round)
WHOLE_BYTES = 32 << 20


def _load_memcpy() -> Callable[[int, int, int], Any] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.memcpy
    except (OSError, AttributeError, TypeError):  # pragma: no cover - hosts without a C library
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_memcpy = _load_memcpy()


def fast_copy_available() -> bool:
    """Whether contiguous host copies go through ``memcpy`` here."""
    return _memcpy is not None


#: boxes below this many bytes are copied together in one call into torch
#: (``_foreach_copy_``: a loop in C++, no Python per box)...
SMALL_BYTES = 256 << 10
#: ... when torch copies them on the calling thread: at most this many
#: elements (its ``at::internal::GRAIN_SIZE``; a larger copy is split over its
#: intra-op threads, whose start-up per box made a group of 128-256 KiB boxes
#: three times slower than one thread on the 2-core benchmark host: 9.9 ms
#: against 3.0 for a 39 MB state's copy, and slower still on a copy thread
#: beside the describing caller); larger boxes are ``memcpy`` pieces
SMALL_NUMEL = 32768
#: ... in groups of about this many bytes, or this many boxes (units several threads share)
SMALL_GROUP_BYTES = 16 << 20
SMALL_GROUP_BOXES = 8192


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src`` can be copied into ``dst`` as raw bytes."""
    return (
        _memcpy is not None
        and src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
    )


class _Box:
    """One large box being copied: where, how many bytes, its running crc32c
    (or, copied by the compiled copies, its blocks' crc32c as they are made)."""

    __slots__ = ("dst", "src", "view", "nbytes", "fast", "sums", "blocks")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, view: memoryview | None, nbytes: int) -> None:
        self.dst, self.src, self.view, self.nbytes = dst, src, view, nbytes
        self.fast = _plain(dst, src)
        self.sums: Sums | None = None
        self.blocks: np.ndarray | None = None

    def bytes(self) -> memoryview:
        return self.view if self.view is not None else host_memoryview(self.dst)


#: ``copy_summed``'s ``out`` for a copy not summed
_UNSUMMED = np.zeros(0, np.uint32)


def _pieces(boxes: list[_Box], checksums: bool, split: bool, block: int | None) -> list[tuple[int, int, int]]:
    """(box index, start, length) units of work: whole boxes, or pieces of
    large boxes when ``split`` (for several threads; when summing, only by
    the compiled copies -- ``block``, in whole blocks, the box's crc32c
    combined from its blocks' -- else a crc32c runs over a box front to
    back). One ``memcpy`` per box where possible: glibc switches to
    non-temporal stores only above a size threshold (about 20 MB on the
    benchmark host), and those ran up to 2x faster than smaller copies."""
    out = []
    step = PIECE_BYTES if block is None else max(block, PIECE_BYTES // block * block)
    for i, b in enumerate(boxes):
        if not split or not b.fast or b.nbytes <= step or (checksums and b.blocks is None):
            out.append((i, 0, b.nbytes))  # one unit; split inside when summed
        else:
            out.extend((i, o, min(step, b.nbytes - o)) for o in range(0, b.nbytes, step))
    return out


def _run(b: _Box, start: int, length: int, checksums: bool, block: int | None, compiled: Any) -> None:
    """Copy ``length`` bytes of ``b`` from ``start``; ``compiled``: the compiled copies (None: none here)."""
    if not b.fast:  # synchronous: any CUDA copy is the caller's business (its stream)
        b.dst.copy_(b.src)
        if checksums:
            b.sums = sums(b.bytes())
        return
    assert _memcpy is not None
    d, s = b.dst.data_ptr() + start, b.src.data_ptr() + start
    if b.blocks is not None:  # the compiled copies: this piece's blocks, summed as they are copied
        assert block is not None and compiled is not None and start % block == 0
        first = start // block
        compiled.copy_summed(np.asarray([d, s, length], np.int64), block, b.blocks[first : first + -(-length // block)])
        return
    if not checksums:
        if compiled is not None:  # streaming stores at any size (glibc's memcpy: only above ~20 MB here)
            compiled.copy_summed(np.asarray([d, s, length], np.int64), 1, _UNSUMMED)
        else:
            _memcpy(d, s, length)
        return
    view = b.bytes()
    if length >= WHOLE_BYTES:  # one memcpy (non-temporal stores), then the sum
        _memcpy(d, s, length)
        b.sums = sums(view[start : start + length])
        return
    summer = Summer()
    for o in range(0, length, CRC_PIECE_BYTES):
        k = min(CRC_PIECE_BYTES, length - o)
        _memcpy(d + o, s + o, k)
        summer.update(view[start + o : start + o + k])
    b.sums = summer.result()


def _copy_small(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs)
    else:  # pragma: no cover - torch without foreach copies
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)


def copy_boxes(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    threads: int = 1,
    checksums: bool = False,
    views: Sequence[memoryview] | None = None,
) -> list[Sums | None]:
    """Copy each ``(dst, src)`` pair (same shape) with ``threads`` threads
    (the calling one included); -> the checksums of each destination's bytes
    (its crc32c and block checksums: :class:`~bytecp.format.checksum.Sums`)
    when ``checksums``, else Nones. ``views[i]``, when given, are the bytes
    of ``dst[i]`` (saves making them). Meant for host destinations; a device
    source is copied synchronously (stage CUDA tensors on a side stream
    instead, see :mod:`bytecp.saving.staging`).

    Small boxes go to torch in one call, large ones are ``memcpy`` pieces.
    Raises the first error of any thread after every thread has stopped.
    """
    return CopyPlan(pairs, views).run(threads=threads, checksums=checksums)


class CopyPlan:
    """The copies of :func:`copy_boxes`, sorted out once (which boxes go to
    torch together, which are ``memcpy`` pieces) and run as often as asked:
    the staging pool keeps one per arena layout, so a save whose boxes and
    sources did not change since the previous one runs only the copies."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 views: Sequence[memoryview] | None = None) -> None:
        self.count = len(pairs)
        small: list[int] = []
        large: list[int] = []
        sizes = []
        for i, (d, _) in enumerate(pairs):
            n = d.numel() * d.element_size()
            sizes.append(n)
            (small if n < SMALL_BYTES and d.numel() <= SMALL_NUMEL else large).append(i)
        self.small, self.large = small, large
        self.small_dsts = [pairs[i][0] for i in small]
        self.small_srcs = [pairs[i][1] for i in small]
        self.small_views = [views[i] for i in small] if views is not None else None
        # the small boxes in groups of about SMALL_GROUP_BYTES (each one torch call), so that
        # several threads can share them
        self.groups: list[tuple[int, int]] = []
        begin, acc = 0, 0
        for j, i in enumerate(small):
            acc += sizes[i]
            if acc >= SMALL_GROUP_BYTES or j + 1 - begin >= SMALL_GROUP_BOXES:
                self.groups.append((begin, j + 1))
                begin, acc = j + 1, 0
        if begin < len(small):
            self.groups.append((begin, len(small)))
        self.group_bytes = [sum(sizes[small[j]] for j in range(a, b)) for a, b in self.groups]
        self.boxes = [_Box(pairs[i][0], pairs[i][1], views[i] if views is not None else None, sizes[i])
                      for i in large]

    def run(self, *, threads: int = 1, checksums: bool = False) -> list[Sums | None]:
        """Copy every pair (see :func:`copy_boxes`)."""
        r = self.start(checksums=checksums, split=threads > 1)
        if threads <= 1:
            r.work()
        else:
            work_on_threads(r, threads)
        return r.result()

    def start(self, *, checksums: bool = False, split: bool = True) -> CopyRun:
        """One run of the copies, as units any number of threads take in turn
        (:meth:`CopyRun.work`), largest first; ``split``: large boxes in pieces
        (for several threads)."""
        return CopyRun(self, checksums, split)


class CopyRun:
    """One run of a :class:`CopyPlan`: its units (groups of small boxes, large
    boxes or their pieces), handed out to whichever thread asks next, so a
    thread may join a run another started (an eager save's caller helps the
    copy it guessed once it described its state: :mod:`bytecp.saving.ahead`)."""

    def __init__(self, plan: CopyPlan, checksums: bool, split: bool) -> None:
        self.plan, self.checksums = plan, checksums
        # the compiled copies sum the large contiguous boxes block by block, when asked (an eager save's
        # copy is not: summed in the copy, 1 GB on two threads took 81 ms against 61, which the caller
        # waits for; its writer sums it in the background)
        self.compiled = checked_reads.compiled()
        self.block = writer_block_bytes() if checksums and self.compiled is not None else None
        for b in plan.boxes:
            b.sums = None
            b.blocks = np.empty(-(-b.nbytes // self.block), np.uint32) \
                if self.block is not None and b.fast and b.nbytes else None
        self.small_sums: list[Sums | None] = [None] * len(plan.small)
        units: list[tuple[int, int, int, int]] = [(n, -1, g, 0) for g, n in enumerate(plan.group_bytes)]
        units += [(length, i, start, length) for i, start, length in _pieces(plan.boxes, checksums, split, self.block)]
        units.sort(key=lambda u: -u[0])  # largest first, so the threads end together
        self.units = units
        self._next = itertools.count()
        self.errors: list[BaseException] = []
        self._stopped = False
        self._finished = [False] * len(units)

    def stop(self) -> None:
        """(any thread) No unit is started after this (those started finish)."""
        self._stopped = True

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped

    def work(self) -> None:
        """(any thread) Take units until none is left; an error is kept for :meth:`result`."""
        units, plan = self.units, self.plan
        try:
            for k in iter(self._next.__next__, None):
                if k >= len(units) or self.errors or self._stopped:
                    return
                _, i, a, length = units[k]
                if i >= 0:
                    _run(plan.boxes[i], a, length, self.checksums, self.block, self.compiled)
                else:
                    lo, hi = plan.groups[a]
                    _copy_small(plan.small_dsts[lo:hi], plan.small_srcs[lo:hi])
                    if self.checksums:
                        for j in range(lo, hi):
                            self.small_sums[j] = sums(plan.small_views[j] if plan.small_views is not None
                                                      else host_memoryview(plan.small_dsts[j]))
                self._finished[k] = True
        except BaseException as e:
            self.errors.append(e)

    @property
    def complete(self) -> bool:
        """(once every thread working on it returned) Whether every unit was copied."""
        return not self.errors and all(self._finished)

    def result(self) -> list[Sums | None]:
        """(once every thread working on it returned) Each pair's checksums
        (Nones without ``checksums``); raises the first error of any thread."""
        if self.errors:
            raise self.errors[0]
        if not self.complete:
            raise RuntimeError("a copy run was stopped before every copy was made")
        plan = self.plan
        crcs: list[Sums | None] = [None] * plan.count
        for j, i in enumerate(plan.small):
            crcs[i] = self.small_sums[j]
        for i, b in zip(plan.large, plan.boxes, strict=True):
            if b.blocks is not None:  # its crc32c combined from its blocks' (in C: 0.2 ms for 4,096 blocks)
                assert self.block is not None and self.compiled is not None
                b.sums = sums_from_blocks(b.blocks, self.block, b.nbytes,
                                          self.compiled.crc_of_blocks(b.blocks, self.block, b.nbytes))
            crcs[i] = b.sums
        return crcs


def _serial(work: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        serial_torch()
        work()

    return run


def work_on_threads(r: CopyRun, workers: int) -> None:
    """``r`` worked on by ``workers`` threads (the calling one included)."""
    workers = max(1, min(workers, len(r.units)))
    # threads of this call: they inherit the calling thread's scheduling
    # priority (a background save's lower one); starting one costs ~0.1 ms
    helpers = [threading.Thread(target=_serial(r.work), name="bytecp-copy", daemon=True) for _ in range(workers - 1)]
    for t in helpers:
        t.start()
    r.work()
    for t in helpers:
        t.join()
