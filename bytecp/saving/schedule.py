"""The orders of a save, each written once as the sequence of its phases.

Picked by :mod:`bytecp.api` (every rank): ``bytecp.save`` runs
:func:`save_now` (through :func:`run_now`); ``bytecp.async_save`` runs :func:`start_async` with one of
the async orders, each a function that runs the caller's part of the save
and returns the part the background thread runs:

- :func:`eager` (the default): describe -> share (this rank's share of the
  cached plan, or every box it holds) -> snapshot (copy it) -> return;
  background: plan -> stage -> write -> commit;
- :func:`lazy` (``lazy=True``): describe -> return, each optimizer's
  pre-step hook waiting for the copy (until it is queued: device copies
  are waited for by the training stream, on the GPU); background: share ->
  snapshot -> plan -> stage -> write -> commit;
- :func:`budgeted` (``memory_budget_bytes``): describe -> plan -> stage
  (every batch but the last also written) -> return; background: write ->
  commit.

Both snapshot orders copy before the plan, so the copy never waits for the
other ranks; it copies this rank's share of the last committed plan when
its state is unchanged since (see
:meth:`~bytecp.saving.pipeline.SavePipeline.share`). The phases are
those of :class:`~bytecp.saving.pipeline.SavePipeline`; what one hands the
next is a frozen value (:mod:`bytecp.saving.results`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

from bytecp.format import metadata as fmt
from bytecp.options import SaveOptions
from bytecp.saving import leases
from bytecp.saving.handles import GcPause, SaveHandle, retire_group
from bytecp.saving.pipeline import SavePipeline
from bytecp.saving.staging import ArenaStager
from bytecp.storage_api import Storage
from bytecp.tree.bulk import gc_paused, heap_frozen

__all__ = [
    "save_now", "eager", "lazy", "budgeted", "Order", "order_for", "async_stager", "run_now", "start_async",
]

#: an async order: runs the caller's part, returns the background thread's part
Order = Callable[[SavePipeline, SaveHandle], Callable[[], fmt.Metadata]]


def save_now(p: SavePipeline) -> fmt.Metadata:
    """``bytecp.save``: every phase on the caller's thread."""
    described = p.describe()
    planned = p.plan(described)
    staged = p.stage(described, planned)
    written = p.write(described, planned, staged)
    return p.commit(described, planned, written)


def eager(p: SavePipeline, handle: SaveHandle) -> Callable[[], fmt.Metadata]:
    """The caller waits for the copy; the plan, the write and the commit
    run on the copy in the background. The copy of a state unchanged since
    the previous save starts while the state is described (:mod:`bytecp.saving.ahead`)."""
    try:
        described = p.describe(ahead=True)
        copied = p.snapshot(described, p.share(described), eager=True)
    finally:
        p.settle()
    handle.mark_staged()

    def background() -> fmt.Metadata:
        planned = p.plan(copied)
        staged = p.stage(copied, planned)
        written = p.write(copied, planned, staged)
        return p.commit(copied, planned, written)

    return background


def lazy(p: SavePipeline, handle: SaveHandle) -> Callable[[], fmt.Metadata]:
    """The caller waits for nothing: the background copies first, and each
    optimizer's ``step()`` waits in a pre-step hook until it has."""
    described = p.describe()
    handle.block_optimizers_until_staged(p.trace)

    def background() -> fmt.Metadata:
        try:
            copied = p.snapshot(described, p.share(described), queued=handle.mark_queued)
        finally:
            handle.mark_staged()
        planned = p.plan(copied)
        staged = p.stage(copied, planned)
        written = p.write(copied, planned, staged)
        return p.commit(copied, planned, written)

    return background


def budgeted(p: SavePipeline, handle: SaveHandle) -> Callable[[], fmt.Metadata]:
    """With a memory budget the caller also waits for the plan and for the
    batches written before the last one (each reuses the arena)."""
    described = p.describe()
    planned = p.plan(described)
    staged = p.stage(described, planned)
    handle.mark_staged()

    def background() -> fmt.Metadata:
        written = p.write(described, planned, staged)
        return p.commit(described, planned, written)

    return background


def order_for(opts: SaveOptions) -> Order:
    """The async order ``opts`` asks for (a lazy save takes no budget)."""
    if opts.lazy:
        return lazy
    return eager if opts.memory_budget_bytes is None else budgeted


def async_stager(opts: SaveOptions, storage: Storage | None = None) -> ArenaStager:
    """The arena stager of an async save: an eager copy with ``staging_threads``
    threads (default: torch's intra-op threads, the caller waits anyway); a
    lazy one with one thread beside forward/backward, checksums summed on
    the way. Into arenas ``storage`` lends when it does (``keeper://``):
    then the storage's process sums them, not this one."""
    threads = opts.staging_threads or (1 if opts.lazy else min(8, torch.get_num_threads()))
    shared = storage if storage is not None and storage.lends_arenas else None
    return ArenaStager(opts.memory_budget_bytes, threads=threads, checksums=opts.lazy and shared is None,
                       shared=shared, files=opts.io_threads)


@contextlib.contextmanager
def _leases_given_up_on_failure(p: SavePipeline) -> Iterator[None]:
    """A failed save removes what it wrote (every rank its own; the space is
    back when the error is raised) and leaves no lease of its own renewing,
    whichever phase failed. Files it cannot remove are named on the error,
    with the command that removes them later."""
    try:
        yield
    except BaseException as e:
        try:
            left = [] if _keep_for_silent_coordinator(e, p) else p.remove_written()
        except Exception as cleanup:  # never hide the save's own error
            left = [f"data/{p.trace.checkpoint_id}/"]
            e.add_note(f"bytecp: removing the failed save's files failed too: {cleanup}")
        if _broke_a_collective(e):
            retire_group(p.opts.process_group)
        if left:
            e.add_note(f"bytecp: {len(left)} file(s) of this failed save remain at {p.storage.url} "
                       f"({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}); `bytecp gc {p.storage.url}` "
                       f"removes them once the storage is writable and the save's lease term "
                       f"({leases.lease_seconds():g} s) has passed")
        leases.give_up_at(p.storage.url)
        raise


def _keep_for_silent_coordinator(e: BaseException, p: SavePipeline) -> bool:
    """(a rank other than the coordinator, its save failed) Whether the
    coordinator is one of the ranks that did not reach the step: stopped
    between its last check of the deadline and its write of metadata.json,
    it may still commit once it continues, so this rank's data files stay
    (found by the chaos run: removed, they left a committed checkpoint
    without them). If it never commits, retention's sweep or ``bytecp gc``
    removes them after the save's lease."""
    ctx = p.ctx
    if ctx.is_coordinator or not _broke_a_collective(e):
        return False
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if ctx.coordinator in (getattr(err, "failures", None) or {}):
            e.add_note(f"bytecp: rank {ctx.rank} keeps its data files at {p.storage.url}: the coordinator "
                       "did not answer and may still commit them (if it does not, retention or "
                       "`bytecp gc` removes them after the save's lease)")
            return True
        err = err.__cause__ or err.__context__
    return False


def _broke_a_collective(e: BaseException) -> bool:
    """Whether ``e`` (or an error it came from) is a collective that broke: a
    rank missed the deadline or died, and the group may be out of step."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:  # (a chain may loop)
        if getattr(e, "broken_group", False):
            return True
        seen.add(id(e))
        e = e.__cause__  # type: ignore[assignment]
    return False


def run_now(p: SavePipeline, *, blocked_since: float) -> fmt.Metadata:
    """Run :func:`save_now`, then the report; the caller is blocked throughout,
    with no cyclic garbage collection until the save is done (describing,
    planning and writing tens of thousands of tensors makes enough objects to
    start collections of the whole heap: a 20,120-tensor save 1.4 s with
    them, 0.9 s paused; the loads pause it alike)."""
    with p.trace.failing(blocked_since=blocked_since), _leases_given_up_on_failure(p), gc_paused():
        md = save_now(p)
    p.trace.add_stall(time.perf_counter() - blocked_since)
    p.report()
    return md


def start_async(order: Order, p: SavePipeline, *, blocked_since: float) -> SaveHandle:
    """Run ``order``'s caller part now (no cyclic garbage collection
    meanwhile), its background part on the handle's thread, then the report.

    The background thread waits until the caller is about to return: it
    would otherwise take the GIL (and the collection the pause put off, which
    it resumes) while the caller still has its last lines to run."""
    handle = SaveHandle(p.storage.url)
    go = threading.Event()
    paused = GcPause()

    def run() -> fmt.Metadata:
        go.wait()
        with heap_frozen():  # (its collections pass over the training process's objects: bulk.heap_frozen)
            paused.end()
            with p.trace.failing(), _leases_given_up_on_failure(p):
                md = background()
        p.report()
        return md

    try:
        with p.trace.failing(blocked_since=blocked_since):
            background = order(p, handle)
        handle.start(run, nice=p.opts.background_nice)
    except BaseException:
        paused.end()
        raise
    try:
        p.trace.add_stall(time.perf_counter() - blocked_since)
    finally:
        go.set()
    return handle
