"""Cross-rank aggregation of checkpoint reports, and straggler detection.

Pure logic, no gRPC and no Prometheus: the collector server feeds every
received :class:`~bytecp.recorder.CheckpointReport` to
:meth:`Aggregator.add`; ``bytecp monitor show`` builds a
:class:`CheckpointAggregate` from the reports stored beside a checkpoint.

Call order (collector):

1. ``Aggregator.add(report)`` for each rank's report, from gRPC threads.
2. When the last of ``world_size`` ranks has reported, or ``complete_after``
   seconds after the first report (``Aggregator.expire``, called by a timer
   thread), the checkpoint is *finalized*: ``on_finalize(aggregate)`` runs
   once, which is where job-level metrics are updated.
3. ``list`` / ``get`` answer queries at any time, finalized or not.

Straggler rule (see :func:`find_straggler`): for each phase, a rank's score
is the smaller of (its seconds in the phase minus the median of the other
ranks) and (how much later than the other ranks' median it *finished* the
phase). A rank that was slow scores on both; a rank that merely waited
inside a collective for a slow peer (long ``commit`` that ends when
everyone's ends) has no lag and scores nothing; a rank that started late
because an earlier phase was slow has no excess in the later phase. Finish times compare wall clocks across
hosts, so they assume clocks synchronised well below the delays of interest.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from bytecp.recorder import WAIT_PHASES, CheckpointReport

__all__ = [
    "CheckpointKey",
    "Straggler",
    "CheckpointAggregate",
    "Aggregator",
    "find_straggler",
]


@dataclasses.dataclass(frozen=True)
class CheckpointKey:
    """Identity of one checkpoint operation across ranks."""

    job: str
    operation: str
    checkpoint_id: str

    @classmethod
    def of(cls, report: CheckpointReport) -> CheckpointKey:
        return cls(report.job, report.operation, report.checkpoint_id)


@dataclasses.dataclass(frozen=True)
class Straggler:
    """The rank and phase that held a checkpoint up."""

    rank: int
    phase: str
    seconds: float
    """The straggler's seconds in ``phase``."""
    median_seconds: float
    """Median over the other ranks of the seconds in ``phase``."""
    lag_seconds: float
    """How much later than the other ranks' median it finished ``phase`` (0 for one rank)."""


def _phase_ends(report: CheckpointReport) -> dict[str, float]:
    ends: dict[str, float] = {}
    for s in report.spans:
        ends[s.phase] = max(ends.get(s.phase, s.start), s.start + s.duration)
    return ends


def _median_without(ordered: list[float], value: float) -> float:
    """Median of ``ordered`` (sorted) with one occurrence of ``value`` left out."""
    i = bisect.bisect_left(ordered, value)
    k = len(ordered) - 1

    def at(pos: int) -> float:  # position in the list without index i
        return ordered[pos if pos < i else pos + 1]

    if k <= 0:
        return value
    if k % 2:
        return at(k // 2)
    return (at(k // 2 - 1) + at(k // 2)) / 2


def find_straggler(reports: Iterable[CheckpointReport]) -> Straggler | None:
    """Name the rank and phase that held the checkpoint up (module docstring).

    Each rank is compared with the median of the *other* ranks. With one
    rank, or when no rank stands out, the rank with the most work and its
    longest phase are named with a lag of zero. Phases in
    :data:`~bytecp.recorder.WAIT_PHASES` are never named. ``None`` when no
    report has a span.
    """
    reps = sorted(reports, key=lambda r: r.rank)
    secs = {r.rank: {p: v for p, v in r.phase_seconds().items() if p not in WAIT_PHASES} for r in reps}
    ends = {r.rank: _phase_ends(r) for r in reps}
    phases = sorted({p for per in secs.values() for p in per})
    if not phases:
        return None
    best: tuple[float, float, Straggler] | None = None
    if len(reps) > 1:
        for phase in phases:
            durations = sorted(secs[r.rank].get(phase, 0.0) for r in reps)
            phase_ends = sorted(ends[r.rank][phase] for r in reps if phase in ends[r.rank])
            for r in reps:
                if phase not in secs[r.rank]:
                    continue
                sec = secs[r.rank][phase]
                median = _median_without(durations, sec)
                end = ends[r.rank][phase]
                lag = end - _median_without(phase_ends, end) if len(phase_ends) > 1 else 0.0
                score = min(sec - median, lag)
                if score > 0 and (best is None or (score, sec) > best[:2]):
                    best = (score, sec, Straggler(r.rank, phase, sec, median, lag))
    if best is not None:
        return best[2]
    # Nobody stands out: the rank with the most work, and its longest phase.
    rank = max(secs, key=lambda k: (sum(secs[k].values()), -k))
    if not secs[rank]:
        return None
    phase = max(secs[rank], key=lambda p: secs[rank][p])
    durations = sorted(secs[r.rank].get(phase, 0.0) for r in reps)
    return Straggler(rank, phase, secs[rank][phase], _median_without(durations, secs[rank][phase]), 0.0)


class CheckpointAggregate:
    """Every rank's report for one checkpoint, and figures across ranks.

    Mutated only under the owning :class:`Aggregator`'s lock; the figures are
    recomputed on demand (ranks are few thousand at most).
    """

    def __init__(self, key: CheckpointKey, world_size: int) -> None:
        self.key = key
        self.world_size = world_size
        self.reports: dict[int, CheckpointReport] = {}
        self.first_seen = time.monotonic()
        self.finalized = False
        self._straggler: tuple[int, Straggler | None] | None = None

    @classmethod
    def from_reports(cls, reports: Iterable[CheckpointReport]) -> CheckpointAggregate:
        """An aggregate of already-collected reports (``monitor show`` from storage)."""
        reps = list(reports)
        if not reps:
            raise ValueError("no reports to aggregate")
        agg = cls(CheckpointKey.of(reps[0]), max(r.world_size for r in reps))
        for r in reps:
            agg.reports[r.rank] = r
        return agg

    # -- figures ---------------------------------------------------------
    @property
    def complete(self) -> bool:
        return len(self.reports) >= self.world_size

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports.values())

    def ranked(self) -> list[CheckpointReport]:
        return [self.reports[k] for k in sorted(self.reports)]

    @property
    def url(self) -> str:
        return self.ranked()[0].url if self.reports else ""

    @property
    def step(self) -> int | None:
        steps = [r.step for r in self.reports.values() if r.step is not None]
        return max(steps) if steps else None

    @property
    def started(self) -> float:
        return min((r.started for r in self.reports.values()), default=0.0)

    @property
    def ended(self) -> float:
        return max((r.ended for r in self.reports.values()), default=0.0)

    @property
    def duration(self) -> float:
        return max(0.0, self.ended - self.started)

    @property
    def max_stall_seconds(self) -> float:
        return max((r.stall_seconds for r in self.reports.values()), default=0.0)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reports.values())

    @property
    def retries(self) -> int:
        return sum(r.retries for r in self.reports.values())

    @property
    def throughput(self) -> float:
        """Bytes written (or read) by all ranks per second of wall-clock time."""
        return self.nbytes / self.duration if self.duration > 0 else 0.0

    def straggler(self) -> Straggler | None:
        """:func:`find_straggler` over the reports so far (cached until another arrives)."""
        n = len(self.reports)
        if self._straggler is None or self._straggler[0] != n:
            self._straggler = (n, find_straggler(list(self.reports.values())))
        return self._straggler[1]

    def errors(self) -> dict[int, str]:
        return {r.rank: r.error or "failed" for r in self.ranked() if not r.ok}


class Aggregator:
    """The collector's memory: recent checkpoints of every job.

    Thread-safe. ``on_finalize`` runs once per checkpoint, outside the lock,
    on the thread that completed or expired it.
    """

    def __init__(
        self,
        *,
        complete_after: float = 120.0,
        keep: int = 1000,
        max_reports: int = 500_000,
        on_finalize: Callable[[CheckpointAggregate], None] | None = None,
    ) -> None:
        if complete_after <= 0 or keep <= 0 or max_reports <= 0:
            raise ValueError("complete_after, keep and max_reports must be positive")
        self.complete_after = complete_after
        #: at most this many checkpoints, and this many rank reports in all, are kept
        #: (oldest forgotten first): memory stays bounded at thousands of ranks
        self.keep = keep
        self.max_reports = max_reports
        self._nreports = 0
        self.on_finalize = on_finalize
        self._lock = threading.Lock()
        self._items: OrderedDict[int, CheckpointAggregate] = OrderedDict()
        self._latest: dict[CheckpointKey, CheckpointAggregate] = {}
        self._seq = 0

    def add(self, report: CheckpointReport) -> bool:
        """Store one rank's report; False if that rank had already sent it.

        A rank reporting the same checkpoint again with another start time is
        a new operation (loading one checkpoint twice): it opens a new aggregate.
        """
        key = CheckpointKey.of(report)
        done: CheckpointAggregate | None = None
        with self._lock:
            agg = self._latest.get(key)
            seen = agg.reports.get(report.rank) if agg is not None else None
            if seen is not None and seen.started == report.started:
                return False
            if agg is None or seen is not None:
                agg = CheckpointAggregate(key, max(1, report.world_size))
                self._seq += 1
                self._items[self._seq] = agg
                self._latest[key] = agg
            agg.reports[report.rank] = report
            self._nreports += 1
            while len(self._items) > 1 and (len(self._items) > self.keep or self._nreports > self.max_reports):
                _, old = self._items.popitem(last=False)
                self._nreports -= len(old.reports)
                if self._latest.get(old.key) is old:
                    del self._latest[old.key]
            agg.world_size = max(agg.world_size, report.world_size)
            if agg.complete and not agg.finalized:
                agg.finalized = True
                done = agg
        if done is not None:
            self._finalize(done)
        return True

    def expire(self, now: float | None = None) -> list[CheckpointAggregate]:
        """Finalize checkpoints whose missing ranks are overdue (timer thread)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [
                a
                for a in self._items.values()
                if not a.finalized and now - a.first_seen >= self.complete_after
            ]
            for a in due:
                a.finalized = True
        for a in due:
            self._finalize(a)
        return due

    def _finalize(self, agg: CheckpointAggregate) -> None:
        if self.on_finalize is not None:
            self.on_finalize(agg)

    def list(self, job: str = "", operation: str = "", limit: int = 100) -> list[CheckpointAggregate]:
        """Newest first (by start time), filtered by job and operation when given."""
        with self._lock:
            items = [
                a
                for a in self._items.values()
                if (not job or a.key.job == job) and (not operation or a.key.operation == operation)
            ]
        items.sort(key=lambda a: a.started, reverse=True)
        return items[:limit] if limit > 0 else items

    def get(self, checkpoint: str, job: str = "", operation: str = "") -> CheckpointAggregate | None:
        """The newest checkpoint whose id or URL is ``checkpoint``."""
        for a in self.list(job, operation, limit=0):
            if checkpoint in (a.key.checkpoint_id, a.url):
                return a
        return None
