"""Conversions between the core's report types and the v1 protobuf messages.

Used by the push client (report -> ``RankReport``), the collector servicer
(``RankReport`` -> report, aggregate -> ``CheckpointSummary``) and the query
client (``CheckpointSummary`` -> aggregate, for ``monitor show``).
"""

from __future__ import annotations

from bytecp.recorder import CheckpointReport, Span

from .aggregate import CheckpointAggregate
from .generated import monitor_pb2 as pb

__all__ = ["report_to_pb", "report_from_pb", "summary_to_pb", "aggregate_from_pb"]


def report_to_pb(report: CheckpointReport, host: str = "", pid: int = 0) -> pb.RankReport:
    msg = pb.RankReport(
        operation=report.operation,
        url=report.url,
        checkpoint_id=report.checkpoint_id,
        rank=report.rank,
        world_size=report.world_size,
        job=report.job,
        started=report.started,
        ended=report.ended,
        stall_seconds=report.stall_seconds,
        spans=[
            pb.Span(phase=s.phase, start=s.start, duration=s.duration, nbytes=s.nbytes, files=s.files)
            for s in report.spans
        ],
        ok=report.ok,
        error=report.error or "",
        nbytes=report.nbytes,
        retries=report.retries,
        host=host,
        pid=pid,
    )
    if report.step is not None:
        msg.step = report.step
    return msg


def report_from_pb(msg: pb.RankReport) -> CheckpointReport:
    return CheckpointReport(
        operation=msg.operation,
        url=msg.url,
        checkpoint_id=msg.checkpoint_id,
        rank=msg.rank,
        world_size=msg.world_size,
        job=msg.job,
        step=msg.step if msg.HasField("step") else None,
        started=msg.started,
        ended=msg.ended,
        stall_seconds=msg.stall_seconds,
        spans=[Span(s.phase, s.start, s.duration, s.nbytes, s.files) for s in msg.spans],
        ok=msg.ok,
        error=msg.error or None,
        nbytes=msg.nbytes,
        retries=msg.retries,
    )


def summary_to_pb(agg: CheckpointAggregate, with_reports: bool = False) -> pb.CheckpointSummary:
    msg = pb.CheckpointSummary(
        job=agg.key.job,
        operation=agg.key.operation,
        checkpoint_id=agg.key.checkpoint_id,
        url=agg.url,
        world_size=agg.world_size,
        ranks_reported=len(agg.reports),
        complete=agg.complete,
        ok=agg.ok,
        started=agg.started,
        ended=agg.ended,
        max_stall_seconds=agg.max_stall_seconds,
        nbytes=agg.nbytes,
        retries=agg.retries,
    )
    if agg.step is not None:
        msg.step = agg.step
    st = agg.straggler()
    if st is not None:
        msg.straggler.CopyFrom(
            pb.Straggler(
                rank=st.rank,
                phase=st.phase,
                seconds=st.seconds,
                median_seconds=st.median_seconds,
                lag_seconds=st.lag_seconds,
            )
        )
    if with_reports:
        msg.reports.extend(report_to_pb(r) for r in agg.ranked())
    return msg


def aggregate_from_pb(msg: pb.CheckpointSummary) -> CheckpointAggregate:
    """Rebuild an aggregate from a ``GetCheckpoint`` answer (reports included)."""
    agg = CheckpointAggregate.from_reports(report_from_pb(r) for r in msg.reports)
    agg.world_size = max(agg.world_size, msg.world_size)
    return agg
