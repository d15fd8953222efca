"""An eager save's copy started while the caller describes its state.

An eager ``bytecp.async_save`` blocks its caller for describing the state
and copying it into the staging arena, one after the other. When the
pool's kept placement (:class:`~bytecp.saving.arena.StagingPool`) was
reused whole by the previous save (its boxes, sources and arena unchanged),
the next save most likely copies exactly the same boxes into exactly the
same places again. :meth:`StagingPool.copy_ahead
<bytecp.saving.arena.StagingPool.copy_ahead>` then starts those copies on
the process's one helper thread (:func:`start`; the copies release the GIL)
right after the save waited for the previous one, while the caller
describes the state; the caller then takes its share of the copies left
(:class:`~bytecp.saving.hostcopy.CopyRun`): the call costs about the
longer of the two, not their sum.

The copy is a guess, checked before anything uses it: the snapshot
(:meth:`StagingPool._copy <bytecp.saving.arena.StagingPool._copy>`) always
waits for it first (its bytes land in the arena), and takes it only when
the description hits that very placement whole (the same tensors, checked by
the adapters, the same boxes, the same arena) and the checksums asked for
are those computed; otherwise it copies as it would have (the guess cost
one copy beside the description, in the arena the stage lays out again).
The sources the guess reads are views of the tensors of the previous save,
held by the placement, so their memory is there; before starting it, each
of their storages is checked to still hold the bytes the views read (a
framework may free a parameter's storage in place, e.g. ``resize_(0)``).
In an eager save the training thread is inside the call, so nothing changes
the tensors between the guess and the description.

Called by the eager order (:func:`bytecp.saving.schedule.eager`) through
:meth:`~bytecp.saving.pipeline.SavePipeline.describe` and
:meth:`~bytecp.saving.pipeline.SavePipeline.settle`; nothing else starts one.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

from bytecp.format.checksum import Sums
from bytecp.saving.hostcopy import CopyRun

__all__ = ["Ahead", "start"]

_EXECUTOR: list[concurrent.futures.ThreadPoolExecutor] = []
_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's helper thread (kept: torch's intra-op threads of a new
    thread are set up at its first parallel copy, not at every save)."""
    with _LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bytecp-copy-ahead"))
        return _EXECUTOR[0]


def _forget() -> None:  # a forked child has the executor object but not its thread
    global _LOCK
    _LOCK = threading.Lock()
    _EXECUTOR.clear()


os.register_at_fork(after_in_child=_forget)


class Ahead:
    """One guessed copy: the placement it copies for (``placed``), the pool's
    copy of it taken for this stage (``now``, the arena's use acquired), and
    the run of its copies (``run``) the helper thread works on."""

    def __init__(self, placed: Any, now: Any, checksums: bool, run: CopyRun,
                 future: concurrent.futures.Future[None]) -> None:
        self.placed, self.now, self.checksums, self.run = placed, now, checksums, run
        self._future = future

    def join(self) -> list[Sums | None] | None:
        """(the snapshot, or the order when the save failed before it; any
        number of times) Help with the copies left, then wait for the helper:
        the checksums per host box, or None when a copy failed (the stage
        then copies again and meets any real error itself)."""
        self.run.work()
        self._future.result()
        try:
            return self.run.result()
        except Exception:
            return None


def start(placed: Any, now: Any, checksums: bool) -> Ahead:
    """Start ``now``'s copies (checksummed when ``checksums``) on the helper
    thread; the caller joins them once it described its state (:meth:`Ahead.join`).
    Returns once the helper runs (it needs the GIL to start, which the
    describing caller would otherwise hold for up to the interpreter's switch interval)."""
    run = now.copies.start(checksums=checksums)
    started = threading.Event()

    def work() -> None:
        started.set()
        run.work()

    future = _executor().submit(work)
    started.wait()
    return Ahead(placed, now, checksums, run, future)
