"""Neutral recorder: the core's only view of monitoring.

The core opens one :class:`Trace` per operation (save, load) on each rank and
records phase spans into it (``plan``, ``stage``, ``write``, ``commit``,
``wait_previous``, ``read``, ``apply``, ...), each with bytes and files. When
the operation ends the trace becomes a :class:`CheckpointReport` that is
handed to every registered :class:`Recorder`. Exporters (Prometheus, the gRPC
push client) live in ``bytecp.monitoring`` and register themselves here; the
core never imports them except through :func:`resolve_monitor`'s registry
(monitor kinds: :func:`register_monitor`).

The *stall* is first-class: the seconds the training loop was blocked by the
operation (the whole call for a synchronous save or load, the staging part
of an asynchronous one, waits for a previous save, lazy-mode waits in the
optimizer hook).

With no recorder registered, tracing is a few list appends per phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from bytecp.errors import ConfigError
from bytecp.plugins import MONITORS_GROUP, entry_point_targets

__all__ = [
    "Span",
    "CheckpointReport",
    "Recorder",
    "Trace",
    "add_recorder",
    "remove_recorder",
    "recorders",
    "recording",
    "emit_event",
    "resolve_monitor",
    "register_monitor",
    "MonitorFactory",
    "PHASES",
    "WAIT_PHASES",
    "OPERATION_STARTED",
    "STORAGE_RETRY",
]

log = logging.getLogger(__name__)

#: phases the core records; exporters may see others from newer versions
PHASES = (
    "wait_previous",
    "plan",
    "stage",
    "write",
    "serve",
    "commit",
    "read_metadata",
    "read",
    "apply",
    "lazy_wait",
)

#: phases that are time spent waiting for something other than this
#: checkpoint's own work on this rank; never named as a straggler's phase
WAIT_PHASES = frozenset({"wait_previous", "lazy_wait"})

#: event sent to every recorder when a :class:`Trace` opens, with labels
#: ``operation``, ``job``, ``rank``; the matching report closes it (in-flight gauges)
OPERATION_STARTED = "operation_started"


@dataclasses.dataclass
class Span:
    """One phase on one rank: wall-clock start, duration, bytes and files."""

    phase: str
    start: float
    duration: float
    nbytes: int = 0
    files: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CheckpointReport:
    """What one rank reports about one save or load when it ends."""

    operation: str  # "save" | "load"
    url: str
    checkpoint_id: str  # the save id (unique per save), or the url for loads
    rank: int
    world_size: int
    job: str
    step: int | None
    started: float
    ended: float
    stall_seconds: float
    spans: list[Span]
    ok: bool = True
    error: str | None = None
    nbytes: int = 0
    retries: int = 0

    @property
    def duration(self) -> float:
        return self.ended - self.started

    def phase_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.spans:
            out[s.phase] = out.get(s.phase, 0.0) + s.duration
        return out

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spans"] = [s.to_json() for s in self.spans]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CheckpointReport:
        d = dict(d)
        d["spans"] = [Span(**s) for s in d.get("spans", [])]
        return cls(**d)


@runtime_checkable
class Recorder(Protocol):
    """An exporter. Called from the thread that ends the operation; must not block."""

    def on_report(self, report: CheckpointReport) -> None: ...

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None: ...


_recorders: list[Recorder] = []
_lock = threading.Lock()


def add_recorder(recorder: Recorder) -> Recorder:
    with _lock:
        if recorder not in _recorders:
            _recorders.append(recorder)
    return recorder


def remove_recorder(recorder: Recorder) -> None:
    with _lock:
        if recorder in _recorders:
            _recorders.remove(recorder)


def recorders() -> list[Recorder]:
    with _lock:
        return list(_recorders)


class _Kept:
    """The recorder :func:`recording` adds: keeps every report it is sent."""

    def __init__(self) -> None:
        self.reports: list[CheckpointReport] = []

    def on_report(self, report: CheckpointReport) -> None:
        self.reports.append(report)

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        pass


@contextlib.contextmanager
def recording() -> Iterator[list[CheckpointReport]]:
    """``with recording() as reports:`` the reports of this process's saves and
    loads that end inside the block (an async save's once it completes), in
    order: bytes read and written, phase times. For scripts, benchmarks and
    tests that want one operation's figures without a monitoring backend."""
    kept = _Kept()
    add_recorder(kept)
    try:
        yield kept.reports
    finally:
        remove_recorder(kept)


#: event storage backends emit per retry; also counted into every open Trace
STORAGE_RETRY = "storage_retry"
#: event :class:`~bytecp.manager.CheckpointManager` emits when an asynchronous save
#: failed (label ``reason``: the error's type); training went on
SAVE_FAILED = "save_failed"
#: event every rank that saw it emits with a :class:`~bytecp.errors.CommittedWithErrorsWarning`
#: (label ``operation``: the step that broke after the commit); the checkpoint is complete
SAVE_COMMITTED_WITH_ERRORS = "save_committed_with_errors"
_open_traces: weakref.WeakSet[Trace] = weakref.WeakSet()  # a trace never finished is no leak


def emit_event(name: str, value: float = 1.0, **labels: str) -> None:
    """Count something that is not a span (a storage retry, a dropped report).

    A ``storage_retry`` is also added to ``retries`` of every operation open
    in this process (backends do not know which operation they serve; with
    one save or load at a time, the usual case, that is exact).
    """
    if name == STORAGE_RETRY and _open_traces:
        with _lock:
            for t in _open_traces:
                t.retries += int(value)
    for r in recorders():
        try:
            r.on_event(name, value, labels)
        except Exception:  # an exporter must never fail a checkpoint
            log.exception("bytecp recorder %r failed on event %s", r, name)


class Trace:
    """Spans of one operation on one rank; becomes a :class:`CheckpointReport`.

    Created by the core at the start of ``save``/``load``/``async_save``; the
    phases may run on background threads (spans are appended under a lock).
    """

    def __init__(
        self,
        operation: str,
        url: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        step: int | None = None,
        checkpoint_id: str | None = None,
        extra_recorders: list[Recorder] | None = None,
        started: float | None = None,
    ) -> None:
        """``started``: wall-clock start of the user's call (default: now), so
        the work before the trace existed counts in its duration as in its stall."""
        self.operation = operation
        self.url = url
        self.rank = rank
        self.world_size = world_size
        self.step = step
        self.checkpoint_id = checkpoint_id or url
        self.job = os.environ.get("BYTECP_JOB", os.environ.get("TORCHELASTIC_RUN_ID", "default"))
        self.started = time.time() if started is None else started
        self.spans: list[Span] = []
        self.stall_seconds = 0.0
        self.retries = 0
        self._extra = list(extra_recorders or [])
        self._lock = threading.Lock()
        self._finished: CheckpointReport | None = None
        with _lock:
            _open_traces.add(self)
        targets = self._targets()
        if targets:
            labels = {"operation": operation, "job": self.job, "rank": str(rank)}
            for r in targets:
                try:
                    r.on_event(OPERATION_STARTED, 1.0, labels)
                except Exception:
                    log.exception("bytecp recorder %r failed on event %s", r, OPERATION_STARTED)

    def _targets(self) -> list[Recorder]:
        """Global recorders plus this operation's own (``monitor=``), each once."""
        out = recorders()
        for r in self._extra:
            if r not in out:
                out.append(r)
        return out

    @contextlib.contextmanager
    def span(self, phase: str, nbytes: int = 0, files: int = 0) -> Iterator[Span]:
        """Time a phase; the yielded span's ``nbytes``/``files`` may be set inside."""
        start = time.time()
        t0 = time.perf_counter()
        s = Span(phase, start, 0.0, nbytes, files)
        try:
            yield s
        finally:
            s.duration = time.perf_counter() - t0
            with self._lock:
                self.spans.append(s)

    def add_span(self, phase: str, start: float, duration: float, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self.spans.append(Span(phase, start, duration, nbytes, files))

    def add_stall(self, seconds: float) -> None:
        with self._lock:
            self.stall_seconds += seconds

    @contextlib.contextmanager
    def failing(self, blocked_since: float | None = None) -> Iterator[None]:
        """Finish the trace as failed if the block raises, then re-raise.

        ``blocked_since`` (a ``perf_counter`` value): the caller was blocked
        from then on, so the time until the failure counts as stall.
        """
        try:
            yield
        except BaseException as e:
            if blocked_since is not None:
                self.add_stall(time.perf_counter() - blocked_since)
            self.finish(ok=False, error=e)
            raise

    def finish(self, ok: bool = True, error: BaseException | str | None = None) -> CheckpointReport:
        """End the trace once; hand the report to every recorder."""
        with _lock:
            _open_traces.discard(self)
        with self._lock:
            if self._finished is not None:
                return self._finished
            spans = sorted(self.spans, key=lambda s: s.start)
            nbytes = sum(s.nbytes for s in spans if s.phase in ("write", "read"))
            report = CheckpointReport(
                operation=self.operation,
                url=self.url,
                checkpoint_id=self.checkpoint_id,
                rank=self.rank,
                world_size=self.world_size,
                job=self.job,
                step=self.step,
                started=self.started,
                ended=time.time(),
                stall_seconds=self.stall_seconds,
                spans=spans,
                ok=ok,
                error=None if error is None else str(error),
                nbytes=nbytes,
                retries=self.retries,
            )
            self._finished = report
        for r in self._targets():
            try:
                r.on_report(report)
            except Exception:
                log.exception("bytecp recorder %r failed on a %s report", r, self.operation)
        return report


#: monitor kind -> ``"module:factory"`` or a factory; the factory takes the
#: address (what follows ``kind://``) and returns a :class:`Recorder`
MonitorFactory = Callable[[str], Recorder]
_MONITOR_FACTORIES: dict[str, str | MonitorFactory] = {
    "grpc": "bytecp.monitoring.push:PushRecorder",
}
_monitors_by_address: dict[str, Recorder] = {}
_monitors_discovered = False


def register_monitor(kind: str, factory: str | MonitorFactory) -> None:
    """Make ``monitor="kind://address"`` (and ``$BYTECP_MONITOR``) build a
    recorder with ``factory(address)`` (``"module:attr"`` is imported on first use).

    (any thread, before the save or load that names it) Registering a known
    kind replaces its factory for addresses not resolved yet. Installed
    packages may instead declare an entry point in the ``bytecp.monitors``
    group (see :mod:`bytecp.plugins`).
    """
    if not kind or "://" in kind or ":" in kind:
        raise ConfigError(f"monitor kind {kind!r} must be a plain name (as in 'kind://address')")
    with _lock:
        _MONITOR_FACTORIES[kind] = factory


def _monitor_factory(kind: str, monitor: str) -> MonitorFactory:
    """The factory of ``kind``; the first miss reads the ``bytecp.monitors``
    entry points (once per process)."""
    global _monitors_discovered
    with _lock:
        entry = _MONITOR_FACTORIES.get(kind)
        discover = entry is None and not _monitors_discovered
        _monitors_discovered = _monitors_discovered or discover
    if discover:
        found = entry_point_targets(MONITORS_GROUP)
        with _lock:
            for name, target in found.items():
                _MONITOR_FACTORIES.setdefault(name, target)
            entry = _MONITOR_FACTORIES.get(kind)
    if entry is None:
        with _lock:
            known = sorted(_MONITOR_FACTORIES)
        raise ConfigError(
            f"monitor={monitor!r}: unknown monitor kind {kind!r}; known: {known} "
            "(register one with bytecp.recorder.register_monitor or a 'bytecp.monitors' entry point)"
        )
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    factory: MonitorFactory = getattr(importlib.import_module(module), attr)
    return factory


def resolve_monitor(monitor: str | Recorder | None) -> Recorder | None:
    """Turn ``monitor=`` (or ``$BYTECP_MONITOR``) into a recorder.

    ``"host:port"`` (or ``"grpc://host:port"``) means: push reports to a
    ``bytecp monitor serve`` collector; ``"kind://address"`` builds the
    recorder of a registered kind (:func:`register_monitor`). One recorder
    per address per process is reused. ``None`` with no environment
    variable means none.
    """
    if monitor is None:
        monitor = os.environ.get("BYTECP_MONITOR") or None
    if monitor is None or not isinstance(monitor, str):
        return monitor
    kind, _, addr = monitor.partition("://") if "://" in monitor else ("grpc", "", monitor)
    with _lock:
        rec = _monitors_by_address.get(monitor)
    if rec is not None:
        return rec
    factory = _monitor_factory(kind, monitor)
    with _lock:
        rec = _monitors_by_address.get(monitor)
        if rec is None:
            rec = factory(addr)
            _monitors_by_address[monitor] = rec
    return rec
