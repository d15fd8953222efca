"""The per-rank, per-phase table ``bytecp monitor show`` prints."""

from __future__ import annotations

from bytecp.recorder import PHASES

from .aggregate import CheckpointAggregate

__all__ = ["format_table", "format_size", "ordered_phases"]


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def ordered_phases(agg: CheckpointAggregate) -> list[str]:
    """Phases present, in the order they first started (the core's order on ties)."""
    first: dict[str, float] = {}
    for r in agg.reports.values():
        for s in r.spans:
            first[s.phase] = min(first.get(s.phase, s.start), s.start)
    rank = {p: i for i, p in enumerate(PHASES)}
    return sorted(first, key=lambda p: (first[p], rank.get(p, len(PHASES)), p))


def format_table(agg: CheckpointAggregate) -> str:
    """Header lines, then one row per rank: seconds per phase, stall, total, bytes.

    The straggler's row is marked ``<`` and its slow phase ``*``.
    """
    phases = ordered_phases(agg)
    st = agg.straggler()
    step = "" if agg.step is None else f" step {agg.step}"
    lines = [
        f"{agg.key.operation}{step} of job {agg.key.job}: {agg.key.checkpoint_id}",
        f"  url {agg.url}",
        f"  {len(agg.reports)}/{agg.world_size} ranks reported, "
        f"{'ok' if agg.ok else 'FAILED'}, {agg.duration:.3f} s, max stall {agg.max_stall_seconds:.3f} s, "
        f"{format_size(agg.nbytes)} ({format_size(agg.throughput)}/s), {agg.retries} retries",
    ]
    if st is not None and agg.world_size > 1:
        lines.append(
            f"  straggler: rank {st.rank} in {st.phase}: {st.seconds:.3f} s vs median "
            f"{st.median_seconds:.3f} s, finished {st.lag_seconds:.3f} s after the other ranks' median"
        )
    elif st is not None:
        lines.append(f"  longest phase: {st.phase} ({st.seconds:.3f} s)")
    header = ["rank", *phases, "stall", "total", "bytes", ""]
    rows: list[list[str]] = []
    for r in agg.ranked():
        sec = r.phase_seconds()
        cells = [str(r.rank)]
        for p in phases:
            mark = "*" if st is not None and agg.world_size > 1 and st.rank == r.rank and st.phase == p else ""
            cells.append(f"{sec[p]:.3f}{mark}" if p in sec else "-")
        note = "< straggler" if st is not None and agg.world_size > 1 and st.rank == r.rank else ""
        if not r.ok:
            note = f"FAILED: {r.error}"
        cells += [f"{r.stall_seconds:.3f}", f"{r.duration:.3f}", format_size(r.nbytes), note]
        rows.append(cells)
    missing = sorted(set(range(agg.world_size)) - set(agg.reports))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths[:-1]) + "  {}"
    lines.append("")
    lines.append(fmt.format(*header).rstrip() + "   (seconds)")
    lines += [fmt.format(*row).rstrip() for row in rows]
    if missing:
        lines.append(f"  no report from rank(s) {', '.join(map(str, missing))}")
    return "\n".join(lines)
