"""Reads into targets on a CUDA device: through pinned slabs the process
keeps, copied to the device on bytecp's copy stream.

Called by the reader (:mod:`bytecp.loading.reader`) for the requests of a
batch whose targets are on a CUDA device (and not shared with another
target: those are read on the host and placed in order). The slabs
(:class:`PinnedSlabs`) are made at the first load into a CUDA tensor and
kept; the copies run after the caller's stream (an event recorded when the
load began): a reader thread reads its next batch while the last one
crosses to the device, and a slab is read into again only once its copies
are done (its event). A slab whose read failed is dropped, not reused (a
storage call that timed out may still be writing into it). The load waits
for the copy stream's last event before it returns (never for the whole
device). Checks (:mod:`bytecp.loading.checks`) run on the slab's bytes
before their copy is queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bytecp import device_memory, faults
from bytecp.format import metadata as fmt
from bytecp.loading.checks import Verifier
from bytecp.plan.load_plan import ReadRequest
from bytecp.tree import buffers
from bytecp.tree.dtypes import byte_view, dtype_from_name, dtype_name, host_memoryview
from bytecp.tree.regions import row_major_strides

__all__ = ["PinnedSlabs", "SLABS", "SLAB_BYTES", "DeviceReads"]

#: bytes of one pinned read slab (loads into CUDA tensors): large enough for
#: full-speed reads and host-to-device copies, small enough that a few per
#: reader thread bound the pinned memory a process keeps
SLAB_BYTES = 32 << 20
_SLOT = 64  # every request's start in a slab: aligned for any dtype


class _Slab:
    """One pinned slab, its bytes seen as a memoryview (sliced per request at
    no tensor op's cost) and as each dtype, and the events its last copies end with."""

    def __init__(self, nbytes: int) -> None:
        self.buf = device_memory.PinnedBuffer(nbytes)
        self.view = host_memoryview(self.buf.tensor)
        self._typed: dict[str, torch.Tensor] = {}
        self.event: list[Any] = []
        self.guard = buffers.Guard("a load's pinned read slab", self.view)

    def ready(self) -> None:
        """(reader thread) Wait until the slab's last copies are done."""
        device_memory.wait_events(self.event)
        self.event = []

    def box(self, dtype: str, pos: int, lengths: tuple[int, ...], chunk_lengths: tuple[int, ...]) -> torch.Tensor:
        """The box ``lengths`` of a chunk shaped ``chunk_lengths`` read to ``pos``: a strided view, no copy."""
        typed = self._typed.get(dtype)
        if typed is None:
            t = dtype_from_name(dtype)
            n = self.buf.nbytes // t.itemsize * t.itemsize
            typed = self._typed[dtype] = self.buf.tensor[:n].view(t)
        return typed.as_strided(lengths, row_major_strides(chunk_lengths), pos // typed.element_size())


class PinnedSlabs:
    """The process's pinned read slabs, made at the first load into a CUDA
    tensor and kept: at most ``per_thread`` per reader thread of the largest
    load so far (2 x 4 threads x 32 MiB: 256 MiB)."""

    def __init__(self, nbytes: int = SLAB_BYTES, per_thread: int = 2) -> None:
        self.nbytes, self.per_thread = nbytes, per_thread
        self._cond = threading.Condition()
        self._free: list[_Slab] = []
        self._made = 0

    def take(self, threads: int) -> _Slab:
        with self._cond:
            while not self._free and self._made >= self.per_thread * max(1, threads):
                self._cond.wait()
            if self._free:
                slab = self._free.pop()
                slab.guard.acquire()
                return slab
            self._made += 1
        try:
            return _Slab(self.nbytes)
        except BaseException:
            self.drop(None)
            raise

    def give(self, slab: _Slab) -> None:
        """A slab whose reads are done (its copies may still run: :meth:`_Slab.ready`)."""
        events = slab.event
        slab.guard.release(lambda: device_memory.wait_events(events))
        faults.handoff("release")
        with self._cond:
            self._free.append(slab)
            self._cond.notify()

    def drop(self, slab: _Slab | None) -> None:
        """Never reuse ``slab`` (its read failed: a request that timed out may still write into it)."""
        with self._cond:
            self._made -= 1
            self._cond.notify()

    def release(self) -> None:
        """Unpin the free slabs (none may be in use)."""
        with self._cond:
            for slab in self._free:
                slab.buf.close()
            self._made -= len(self._free)
            self._free.clear()


SLABS = PinnedSlabs()

#: reads ``ranges`` (file offset, buffer) of the file of ``reqs[0]``'s chunk, errors naming ``reqs``
Read = Callable[[Sequence[ReadRequest], list[tuple[int, memoryview]]], None]
#: the checker of request ``r``'s bytes, or None (``verify`` off, or nothing covers a part of its chunk)
Check = Callable[[ReadRequest], "tuple[Verifier, int, int] | None"]


class DeviceReads:
    """The CUDA half of one load's reads (shared by its reader threads)."""

    def __init__(self, chunks: Sequence[fmt.ChunkRecord], target_of: Callable[[ReadRequest], torch.Tensor],
                 read: Read, check: Check, threads: int) -> None:
        self.chunks, self.target_of, self.read, self.check, self.threads = chunks, target_of, read, check, threads
        #: the copy stream of each CUDA device written to
        self.streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            s = self.streams.get(index)
            if s is None:
                s = self.streams[index] = device_memory.copy_stream(index)
            return s

    def _copies(self, reqs: Sequence[ReadRequest], raws: Sequence[torch.Tensor]) -> list[Any]:
        """Queue the copies of ``raws`` (each request's box, pinned) into their
        targets, each on its device's copy stream; -> an event after them on each stream used."""
        by_device: dict[torch.device, list[int]] = {}
        for i, r in enumerate(reqs):
            by_device.setdefault(self.target_of(r).device, []).append(i)
        events = []
        for device, ks in by_device.items():
            stream = self.stream(device)
            with torch.cuda.stream(stream):
                for i in ks:
                    if reqs[i].box.numel:
                        self.target_of(reqs[i]).copy_(raws[i], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            device_memory.STATS.host_to_device += len(ks)
            events.append(ev)
        return events

    def __call__(self, reqs: list[ReadRequest]) -> None:
        """Read ``reqs`` (one file) through pinned slabs: as many requests per
        slab as fit (each with the blocks its check needs), one read call
        each; a request larger than a slab in slab-sized pieces."""
        spans = [self._span(r) for r in reqs]
        groups: list[list[int]] = [[]]
        used = 0
        for i, (start, end, _) in enumerate(spans):
            n = -(-(end - start) // _SLOT) * _SLOT
            if groups[-1] and used + n > SLABS.nbytes:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n
        for group in groups:
            if len(group) == 1 and spans[group[0]][1] - spans[group[0]][0] > SLABS.nbytes:
                self._large(reqs[group[0]], spans[group[0]])
                continue
            slab = SLABS.take(self.threads)
            try:
                slab.ready()
                ranges, heads, pos = [], [], 0
                for i in group:
                    start, end, _ = spans[i]
                    heads.append(pos + reqs[i].byte_offset - start)
                    ranges.append((start, slab.view[pos : pos + end - start]))
                    pos += -(-(end - start) // _SLOT) * _SLOT
                self.read([reqs[i] for i in group], ranges)
            except BaseException:
                SLABS.drop(slab)
                raise
            try:
                faults.handoff("read")
                slab.guard.check()
                for i, (_, mv) in zip(group, ranges, strict=True):
                    v = spans[i][2]
                    if v is not None:
                        v.feed(mv)
                        v.done()
                faults.handoff("check")
                boxes = []
                for i, at in zip(group, heads, strict=True):
                    c = self.chunks[reqs[i].chunk]
                    boxes.append(slab.box(c.dtype, at, reqs[i].box.lengths, c.lengths))
                slab.event = self._copies([reqs[i] for i in group], boxes)
            finally:
                SLABS.give(slab)

    def _span(self, r: ReadRequest) -> tuple[int, int, Verifier | None]:
        """The file bytes to read for ``r`` (its own, or its check's cover) and the check."""
        got = self.check(r)
        if got is None:
            return r.byte_offset, r.byte_offset + r.nbytes, None
        v, start, end = got
        base = self.chunks[r.chunk].byte_offset
        return base + start, base + end, v

    def _large(self, req: ReadRequest, span: tuple[int, int, Verifier | None]) -> None:
        """A request larger than a slab: read in slab-sized pieces into the
        target's bytes when they are exactly its box (contiguous, in the
        stored dtype); else through one pinned buffer of its size. The bytes
        its check needs beyond the request's are read into host memory."""
        start, end, v = span
        edges = self._edges(req, start, end)
        if v is not None:
            v.feed(edges[0])
        dest = self.target_of(req)
        c = self.chunks[req.chunk]
        if not (dest.is_contiguous() and dtype_name(dest.dtype) == c.dtype
                and req.nbytes == req.box.numel * dest.element_size()):
            raw = torch.empty(req.nbytes, dtype=torch.uint8, pin_memory=True)  # held by torch until copied
            self.read([req], [(req.byte_offset, host_memoryview(raw))])
            if v is not None:
                v.feed(host_memoryview(raw))
                v.feed(edges[1])
                v.done()
            box = torch.as_strided(raw.view(dtype_from_name(c.dtype)), req.box.lengths, row_major_strides(c.lengths))
            self._copies([req], [box])
            return
        out = byte_view(dest)
        stream = self.stream(dest.device)
        for at in range(0, req.nbytes, SLABS.nbytes):
            n = min(SLABS.nbytes, req.nbytes - at)
            slab = SLABS.take(self.threads)
            try:
                slab.ready()
                self.read([req], [(req.byte_offset + at, slab.view[:n])])
            except BaseException:
                SLABS.drop(slab)
                raise
            try:
                if v is not None:
                    v.feed(slab.view[:n], kept=False)  # (the slab is reused)
                with torch.cuda.stream(stream):
                    out[at : at + n].copy_(slab.buf.tensor[:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                device_memory.STATS.host_to_device += 1
                slab.event = [ev]
            finally:
                SLABS.give(slab)
        if v is not None:
            v.feed(edges[1])
            v.done()

    def _edges(self, req: ReadRequest, start: int, end: int) -> tuple[memoryview, memoryview]:
        """The bytes of ``[start, end)`` before and after the request's own, read into host memory."""
        head, tail = req.byte_offset - start, end - req.byte_offset - req.nbytes
        buf = memoryview(bytearray(head + tail))
        ranges = [(o, b) for o, b in ((start, buf[:head]), (req.byte_offset + req.nbytes, buf[head:])) if len(b)]
        if ranges:
            self.read([req], ranges)
        return buf[:head], buf[head:]

    def finish(self) -> None:
        """(the load's thread) Wait for the last copy on each copy stream used."""
        ends = []
        for stream in self.streams.values():
            ev = torch.cuda.Event()
            ev.record(stream)
            ends.append(ev)
        device_memory.wait_events(ends)
