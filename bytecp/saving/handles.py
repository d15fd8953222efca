"""Saves in flight: the handle ``async_save`` returns, the one-save-in-flight
rule, the background thread and the checkpoint process group.

Used by :mod:`bytecp.saving.schedule` (an async order starts a handle's background
thread; every save first waits for the previous one) and by the save
pipeline's describe phase (:func:`wait_for_previous`). A background failure
is never lost: ``handle.wait()``/``result()`` raise it, the next save raises
it once, and it is logged.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

import bytecp.dist_raw  # noqa: F401  (its exit hook runs after the drain below)
from bytecp.dist_raw import retire_side_group, side_group
from bytecp.errors import BytecpError
from bytecp.format import metadata as fmt
from bytecp.recorder import Trace
from bytecp.saving.own_threads import serial_torch
from bytecp.tree.bulk import pause_gc, resume_gc

__all__ = [
    "SaveHandle", "wait_for_pending_save", "wait_for_previous", "checkpoint_group", "retire_group",
    "pending_save",
    "GcPause",
]

log = logging.getLogger("bytecp")


class SaveHandle:
    """The state of one asynchronous save on this rank."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._staged = threading.Event()
        #: a lazy save's copies are queued (device copies: ``_device_events`` say when they end)
        self._queued = threading.Event()
        self._device_events: dict[int, Any] = {}
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._metadata: fmt.Metadata | None = None
        self._error_seen = False
        self.thread: threading.Thread | None = None
        #: lazy mode: what any optimizer's step does first while this save's copies are not queued
        self._before_step: Callable[..., None] | None = None
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._callbacks_lock = threading.Lock()

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save has committed or failed.

        Runs on the background thread that ran the save (off the training
        thread), or at once on the caller's thread if the save has ended
        already. Exceptions from ``fn`` are logged, never raised.
        (CheckpointManager applies retention this way.)
        """
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def exception(self) -> BaseException | None:
        """The save's error once it has ended (None: committed or still running);
        unlike :meth:`result`, this does not count as the error being seen."""
        return self._error if self._done.is_set() else None

    def _run_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        try:
            fn(self)
        except Exception as e:  # a callback must not break the save's thread
            log.warning("bytecp: a done-callback of the async save to %s failed: %s", self.url, e)

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._done.is_set()

    def wait_done(self) -> None:
        """Block until the save has committed or failed, raising nothing
        (the manager, before its next save, to report a failure itself)."""
        self._done.wait()

    def staged(self) -> bool:
        """Whether this rank's data has been copied (the state may change now)."""
        return self._staged.is_set()

    def wait(self, timeout: float | None = None) -> fmt.Metadata:
        """Block until committed; raise the save's error (from any rank)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.url} not finished after {timeout} s")
        self._unwatch_if_staged()
        return self.result()

    def result(self) -> fmt.Metadata:
        if not self._done.is_set():
            raise BytecpError(f"async save to {self.url} is still running; call wait()")
        if self._error is not None:
            self._error_seen = True
            raise self._error
        assert self._metadata is not None
        return self._metadata

    # -- used by the API and the pipeline ------------------------------------
    def mark_staged(self) -> None:
        self._queued.set()
        self._staged.set()

    def mark_queued(self, events: Mapping[int, Any]) -> None:
        """(the save's thread) Every copy is queued and the host copies are
        done; device copies end with ``events`` (device index -> CUDA event)."""
        self._device_events = dict(events)
        self._queued.set()

    def block_optimizers_until_staged(self, trace: Trace) -> None:
        """Lazy mode: every torch optimizer's ``step()`` in this process waits
        until this rank's copies are queued; device copies are then waited
        for on the GPU (the training stream waits for their events), not by
        the host. One process-wide pre-step hook does it
        (``register_optimizer_step_pre_hook``): the state's own optimizers,
        those inside wrappers (a DeepSpeed engine's, Megatron's chained
        ones) and one rebuilt over the same parameters right after the call
        (layers unfrozen) alike."""

        def wait_staged(*_: Any) -> None:
            if not self._queued.is_set():
                t = time.perf_counter()
                self._queued.wait()
                waited = time.perf_counter() - t
                trace.add_stall(waited)
                trace.add_span("lazy_wait", time.time() - waited, waited)
            if self._device_events and not self._staged.is_set():
                for index, ev in self._device_events.items():
                    torch.cuda.current_stream(index).wait_event(ev)

        self._before_step = wait_staged
        _watch_every_optimizer(self)

    def start(self, run: Callable[[], fmt.Metadata], nice: int = 0) -> None:
        """Run ``run`` (the rest of the save) on the background thread of
        ``nice`` (:class:`_Worker`: ``nice`` steps below the caller's
        scheduling priority, and the threads it starts with it); this handle
        becomes the one in flight."""
        global _inflight

        def background() -> None:
            try:
                md = run()
            except BaseException as e:
                log.error("bytecp: async save to %s failed: %s", self.url, e)
                self._finish(None, e)
                return
            self._finish(md, None)

        with _inflight_lock:
            _inflight = self
        self.thread = _worker(nice).submit(background)

    def _unwatch_if_staged(self) -> None:
        """(the caller's thread: wait(), the next save) Its copies are done: the
        process-wide hook forgets it."""
        if self._staged.is_set():
            _unwatch(self)

    def _finish(self, md: fmt.Metadata | None, error: BaseException | None) -> None:
        self._metadata, self._error = md, error
        self._queued.set()
        self._staged.set()
        self._done.set()
        _unwatch(self)
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._run_callback(fn)


#: lazy saves whose copies any optimizer's step of this process waits for (see
#: :meth:`SaveHandle.block_optimizers_until_staged`); the one process-wide hook reads it
_WATCHED: list[SaveHandle] = []
_WATCHED_LOCK = threading.Lock()
_GLOBAL_HOOK: list[Any] = []


def _watch_every_optimizer(handle: SaveHandle) -> None:
    """(the lazy call) ``handle``'s copies are waited for by every torch optimizer's step from now on."""
    with _WATCHED_LOCK:
        _WATCHED.append(handle)
        if not _GLOBAL_HOOK:  # once per process, never removed: a look at an empty list per step
            _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_before_any_step))


def _unwatch(handle: SaveHandle) -> None:
    with _WATCHED_LOCK:
        if handle in _WATCHED:
            _WATCHED.remove(handle)


def _before_any_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """(torch, before every optimizer's step, on the training thread) Wait for
    the lazy saves in flight; a save done with its copies is forgotten (from
    this list: torch's hooks are not touched while it iterates them)."""
    if not _WATCHED:
        return
    with _WATCHED_LOCK:
        pending = list(_WATCHED)
    for h in pending:
        if h._before_step is not None:
            h._before_step()
        if h._staged.is_set():
            _unwatch(h)


def _forget_watched() -> None:  # a forked child runs none of its parent's saves
    global _WATCHED_LOCK
    _WATCHED_LOCK = threading.Lock()
    _WATCHED.clear()


os.register_at_fork(after_in_child=_forget_watched)


class _Worker:
    """The thread that runs the background part of async saves, one after
    the other (one save is in flight at a time), at one nice level.

    Started by the first save and kept for the next: a thread started for
    each save made every async call wait until the OS first ran it
    (milliseconds on a loaded host, in a lazy call that otherwise costs as
    much). Each save runs in a fresh ``contextvars`` context, as on a new
    thread. Ended at interpreter exit by :func:`_drain`; a forked child
    starts its own."""

    def __init__(self, nice: int) -> None:
        self.nice = nice
        self.thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> threading.Thread:
        """Queue ``job`` (the caller does not wait for the thread to run); -> the thread."""
        with self._lock:
            if self.thread is None or not self.thread.is_alive():
                self._jobs = queue.SimpleQueue()
                self.thread = threading.Thread(target=self._run, args=(self._jobs,), name="bytecp-async-save",
                                               daemon=True)
                self.thread.start()
            self._jobs.put(job)
            return self.thread

    def _run(self, jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        _lower_priority(self.nice)
        serial_torch()
        while True:
            job = jobs.get()
            if job is None:
                return
            contextvars.Context().run(job)  # (never raises: a save's error goes to its handle)
            del job  # (the save's state is not held while the thread waits for the next)

    def stop(self) -> threading.Thread | None:
        """(at exit) Let the thread end once its queued saves are done; -> the thread to join."""
        with self._lock:
            t = self.thread
            if t is not None and t.is_alive():
                self._jobs.put(None)
                return t
        return None


_workers: dict[int, _Worker] = {}
_workers_lock = threading.Lock()


def _worker(nice: int) -> _Worker:
    with _workers_lock:
        w = _workers.get(nice)
        if w is None:
            w = _workers[nice] = _Worker(nice)
        return w


def _forget_workers() -> None:
    """(a forked child) The parent's threads are not here: the child starts its own."""
    global _workers_lock
    _workers_lock = threading.Lock()
    _workers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _lower_priority(nice: int) -> None:
    """(a save's background thread) Raise this thread's nice value by ``nice``
    (Linux: per thread), so its copies, checksums and writes take the cores
    only when training leaves them idle. Never fails a save."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # pragma: no cover - a sandbox refusing it
        log.debug("bytecp: could not lower the background save's priority: %s", e)


_inflight: SaveHandle | None = None
_inflight_lock = threading.Lock()


def pending_save() -> SaveHandle | None:
    """This process's save in flight (or the last one, until the next save waited for it)."""
    return _inflight


def wait_for_pending_save(timeout: float | None = None) -> None:
    """Block until this process's in-flight async save (if any) has ended."""
    h = _inflight
    if h is not None:
        h._done.wait(timeout)


def wait_for_previous(trace: Trace) -> None:
    """(every rank, first thing of every save) Wait for the previous save;
    raise its error once if nobody saw it."""
    global _inflight
    with _inflight_lock:
        prev = _inflight
    if prev is None:
        return
    with trace.span("wait_previous"):
        prev._done.wait()
    prev._unwatch_if_staged()
    with _inflight_lock:
        if _inflight is prev:
            _inflight = None
    if prev._error is not None and not prev._error_seen:
        prev._error_seen = True
        raise BytecpError(f"the previous async save to {prev.url} failed: {prev._error}") from prev._error


class GcPause:
    """(the caller's thread, while an async save blocks it) No cyclic garbage
    collection meanwhile: describing and copying a state of thousands of
    tensors allocates enough objects to start collections of the training
    process's whole heap (8,000 tensors: 0.54-0.61 s per call paused, against
    0.74-0.80 s). :meth:`end` turns the collector on again (if it was on):
    the save's background thread calls it first thing, so the collection of
    what the call allocated runs there, not in the call; a call that fails
    calls it itself. Nothing is lost; ending twice is harmless."""

    def __init__(self) -> None:
        self._ended = False
        pause_gc()  # (nested with the pauses of other threads: bytecp.tree.bulk)

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        resume_gc()


def checkpoint_group(process_group: Any) -> Any:
    """(every rank, collectively the first time) A gloo group over the same
    ranks, created once (again after an in-process restart of
    torch.distributed: :func:`bytecp.dist_raw.side_group`), for the
    collectives of background saves: they never interleave with training's
    collectives. None without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return side_group("saves", process_group)


def retire_group(process_group: Any) -> None:
    """(every rank, a save whose collective broke: a rank missed the deadline
    or died) Never use the checkpoint group again
    (:func:`bytecp.dist_raw.retire_side_group`); the next save makes a new
    one (every rank calls it then, the late rank too once it is back)."""
    retire_side_group("saves", process_group)


def _drain() -> None:
    """(the main thread, at interpreter exit) Let the in-flight save finish and
    its thread end (done-callbacks such as the manager's retention included)
    before the interpreter finalizes.

    Runs from ``threading._shutdown``, before ``concurrent.futures`` refuses
    new work (the save still needs its writer pools) and before any
    ``atexit`` handler. A daemon thread still running once finalization has
    begun is ended by ``pthread_exit`` the next time it takes the GIL; the
    forced unwind through the C++ frames of torch or pyarrow then calls
    ``std::terminate`` (*terminate called without an active exception*,
    SIGABRT) although every checkpoint committed. Interrupted (Ctrl-C) while
    waiting, the save is abandoned with a message: the process ends at once
    and the files of the uncommitted save are removed by the next save to
    that URL or by ``bytecp gc``.
    """
    h = _inflight
    if h is not None and not h.done() and h.thread is not None and h.thread.is_alive():
        log.warning("bytecp: waiting for the async save to %s before exit", h.url)
    with _workers_lock:
        threads = [t for w in _workers.values() if (t := w.stop()) is not None]
    try:
        for t in threads:  # each ends once its save (and the save's done-callbacks) has
            if t is not threading.current_thread():
                t.join()
    except KeyboardInterrupt:
        url = h.url if h is not None else "?"
        log.error("bytecp: the async save to %s was abandoned at exit; it never committed, and the next "
                  "save to it or `bytecp gc` removes its files", url)
        logging.shutdown()
        os._exit(130)


def _register_drain() -> None:
    """Run :func:`_drain` first thing at interpreter exit: in threading's own
    exit hooks (they run in reverse order of registration, so after this one
    registers, ``concurrent.futures``'s hook, imported first, runs after it),
    or as an ``atexit`` handler where that hook does not exist."""
    import concurrent.futures.thread  # noqa: F401  (registers its exit hook first)

    import bytecp.saving.leases  # noqa: F401  (and its own: the in-flight save's lease ends after it)

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        atexit.register(_drain)
    else:
        register(_drain)


_register_drain()
