"""The demo's two tables: the loss step by step, and what each checkpoint
cost training, read from the per-rank reports bytecp stores beside every
committed checkpoint (``<checkpoint>/reports/<rank>.json``, the same ones
``bytecp monitor show`` reads).

Called by :mod:`bytecp.demo.story`: :func:`collect_checkpoints` after each
job (retention deletes old checkpoints later, so their reports are read
while they exist), the ``format_*`` functions at the end.
"""

from __future__ import annotations

import json
from typing import Any

from bytecp.catalog import list_checkpoints
from bytecp.format import metadata as fmt
from bytecp.recorder import CheckpointReport
from bytecp.storage_api import open_storage

__all__ = ["collect_checkpoints", "format_costs", "format_losses", "job_label"]

_FRAMEWORKS = {"fsdp2": "FSDP2", "ddp": "DDP"}


def job_label(parallel: str, world: int) -> str:
    """``FSDP2 x2``: the parallelism and the number of processes."""
    return f"{_FRAMEWORKS.get(parallel, parallel)} x{world}"


def collect_checkpoints(run_url: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """Add a row for each committed checkpoint under ``run_url`` not in
    ``rows`` yet (keyed by save id); returns the names committed now."""
    names = []
    for info in list_checkpoints(run_url):
        names.append(info.name)
        storage = open_storage(info.url)
        try:
            md = fmt.Metadata.from_bytes(fmt.read_metadata(storage), info.url)
            if md.save_id in rows:
                continue
            reports = [CheckpointReport.from_json(json.loads(storage.read_bytes(p)))
                       for p in sorted(storage.list_files("reports")) if p.endswith(".json")]
        finally:
            storage.close()
        reports.sort(key=lambda r: r.rank)
        rows[md.save_id] = {
            "checkpoint": info.name, "step": md.step, "save_id": md.save_id, "committed": True,
            "saved_by": job_label(md.framework, md.world_size),
            "paused_s": [r.stall_seconds for r in reports],
            # the part of the pause the optimizer step waited for the lazy copy
            "copy_wait_s": [r.phase_seconds().get("lazy_wait", 0.0) for r in reports],
            "seconds": max((r.duration for r in reports), default=0.0),
            "bytes": sum(r.nbytes for r in reports),
            "ranks_reported": len(reports), "world_size": md.world_size,
        }
    return names


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _grid(header: list[str], rows: list[list[str]], indent: str, right: frozenset[int] = frozenset()) -> list[str]:
    """Aligned columns; a row of two cells and a note (``[a, b, note]``) spans the rest."""
    full = [r for r in [header, *rows] if len(r) == len(header)]
    widths = [max(len(r[i]) for r in full) for i in range(len(header))]
    for r in rows:
        widths[:2] = [max(widths[i], len(r[i])) for i in range(2)]

    def cell(i: int, c: str) -> str:
        return c.rjust(widths[i]) if i in right else c.ljust(widths[i])

    out = []
    for r in [header, *rows]:
        if len(r) == len(header):
            out.append(indent + "  ".join(cell(i, c) for i, c in enumerate(r)).rstrip())
        else:
            out.append(indent + "  ".join([cell(0, r[0]), cell(1, r[1]), r[2]]))
    return out


def format_costs(rows: list[dict[str, Any]], indent: str = "       ") -> list[str]:
    """One line per checkpoint: who saved it, how long each process's training
    was paused (and the longest wait for the lazy copy), how long the save
    took in the background, the bytes written."""
    out = []
    for r in rows:
        if not r["committed"]:
            out.append([r["checkpoint"], r["saved_by"], r["note"]])
            continue
        paused = "  ".join(f"{s * 1e3:5.1f}" for s in r["paused_s"])
        copy = f"{max(r['copy_wait_s'], default=0.0) * 1e3:.1f}"
        out.append([r["checkpoint"], r["saved_by"], paused, copy, f"{r['seconds']:.2f}", _size(r["bytes"])])
    header = ["checkpoint", "saved by", "training paused, per process (ms)", "of which copy, max",
              "save took (s)", "written"]
    return _grid(header, out, indent, right=frozenset({3, 4, 5}))


def format_losses(trajectory: dict[int, tuple[str, float]], reference: dict[int, float],
                  indent: str = "       ") -> list[str]:
    """Step, the job that ran it, its loss, the uninterrupted run's loss."""
    rows = [[str(s), job, f"{loss:.4f}", f"{reference[s]:.4f}", f"{abs(loss - reference[s]):.1e}"]
            for s, (job, loss) in sorted(trajectory.items())]
    return _grid(["step", "trained by", "loss", "uninterrupted run", "difference"], rows, indent,
                 right=frozenset({0, 2, 3, 4}))
