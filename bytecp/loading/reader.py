"""Ranged reads of an opened checkpoint's data files straight into target
tensors.

Called by the load pipeline (every rank executes its own read requests) and
by ``bytecp export`` (one process), with rows from the opened checkpoint
(:mod:`bytecp.loading.opened`), already checked against its metadata, and
the requests :func:`bytecp.plan.load_plan.plan_load` made from them. A
checksum mismatch, a short or missing file raises
:class:`~bytecp.errors.CorruptCheckpointError` naming the file and tensor.

Targets on a CUDA device are read into pinned slabs (:class:`PinnedSlabs`,
kept by the process) and copied to the device with non-blocking copies on
bytecp's copy stream, after the caller's stream (an event recorded when the
load began): a reader thread reads its next batch while the last one
crosses to the device, and a slab is read into again only once its copies
are done (its event). The load waits for the copy stream's last event
before it returns (never for the whole device).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import increment_version

from bytecp import device_memory
from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.plan.load_plan import ReadRequest
from bytecp.recorder import Trace
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import byte_view, dtype_from_name, dtype_name, host_memoryview
from bytecp.tree.regions import Region, row_major_strides

__all__ = ["Target", "execute_reads", "READ_BATCH_MIN_BYTES", "PinnedSlabs", "SLABS", "SLAB_BYTES"]

#: reads smaller than this per file are not split across threads
READ_BATCH_MIN_BYTES = 8 << 20
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
                return self._free.pop()
            self._made += 1
        try:
            return _Slab(self.nbytes)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def give(self, slab: _Slab) -> None:
        with self._cond:
            self._free.append(slab)
            self._cond.notify()

    def release(self) -> None:
        """Unpin the free slabs (none may be in use)."""
        with self._cond:
            for slab in self._free:
                slab.buf.close()
            self._made -= len(self._free)
            self._free.clear()


SLABS = PinnedSlabs()


@dataclasses.dataclass
class Target:
    """A box of tensor ``fqn`` to fill, and the local tensor (view) that holds it."""

    fqn: str
    box: Region
    view: torch.Tensor


def _batches(chunks: Sequence[fmt.ChunkRecord], reqs: Sequence[ReadRequest], io_threads: int) -> list[list[ReadRequest]]:
    """The requests of each file in offset order, cut so that every reader
    thread has work (about ``io_threads`` batches per file at least)."""
    by_file: dict[str, list[ReadRequest]] = {}
    for r in reqs:
        by_file.setdefault(chunks[r.chunk].file, []).append(r)
    batches: list[list[ReadRequest]] = []
    for file_reqs in by_file.values():
        file_reqs.sort(key=lambda r: r.byte_offset)
        cap = max(READ_BATCH_MIN_BYTES, -(-sum(r.nbytes for r in file_reqs) // io_threads))
        cur: list[ReadRequest] = []
        size = 0
        for r in file_reqs:
            if cur and size + r.nbytes > cap:
                batches.append(cur)
                cur, size = [], 0
            cur.append(r)
            size += r.nbytes
        if cur:
            batches.append(cur)
    return batches


class _BatchReader:
    """Reads one batch (one ranged-read call: backends coalesce) into its targets."""

    def __init__(self, storage: Storage, chunks: Sequence[fmt.ChunkRecord], targets: Sequence[Target], verify: bool,
                 threads: int = 1) -> None:
        self.storage, self.chunks, self.targets, self.verify = storage, chunks, targets, verify
        self.threads = threads
        #: the copy stream of each CUDA device written to
        self.streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _dest(self, req: ReadRequest) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(destination view, buffer to read into, whether the buffer is the destination)."""
        t = self.targets[req.target]
        dest = t.view[req.box.relative_to(t.box).slices()]
        # straight into the target when the bytes read are exactly its box (a
        # whole chunk, or rows of one: FSDP2's shards) in its dtype; else staged (and cast)
        direct = (dest.is_contiguous() and dest.device.type == "cpu"
                  and req.nbytes == req.box.numel * dest.element_size()
                  and dtype_name(dest.dtype) == self.chunks[req.chunk].dtype)
        raw = byte_view(dest) if direct else torch.empty(req.nbytes, dtype=torch.uint8)
        return dest, raw, direct

    def _finish(self, req: ReadRequest, dest: torch.Tensor, raw: torch.Tensor, direct: bool) -> None:
        c = self.chunks[req.chunk]
        if self.verify and req.whole_chunk:
            self._check(req, crc32c(host_memoryview(raw)))
        if direct:  # read into its memory, behind its version counter: incremental saves must see it
            increment_version(dest)
        elif req.box.numel:
            typed = raw.view(dtype_from_name(c.dtype))  # copy_ casts a foreign source's dtype
            dest.copy_(torch.as_strided(typed, req.box.lengths, row_major_strides(c.lengths), 0))

    def _read(self, batch: Sequence[ReadRequest], ranges: list[tuple[int, memoryview]]) -> None:
        """One ranged-read call on the batch's file, its errors naming the tensors."""
        first = self.chunks[batch[0].chunk]
        try:
            self.storage.read_ranges(first.file, ranges)
        except CorruptCheckpointError as e:
            names = sorted({self.chunks[r.chunk].fqn for r in batch})
            more = f" and {len(names) - 1} more from {first.file}; first region" if len(names) > 1 else " region"
            raise CorruptCheckpointError(f"{e} (reading tensor {names[0]!r}{more} {batch[0].box})") from e
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{self.storage.url}: data file {first.file} holding tensor {first.fqn!r} region "
                f"{Region(first.offsets, first.lengths)} is missing"
            ) from e

    def _check(self, req: ReadRequest, crc: int) -> None:
        """A whole chunk's bytes read: their crc32c is the index's."""
        c = self.chunks[req.chunk]
        if crc != c.crc32c:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{c.file}: checksum mismatch in tensor {c.fqn!r} region "
                f"{Region(c.offsets, c.lengths)} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes})"
            )

    def __call__(self, batch: list[ReadRequest]) -> int:
        on_device = [r for r in batch if self.targets[r.target].view.device.type == "cuda"]
        if on_device:
            self._to_device(on_device)
            batch = [r for r in batch if self.targets[r.target].view.device.type != "cuda"]
            if not batch:
                return sum(r.nbytes for r in on_device)
        bufs = [self._dest(r) for r in batch]
        self._read(batch, [(r.byte_offset, host_memoryview(raw)) for r, (_, raw, _) in zip(batch, bufs, strict=True)])
        for r, (dest, raw, direct) in zip(batch, bufs, strict=True):
            self._finish(r, dest, raw, direct)
        return sum(r.nbytes for r in batch) + sum(r.nbytes for r in on_device)

    # -- targets on a CUDA device ------------------------------------------------
    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            s = self.streams.get(index)
            if s is None:
                s = self.streams[index] = device_memory.copy_stream(index)
            return s

    def _target_of(self, req: ReadRequest) -> torch.Tensor:
        t = self.targets[req.target]
        return t.view if req.box == t.box else t.view[req.box.relative_to(t.box).slices()]

    def _copies(self, reqs: Sequence[ReadRequest], raws: Sequence[torch.Tensor]) -> list[Any]:
        """Queue the copies of ``raws`` (each request's box, pinned) into their
        targets, each on its device's copy stream; -> an event after them on each stream used."""
        by_device: dict[torch.device, list[int]] = {}
        for i, r in enumerate(reqs):
            by_device.setdefault(self.targets[r.target].view.device, []).append(i)
        events = []
        for device, ks in by_device.items():
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                for i in ks:
                    if reqs[i].box.numel:
                        self._target_of(reqs[i]).copy_(raws[i], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            device_memory.STATS.host_to_device += len(ks)
            events.append(ev)
        return events

    def _to_device(self, reqs: list[ReadRequest]) -> None:
        """Read ``reqs`` (one file, targets on CUDA devices) through pinned
        slabs: as many requests per slab as fit, one read call each; a
        request larger than a slab in slab-sized pieces."""
        groups: list[list[ReadRequest]] = [[]]
        used = 0
        for r in reqs:
            n = -(-r.nbytes // _SLOT) * _SLOT
            if groups[-1] and used + n > SLABS.nbytes:
                groups.append([])
                used = 0
            groups[-1].append(r)
            used += n
        for group in groups:
            if len(group) == 1 and group[0].nbytes > SLABS.nbytes:
                self._large_to_device(group[0])
                continue
            slab = SLABS.take(self.threads)
            try:
                slab.ready()
                ranges, starts, pos = [], [], 0
                for r in group:
                    starts.append(pos)
                    ranges.append((r.byte_offset, slab.view[pos : pos + r.nbytes]))
                    pos += -(-r.nbytes // _SLOT) * _SLOT
                self._read(group, ranges)
                if self.verify:
                    for r, (_, mv) in zip(group, ranges, strict=True):
                        if r.whole_chunk:
                            self._check(r, crc32c(mv))
                boxes = []
                for r, at in zip(group, starts, strict=True):
                    c = self.chunks[r.chunk]
                    boxes.append(slab.box(c.dtype, at, r.box.lengths, c.lengths))
                slab.event = self._copies(group, boxes)
            finally:
                SLABS.give(slab)

    def _large_to_device(self, req: ReadRequest) -> None:
        """A request larger than a slab: read in slab-sized pieces into the
        target's bytes when they are exactly its box (contiguous, in the
        stored dtype); else through one pinned buffer of its size."""
        t = self.targets[req.target]
        dest = t.view[req.box.relative_to(t.box).slices()]
        c = self.chunks[req.chunk]
        if not (dest.is_contiguous() and dtype_name(dest.dtype) == c.dtype
                and req.nbytes == req.box.numel * dest.element_size()):
            raw = torch.empty(req.nbytes, dtype=torch.uint8, pin_memory=True)  # held by torch until copied
            self._read([req], [(req.byte_offset, host_memoryview(raw))])
            if self.verify and req.whole_chunk:
                self._check(req, crc32c(host_memoryview(raw)))
            box = torch.as_strided(raw.view(dtype_from_name(c.dtype)), req.box.lengths, row_major_strides(c.lengths))
            self._copies([req], [box])
            return
        out = byte_view(dest)
        stream = self._stream(dest.device)
        crc = 0
        for start in range(0, req.nbytes, SLABS.nbytes):
            n = min(SLABS.nbytes, req.nbytes - start)
            slab = SLABS.take(self.threads)
            try:
                slab.ready()
                self._read([req], [(req.byte_offset + start, slab.view[:n])])
                if self.verify and req.whole_chunk:
                    crc = crc32c(slab.view[:n], crc)
                with torch.cuda.stream(stream):
                    out[start : start + n].copy_(slab.buf.tensor[:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                device_memory.STATS.host_to_device += 1
                slab.event = [ev]
            finally:
                SLABS.give(slab)
        if self.verify and req.whole_chunk:
            self._check(req, crc)

    def finish_device_copies(self) -> None:
        """(the load's thread) Wait for the last copy on each copy stream used."""
        ends = []
        for stream in self.streams.values():
            ev = torch.cuda.Event()
            ev.record(stream)
            ends.append(ev)
        device_memory.wait_events(ends)


#: idle read pools by width, each reused by one later load at a time (starting 8
#: threads costs milliseconds on a busy host: a third of a small load's time)
_IDLE: dict[int, list[concurrent.futures.ThreadPoolExecutor]] = {}
_IDLE_LOCK = threading.Lock()
_MAX_IDLE = 2
os.register_at_fork(after_in_child=_IDLE.clear)  # the child of a fork has none of their threads


@contextlib.contextmanager
def _read_pool(width: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A pool of ``width`` reader threads this caller alone uses until it
    returns: an idle one kept from an earlier load, or a new one. After a
    failure the pool is shut down as before (its running batches waited for)."""
    with _IDLE_LOCK:
        idle = _IDLE.get(width)
        ex = idle.pop() if idle else None
    ex = ex or concurrent.futures.ThreadPoolExecutor(width, "bytecp-read")
    try:
        yield ex
    except BaseException:
        ex.shutdown(wait=True)
        raise
    with _IDLE_LOCK:
        idle = _IDLE.setdefault(width, [])
        if len(idle) < _MAX_IDLE:
            idle.append(ex)
            return
    ex.shutdown(wait=True)


def execute_reads(
    storage: Storage,
    chunks: Sequence[fmt.ChunkRecord],
    targets: Sequence[Target],
    reqs: Sequence[ReadRequest],
    *,
    io_threads: int,
    verify: bool,
    trace: Trace,
) -> int:
    """(every rank, its own requests) Read ``reqs`` into ``targets`` with
    ``io_threads`` threads; returns the bytes read."""
    batches = _batches(chunks, reqs, io_threads)
    run = _BatchReader(storage, chunks, targets, verify, io_threads)
    # the copy streams start after what the caller queued on the targets (their allocation, an init)
    for index, ev in device_memory.ready_events(t.view for t in targets).items():
        run._stream(torch.device("cuda", index)).wait_event(ev)
    with trace.span("read") as sp:
        try:
            if len(batches) <= 1 or io_threads == 1:
                total = sum(run(b) for b in batches)
            else:
                with _read_pool(io_threads) as ex:
                    total = sum(ex.map(run, batches))
        finally:  # never leave copies running into targets the caller may free
            run.finish_device_copies()
        sp.nbytes = total
        sp.files = len({chunks[b[0].chunk].file for b in batches})
    return total
