"""``async_save``: training blocks only while this rank's data is staged.

Who runs what (every rank calls ``async_save`` at the same point):

caller's thread
  wait for the previous save (one in flight per process), detect the
  adapter, flatten the state (views), and -- unless ``lazy`` -- plan (on the
  checkpoint process group) and copy this rank's boxes into the reused
  staging arena; then return the :class:`SaveHandle`.
background thread
  (lazy: plan and stage first, while forward/backward run; a pre-step hook on
  each optimizer in ``state`` blocks only if staging is unfinished) write the
  data files, the index, and commit on the checkpoint process group, which is
  separate from training's so collectives never interleave.

A background failure is never lost: ``handle.wait()``/``result()`` raise it,
the next ``async_save``/``save`` raises it once, and it is logged.
"""

from __future__ import annotations

import atexit
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import engine
from . import format as fmt
from .adapter_api import detect_adapter
from .api import __version__, _check_json, _check_state, _recorders, _storage, _write_report
from .dist import DistContext
from .errors import BytecpError, ConfigError
from .recorder import Recorder, Trace
from .staging import POOL, batches_within
from .state import FlatTree, flatten_tree

__all__ = ["async_save", "SaveHandle", "wait_for_pending_save"]

log = logging.getLogger("bytecp")


class SaveHandle:
    """The state of one asynchronous save on this rank."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._staged = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._metadata: fmt.Metadata | None = None
        self._error_seen = False
        self.thread: threading.Thread | None = None
        #: lazy mode's optimizer pre-step hooks; no-ops once staged, removed
        #: from the caller's thread (wait(), the next save), never from inside
        #: optimizer.step(), which is iterating them
        self._hooks: list[Any] = []
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
        except Exception as e:  # noqa: BLE001 - a callback must not break the save's thread
            log.warning("bytecp: a done-callback of the async save to %s failed: %s", self.url, e)

    def _remove_hooks(self) -> None:
        if self._staged.is_set():
            for h in self._hooks:
                h.remove()
            self._hooks.clear()

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._done.is_set()

    def staged(self) -> bool:
        """Whether this rank's data has been copied (the state may change now)."""
        return self._staged.is_set()

    def wait(self, timeout: float | None = None) -> fmt.Metadata:
        """Block until committed; raise the save's error (from any rank)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.url} not finished after {timeout} s")
        self._remove_hooks()
        return self.result()

    def result(self) -> fmt.Metadata:
        if not self._done.is_set():
            raise BytecpError(f"async save to {self.url} is still running; call wait()")
        if self._error is not None:
            self._error_seen = True
            raise self._error
        assert self._metadata is not None
        return self._metadata

    def _finish(self, md: fmt.Metadata | None, error: BaseException | None) -> None:
        self._metadata, self._error = md, error
        self._staged.set()
        self._done.set()
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._run_callback(fn)


_inflight: SaveHandle | None = None
_inflight_lock = threading.Lock()
_groups: dict[Any, Any] = {}


def wait_for_pending_save(timeout: float | None = None) -> None:
    """Block until this process's in-flight async save (if any) has ended."""
    h = _inflight
    if h is not None:
        h._done.wait(timeout)


def _raise_previous(trace: Trace) -> None:
    """Wait for the previous save; raise its error once if nobody saw it."""
    global _inflight
    with _inflight_lock:
        prev = _inflight
    if prev is None:
        return
    with trace.span("wait_previous"):
        prev._done.wait()
    prev._remove_hooks()
    with _inflight_lock:
        if _inflight is prev:
            _inflight = None
    if prev._error is not None and not prev._error_seen:
        prev._error_seen = True
        raise BytecpError(f"the previous async save to {prev.url} failed: {prev._error}") from prev._error


def _checkpoint_group(process_group: Any) -> Any:
    """A gloo group over the same ranks, created once, for background collectives."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = id(process_group)
    if key not in _groups:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        _groups[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _groups[key]


def _optimizers(state: Any) -> list[torch.optim.Optimizer]:
    if isinstance(state, torch.optim.Optimizer):
        return [state]
    if isinstance(state, dict):
        return [o for v in state.values() for o in _optimizers(v)]
    if isinstance(state, (list, tuple)):
        return [o for v in state for o in _optimizers(v)]
    return []


def async_save(
    url: str,
    state: dict[str, Any],
    *,
    lazy: bool = False,
    memory_budget_bytes: int | None = None,
    framework: str | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    io_threads: int = 4,
    process_group: Any = None,
    coordinator_rank: int = 0,
    storage_options: dict[str, Any] | None = None,
    monitor: str | Recorder | None = None,
) -> SaveHandle:
    """Save ``state`` in the background; every rank calls it.

    Returns once this rank's data is staged in reused host memory (or at
    once with ``lazy=True``: then each optimizer in ``state`` waits in a
    pre-step hook until staging is done, so no tensor changes under the
    copy). ``memory_budget_bytes`` bounds the staging memory: larger states
    are staged and written in batches, and the call blocks until the last
    batch is staged.
    """
    global _inflight
    t0, wall0 = time.perf_counter(), time.time()
    _check_state(state)
    _check_json("metadata", metadata)
    if memory_budget_bytes is not None and memory_budget_bytes < 1:
        raise ConfigError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
    if lazy and memory_budget_bytes is not None:
        raise ConfigError("lazy=True stages in the background and takes no memory_budget_bytes")
    storage = _storage(url, storage_options)
    opts = engine.SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle, io_threads=io_threads)
    probe = DistContext(process_group, coordinator_rank)
    trace = Trace("save", storage.url, rank=probe.rank, world_size=probe.world_size, step=step,
                  extra_recorders=_recorders(monitor), started=wall0)
    handle = SaveHandle(storage.url)
    try:
        def describe() -> tuple[Any, FlatTree, dict[str, Any]]:
            _raise_previous(trace)
            adapter = detect_adapter(state, framework)
            with trace.span("plan"):
                flat = flatten_tree(adapter.save_tree(state, probe))
                parallelism = adapter.parallelism(state, probe)
                # objects are small: snapshot them now, tensors are staged below
                flat = FlatTree(flat.skeleton, flat.tensors, copy.deepcopy(flat.objects),
                                copy.deepcopy(flat.per_rank), {})
            return adapter, flat, parallelism

        # fail-together on training's group: every rank gets here or raises
        adapter, flat, parallelism = probe.run("save", describe)
        group = _checkpoint_group(process_group)
        ctx = DistContext(group, coordinator_rank) if group is not None else probe
        common = dict(framework=adapter.name, parallelism=parallelism, step=step,
                      user_metadata=dict(metadata or {}), trace=trace, bytecp_version=__version__)
        if lazy:
            run = _lazy(storage, flat, ctx, opts, trace, handle, _optimizers(state), common)
        else:
            run = _eager(storage, flat, ctx, opts, trace, handle, memory_budget_bytes, common)
    except BaseException as e:
        trace.add_stall(time.perf_counter() - t0)
        trace.finish(ok=False, error=e)
        raise
    with _inflight_lock:
        _inflight = handle

    def background() -> None:
        try:
            md = run()
        except BaseException as e:
            log.error("bytecp: async save to %s failed: %s", storage.url, e)
            trace.finish(ok=False, error=e)
            handle._finish(None, e)
            return
        report = trace.finish(ok=True)
        if opts.write_reports:
            _write_report(storage, report)
        handle._finish(md, None)

    handle.thread = threading.Thread(target=background, name="bytecp-async-save", daemon=True)
    handle.thread.start()
    trace.add_stall(time.perf_counter() - t0)
    return handle


def _stage(flat: FlatTree, items: list[Any], trace: Trace) -> list[Any]:
    """Copy ``items`` into the reused staging arena, as a ``stage`` span."""
    with trace.span("stage") as sp:
        staged = POOL.stage(flat, items)
        sp.nbytes = sum(len(s.data) for s in staged)
    return staged


def _eager(
    storage: Any, flat: FlatTree, ctx: DistContext, opts: engine.SaveOptions, trace: Trace,
    handle: SaveHandle, budget: int | None, common: dict[str, Any],
) -> Callable[[], fmt.Metadata]:
    prep = engine.prepare_save(storage, flat, ctx, opts, trace)
    batches = batches_within(prep.items, budget)

    def foreground() -> tuple[list[engine._RankOutput], list[Any]]:
        # every batch but the last is staged and written now: the arena is reused
        done: list[engine._RankOutput] = []
        for batch in batches[:-1]:
            staged = _stage(flat, batch, trace)
            done.append(engine.write_batch(storage, prep, ctx, flat, staged, opts, trace, done))
        return done, _stage(flat, batches[-1], trace)

    done, last = engine.run_or_clean_up(storage, ctx, prep, foreground)
    handle._staged.set()

    def write() -> engine._RankOutput:
        return engine.write_last_batch(storage, prep, ctx, flat, last, opts, trace, done)

    return lambda: engine.commit_save(storage, flat, ctx, prep, write, **common)


def _lazy(
    storage: Any, flat: FlatTree, ctx: DistContext, opts: engine.SaveOptions, trace: Trace,
    handle: SaveHandle, optimizers: list[torch.optim.Optimizer], common: dict[str, Any],
) -> Callable[[], fmt.Metadata]:
    def wait_staged(*_: Any) -> None:
        if not handle._staged.is_set():
            t = time.perf_counter()
            handle._staged.wait()
            waited = time.perf_counter() - t
            trace.add_stall(waited)
            trace.add_span("lazy_wait", time.time() - waited, waited)

    handle._hooks.extend(opt.register_step_pre_hook(wait_staged) for opt in optimizers)

    def run() -> fmt.Metadata:
        try:
            prep = engine.prepare_save(storage, flat, ctx, opts, trace)
            staged = engine.run_or_clean_up(storage, ctx, prep, lambda: _stage(flat, prep.items, trace))
        finally:
            handle._staged.set()

        def write() -> engine._RankOutput:
            return engine.write_last_batch(storage, prep, ctx, flat, staged, opts, trace)

        return engine.commit_save(storage, flat, ctx, prep, write, **common)

    return run


@atexit.register
def _drain() -> None:
    """Let an in-flight save finish before the interpreter tears threads down."""
    h = _inflight
    if h is not None and not h.done():
        log.warning("bytecp: waiting for the async save to %s before exit", h.url)
        h._done.wait()
