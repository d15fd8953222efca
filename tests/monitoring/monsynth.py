"""Synthetic per-rank reports shaped like a distributed save or load.

Each rank plans, stages and writes on its own, then waits in ``commit`` until
the slowest rank has written (as a gather/barrier makes it), so fast ranks
show long commits that are waiting, not work: the straggler rule must see
through that.
"""

from __future__ import annotations

from bytecp.recorder import CheckpointReport, Span

SAVE_PHASES = (("plan", 0.04), ("stage", 0.12), ("write", 0.30))
LOAD_PHASES = (("read_metadata", 0.03), ("read", 0.25), ("apply", 0.05))


def make_reports(
    world_size: int = 4,
    *,
    slow: dict[tuple[int, str], float] | None = None,
    operation: str = "save",
    job: str = "synthetic",
    step: int | None = 100,
    checkpoint_id: str = "ckpt-100",
    url: str = "memory://run/step-100",
    t0: float = 1_700_000_000.0,
    nbytes_per_rank: int = 64 << 20,
    failed_ranks: tuple[int, ...] = (),
) -> list[CheckpointReport]:
    """One report per rank; ``slow[(rank, phase)]`` adds seconds to that phase."""
    slow = slow or {}
    phases = SAVE_PHASES if operation == "save" else LOAD_PHASES
    spans: dict[int, list[Span]] = {}
    local_end: dict[int, float] = {}
    for rank in range(world_size):
        t = t0 + 0.001 * rank
        out: list[Span] = []
        for phase, base in phases:
            d = base + 0.01 * rank + slow.get((rank, phase), 0.0)
            io = phase in ("write", "read")
            out.append(Span(phase, t, d, nbytes_per_rank if io else 0, 2 if io else 0))
            t += d
        spans[rank] = out
        local_end[rank] = t
    sync_end = max(local_end.values()) + 0.02
    reports = []
    for rank in range(world_size):
        if operation == "save":
            start = local_end[rank]
            spans[rank].append(Span("commit", start, sync_end - start + slow.get((rank, "commit"), 0.0), 0, 1))
        ended = spans[rank][-1].start + spans[rank][-1].duration
        stall = sum(s.duration for s in spans[rank] if s.phase in ("plan", "stage"))
        reports.append(
            CheckpointReport(
                operation=operation,
                url=url,
                checkpoint_id=checkpoint_id,
                rank=rank,
                world_size=world_size,
                job=job,
                step=step,
                started=t0 + 0.001 * rank,
                ended=ended,
                stall_seconds=stall if operation == "save" else ended - t0,
                spans=spans[rank],
                ok=rank not in failed_ranks,
                error="OSError: disk full" if rank in failed_ranks else None,
                nbytes=nbytes_per_rank,
                retries=1 if rank == 0 else 0,
            )
        )
    return reports


