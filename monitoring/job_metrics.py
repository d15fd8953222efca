"""Job-level Prometheus metrics the collector exports (``bytecp monitor serve --metrics``).

Who calls what, and when:

1. The collector server builds one :class:`JobMetrics` on its registry.
2. (gRPC threads) :meth:`JobMetrics.report_received` for every report and
   :meth:`JobMetrics.rejected` for every refused call.
3. (the thread that finalizes a checkpoint) :meth:`JobMetrics.observe` once
   per checkpoint: cumulative counters and histograms move, and the *last
   checkpoint* figures of that job and operation (per-rank stall and phase
   seconds, straggler, throughput) are replaced as a whole, so a rank or
   phase that disappears leaves no stale series behind.

Every family name is listed in :data:`JOB_METRICS`; the Grafana dashboard
in ``deploy/`` may only use these (a test checks it against a real
Prometheus).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

from bytecp.plugins import missing_extra

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

from .aggregate import CheckpointAggregate
from .prometheus import SECONDS_BUCKETS

__all__ = ["JobMetrics", "JOB_METRICS"]

#: every metric family the collector exports (names as scraped)
JOB_METRICS = (
    "bytecp_job_checkpoints_total",
    "bytecp_job_checkpoints_failed_total",
    "bytecp_job_incomplete_checkpoints_total",
    "bytecp_job_retries_total",
    "bytecp_job_bytes_total",
    "bytecp_job_stall_seconds",
    "bytecp_job_duration_seconds",
    "bytecp_job_last_step",
    "bytecp_job_last_timestamp_seconds",
    "bytecp_job_last_stall_seconds",
    "bytecp_job_last_duration_seconds",
    "bytecp_job_last_throughput_bytes_per_second",
    "bytecp_job_last_bytes",
    "bytecp_job_last_ranks_reported",
    "bytecp_job_last_world_size",
    "bytecp_job_rank_stall_seconds",
    "bytecp_job_rank_duration_seconds",
    "bytecp_job_rank_phase_seconds",
    "bytecp_job_straggler_rank",
    "bytecp_job_straggler_lag_seconds",
    "bytecp_job_straggler_info",
    "bytecp_collector_reports_total",
    "bytecp_collector_rejected_total",
)


@dataclasses.dataclass(frozen=True)
class _Last:
    """The figures of the last finalized checkpoint of one (job, operation)."""

    step: float
    timestamp: float
    stall: float
    duration: float
    throughput: float
    nbytes: int
    ranks_reported: int
    world_size: int
    rank_stall: tuple[tuple[int, float], ...]
    rank_duration: tuple[tuple[int, float], ...]
    rank_phase: tuple[tuple[int, str, float], ...]
    straggler: tuple[int, str, float] | None

    @classmethod
    def of(cls, agg: CheckpointAggregate) -> _Last:
        reps = agg.ranked()
        st = agg.straggler()
        return cls(
            step=float("nan") if agg.step is None else float(agg.step),
            timestamp=agg.ended,
            stall=agg.max_stall_seconds,
            duration=agg.duration,
            throughput=agg.throughput,
            nbytes=agg.nbytes,
            ranks_reported=len(reps),
            world_size=agg.world_size,
            rank_stall=tuple((r.rank, r.stall_seconds) for r in reps),
            rank_duration=tuple((r.rank, r.duration) for r in reps),
            rank_phase=tuple(
                (r.rank, phase, sec) for r in reps for phase, sec in sorted(r.phase_seconds().items())
            ),
            straggler=None if st is None else (st.rank, st.phase, st.lag_seconds),
        )


class _LastCheckpointCollector(Collector):
    """Yields the ``last``/``rank``/``straggler`` gauges at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], _Last] = {}

    def set(self, job: str, operation: str, last: _Last) -> None:
        with self._lock:
            self._last[(job, operation)] = last

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = sorted(self._last.items())
        lo = ["job", "operation"]

        def fam(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*lo, *extra])

        simple = {
            "step": fam("bytecp_job_last_step", "Training step of the last checkpoint"),
            "timestamp": fam(
                "bytecp_job_last_timestamp_seconds", "Unix time the last checkpoint ended"
            ),
            "stall": fam(
                "bytecp_job_last_stall_seconds",
                "Largest stall over ranks of the last checkpoint (training blocked)",
            ),
            "duration": fam(
                "bytecp_job_last_duration_seconds",
                "Seconds from the first rank's start to the last rank's end, last checkpoint",
            ),
            "throughput": fam(
                "bytecp_job_last_throughput_bytes_per_second",
                "Bytes of all ranks over the last checkpoint's duration",
            ),
            "nbytes": fam("bytecp_job_last_bytes", "Bytes of all ranks, last checkpoint"),
            "ranks_reported": fam(
                "bytecp_job_last_ranks_reported", "Ranks that reported the last checkpoint"
            ),
            "world_size": fam("bytecp_job_last_world_size", "World size of the last checkpoint"),
        }
        rank_stall = fam(
            "bytecp_job_rank_stall_seconds", "Stall of each rank, last checkpoint", ("rank",)
        )
        rank_duration = fam(
            "bytecp_job_rank_duration_seconds",
            "Wall-clock seconds of each rank's operation, last checkpoint",
            ("rank",),
        )
        rank_phase = fam(
            "bytecp_job_rank_phase_seconds",
            "Seconds of each rank in each phase, last checkpoint",
            ("rank", "phase"),
        )
        s_rank = fam("bytecp_job_straggler_rank", "Straggler rank of the last checkpoint")
        s_lag = fam(
            "bytecp_job_straggler_lag_seconds",
            "How much later than the other ranks' median the straggler finished its slow phase",
        )
        s_info = fam(
            "bytecp_job_straggler_info",
            "1 for the straggler rank and phase of the last checkpoint",
            ("rank", "phase"),
        )
        for (job, op), last in items:
            for attr, family in simple.items():
                family.add_metric([job, op], float(getattr(last, attr)))
            for rank, v in last.rank_stall:
                rank_stall.add_metric([job, op, str(rank)], v)
            for rank, v in last.rank_duration:
                rank_duration.add_metric([job, op, str(rank)], v)
            for rank, phase, v in last.rank_phase:
                rank_phase.add_metric([job, op, str(rank), phase], v)
            if last.straggler is not None:
                rank, phase, lag = last.straggler
                s_rank.add_metric([job, op], rank)
                s_lag.add_metric([job, op], lag)
                s_info.add_metric([job, op, str(rank), phase], 1.0)
        yield from simple.values()
        yield from (rank_stall, rank_duration, rank_phase, s_rank, s_lag, s_info)


class JobMetrics:
    """The collector's metric families on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        lo = ("job", "operation")
        self.registry = registry
        self.checkpoints = Counter(
            "bytecp_job_checkpoints", "Checkpoints aggregated (saves, loads)", lo, registry=registry
        )
        self.failed = Counter(
            "bytecp_job_checkpoints_failed",
            "Checkpoints on which at least one rank failed",
            lo,
            registry=registry,
        )
        self.incomplete = Counter(
            "bytecp_job_incomplete_checkpoints",
            "Checkpoints finalized before every rank reported (reports dropped or ranks lost)",
            lo,
            registry=registry,
        )
        self.retries = Counter(
            "bytecp_job_retries", "Storage retries summed over ranks", lo, registry=registry
        )
        self.nbytes = Counter(
            "bytecp_job_bytes", "Bytes written or read, all ranks", lo, registry=registry
        )
        self.stall = Histogram(
            "bytecp_job_stall_seconds",
            "Largest stall over ranks, per checkpoint",
            lo,
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "bytecp_job_duration_seconds",
            "First start to last end over ranks, per checkpoint",
            lo,
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.reports = Counter(
            "bytecp_collector_reports", "Rank reports received", ("job",), registry=registry
        )
        self._rejected = Counter(
            "bytecp_collector_rejected",
            "Calls refused (bad token) or reports ignored (duplicates)",
            ("reason",),
            registry=registry,
        )
        for reason in ("unauthenticated", "duplicate"):
            self._rejected.labels(reason)  # exported at 0 from the start
        self._last = _LastCheckpointCollector()
        registry.register(self._last)

    def report_received(self, job: str) -> None:
        self.reports.labels(job).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def observe(self, agg: CheckpointAggregate) -> None:
        """(finalizing thread, once per checkpoint) move every figure."""
        lo = (agg.key.job, agg.key.operation)
        self.checkpoints.labels(*lo).inc()
        failed = self.failed.labels(*lo)  # exists at 0 from the first checkpoint on
        if not agg.ok:
            failed.inc()
        incomplete = self.incomplete.labels(*lo)
        if not agg.complete:
            incomplete.inc()
        self.retries.labels(*lo).inc(agg.retries)
        self.nbytes.labels(*lo).inc(agg.nbytes)
        self.stall.labels(*lo).observe(agg.max_stall_seconds)
        self.duration.labels(*lo).observe(agg.duration)
        self._last.set(*lo, _Last.of(agg))
