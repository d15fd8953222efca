"""Per-process Prometheus metrics: a :class:`~bytecp.recorder.Recorder`.

Who calls what, and when:

1. The training script (every rank) calls :func:`enable_prometheus` once,
   optionally with a port: it registers a :class:`PrometheusRecorder` with
   the core and, if asked, serves ``/metrics`` from this process (opt-in;
   binds 127.0.0.1 unless told otherwise).
2. The core's :class:`~bytecp.recorder.Trace` sends ``operation_started``
   when a save or load opens (in-flight gauge up) and
   :meth:`PrometheusRecorder.on_report` when it ends, on the thread that
   ends it; storage backends send ``storage_retry`` events as they retry.

Tests build a recorder on a fresh ``CollectorRegistry`` and read values
back with ``registry.get_sample_value``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from bytecp.plugins import missing_extra

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

from bytecp.recorder import OPERATION_STARTED, STORAGE_RETRY, CheckpointReport, add_recorder

__all__ = ["PrometheusRecorder", "enable_prometheus", "PROCESS_METRICS", "FOLLOWER_EVENTS", "SECONDS_BUCKETS"]

#: seconds buckets from 10 ms to ~17 min: stalls are short, slow saves are long
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1000)

#: every metric family a process exports (names as scraped, counters with _total)
PROCESS_METRICS = (
    "bytecp_stall_seconds",
    "bytecp_phase_seconds",
    "bytecp_phase_bytes_total",
    "bytecp_operation_seconds",
    "bytecp_operations_total",
    "bytecp_failures_total",
    "bytecp_retries_total",
    "bytecp_storage_retries_total",
    "bytecp_bytes_total",
    "bytecp_throughput_bytes_per_second",
    "bytecp_operations_in_flight",
    "bytecp_monitor_reports_dropped_total",
    "bytecp_follower_lag_steps",
    "bytecp_follower_lag_seconds",
    "bytecp_follower_update_bytes",
)
#: events ``bytecp.follow`` sends after each update (bytecp.serving.follow): name -> gauge family
FOLLOWER_EVENTS = {"follower_lag_steps": "bytecp_follower_lag_steps",
                   "follower_lag_seconds": "bytecp_follower_lag_seconds",
                   "follower_update_bytes": "bytecp_follower_update_bytes"}

_BASE = ("job", "rank", "operation")


class PrometheusRecorder:
    """Turns reports and events into this process's metrics.

    Labels: ``job``, ``rank``, ``operation`` (``save``/``load``) and, on
    phase metrics, ``phase``. Events without a rank or job (storage retries)
    take them from ``rank``/``job`` given here, else ``$RANK`` / ``$BYTECP_JOB``.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        job: str | None = None,
        rank: int | None = None,
    ) -> None:
        reg = REGISTRY if registry is None else registry
        self.registry = reg
        self.job = job or os.environ.get("BYTECP_JOB", os.environ.get("TORCHELASTIC_RUN_ID", "default"))
        self.rank = str(rank if rank is not None else os.environ.get("RANK", "0"))
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str, str], int] = {}
        #: the port ``/metrics`` is served on by :func:`enable_prometheus`, if any
        self.http_port: int | None = None
        self.http_server: Any = None
        kw: dict[str, Any] = {"registry": reg}
        self.stall = Histogram(
            "bytecp_stall_seconds",
            "Seconds the training loop was blocked by a checkpoint call (per operation)",
            _BASE, buckets=SECONDS_BUCKETS, **kw,
        )
        self.phase = Histogram(
            "bytecp_phase_seconds",
            "Seconds spent in each checkpoint phase (per operation)",
            (*_BASE, "phase"), buckets=SECONDS_BUCKETS, **kw,
        )
        self.phase_bytes = Counter(
            "bytecp_phase_bytes", "Bytes handled in each phase", (*_BASE, "phase"), **kw
        )
        self.duration = Histogram(
            "bytecp_operation_seconds",
            "Wall-clock seconds from the call to the end of the operation (async saves included)",
            _BASE, buckets=SECONDS_BUCKETS, **kw,
        )
        self.operations = Counter("bytecp_operations", "Saves and loads that ended", _BASE, **kw)
        self.failures = Counter("bytecp_failures", "Saves and loads that failed", _BASE, **kw)
        self.retries = Counter(
            "bytecp_retries", "Storage retries counted by the core per operation", _BASE, **kw
        )
        self.storage_retries = Counter(
            "bytecp_storage_retries",
            "Storage retries as the backends report them, by backend and reason",
            ("job", "rank", "backend", "reason"), **kw,
        )
        self.nbytes = Counter("bytecp_bytes", "Bytes written by saves, read by loads", _BASE, **kw)
        self.throughput = Gauge(
            "bytecp_throughput_bytes_per_second",
            "Bytes per second of the last operation (its write or read bytes over its duration)",
            _BASE, **kw,
        )
        self.in_flight = Gauge(
            "bytecp_operations_in_flight", "Saves and loads started and not yet ended", _BASE, **kw
        )
        self.follower = {
            name: Gauge(fam, help, ("job", "rank"), **kw) for name, fam, help in (
                ("follower_lag_steps", FOLLOWER_EVENTS["follower_lag_steps"],
                 "Steps from the run's newest commit to what a follower holds, at its last update"),
                ("follower_lag_seconds", FOLLOWER_EVENTS["follower_lag_seconds"],
                 "Seconds from the commit of what a follower took to the end of its last update"),
                ("follower_update_bytes", FOLLOWER_EVENTS["follower_update_bytes"],
                 "Stored bytes a follower's last update read (only what changed)"))
        }
        self.dropped = Counter(
            "bytecp_monitor_reports_dropped",
            "Reports the push client dropped (collector slow or absent)",
            ("job", "rank"), **kw,
        )

    # -- Recorder --------------------------------------------------------
    def on_report(self, report: CheckpointReport) -> None:
        labels = (report.job, str(report.rank), report.operation)
        self._close(labels)
        self.operations.labels(*labels).inc()
        # touch the failure counter so it exists (at 0) for rate() and dashboards
        failures = self.failures.labels(*labels)
        if not report.ok:
            failures.inc()
        self.retries.labels(*labels).inc(report.retries)
        self.stall.labels(*labels).observe(report.stall_seconds)
        self.duration.labels(*labels).observe(max(0.0, report.duration))
        self.nbytes.labels(*labels).inc(report.nbytes)
        if report.duration > 0:
            self.throughput.labels(*labels).set(report.nbytes / report.duration)
        for phase, seconds in report.phase_seconds().items():
            self.phase.labels(*labels, phase).observe(seconds)
        for span in report.spans:
            if span.nbytes:
                self.phase_bytes.labels(*labels, span.phase).inc(span.nbytes)

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        job = labels.get("job", self.job)
        rank = labels.get("rank", self.rank)
        if name == OPERATION_STARTED:
            key = (job, rank, labels.get("operation", "save"))
            with self._lock:
                self._open[key] = self._open.get(key, 0) + 1
            self.in_flight.labels(*key).inc()
        elif name == STORAGE_RETRY:
            backend, reason = labels.get("backend", "unknown"), labels.get("reason", "unknown")
            self.storage_retries.labels(job, rank, backend, reason).inc(value)
        elif name == "monitor_report_dropped":
            self.dropped.labels(job, rank).inc(value)
        elif name in self.follower:
            self.follower[name].labels(job, rank).set(value)

    def _close(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            n = self._open.get(key, 0)
            if n <= 0:  # started before this recorder was registered
                return
            self._open[key] = n - 1
        self.in_flight.labels(*key).dec()


def enable_prometheus(
    port: int | None = None,
    addr: str = "127.0.0.1",
    *,
    registry: CollectorRegistry | None = None,
    job: str | None = None,
    rank: int | None = None,
) -> PrometheusRecorder:
    """Record this process's checkpoints as metrics; serve them on ``addr:port`` if given.

    (every rank, once, at start-up) ``port=0`` picks a free port; the bound
    port is then ``recorder.http_port``.
    """
    from prometheus_client import start_http_server

    rec = PrometheusRecorder(registry, job=job, rank=rank)
    add_recorder(rec)
    if port is not None:
        server, _thread = start_http_server(port, addr, registry=rec.registry)
        rec.http_server, rec.http_port = server, server.server_port
    return rec
