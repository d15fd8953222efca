"""An eager save's copy started while the caller describes its state.

An eager ``bytecp.async_save`` blocks its caller for describing the state
and copying it into the staging arena, one after the other. When the
pool's kept placement (:class:`~bytecp.saving.arena.StagingPool`) was
reused whole by the previous eager save (its boxes, sources and arena
unchanged), the next save most likely copies exactly the same boxes into
exactly the same places again. :meth:`StagingPool.copy_ahead
<bytecp.saving.arena.StagingPool.copy_ahead>` then starts those copies on
the process's one helper thread (with the save's other copy threads; the
copies release the GIL) right after the save waited for the previous one,
while the caller describes the state; the caller then takes its share of
the copies left (:class:`~bytecp.saving.hostcopy.CopyRun`): the call costs
about the longer of the two, not their sum.

The copy is a guess, checked before anything uses it. The snapshot
(:meth:`StagingPool._copy <bytecp.saving.arena.StagingPool._copy>`) decides
first whether the description hits that very placement whole (the same
tensors, checked by the adapters, the same boxes, the same arena) with
the checksums the guess computes: then it helps finish the guess and takes
it; otherwise it stops the guess, waits for the copies in flight (their
bytes land in the arena) and copies as it would have. The pool tracks the
guess in flight, so nothing lays the arena out again, takes it for another
stage or lets it go before the guess ended, however the save that started
it ended (an error, an interrupt).

The guess reads the sources through views of its own (made at the first
guess of a placement), so a tensor given other memory since (``set_``,
``.data =``) is never read through its new, possibly smaller, storage --
the view still holds the old one; and before each guess every one of those
storages is checked to still hold the bytes the views read (a framework may
free a storage in place, ``resize_(0)``). The guess copies before the save
reads the tensors' version counters (a lazy save reads them first): in an
eager save the training thread is inside the call, so nothing changes the
tensors meanwhile.

Called by the eager order (:func:`bytecp.saving.schedule.eager`) through
:meth:`~bytecp.saving.pipeline.SavePipeline.describe` and
:meth:`~bytecp.saving.pipeline.SavePipeline.settle`; nothing else starts one.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
from typing import Any

import torch

from bytecp.format.checksum import Sums
from bytecp.saving.hostcopy import CopyPlan, work_on_threads
from bytecp.saving.own_threads import serial_torch
from bytecp.tree.pools import KeptPool

__all__ = ["Ahead", "guess_plan"]

#: the process's helper thread (kept: torch's intra-op threads of a new thread are set up at its first
#: parallel copy, not at every save)
_EXECUTOR = KeptPool(1, "bytecp-copy-ahead")


class Ahead:
    """One guessed copy: the placement it copies for (``placed``), the pool's
    copy of it taken for this stage (``now``, the arena's use acquired), and
    the run of ``plan`` (the placement's copies from the guess's own views of
    the sources) that the helper thread, ``threads`` copy threads in all with
    the caller, works on."""

    def __init__(self, placed: Any, now: Any, plan: CopyPlan, checksums: bool, threads: int) -> None:
        self.placed, self.now, self.checksums, self.threads = placed, now, checksums, threads
        self.run = plan.start(checksums=checksums, split=threads > 1)
        self._future: concurrent.futures.Future[None] | None = None
        self._taken: list[Sums | None] | None = None

    def start(self) -> None:
        """Hand the copies to the helper thread; return once it runs them (it
        needs the GIL to start, which the describing caller would otherwise
        hold for up to the interpreter's switch interval)."""
        started = threading.Event()

        def work() -> None:
            started.set()
            serial_torch()
            work_on_threads(self.run, max(1, self.threads - 1))

        try:
            self._future = _EXECUTOR.get().submit(work)
        except RuntimeError:  # the interpreter is shutting down: no guess
            self.run.stop()
            return
        started.wait()

    def take(self) -> list[Sums | None] | None:
        """(the snapshot, on a hit) Help with the copies left, wait for the
        helper: the checksums per host box, or None when a copy failed (the
        stage then copies again and meets any real error itself)."""
        if self._taken is None:
            self.run.work()
            self.end()
            if not self.run.complete:
                return None
            self._taken = self.run.result()
        return self._taken

    def end(self) -> None:
        """(a miss, a failed save, the pool before it uses the arena; any number
        of times) No copy is started any more; wait for those in flight."""
        self.run.stop()
        if self._future is not None:
            self._future.exception()  # (waits; the run keeps its own errors)


def guess_plan(placed: Any) -> CopyPlan | None:
    """(the pool, under its lock) A placement's host copies from the guess's
    own views of its sources (made at its first guess, kept in its ``guess``)
    when every storage they read still holds the bytes they read (a
    framework may have freed or shrunk one in place), else None."""
    if placed.guess is None:
        own = [placed.srcs[k].detach() for k in placed.host]  # (a ``set_`` of a live tensor leaves these be)
        need: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for s in own:
            st = s.untyped_storage()
            end = (s.storage_offset() + sum((n - 1) * d for n, d in zip(s.shape, s.stride(), strict=True))
                   + 1) * s.element_size() if s.numel() else 0
            got = need.get(st._cdata)
            need[st._cdata] = (st, max(int(end), got[1] if got is not None else 0))
        plan = CopyPlan([(placed.dsts[k], v) for k, v in zip(placed.host, own, strict=True)],
                        [placed.datas[k] for k in placed.host])
        placed.guess = plan, [st for st, _ in need.values()], [end for _, end in need.values()]
    plan, sts, ends = placed.guess
    ok = all(map(operator.ge, map(torch.UntypedStorage.nbytes, sts), ends))  # (no Python per storage)
    return plan if ok else None
