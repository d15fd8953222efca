"""Staging: how the boxes a rank writes become bytes that the writer can
take while training goes on.

The save pipeline's stage phase asks a :class:`Stager` (chosen by the API):

- :class:`ViewStager` (``bytecp.save``): no copy; views of the live tensors
  (a non-contiguous or device tensor is copied to a contiguous host tensor);
- :class:`ArenaStager` (``bytecp.async_save``, eager on the caller's thread,
  lazy on the save's background thread): the boxes are copied into one host
  arena that lives as long as the process, because on typical hosts a copy
  into freshly allocated memory runs several times slower than into a reused
  buffer (first-touch page faults). CUDA tensors are staged into pinned
  memory with non-blocking copies on a side stream, waited for before the
  stage returns. A memory budget splits the boxes into batches.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from .dtypes import dtype_from_name, host_memoryview
from .planner import WriteItem
from .state import FlatTree, Shard, TensorLeaf
from .writer import Staged, as_host_bytes, source_view

__all__ = ["Stager", "ViewStager", "ArenaStager", "StagingPool", "POOL", "batches_within"]

_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StagingPool:
    """One growing arena per process (one save is in flight at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arena: torch.Tensor | None = None
        self.allocations = 0  # how many times an arena was allocated (tests)

    def arena(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            a = self._arena
            if a is None or a.numel() < nbytes or (pinned and not a.is_pinned()):
                size = max(nbytes, int((a.numel() if a is not None else 0) * 1.25))
                self._arena = None
                a = torch.empty(size, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
                self._arena = a
                self.allocations += 1
            return a

    def release(self) -> None:
        with self._lock:
            self._arena = None

    def stage(self, flat: FlatTree, items: Sequence[WriteItem]) -> list[Staged]:
        """Copy the boxes ``items`` name into the arena; views of it come back."""
        return [Staged(it, host_memoryview(raw)) for it, _, raw in self._copy(flat, items)]

    def snapshot(self, flat: FlatTree, items: Sequence[WriteItem]) -> FlatTree:
        """Copy the boxes ``items`` name into the arena; the same tree comes
        back with its tensors replaced by those copies (host tensors), so the
        rest of a save can run on it while training changes the live ones."""
        tensors: dict[str, TensorLeaf] = {}
        for it, dst, _ in self._copy(flat, items):
            leaf = flat.tensors[it.fqn]
            tensors.setdefault(it.fqn, TensorLeaf(leaf.global_shape, leaf.dtype, [])).shards.append(
                Shard(it.region, dst))
        for fqn, leaf in flat.tensors.items():  # tensors this rank writes nothing of
            tensors.setdefault(fqn, TensorLeaf(leaf.global_shape, leaf.dtype, []))
        return dataclasses.replace(flat, tensors=tensors)

    def _copy(self, flat: FlatTree, items: Sequence[WriteItem]) -> list[tuple[WriteItem, torch.Tensor, torch.Tensor]]:
        """Copy each box into the arena: (item, typed view, raw bytes) each."""
        total = sum(_aligned(it.nbytes) for it in items)
        srcs = [source_view(flat.tensors[it.fqn], it.region, it.fqn) for it in items]
        devices = {s.device for s in srcs if s.device.type == "cuda"}
        if len(devices) > 1:
            raise ValueError(f"staging tensors of several CUDA devices at once: {sorted(map(str, devices))}")
        device = next(iter(devices), None)
        arena = self.arena(total, pinned=device is not None)
        # a side stream on the tensors' own device (a background thread's
        # current device is 0 whatever the rank's is)
        stream = torch.cuda.Stream(device=device) if device is not None else None
        out: list[tuple[WriteItem, torch.Tensor, torch.Tensor]] = []
        pos = 0
        ctx = torch.cuda.stream(stream) if stream is not None else None
        if ctx is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # type: ignore[union-attr]
            ctx.__enter__()
        try:
            for it, src in zip(items, srcs, strict=True):
                n = it.nbytes
                raw = arena[pos : pos + n]
                dst = raw.view(dtype_from_name(it.dtype)).view(it.region.lengths)
                if n:
                    dst.copy_(src, non_blocking=src.device.type == "cuda")
                out.append((it, dst, raw))
                pos += _aligned(n)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        if stream is not None:
            stream.synchronize()
        return out


POOL = StagingPool()


def batches_within(items: Sequence[WriteItem], budget: int | None) -> list[list[WriteItem]]:
    """Group items into batches of at most ``budget`` staged bytes (an item
    larger than the budget forms a batch of its own)."""
    if budget is None:
        return [list(items)]
    out: list[list[WriteItem]] = [[]]
    used = 0
    for it in items:
        n = _aligned(it.nbytes)
        if out[-1] and used + n > budget:
            out.append([])
            used = 0
        out[-1].append(it)
        used += n
    return out


class Stager(Protocol):
    """How the stage phase turns this rank's planned boxes into bytes to write."""

    #: whether the staged bytes are a copy (the live tensors may change after staging)
    copies: bool

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        """The items in the batches that are staged and written in turn."""
        ...

    def stage(self, flat: FlatTree, items: Sequence[WriteItem]) -> list[Staged]:
        """Bytes for ``items`` (one batch)."""
        ...


class ViewStager:
    """Synchronous saves: the writer reads the live tensors (no copy)."""

    copies = False

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        return [list(items)]

    def stage(self, flat: FlatTree, items: Sequence[WriteItem]) -> list[Staged]:
        return [Staged(it, as_host_bytes(source_view(flat.tensors[it.fqn], it.region, it.fqn))) for it in items]


class ArenaStager:
    """Asynchronous saves: copies into the process's reused arena, in batches
    of at most ``budget`` bytes (None: one batch)."""

    copies = True

    def __init__(self, budget: int | None = None, pool: StagingPool = POOL) -> None:
        self.budget = budget
        self.pool = pool

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        return batches_within(items, self.budget)

    def stage(self, flat: FlatTree, items: Sequence[WriteItem]) -> list[Staged]:
        return self.pool.stage(flat, items)
