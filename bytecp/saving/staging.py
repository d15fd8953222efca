"""Staging: how the boxes a rank writes become bytes that the writer can
take while training goes on.

The save pipeline's stage phase asks a :class:`Stager` (chosen by the API):

- :class:`ViewStager` (``bytecp.save``): no copy; views of the live tensors
  (a non-contiguous or device tensor is copied to a contiguous host tensor;
  boxes on a CUDA device go through the pool's pinned arena);
- :class:`ArenaStager` (``bytecp.async_save``, eager on the caller's thread,
  lazy on the save's background thread): the boxes are copied into the
  process's reused arena (:mod:`bytecp.saving.arena`: its layout, pinning,
  lent arenas and the placements kept between saves); a memory budget
  splits the boxes into batches;
- :class:`SnapshotStager` (eager ``async_save`` after
  :meth:`~bytecp.saving.arena.StagingPool.snapshot`): the boxes were copied
  on the caller's thread; the background write takes those copies.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Protocol

from bytecp.plan.planner import WriteItem
from bytecp.saving.ahead import Ahead
from bytecp.saving.arena import (
    PAGE_ALIGN_MIN_BYTES,
    POOL,
    Copied,
    Queued,
    Ready,
    StagingPool,
    batches_within,
)
from bytecp.saving.arena import shared_layout_sizes as shared_layout_sizes
from bytecp.saving.writer import Staged, as_host_bytes, source_view
from bytecp.storage_api import Storage
from bytecp.tree.regions import Region
from bytecp.tree.state import FlatTree

__all__ = [
    "Stager", "ViewStager", "ArenaStager", "SnapshotStager", "StagingPool", "POOL", "batches_within",
    "PAGE_ALIGN_MIN_BYTES", "shared_layout_sizes", "Ready", "Queued",
]

class Stager(Protocol):
    """How the stage phase turns this rank's planned boxes into bytes to write."""

    #: whether the staged bytes are a copy (the live tensors may change after staging)
    copies: bool

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        """The items in the batches that are staged and written in turn."""
        ...

    def stage(self, flat: FlatTree, items: Sequence[WriteItem], ready: Ready | None = None) -> list[Staged]:
        """Bytes for ``items`` (one batch); CUDA boxes copied after the ``ready`` events."""
        ...


class ViewStager:
    """Synchronous saves: the writer reads the live tensors (no copy). Boxes
    on a CUDA device are copied into the process's pinned arena first, all
    at once on the copy stream (not one blocking copy into fresh pageable
    memory each)."""

    copies = False

    def __init__(self, pool: StagingPool = POOL) -> None:
        self.pool = pool

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        return [list(items)]

    def stage(self, flat: FlatTree, items: Sequence[WriteItem], ready: Ready | None = None) -> list[Staged]:
        on_device = [it for it in items if _on_device(flat, it)]
        if not on_device:
            return [Staged(it, as_host_bytes(source_view(flat.tensors[it.fqn], it.region, it.fqn))) for it in items]
        copied = {(s.item.fqn, s.item.region): s for s in self.pool.stage(flat, on_device, ready=ready)}
        return [copied.get((it.fqn, it.region))
                or Staged(it, as_host_bytes(source_view(flat.tensors[it.fqn], it.region, it.fqn))) for it in items]


def _on_device(flat: FlatTree, it: WriteItem) -> bool:
    leaf = flat.tensors[it.fqn]
    return any(sh.tensor.device.type == "cuda" for sh in leaf.shards)


class ArenaStager:
    """Asynchronous saves: copies into the process's reused arena, in batches
    of at most ``budget`` bytes (None: one batch), with ``threads`` copy
    threads, each box's crc32c computed on the way when ``checksums``."""

    copies = True

    def __init__(self, budget: int | None = None, pool: StagingPool = POOL, *, threads: int = 1,
                 checksums: bool = False, shared: Storage | None = None, files: int = 4) -> None:
        self.budget = budget
        self.pool = pool
        self.threads = threads
        self.checksums = checksums
        #: the storage whose lent arenas the boxes are copied into (None: the pool's own),
        #: at most ``files`` of them per stage (the save's ``io_threads``: data files replicated in parallel)
        self.shared, self.files = shared, files

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        return batches_within(items, self.budget)

    def stage(self, flat: FlatTree, items: Sequence[WriteItem], ready: Ready | None = None) -> list[Staged]:
        return self.pool.stage(flat, items, threads=self.threads, checksums=self.checksums, shared=self.shared,
                               files=self.files, ready=ready)

    def copy_ahead(self, checksums: bool = False) -> Ahead | None:
        """(an eager save, once the previous one is done) Guess the snapshot's
        copies and start them (:mod:`bytecp.saving.ahead`): into the pool's own
        arena only, in one batch."""
        if self.shared is not None or self.budget is not None:
            return None
        return self.pool.copy_ahead(self.checksums or checksums, self.threads)

    def snapshot(self, flat: FlatTree, items: Sequence[WriteItem], *, checksums: bool = False,
                 ready: Ready | None = None, queued: Queued | None = None,
                 ahead: Ahead | None = None, eager: bool = False) -> tuple[FlatTree, SnapshotStager]:
        """All of ``items`` copied at once (see :meth:`StagingPool.snapshot`),
        summed when this stager sums its copies or ``checksums`` asks to."""
        copy, copied = self.pool.snapshot(flat, items, threads=self.threads, checksums=self.checksums or checksums,
                                          shared=self.shared, files=self.files, ready=ready, queued=queued,
                                          ahead=ahead, eager=eager)
        return copy, SnapshotStager(copied)


class SnapshotStager:
    """Eager async saves, after the snapshot: the boxes were copied on the
    caller's thread; the write takes those copies (with any crc32c computed
    on the way). A planned box that is not one of them -- a piece of a
    copied box, when the plan was made after the copy -- is a view of the
    copied tree."""

    copies = False  # the tree it reads is the copy already

    def __init__(self, copied: Copied) -> None:
        self._copied: Copied | None = copied
        self._by_box: dict[tuple[str, Region], Staged] = {}
        #: the bytes copied
        self.nbytes = copied.nbytes

    @property
    def _staged(self) -> dict[tuple[str, Region], Staged]:
        """The copies by box, made at the first use (on the save's background thread)."""
        if self._copied is not None:
            self._by_box = {(s.item.fqn, s.item.region): s for s in self._copied.staged()}
            self._copied = None
        return self._by_box

    def checksums(self) -> dict[tuple[str, Region], int]:
        """crc32c of the copied boxes whose sum was computed during the copy."""
        return {k: s.sums.crc for k, s in self._staged.items() if s.sums is not None}

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        return [list(items)]

    def stage(self, flat: FlatTree, items: Sequence[WriteItem], ready: Ready | None = None) -> list[Staged]:
        copied = self._copied
        if copied is not None and len(items) == len(copied.items) and all(map(operator.is_, items, copied.items)):
            # the plan writes the very boxes copied (a plan cached, an incremental save's changed boxes): their
            # records as they are, no look-up by box (tens of thousands on a MoE rank, on the background thread)
            return copied.staged()
        out = []
        for it in items:
            s = self._staged.get((it.fqn, it.region))
            if s is not None and s.item.dtype == it.dtype:
                out.append(s.for_item(it))
            else:
                out.append(Staged(it, as_host_bytes(source_view(flat.tensors[it.fqn], it.region, it.fqn))))
        return out
