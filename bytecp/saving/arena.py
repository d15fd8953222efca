"""The process's staging arena: where an async save's copies go.

:class:`StagingPool` (one per process, :data:`POOL`) holds one host arena
that lives as long as the process, because on typical hosts a copy into
freshly allocated memory runs several times slower than into a reused
buffer (first-touch page faults; a new arena is faulted in by the kernel at
allocation, ``MAP_POPULATE``). The stagers of :mod:`bytecp.saving.staging`
ask it to copy a rank's boxes (:meth:`StagingPool.stage`,
:meth:`StagingPool.snapshot`). Host copies go through
:mod:`bytecp.saving.hostcopy` (GIL-free ``memcpy`` pieces on ``threads``
threads, crc32c fused with the copy when ``checksums``). CUDA tensors are
staged into pinned memory (the arena is registered with CUDA once, when it
is allocated) with non-blocking copies on bytecp's copy stream
(:mod:`bytecp.device_memory`), ordered after the caller's stream by the
event recorded when the save was asked for (no device-wide synchronize),
their sources held until copied, waited for before the stage returns.

With a storage that lends arenas (``keeper://``:
:meth:`~bytecp.storage_api.Storage.staging_arena`, a shared-memory file of
the host's keeper) the arena of each stage is the storage's, laid out
exactly as a data file (every box page-aligned, zero-padded): the writer
hands it back whole (:meth:`~bytecp.storage_api.Storage.adopt`) and the
backend's process checksums, stores and replicates it. Such an arena is
never reused: it became a data file; the next save is lent another. When
CUDA boxes are copied into one, its mapping is registered with CUDA (once
per mapping: the backend keeps its mappings between saves), so the copy
runs at pinned speed.

Boxes of at least :data:`PAGE_ALIGN_MIN_BYTES` start at a multiple of
:data:`~bytecp.format.metadata.ALIGNMENT` in the arena and are followed by zeros up
to the next multiple, exactly as the data file lays them out: the writer
hands storage that padded view whole, and local ``O_DIRECT`` writes take it
without a bounce copy.

The pool keeps where its last stage laid each box out (:class:`_Placed`,
with the state's kept description): a later stage of the same boxes of the
same tensors, or of some of them, only copies.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import operator
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from bytecp import device_memory, faults
from bytecp.format import metadata as fmt
from bytecp.format.checksum import Sums
from bytecp.plan.planner import WriteItem
from bytecp.saving.ahead import Ahead, guess_plan
from bytecp.saving.hostcopy import CopyPlan
from bytecp.saving.writer import FILE_TARGET_BYTES, PAD_ZEROS, Staged, source_view
from bytecp.storage_api import SharedArena, Storage
from bytecp.tree import buffers
from bytecp.tree.dtypes import dtype_from_name, host_memoryview
from bytecp.tree.regions import row_major_strides
from bytecp.tree.state import FlatTree, Shard, TensorLeaf

__all__ = ["StagingPool", "POOL", "Copied", "PAGE_ALIGN_MIN_BYTES", "shared_layout_sizes", "batches_within", "Ready",
           "Queued"]

#: the caller's streams marked ready when the save was asked for (device index -> CUDA event;
#: :func:`bytecp.device_memory.ready_events`)
Ready = Mapping[int, Any]
#: called once the copies of a stage are queued and its host copies done, with each device's event
Queued = Callable[[Mapping[int, Any]], None]

_ALIGN = 64
#: boxes this large are laid out in the arena as in a data file (page-aligned, zero-padded)
PAGE_ALIGN_MIN_BYTES = 64 << 10


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _slot(n: int, whole_pages: bool = False) -> int:
    """Arena bytes a box of ``n`` bytes takes (with its padding)."""
    return _up(n, fmt.ALIGNMENT) if n >= PAGE_ALIGN_MIN_BYTES or whole_pages else _up(n, _ALIGN)


def _bins(items: Sequence[WriteItem], files: int) -> list[list[int]]:
    """``items`` (their indices) spread over at most ``files`` lent arenas of
    similar size, largest first, as the writer spreads boxes over data files:
    each arena becomes a data file, and the keeper replicates them in parallel."""
    total = sum(it.nbytes for it in items)
    n = max(1, min(files, -(-total // FILE_TARGET_BYTES), len(items)))
    bins: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for k in sorted(range(len(items)), key=lambda k: -items[k].nbytes):
        i = loads.index(min(loads))
        bins[i].append(k)
        loads[i] += items[k].nbytes
    return [sorted(b) for b in bins if b]


def shared_layout_sizes(items: Sequence[WriteItem], files: int = 4) -> list[int]:
    """The bytes of each arena a save of ``items`` is lent (data files' layout)."""
    return [_Layout([items[k] for k in b], 0, whole_pages=True).end for b in _bins(items, files)]


def _host_arena(nbytes: int, pinned: bool) -> tuple[torch.Tensor, device_memory.PinnedBuffer | None]:
    """``nbytes`` of page-aligned host memory, faulted in now where the OS
    allows (pinned: registered with CUDA, see :class:`~bytecp.device_memory.PinnedBuffer`)."""
    if pinned:
        buf = device_memory.PinnedBuffer(nbytes)
        return buf.tensor, buf
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    raw = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    return torch.frombuffer(raw, dtype=torch.uint8), None  # keeps ``raw`` alive


@dataclasses.dataclass(eq=False)
class _Placed:
    """Where the last stage into the pool's own arena put each box, from
    which sources, and the copies sorted out (:class:`~bytecp.saving.hostcopy.CopyPlan`).

    Kept with the state's description (in its first
    :class:`~bytecp.tree.state.Prebuilt` piece's memo, so it goes when the job
    drops the state) for the next stage: one of the very same boxes (the
    same :class:`~bytecp.plan.planner.WriteItem` objects, as the plan cache
    hands them again) of a state whose description was kept between saves
    (the same pieces: the same tensor objects at the same addresses, which
    the adapters check) into the same arena, still laid out as this stage
    left it (the pool's last placement), only copies: no layout, views,
    padding or bookkeeping per box on the caller's thread (an eager save of
    tens of thousands of tensors spent most of its call there)."""

    pieces: tuple[dict[str, TensorLeaf], ...]
    items: tuple[WriteItem, ...]
    arena: tuple[int, int]  # its address and size
    srcs: list[torch.Tensor]  # (views of the live tensors)
    dsts: list[torch.Tensor]
    datas: list[memoryview]
    padded: list[memoryview | None]
    #: the boxes copied on the host and their copies; the boxes (not empty) copied from ``device``
    host: list[int]
    copies: CopyPlan
    device: torch.device | None
    device_boxes: list[int]
    nbytes: int
    #: the snapshot's tensors (copies of the live tree's, in its order), made at the first snapshot
    tree: dict[str, TensorLeaf] | None = None
    #: each box's place by the id of its item (made at the first stage of some of them)
    index: dict[int, int] | None = None
    #: eager saves in a row whose stage reused it whole (the next one guesses its copy: :mod:`~bytecp.saving.ahead`)
    streak: int = 0
    #: what a guess copies from (:mod:`~bytecp.saving.ahead`; made at the first one): the host
    #: boxes' copies from views of the sources of its own, and each of their storages with the
    #: bytes the views read in it
    guess: tuple[CopyPlan, list[torch.UntypedStorage], list[int]] | None = None

    def clear(self) -> None:
        """(the pool, when another layout or arena replaces this one) Let its views go."""
        self.pieces, self.items, self.arena = (), (), (0, 0)
        self.srcs, self.dsts, self.datas, self.padded, self.host, self.device_boxes = [], [], [], [], [], []
        self.copies, self.tree, self.index, self.guess = CopyPlan([]), None, None, None

    def fits(self, flat: FlatTree, items: Sequence[WriteItem]) -> tuple[bool, list[int] | None]:
        """Whether a stage of ``items`` of ``flat`` can copy into these places:
        ``(True, None)`` when it stages exactly these boxes, ``(True, ks)``
        when ``items`` are some of them (``ks``: their places; an incremental
        save copies the boxes that changed), else ``(False, None)``."""
        if not (self.items and not flat.loose and len(flat.pieces) == len(self.pieces)
                and all(map(operator.is_, (p.flat.tensors for p in flat.pieces), self.pieces))):
            return False, None
        if len(items) == len(self.items) and all(map(operator.is_, items, self.items)):
            return True, None
        index = self.index
        if index is None:
            index = self.index = {id(it): k for k, it in enumerate(self.items)}
        ks = [index.get(id(it), -1) for it in items]  # (the items are held: their ids are theirs)
        return (-1 not in ks), ks


@dataclasses.dataclass(eq=False)
class Copied:
    """One stage's copies: per box its bytes, checksums, padded view and
    place; :meth:`staged` makes the writer's :class:`Staged` records (on the
    save's background thread when the caller only waits for the copy)."""

    items: Sequence[WriteItem]
    dsts: list[torch.Tensor]
    datas: list[memoryview]
    crc: list[Sums | None]
    padded: list[memoryview | None]
    where: list[tuple[SharedArena | None, int]]
    use: tuple[buffers.Guard, int] | None
    nbytes: int
    #: the kept placement these copies filled whole (the snapshot's tree is kept with it), else None
    placed: _Placed | None = None

    def staged(self) -> list[Staged]:
        """The writer's record of each box (made once, when the write asks)."""
        return [Staged(it, self.datas[k], sums=self.crc[k], padded=self.padded[k], arena=self.where[k][0],
                       offset=self.where[k][1], use=self.use) for k, it in enumerate(self.items)]


class _Layout:
    """Where each box goes in an arena whose first byte is at address ``base``
    (``whole_pages``: every box page-aligned, as in a data file)."""

    def __init__(self, items: Sequence[WriteItem], base: int, whole_pages: bool = False) -> None:
        pos = (-base) % fmt.ALIGNMENT  # the arena's first page boundary
        self.whole_pages = whole_pages
        self.starts: list[int] = []
        self.sizes: list[int] = []
        for it in items:
            n = it.nbytes
            pos = _up(pos, fmt.ALIGNMENT if n >= PAGE_ALIGN_MIN_BYTES or whole_pages else _ALIGN)
            self.starts.append(pos)
            self.sizes.append(n)
            pos += _slot(n, whole_pages)
        self.end = pos


class StagingPool:
    """One growing arena per process (one save is in flight at a time).

    Its :class:`~bytecp.tree.buffers.Guard`: each stage into it acquires it
    (the boxes staged carry its token), and the writer checks it once their
    file is written and releases it once every file of the batch is
    (:func:`bytecp.saving.writer.write_data_files`); with
    ``BYTECP_DEBUG_BUFFERS=1`` a released arena is poisoned and a later use
    of the old copies fails loudly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arena: torch.Tensor | None = None
        #: the arena's pinned memory (None: pageable), unpinned when the arena is replaced
        self._pinned: device_memory.PinnedBuffer | None = None
        self.allocations = 0  # how many times an arena was allocated (tests)
        self.guard = buffers.Guard("a save's staging arena")
        #: where the last stage into the arena put its boxes (kept by the state's description)
        self._placed: weakref.ref[_Placed] | None = None
        self.reused = 0  # how many stages reused the last one's placement (tests)
        #: an eager save's guess in flight: ended before anything else uses the arena
        self._guess: Ahead | None = None
        self.guessed = 0  # how many of them took the copies an eager save guessed (tests)

    def arena(self, items: Sequence[WriteItem], pinned: bool) -> tuple[torch.Tensor, _Layout]:
        """The arena (grown if needed) and where ``items`` go in it (``pinned``:
        for device copies; a pinned arena also serves host copies)."""
        self.end_guess()
        pinned = pinned and torch.cuda.is_available()
        with self._lock:
            a = self._arena
            if a is not None and (not pinned or self._pinned is not None):
                layout = _Layout(items, a.data_ptr())
                if layout.end <= a.numel():
                    self.guard.acquire()
                    return a, layout
            # room for the layout at any base address (<= one page more)
            need = _Layout(items, 0).end + fmt.ALIGNMENT
            size = max(need, int((a.numel() if a is not None else 0) * 1.25))
            self._drop()
            a, self._pinned = _host_arena(size, pinned or self._pinned is not None)
            self._arena = a
            self.allocations += 1
            self.guard = buffers.Guard("a save's staging arena", host_memoryview(a))
            self.guard.acquire()
            return a, _Layout(items, a.data_ptr())

    def _drop(self) -> None:
        """Let the arena go (one save at a time: no copy into it is in flight)."""
        self._arena = None
        self._forget()
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None

    def _forget(self) -> None:
        """(under the lock) The arena's layout changes: the last placement lets
        its views go (the arena itself, and its pinning, stay)."""
        placed = self._placed() if self._placed is not None else None
        if placed is not None:
            placed.clear()
        self._placed = None

    def lent(self, items: Sequence[WriteItem], storage: Storage | None,
             pinned: bool = False) -> tuple[torch.Tensor, _Layout, SharedArena] | None:
        """An arena ``storage`` lends for ``items`` (never kept: it becomes a
        data file), or None; ``pinned``: registered for device copies (the
        backend keeps the mapping and unpins it when it lets it go)."""
        if storage is None:
            return None
        need = _Layout(items, 0, whole_pages=True).end
        shared = storage.staging_arena(max(need, 1))
        if shared is None:
            return None
        a = torch.frombuffer(shared.buffer, dtype=torch.uint8)  # keeps the mapping alive
        if pinned:
            device_memory.register(a.data_ptr(), a.numel())
        layout = _Layout(items, a.data_ptr(), whole_pages=True)
        if layout.end > a.numel():  # pragma: no cover - a backend lending less than asked
            raise ValueError(f"{storage.url}: lent a staging arena of {a.numel()} bytes for {layout.end}")
        shared.used = layout.end
        return a, layout, shared

    def release(self) -> None:
        self.end_guess()
        with self._lock:
            self._drop()

    def stage(self, flat: FlatTree, items: Sequence[WriteItem], *, threads: int = 1,
              checksums: bool = False, shared: Storage | None = None, files: int = 4,
              ready: Ready | None = None) -> list[Staged]:
        """Copy the boxes ``items`` name into the arena (those ``shared``
        lends when it does, at most ``files`` of them); views of it come back
        (with their crc32c when ``checksums``). CUDA boxes are copied after
        the ``ready`` events (see :mod:`bytecp.device_memory`)."""
        return self._copy(flat, items, threads, checksums, shared, files, ready).staged()

    def snapshot(self, flat: FlatTree, items: Sequence[WriteItem], *, threads: int = 1,
                 checksums: bool = False, shared: Storage | None = None,
                 files: int = 4, ready: Ready | None = None,
                 queued: Queued | None = None, ahead: Ahead | None = None,
                 eager: bool = False) -> tuple[FlatTree, Copied]:
        """Copy the boxes ``items`` name into the arena; the same tree comes
        back with its tensors replaced by those copies (host tensors), so the
        rest of a save can run on it while training changes the live ones,
        with the copies (what :class:`~bytecp.saving.staging.SnapshotStager`
        hands the writer). ``queued`` is
        told, before the host waits for the device copies, that every copy
        is queued (with the events a stream can wait for instead). ``eager``:
        an eager save's snapshot (the placement counts it), ``ahead`` the
        copies it guessed (:meth:`copy_ahead`), taken when they fit."""
        copied = self._copy(flat, items, threads, checksums, shared, files, ready, queued, ahead, eager)
        tensors = copied.placed.tree if copied.placed is not None else None
        if tensors is None:
            # in the live tree's order (the specs digest every rank compares depends on it)
            tensors = {fqn: TensorLeaf(leaf.global_shape, leaf.dtype, [], leaf.replicas)
                       for fqn, leaf in flat.tensors.items()}
            for it, dst in zip(copied.items, copied.dsts, strict=True):
                tensors[it.fqn].shards.append(Shard(it.region, dst))
            if copied.placed is not None:  # the same copies of the same boxes next time: the same tree
                copied.placed.tree = tensors
        # (the pieces describe the live tensors, not these)
        return dataclasses.replace(flat, tensors=tensors, pieces=(), loose=None, copy_of=flat.copy_of or flat), copied

    @property
    def _memo_key(self) -> tuple[str, int]:
        """This pool's placement in a kept description's memo."""
        return ("staging", id(self))

    def _reuse(self, flat: FlatTree, items: Sequence[WriteItem], eager: bool = False
               ) -> tuple[_Placed, _Placed, list[int] | None] | None:
        """The last stage's placement when this one stages the same boxes (or
        some of them: their places) of the same tensors into the same arena
        (taken: the guard acquired), with a copy of it as it was then (a
        ``prewarm`` or ``release`` on another thread may clear it), else None."""
        if not flat.pieces or flat.loose:
            return None
        placed = flat.pieces[0].memo.get(self._memo_key)
        if not isinstance(placed, _Placed):
            return None
        fits, ks = placed.fits(flat, items)
        if not fits:
            return None
        pinned = placed.device is not None and torch.cuda.is_available()
        with self._lock:
            if not self._holds(placed) or pinned and self._pinned is None:
                return None
            now = self._take(placed)
        if eager:
            placed.streak = placed.streak + 1 if ks is None else 0
        self.reused += 1
        return placed, now, ks

    def _holds(self, placed: _Placed) -> bool:
        """(under the lock) Whether ``placed`` is still the pool's placement,
        in the arena it laid its boxes out in (a ``prewarm`` or ``release`` on
        another thread may have replaced either)."""
        a = self._arena
        return (self._placed is not None and self._placed() is placed and a is not None
                and (a.data_ptr(), a.numel()) == placed.arena)

    def _take(self, placed: _Placed) -> _Placed:
        """(under the lock) The arena's use acquired for a stage into ``placed``'s
        places: a copy of it as it is now (a ``prewarm`` or ``release`` on
        another thread may clear it); debug mode filled the arena at its
        release, so the files' padding is written again."""
        poisoned = self.guard.poisoned
        self.guard.acquire()
        now = copy.copy(placed)
        if poisoned:
            for k, pad in enumerate(now.padded):
                if pad is not None:
                    n = len(now.datas[k])
                    pad[n:] = PAD_ZEROS[: len(pad) - n]
        return now

    def end_guess(self) -> None:
        """A guess in flight not taken (its save failed or was interrupted
        before its snapshot took it) ends: before the arena is used again."""
        g = self._guess
        if g is not None:
            g.end()
            self._guess = None

    def copy_ahead(self, checksums: bool, threads: int = 1) -> Ahead | None:
        """(an eager save, once the previous save is done) Start copying the
        last placement's boxes again, on the helper thread, when the save
        before (an eager one) reused it whole (:mod:`bytecp.saving.ahead`); None when there is
        nothing to guess (device boxes, a pinned arena, sources freed)."""
        self.end_guess()
        with self._lock:
            placed = self._placed() if self._placed is not None else None
            if (placed is None or not self._holds(placed) or placed.streak < 1 or placed.device is not None
                    or self._pinned is not None or not placed.host):
                return None
            try:
                plan = guess_plan(placed)
            except RuntimeError:  # a source without a storage of its own to check
                return None
            if plan is None:
                return None
            now = self._take(placed)
            self._guess = guess = Ahead(placed, now, plan, checksums, threads)
        guess.start()
        return guess

    def _guessed(self, ahead: Ahead | None, flat: FlatTree, items: Sequence[WriteItem], checksums: bool,
                 shared: Storage | None) -> list[Sums | None] | None:
        """The checksums of ``ahead``'s copies when they are this stage's (the
        same placement whole, still the pool's, summed as asked; the caller
        helps finish them), else None (any guess in flight stopped, its
        copies in flight waited for)."""
        crcs = None
        if ahead is not None and shared is None and ahead.checksums == checksums:
            placed: _Placed = ahead.placed
            if placed.fits(flat, items) == (True, None):
                with self._lock:
                    hit = self._holds(placed)
                crcs = ahead.take() if hit else None
        self.end_guess()
        if ahead is None or crcs is None:
            return None
        ahead.placed.streak += 1
        self.reused += 1
        self.guessed += 1
        return crcs

    def _copy(self, flat: FlatTree, items: Sequence[WriteItem], threads: int, checksums: bool,
              shared: Storage | None = None, files: int = 4, ready: Ready | None = None,
              queued: Queued | None = None, ahead: Ahead | None = None, eager: bool = False) -> Copied:
        """Copy each box into the arena: its :class:`Staged` bytes and its typed copy
        (``eager``: an eager save's snapshot, with ``ahead`` the copies it
        guessed, waited for first, taken when they fit)."""
        done = self._guessed(ahead, flat, items, checksums, shared)
        got: tuple[_Placed, _Placed, list[int] | None] | None
        if ahead is not None and done is not None:
            got = ahead.placed, ahead.now, None
        else:
            got = self._reuse(flat, items, eager) if shared is None and items else None
        where: list[tuple[SharedArena | None, int]] | None = None  # (None: every box in the pool's arena)
        ks: list[int] | None = None  # (the places of some of the placement's boxes)
        if got is None:
            placed, where = self._place(flat, items, shared, files)
            kept = placed
        else:
            kept, placed, ks = got
        use = (self.guard, self.guard.token()) if where is None else None  # (lent arenas are never reused)
        if ks is None:
            srcs, dsts, datas, padded = placed.srcs, placed.dsts, placed.datas, placed.padded
            host, device_boxes, copies = placed.host, placed.device_boxes, placed.copies
        else:  # some of the boxes, in their places: only their copies are sorted out anew
            srcs, dsts = [placed.srcs[k] for k in ks], [placed.dsts[k] for k in ks]
            datas, padded = [placed.datas[k] for k in ks], [placed.padded[k] for k in ks]
            on_host = set(placed.host)
            host = [j for j, k in enumerate(ks) if k in on_host]
            device_boxes = [j for j, k in enumerate(ks) if k not in on_host and datas[j]]
            copies = CopyPlan([(dsts[j], srcs[j]) for j in host], [datas[j] for j in host])
        # each device copy is queued (on the copy stream of the tensors' device, after the
        # caller's stream was ready); the DMA runs while the host copies below run
        device_copies = device_memory.DeviceToHost(dict(ready or {}))
        if placed.device is not None:
            with device_copies.on(placed.device):
                for k in device_boxes:
                    device_copies.copy(dsts[k], srcs[k])
        crcs = done if done is not None else copies.run(threads=threads, checksums=checksums)
        crc: list[Sums | None] = [None] * len(items)
        for k, c in zip(host, crcs, strict=True):
            crc[k] = c
        events = device_copies.queued()
        if queued is not None:
            queued(events)
        device_copies.wait()
        faults.handoff("stage")
        nbytes = placed.nbytes if ks is None else sum(it.nbytes for it in items)
        if where is not None:  # lent arenas
            return Copied(items, dsts, datas, crc, padded, where, use, nbytes)
        return Copied(items, dsts, datas, crc, padded, [(None, 0)] * len(items), use, nbytes,
                       kept if ks is None else None)

    def _place(self, flat: FlatTree, items: Sequence[WriteItem], shared: Storage | None,
               files: int) -> tuple[_Placed, list[tuple[SharedArena | None, int]] | None]:
        """Lay ``items`` out in lent arenas or the pool's (acquired) and make
        their views; kept as the pool's placement when in the pool's arena
        and the state's description is kept between saves."""
        srcs = [source_view(flat.tensors[it.fqn], it.region, it.fqn) for it in items]
        devices = {s.device for s in srcs if s.device.type == "cuda"}
        if len(devices) > 1:
            raise ValueError(f"staging tensors of several CUDA devices at once: {sorted(map(str, devices))}")
        device = next(iter(devices), None)
        # (indices, arena, layout, the storage's handle): lent arenas, one per future data file, or the pool's
        pieces: list[tuple[list[int], torch.Tensor, _Layout, SharedArena | None]] = []
        for b in _bins(items, files) if shared is not None and items else []:
            lent = self.lent([items[k] for k in b], shared, pinned=device is not None)
            if lent is None:
                pieces = []
                break
            pieces.append((b, *lent))
        if not pieces:
            pieces = [(list(range(len(items))), *self.arena(items, pinned=device is not None), None)]
        dsts: list[torch.Tensor] = [torch.empty(0)] * len(items)
        datas: list[memoryview] = [memoryview(b"")] * len(items)
        padded: list[memoryview | None] = [None] * len(items)
        where: list[tuple[SharedArena | None, int]] = [(None, 0)] * len(items)
        for ks, arena, layout, at in pieces:
            raw = host_memoryview(arena)  # sliced per box: a view costs no tensor op
            typed: dict[str, torch.Tensor] = {}
            for k, pos, n in zip(ks, layout.starts, layout.sizes, strict=True):
                it = items[k]
                t = typed.get(it.dtype)
                if t is None:  # the arena seen as this dtype (every start is a multiple of its size)
                    t = typed[it.dtype] = arena[: arena.numel() // it.itemsize * it.itemsize].view(
                        dtype_from_name(it.dtype))
                shape = it.region.lengths
                dsts[k] = t.as_strided(shape, row_major_strides(shape), pos // it.itemsize)
                datas[k] = raw[pos : pos + n]
                where[k] = (at, pos)
                if n >= PAGE_ALIGN_MIN_BYTES or layout.whole_pages:
                    end = pos + _slot(n, layout.whole_pages)
                    raw[pos + n : end] = PAD_ZEROS[: end - pos - n]  # the file's padding
                    padded[k] = raw[pos:end]
        host = [k for k, s in enumerate(srcs) if s.device.type != "cuda"]
        placed = _Placed(tuple(p.flat.tensors for p in flat.pieces), tuple(items),
                         (pieces[0][1].data_ptr(), pieces[0][1].numel()), srcs, dsts, datas, padded, host,
                         CopyPlan([(dsts[k], srcs[k]) for k in host], [datas[k] for k in host]), device,
                         [k for k, s in enumerate(srcs) if s.device.type == "cuda" and datas[k]],
                         sum(it.nbytes for it in items))
        if pieces[0][3] is not None:  # lent arenas (each becomes a data file): never kept
            return placed, where
        if not items:  # nothing laid out: the last placement still holds
            return placed, None
        with self._lock:  # the pool's arena, laid out anew: kept for the next stage when the description is
            self._forget()
            if flat.pieces and not flat.loose and self._arena is pieces[0][1]:
                self._placed = weakref.ref(placed)
                flat.pieces[0].memo[self._memo_key] = placed
        return placed, None


POOL = StagingPool()


def _forget_guess() -> None:
    """(a forked child) The parent's guess in flight runs on a thread the child does not have."""
    POOL._guess = None


os.register_at_fork(after_in_child=_forget_guess)


def batches_within(items: Sequence[WriteItem], budget: int | None) -> list[list[WriteItem]]:
    """Group items into batches of at most ``budget`` staged bytes (an item
    larger than the budget forms a batch of its own)."""
    if budget is None:
        return [list(items)]
    out: list[list[WriteItem]] = [[]]
    used = 0
    for it in items:
        end = _up(used, fmt.ALIGNMENT if it.nbytes >= PAGE_ALIGN_MIN_BYTES else _ALIGN) + _slot(it.nbytes)
        if out[-1] and end > budget:
            out.append([])
            end = _slot(it.nbytes)
        out[-1].append(it)
        used = end
    return out
