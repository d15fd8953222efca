"""``bytecp inspect`` of a large version-4 checkpoint (``python -m
benchmarks.scale_inspect``): the time and peak memory of the summary read a
part at a time, and beside it of every row read at once (what ``inspect``
did before: ``OpenedCheckpoint.all_rows``).

The checkpoint is a simulated job of :mod:`benchmarks.scale_jobs` at
``--world`` ranks with every rank's index part built for real (its chunk
records, ``build_part``), the directory and ``metadata.json`` as the commit
writes them, and sparse data files of the declared sizes (``inspect``
checks sizes, not bytes). Each mode runs in its own process; memory is the
process's peak resident set less that of a process that only opened the
checkpoint (``metadata.json`` parsed), both as ``VmHWM``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def write(root: Path, model: str, world: int) -> int:
    """The checkpoint at ``root``; -> its rows."""
    from bytecp.format import metadata as fmt
    from bytecp.format.parts_build import build_directory
    from bytecp.format.parts_schema import buckets_for, part_file

    from . import scale_jobs as jobs
    from . import scale_load as sl
    from .scale_parts import Entries

    job = jobs.llama_job(world) if model == "llama" else jobs.moe_job(world)
    entries = Entries(job, buckets_for(world))
    for r in range(world):
        entries.add_real(r)
    pages, directory = build_directory(entries.all(), jobs.SAVE_ID, entries.buckets, job.specs())
    (root / "index" / jobs.SAVE_ID).mkdir(parents=True)
    (root / "data" / jobs.SAVE_ID).mkdir(parents=True)
    (root / directory.file).write_bytes(b"".join(pages))
    for r, part in entries.real.items():
        if part.blobs:
            (root / part_file(jobs.SAVE_ID, r)).write_bytes(b"".join(part.blobs))
    files = sl.data_files(job)  # written sparse, each DATA_FILE_BYTES long
    for path, size in files.items():
        _sparse(root / path, size)
    described = jobs.union(job)
    skeleton, specs = described.skeleton, described.tensors
    (root / fmt.METADATA_FILE).write_bytes(sl.metadata_for(job, directory, files, skeleton, specs).to_bytes())
    return job.chunk_count()


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def run_mode(url: str, mode: str) -> dict[str, Any]:
    """(a child process) One mode: ``open`` (metadata.json only), ``parts``
    (``summarize``: a part at a time) or ``whole`` (every row at once)."""
    from bytecp.loading.opened import open_checkpoint
    from bytecp.storage_api import open_storage
    from bytecp.tools.inspect import summarize

    t0 = time.perf_counter()
    st = open_storage(url)
    out: dict[str, Any] = {"mode": mode}
    if mode == "open":
        out["tensors"] = len(open_checkpoint(st).metadata.tensors)
    elif mode == "parts":
        out["chunks"] = summarize(st)["totals"]["chunks"]
    else:
        out["chunks"] = len(open_checkpoint(st).all_rows())
    out["s"] = time.perf_counter() - t0
    out["max_rss_mb"] = _peak_rss_mb()
    return out


def _peak_rss_mb() -> float:
    """This process's peak resident set since it started (``VmHWM``: unlike
    ``ru_maxrss``, not inherited from the parent it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama", choices=["llama", "moe"])
    p.add_argument("--world", type=int, default=4096)
    p.add_argument("--modes", default="open,parts,whole")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_mode(args.child, args.modes)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        t0 = time.perf_counter()
        chunks = write(root, args.model, args.world)
        print(json.dumps({"model": args.model, "world": args.world, "chunks": chunks,
                          "written_s": time.perf_counter() - t0}), flush=True)
        got = {}
        for mode in args.modes.split(","):
            res = subprocess.run([sys.executable, "-m", "benchmarks.scale_inspect", "--child", str(root),
                                  "--modes", mode], capture_output=True, text=True, check=False)
            got[mode] = json.loads(res.stdout) if res.returncode == 0 else {"error": res.stderr[-2000:]}
            print(json.dumps(got[mode]), flush=True)
        base = got.get("open", {}).get("max_rss_mb", 0.0)
        for mode in ("parts", "whole"):
            if "max_rss_mb" in got.get(mode, {}):
                print(f"{mode}: {got[mode]['s']:.1f} s, {got[mode]['max_rss_mb'] - base:.0f} MB over opening",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
