"""Retention, ``gc`` and incremental references over a run of W-rank
checkpoints, on a local disk (``python -m benchmarks.scale_retention``).

The run holds real ``metadata.json`` files of the scale benchmark's jobs
(:mod:`benchmarks.scale_jobs`: every rank's data file and index part listed,
the directory built by ``build_directory``, the MoE's merged skeleton) and
every file they name, empty: retention and ``gc`` read metadata and list
and delete files, and never read data. What the coordinator runs, timed
with the real code:

- ``list``: ``list_checkpoints`` of the run (what the manager does twice per
  retention: the checkpoints and their steps);
- ``sweep``: the coordinator's sweep after a commit (``orphans`` at the
  committed checkpoint), beside ``saves_at`` listing every file there (what
  ``bytecp gc`` does, and the sweep did before it skipped the committed
  save's folders);
- ``check_references``: what the coordinator of an incremental save checks
  before its commit, and an incremental checkpoint's opening, of the
  checkpoint it references (``step-3`` references half its data files in
  ``step-2``): that it holds the save and each file, with its size;
- ``live``: ``live_files`` of the kept checkpoints (what they reference);
- ``retain 1``: after ``step-3`` commits, ``keep_last=2``: ``step-1`` goes whole;
- ``retain 2``: after ``step-4`` (a full save) commits: ``step-2`` is retired
  (the files ``step-3`` references stay, the rest go);
- ``gc``: ``collect_garbage`` over the run, with a killed save's W data
  files and parts in ``step-4``.

Times are one cold run each (the steps delete what they measure); memory is
the peak of Python allocations in a second, traced run of the steps that
delete nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bytecp.catalog import list_checkpoints
from bytecp.format import metadata as fmt
from bytecp.format.parts_build import build_directory
from bytecp.format.parts_schema import buckets_for, part_file
from bytecp.format.references import check_references
from bytecp.saving.leases import orphans, saves_at
from bytecp.storage_api import open_storage
from bytecp.tools.gc import collect_garbage
from bytecp.tools.retention import live_files, retain

from . import scale_jobs as jobs
from . import scale_load as sl
from .scale_parts import Entries

DEAD_SAVE = "19990101T000000-00000000"  # a killed save's id (started long ago, no lease)


def _touch(root: Path, paths: list[str]) -> None:
    dirs = {os.path.dirname(p) for p in paths}
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    for p in paths:
        os.close(os.open(root / p, os.O_CREAT | os.O_WRONLY, 0o644))


class Run:
    """A run directory of checkpoints of one job (metadata as the coordinator
    writes it, every named file empty)."""

    def __init__(self, job: jobs.Job, root: Path) -> None:
        self.job, self.root = job, root
        buckets = buckets_for(job.world)
        entries = Entries(job, buckets)
        self.pages, self.directory = build_directory(entries.all(), jobs.SAVE_ID, buckets, job.specs())
        described = jobs.union(job)
        self.skeleton, self.specs = described.skeleton, described.tensors
        self.files = sl.data_files(self.job)
        self.parts = [part_file(jobs.SAVE_ID, r) for r in self.directory.ranks]

    def checkpoint(self, step: int, base: int | None = None) -> float:
        """Write ``step-<step>`` (referencing half its data files in ``step-<base>``); -> seconds."""
        t0 = time.perf_counter()
        ck = self.root / f"step-{step}"
        md = sl.metadata_for(self.job, self.directory, dict(self.files), self.skeleton, self.specs)
        md.step = step
        own = list(self.files)
        if base is not None:
            theirs = own[1::2]
            own = own[0::2]
            md.data_files = {**{p: self.files[p] for p in own},
                             **{f"../step-{base}/{p}": self.files[p] for p in theirs}}
            md.references = {f"step-{base}": jobs.SAVE_ID}
        _touch(ck, own + self.parts)
        (ck / self.directory.file).write_bytes(b"".join(self.pages))
        (ck / fmt.METADATA_FILE).write_bytes(md.to_bytes())
        return time.perf_counter() - t0

    def killed_save(self, step: int) -> None:
        """A save killed before its commit left every rank's data file and part in ``step-<step>``."""
        _touch(self.root / f"step-{step}", [p.replace(jobs.SAVE_ID, DEAD_SAVE) for p in [*self.files, *self.parts]])


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _traced(fn: Callable[[], Any]) -> float:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 1e6


def measure(job: jobs.Job, tmp: Path) -> dict[str, Any]:
    root = tmp / "run"
    run = Run(job, root)
    out: dict[str, Any] = {"world": job.world, "label": job.label, "files_per_checkpoint": len(run.files) + len(run.parts)}
    out["write_s"] = run.checkpoint(1) + run.checkpoint(2)
    run.checkpoint(3, base=2)
    out["metadata_mb"] = (root / "step-3" / fmt.METADATA_FILE).stat().st_size / 1e6
    url = str(root)
    st = open_storage(url)
    ck3 = st.child("step-3")
    md3 = fmt.Metadata.from_bytes((root / "step-3" / fmt.METADATA_FILE).read_bytes(), url)
    steps: dict[str, Callable[[], Any]] = {
        "list": lambda: list_checkpoints(url),
        "check_references": lambda: check_references(ck3, md3),
        "sweep": lambda: orphans(ck3, jobs.SAVE_ID),
        "list_every_file": lambda: saves_at(ck3),
        "live": lambda: live_files(st, ["step-2", "step-3"]),
    }
    for name, fn in steps.items():
        out[f"{name}_s"], got = _timed(fn)
        out[f"{name}_peak_mb"] = _traced(fn)
        if name == "live":
            out["live_files"] = sum(len(v) for v in got.values())

    def retention(keep: int) -> Any:
        found = [c.name for c in list_checkpoints(url)]
        return retain(st, found[-keep:], found[:-keep], lambda: [c.name for c in list_checkpoints(url)])

    out["retain_delete_s"], r1 = _timed(lambda: retention(2))
    assert r1.deleted == ["step-1"] and not (root / "step-1").exists(), r1
    run.checkpoint(4)
    out["retain_retire_s"], r2 = _timed(lambda: retention(2))
    assert r2.retired == ["step-2"], r2
    left = sum(len(f) for _, _, f in os.walk(root / "step-2"))
    out["retired_files_left"] = left
    run.killed_save(4)
    out["gc_s"], g = _timed(lambda: collect_garbage(st))
    assert len(g.removed) == len(run.files) + len(run.parts), len(g.removed)
    out["gc_removed"] = len(g.removed)
    shutil.rmtree(root)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="16384,131072")
    p.add_argument("--models", default="llama,moe")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = []
    for world in (int(w) for w in a.worlds.split(",")):
        for name in a.models.split(","):
            job = jobs.llama_job(world) if name == "llama" else jobs.moe_job(world)
            with tempfile.TemporaryDirectory(prefix="bytecp-retention-") as tmp:
                row = measure(job, Path(tmp))
            row["model"] = name
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
