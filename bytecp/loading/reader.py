"""Ranged reads of an opened checkpoint's data files straight into target
tensors, every byte placed covered by a checksum (``verify``).

Called by the load pipeline (every rank executes its own read requests) and
by ``bytecp export`` (one process), with rows from the opened checkpoint
(:mod:`bytecp.loading.opened`), already checked against its metadata, and
the requests :func:`bytecp.plan.load_plan.plan_load` made from them. Each
reader thread takes a batch of requests of one file and, for each request,
reads, checks, then places:

1. **read**: one ranged-read call for the batch (backends coalesce), each
   request straight into its target when the bytes read are exactly its box
   (a whole chunk, rows of one) in its dtype, else into a buffer of its own;
   with ``verify``, also the bytes its check needs beyond its own (the rest
   of its chunk's blocks at each edge: :mod:`bytecp.loading.checks`);
2. **check**: each block's crc32c (format version 5), or the chunk's, over
   the bytes read (a :class:`~bytecp.loading.checks.Verifier` per request).
   Where the storage :attr:`~bytecp.storage_api.Storage.sums_reads` (local
   disk, buffered, with the compiled checked reads of
   :mod:`bytecp.format.checked_reads`), the read call itself sums every
   check's spans (its blocks, or its whole cover) in 256 KiB pieces as they
   arrive, the GIL released for the whole batch, and the sums are compared
   at once afterwards (a resharded checked load of 2 GB: 1.6-1.7x -> 1.1-1.3x
   the time of an unchecked one). Elsewhere each range is fed to its
   verifier as soon as it is in where the storage
   :attr:`~bytecp.storage_api.Storage.reads_each`, else once the call
   returns. Two requests whose checks read the same block (targets that
   meet inside one block) are fed, not summed by the storage: its spans
   may not overlap.
3. **place**: a staged request's box copied (and cast) into its target.

A checksum mismatch, a short or missing file raises
:class:`~bytecp.errors.CorruptCheckpointError` naming the file, the tensor
and the region.

Targets that share memory with another target of the same load (a
Megatron fp32 model's parameters and its distributed optimizer's main
parameters, which are views of them) are never read at the same time: the
reads run in *waves* (:func:`target_waves`), a target in a later wave than
every earlier target of the state it overlaps, each wave once the one
before it is placed; so the later target's bytes are what the shared memory
holds, as loading the state's entries one after the other would leave it,
and no target's bytes land in memory another is checking. (Read by two
reader threads at once, one's bytes could land between the other's read
and its checksum, failing a sound checkpoint, and which target's bytes
stayed was a race.) Targets that share nothing -- nearly all -- are in the
first wave; the Megatron case takes two.

With several reader threads, each batch is prepared (step 1's Python:
targets, ranges, checks) on the caller's thread and handed to a reader
thread, which reads, checks and places it (:func:`_pipelined`): the
requests' Python then never queues for the GIL behind another thread's.

Targets on a CUDA device go through :mod:`bytecp.loading.device_reads`.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import dataclasses
import heapq
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.autograd.graph import increment_version

from bytecp import device_memory, faults
from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.loading.checks import Verifier, cover
from bytecp.loading.device_reads import SLAB_BYTES, SLABS, DeviceReads, PinnedSlabs
from bytecp.plan.load_plan import ReadRequest
from bytecp.recorder import Trace
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import dtype_from_name, dtype_name, host_memoryview
from bytecp.tree.regions import Region, row_major_strides

__all__ = ["Target", "execute_reads", "target_waves", "READ_BATCH_MIN_BYTES", "READ_BATCH_MAX_BYTES", "batch_bytes",
           "PinnedSlabs", "SLABS", "SLAB_BYTES"]

#: reads smaller than this per file are not split across threads
READ_BATCH_MIN_BYTES = 8 << 20
#: no read batch is larger (but one request: it is never split); the batches prepared ahead (``io_threads``
#: of them) stage at most this each for requests not read straight into their targets
READ_BATCH_MAX_BYTES = 128 << 20
#: how far past the even share of the reads the last reader thread may end (:func:`batch_bytes`)
_SLACK = 1.125


@dataclasses.dataclass
class Target:
    """A box of tensor ``fqn`` to fill, and the local tensor (view) that holds it."""

    fqn: str
    box: Region
    view: torch.Tensor


#: a group of targets whose memory meets this large is read one target per wave (no pairwise checks)
_PAIRWISE_MAX = 4096


def target_waves(targets: Sequence[Target]) -> list[int]:
    """Each target's wave: 0 unless its memory may meet an earlier target's,
    else one more than the latest wave of the earlier targets it meets. The
    spans from each view's first to its last byte are grouped where they
    meet (a strided view is taken as its whole span: two interleaved views
    count as meeting, which only costs a wave)."""
    spans = []
    for i, t in enumerate(targets):
        v = t.view
        n = v.numel()
        if n == 0:
            continue
        ptr = v.data_ptr()
        if v.is_contiguous():  # (nearly every target: no Python per dimension)
            end = ptr + n * v.element_size()
        else:
            last = sum((k - 1) * s for k, s in zip(v.shape, v.stride(), strict=True))
            end = ptr + (last + 1) * v.element_size()
        spans.append(("cpu" if v.is_cpu else str(v.device), ptr, end, i))
    spans.sort()
    waves = [0] * len(targets)
    group: list[tuple[str, int, int, int]] = []
    device, end = "", -1
    for span in [*spans, ("", -1, -1, -1)]:  # (a sentinel closes the last group)
        if span[0] == device and span[1] < end:
            group.append(span)
            end = max(end, span[2])
            continue
        if len(group) > 1:
            members = sorted(group, key=lambda x: x[3])
            for k, (_, lo, hi, i) in enumerate(members):
                if len(members) > _PAIRWISE_MAX:
                    waves[i] = k
                    continue
                waves[i] = max((waves[j] + 1 for _, a, b, j in members[:k] if a < hi and lo < b), default=0)
        group, device, end = [span], span[0], span[2]
    return waves


def _batches(chunks: Sequence[fmt.ChunkRecord], reqs: Sequence[ReadRequest], io_threads: int) -> list[list[ReadRequest]]:
    """The requests of each file in offset order, cut into batches of about
    :func:`batch_bytes` each (a file into pieces alike in size)."""
    by_file: dict[str, list[ReadRequest]] = {}
    for r in reqs:
        by_file.setdefault(chunks[r.chunk].file, []).append(r)
    sizes = {}
    for file, file_reqs in by_file.items():
        file_reqs.sort(key=lambda r: r.byte_offset)
        sizes[file] = sum(r.nbytes for r in file_reqs)
    cap, bound = batch_bytes(list(sizes.values()), io_threads), READ_BATCH_MAX_BYTES
    batches: list[list[ReadRequest]] = []
    for file, file_reqs in by_file.items():
        # the file's pieces alike: a request goes to the piece its middle byte falls in (and a batch
        # ends before it passes the bound: large requests beside a piece's edge would take it past)
        n, size = _cuts(sizes[file], cap), sizes[file] or 1
        cur: list[ReadRequest] = []
        piece = done = held = 0
        for r in file_reqs:
            k = min(n - 1, (2 * done + r.nbytes) * n // (2 * size))
            if cur and (k != piece or held + r.nbytes > bound):
                batches.append(cur)
                cur, held = [], 0
            piece = k
            cur.append(r)
            done += r.nbytes
            held += r.nbytes
        if cur:
            batches.append(cur)
    return batches


def batch_bytes(sizes: Sequence[int], threads: int) -> int:
    """(``_batches``, once per wave) The largest read batch that keeps
    ``threads`` reader threads evenly busy over files of ``sizes`` bytes: the
    total over ``threads * r`` for the least ``r`` whose pieces (each file cut
    into pieces alike, :func:`_cuts`), handed out in file order to the first free thread,
    end within 12.5% of the even share (:data:`_SLACK`); held between
    :data:`READ_BATCH_MIN_BYTES` and :data:`READ_BATCH_MAX_BYTES`.

    Fewer, larger batches cost less: every batch is a ranged-read call, a
    mapping and its checks' arrays, prepared on the caller's thread (a 1 GB
    load from four 250 MB files, 4 threads: 98.8 ms in one batch a file against
    103.9 in four, the median of 40 alternated). But a file per batch leaves a lone
    batch at the tail when the files do not divide among the threads (five
    files, four threads: the fifth read alone after the others), which the
    even-share test refuses. The upper bound holds what the batches prepared
    ahead (``io_threads`` of them) stage for requests not read straight into
    their targets (a cast, a column shard) to ``io_threads`` x 128 MiB, where a
    batch was a file's bytes over the threads (1 GiB files, 8 threads: 128 MiB
    each; larger files, more); at 128 MiB the 1 GB load above took 108.7 ms,
    109.1 at 256 and 113.2 at 64 (30 alternated rounds)."""
    total = sum(sizes)
    lo, hi = READ_BATCH_MIN_BYTES, READ_BATCH_MAX_BYTES
    if total <= 0 or threads <= 1:
        return max(lo, min(hi, total))
    share = total / threads
    r = max(1, total // (threads * hi))
    while True:
        cap = max(lo, min(hi, -(-total // (threads * r))))
        # (the first free thread ends at most one piece after the even share: pieces that small need
        # no simulation, and r reaches them within a dozen steps)
        if cap <= lo or max(x / _cuts(x, cap) for x in sizes) <= (_SLACK - 1) * share \
                or _makespan(sizes, cap, threads) <= _SLACK * share:
            return cap
        r += 1


def _cuts(size: int, cap: int) -> int:
    """Into how many pieces alike a file's ``size`` bytes of reads are cut for
    batches of about ``cap`` bytes (the nearest count: a file a little over
    ``cap`` stays whole), none over :data:`READ_BATCH_MAX_BYTES`."""
    return max(1, round(size / cap), -(-size // READ_BATCH_MAX_BYTES))


def _makespan(sizes: Sequence[int], cap: int, threads: int) -> float:
    """When the last of ``threads`` threads ends, each taking the next piece
    (files cut by :func:`_cuts`) as it is free."""
    free = [0.0] * threads
    for s in sizes:
        n = _cuts(s, cap)
        for _ in range(n):
            heapq.heapreplace(free, free[0] + s / n)
    return max(free)


#: a request's read: (its bytes' buffer and the bytes of it, the target view, whether that buffer is
#: the target, the bytes its check needs before and after its own, and the check)
_Plan = tuple[torch.Tensor, memoryview, torch.Tensor, bool, memoryview, memoryview, "Verifier | None"]


#: a batch's checks as a storage that sums its reads takes them: the spans (int64 pairs, flat), the sum
#: each must have (-1: none recorded), and each check's first span, the check and its request's read
_Sums = tuple[np.ndarray, np.ndarray, list[tuple[int, "Verifier", _Plan]]]


@dataclasses.dataclass
class _Prepared:
    """A batch made ready on the caller's thread (:meth:`_BatchReader.prepare`) for a reader thread."""

    total: int
    device: list[ReadRequest]
    host: list[ReadRequest]
    plans: list[_Plan]
    ranges: list[tuple[int, memoryview]]
    checks: list[Verifier | None]
    #: where the storage sums as it reads (and the ranges allow it): what to sum; else None (fed)
    summed: _Sums | None


class _BatchReader:
    """Reads one batch (one ranged-read call: backends coalesce) into its targets."""

    def __init__(self, storage: Storage, chunks: Sequence[fmt.ChunkRecord], targets: Sequence[Target], verify: bool,
                 threads: int = 1, block_bytes: int | None = None) -> None:
        self.storage, self.chunks, self.targets, self.verify = storage, chunks, targets, verify
        self.block_bytes = block_bytes
        self.device = DeviceReads(chunks, self._target_of, self._read, self._check, threads)

    def close(self) -> None:
        """(execute_reads, once its copies finished) Drop the targets: ``device``
        holds this reader's bound methods, a cycle that would otherwise keep the
        caller's tensors referenced until a garbage collection (a follower swaps a
        storage in only where nothing else holds it)."""
        self.targets = ()
        del self.device

    def _target_of(self, req: ReadRequest) -> torch.Tensor:
        t = self.targets[req.target]
        return t.view if req.box == t.box else t.view[req.box.relative_to(t.box).slices()]

    def _check(self, req: ReadRequest) -> tuple[Verifier, int, int] | None:
        """The check of ``req``'s bytes and the chunk bytes ``[start, end)`` it needs (None: none)."""
        if not self.verify:
            return None
        c = self.chunks[req.chunk]
        lo = req.byte_offset - c.byte_offset
        span = cover(c, lo, lo + req.nbytes, self.block_bytes)
        if span is None:
            return None
        return Verifier(c, span[0], span[1], self.block_bytes, self.storage.url, req.box), span[0], span[1]

    def _plan(self, req: ReadRequest) -> _Plan:
        dest = self._target_of(req)
        # straight into the target when the bytes read are exactly its box (a whole chunk, or rows
        # of one: FSDP2's shards) in its dtype; else staged
        # (the cheap comparisons first: torch's is_conj/is_neg cost about a microsecond each; only a
        # complex tensor has a conjugate bit)
        direct = (req.nbytes == req.box.numel * dest.element_size()
                  and dtype_name(dest.dtype) == self.chunks[req.chunk].dtype
                  and dest.is_cpu and dest.is_contiguous() and not (dest.dtype.is_complex and dest.is_conj())
                  and not dest.is_neg())
        raw = dest if direct else torch.empty(req.nbytes, dtype=torch.uint8)
        check = self._check(req)
        head = tail = memoryview(b"")
        if check is not None:
            v, start, end = check
            base = self.chunks[req.chunk].byte_offset
            before, after = req.byte_offset - base - start, end - (req.byte_offset - base + req.nbytes)
            if before or after:
                edges = memoryview(np.empty(before + after, np.uint8).data)
                head, tail = edges[:before], edges[before:]
        # (raw: the target just checked above, or a fresh byte buffer)
        return raw, host_memoryview(raw, checked=True), dest, direct, head, tail, None if check is None else check[0]

    @contextlib.contextmanager
    def _naming(self, batch: Sequence[ReadRequest]) -> Iterator[str]:
        """Around a ranged-read call on the batch's file (yielded): its errors name the tensors."""
        first = self.chunks[batch[0].chunk]
        try:
            yield first.file
        except CorruptCheckpointError as e:
            names = sorted({self.chunks[r.chunk].fqn for r in batch})
            more = f" and {len(names) - 1} more from {first.file}; first region" if len(names) > 1 else " region"
            raise CorruptCheckpointError(f"{e} (reading tensor {names[0]!r}{more} {batch[0].box})") from e
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{self.storage.url}: data file {first.file} holding tensor {first.fqn!r} region "
                f"{Region(first.offsets, first.lengths)} is missing"
            ) from e

    def _read(self, batch: Sequence[ReadRequest], ranges: list[tuple[int, memoryview]],
              each: Callable[[int], None] | None = None) -> None:
        """One ranged-read call on the batch's file; ``each(i)`` once range
        ``i`` is in, in order (as it arrives where the storage
        :attr:`~bytecp.storage_api.Storage.reads_each`)."""
        with self._naming(batch) as file:
            if each is not None and self.storage.reads_each:
                self.storage.read_ranges(file, ranges, each=each)
                return
            self.storage.read_ranges(file, ranges)
        if each is not None:
            for i in range(len(ranges)):
                each(i)

    def __call__(self, batch: list[ReadRequest]) -> int:
        return self.finish(self.prepare(batch))

    def prepare(self, batch: list[ReadRequest]) -> _Prepared:
        """(the caller's thread, batch after batch: :func:`_pipelined`) Everything of a batch that is Python
        per request: where each request's bytes go, the ranges to read, the checks and what they sum."""
        host = [r for r in batch if not self.targets[r.target].view.is_cuda]
        device = [r for r in batch if self.targets[r.target].view.is_cuda] if len(host) < len(batch) else []
        plans = [self._plan(r) for r in host]
        # each request's bytes and those its check needs
        ranges: list[tuple[int, memoryview]] = []
        checks: list[Verifier | None] = []
        for r, (_, own, _, _, head, tail, v) in zip(host, plans, strict=True):
            for offset, view in ((r.byte_offset - len(head), head), (r.byte_offset, own),
                                 (r.byte_offset + r.nbytes, tail)):
                if len(view):
                    ranges.append((offset, view))
                    checks.append(v)
        summed = None
        if host and self.storage.sums_reads and _in_order(ranges):
            summed = self._sums_wanted(host, plans)
        return _Prepared(sum(r.nbytes for r in batch), device, host, plans, ranges, checks, summed)

    def finish(self, p: _Prepared) -> int:
        """(a reader thread) Read a prepared batch, check every byte, then place it; -> the bytes it holds."""
        if p.device:
            self.device(p.device)
        if not p.host:
            return p.total
        if p.summed is not None:
            self._read_summed(p.host, p.plans, p.ranges, p.summed)
        else:
            self._read_fed(p.host, p.plans, p.ranges, p.checks)
        faults.handoff("check")
        # read into their memory, behind their version counters: incremental saves must see it
        increment_version([dest for _, _, dest, direct, _, _, _ in p.plans if direct])
        for r, (raw, _, dest, direct, _, _, _) in zip(p.host, p.plans, strict=True):
            if not direct:
                self._place(r, raw, dest)
        faults.handoff("place")
        return p.total

    def _read_fed(self, batch: Sequence[ReadRequest], plans: Sequence[_Plan], ranges: list[tuple[int, memoryview]],
                  checks: list[Verifier | None]) -> None:
        """Read, each range fed to its check as it arrives (where the storage
        :attr:`~bytecp.storage_api.Storage.reads_each`, else once the call
        returned); every check done before any byte is placed."""
        failed: list[CorruptCheckpointError] = []

        def each(i: int) -> None:
            v = checks[i]
            if v is not None and not failed:
                try:
                    v.feed(ranges[i][1])
                except CorruptCheckpointError as e:  # raised once the call returns
                    failed.append(e)

        self._read(batch, ranges, each if self.verify else None)
        faults.handoff("read")
        if failed:
            raise failed[0]
        for plan in plans:  # every byte read checked before any is placed
            if plan[6] is not None:
                plan[6].done()

    def _sums_wanted(self, batch: Sequence[ReadRequest], plans: Sequence[_Plan]) -> _Sums:
        """For a storage that sums as it reads: every check's spans, flat, and what each must sum to."""
        spans: list[int] = []
        want: list[int] = []
        owners: list[tuple[int, Verifier, _Plan]] = []
        for r, plan in zip(batch, plans, strict=True):
            v = plan[6]
            if v is not None:
                s, w = v.spans(self.chunks[r.chunk].byte_offset)
                owners.append((len(want), v, plan))
                spans += s
                want += w
        return np.asarray(spans, np.int64), np.asarray(want, np.int64), owners

    def _read_summed(self, batch: Sequence[ReadRequest], plans: Sequence[_Plan],
                     ranges: list[tuple[int, memoryview]], sums: _Sums) -> None:
        """Read, the storage summing each check's spans piece by piece as it
        reads them (:meth:`~bytecp.storage_api.Storage.read_ranges_summed`:
        the local disk's compiled checked reads), then every sum against its
        checksum at once."""
        spans, want, owners = sums
        with self._naming(batch) as file:
            crcs = self.storage.read_ranges_summed(file, ranges, spans)
        faults.handoff("read")
        bad = np.flatnonzero(np.asarray(crcs, np.int64) != want)
        if len(bad):
            first = int(bad[0])
            at, v, plan = owners[bisect.bisect_right([o[0] for o in owners], first) - 1]
            raise v.mismatch(first - at, (plan[4], plan[1], plan[5]))

    def _place(self, req: ReadRequest, raw: torch.Tensor, dest: torch.Tensor) -> None:
        """A staged request's bytes copied (and cast) into its target."""
        if not req.box.numel:
            return
        c = self.chunks[req.chunk]
        box = torch.as_strided(raw.view(dtype_from_name(c.dtype)), req.box.lengths, row_major_strides(c.lengths), 0)
        dest.copy_(box)  # copy_ casts a foreign source's dtype


def _in_order(ranges: Sequence[tuple[int, memoryview]]) -> bool:
    """Whether ``ranges`` follow each other in the file without overlapping
    (two targets reading one block at their edges do not: summed as fed)."""
    end = -1
    for offset, view in ranges:
        if offset < end:
            return False
        end = offset + len(view)
    return True


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


def _pipelined(run: _BatchReader, batches: Sequence[list[ReadRequest]], ex: concurrent.futures.Executor,
               ahead: int) -> int:
    """Each batch prepared on the caller's thread, then read, checked and
    placed on ``ex``; -> the bytes of every batch. A batch's Python (its
    requests' targets, ranges and checks: 20-25 us a request) runs on one
    thread while the reader threads read with the GIL released: prepared by
    the reader threads themselves, a load of 20,120 small tensors took 0.47 s
    to read with 4 threads against 0.30 s with one (each thread's requests
    queued for the GIL behind the others'). At most ``ahead`` batches wait
    prepared and unread (their staging buffers); after a failed batch no more
    are handed out, and the first failure in batch order is raised."""
    room = threading.Semaphore(ahead)
    failed = threading.Event()

    def finish(p: _Prepared) -> int:
        try:
            return run.finish(p)
        except BaseException:
            failed.set()
            raise
        finally:
            room.release()

    futures: list[concurrent.futures.Future[int]] = []
    for b in batches:
        room.acquire()
        if failed.is_set():
            break
        futures.append(ex.submit(finish, run.prepare(b)))
    return sum(f.result() for f in futures)


def execute_reads(
    storage: Storage,
    chunks: Sequence[fmt.ChunkRecord],
    targets: Sequence[Target],
    reqs: Sequence[ReadRequest],
    *,
    io_threads: int,
    verify: bool,
    trace: Trace,
    block_bytes: int | None = None,
) -> int:
    """(every rank, its own requests) Read ``reqs`` into ``targets`` with
    ``io_threads`` threads; returns the bytes the requests hold (those read
    for their checks beyond them not counted). ``block_bytes``: the
    checkpoint's block size (format version 5; None: older, whose partial
    reads no checksum covers)."""
    waves = target_waves(targets)
    by_wave: dict[int, list[ReadRequest]] = {}
    for r in reqs:
        by_wave.setdefault(waves[r.target], []).append(r)
    run = _BatchReader(storage, chunks, targets, verify, io_threads, block_bytes)
    # the copy streams start after what the caller queued on the targets (their allocation, an init)
    for index, ev in device_memory.ready_events(t.view for t in targets).items():
        run.device.stream(torch.device("cuda", index)).wait_event(ev)
    total, files = 0, set[str]()
    with trace.span("read") as sp:
        try:
            for wave in sorted(by_wave):  # (a device's copies are ordered: one copy stream per device)
                batches = _batches(chunks, by_wave[wave], io_threads)
                files.update(chunks[b[0].chunk].file for b in batches)
                if len(batches) <= 1 or io_threads == 1:
                    total += sum(run(b) for b in batches)
                else:
                    with _read_pool(io_threads) as ex:
                        total += _pipelined(run, batches, ex, io_threads)
        finally:  # never leave copies running into targets the caller may free
            run.device.finish()
            run.close()
        sp.nbytes = total
        sp.files = len(files)
    return total
