"""The scale benchmark's load case: a version-4 checkpoint written to a
local temporary directory with the real parts of only the ranks a measured
reader touches, and that reader's :func:`~bytecp.format.parts_read.read_parts`
and :func:`~bytecp.plan.load_plan.plan_load` on it.

The directory and ``metadata.json`` list every rank (:class:`benchmarks.
scale_parts.Entries`); the part files of the ranks the reader's targets
meet are built for real (their entries replace the synthetic ones, and the
ranks touched are found again until nothing changes); every read goes
through a recording storage, and a read of a part that was not written
fails the run.
"""

from __future__ import annotations

import collections
import types
from pathlib import Path
from typing import Any

from bytecp.format import metadata as fmt
from bytecp.format import parts_read
from bytecp.format.parts_build import build_directory
from bytecp.format.parts_schema import part_file
from bytecp.plan.load_plan import plan_load
from bytecp.storage_api import Storage
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node

from .scale_jobs import SAVE_ID, Job
from .scale_parts import Entries, directory_stub, touched

__all__ = ["metadata_for", "Recording", "prepare", "wanted_of"]


def metadata_for(job: Job, directory: Any, data_files: dict[str, int], skeleton: Node | None = None,
                 tensors: dict[str, dict[str, Any]] | None = None, encoded: Any = None) -> fmt.Metadata:
    """The save's ``metadata.json``: with the merged skeleton and specs of
    :func:`benchmarks.scale_jobs.described` (the coordinator's merge) and
    their JSON text (``encoded``, as the commit keeps it), or an empty skeleton."""
    param_groups = {"optimizer.param_groups": fmt.ObjectRecord(json=[{"lr": 1e-4, "params": []}])}
    return fmt.Metadata(save_id=SAVE_ID, world_size=job.world, framework="fsdp2", parallelism={},
                        skeleton=skeleton or Node.container("dict", ()), tensors=job.specs() if tensors is None
                        else tensors, objects=param_groups if skeleton else {}, per_rank={},
                        index_files=[], data_files=data_files, index=directory, encoded=encoded)


DATA_FILE_BYTES = 1 << 36
"""The size ``metadata.json`` lists for each rank's data file: room for any
rank's share (an expert set's holder writes GBs). The data are never read
here, but a load checks every index row it reads against this size, so a
size under a rank's real share makes the load refuse the checkpoint."""


def data_files(job: Job) -> dict[str, int]:
    """Every rank's data file (metadata.json lists them: O(W)), each
    :data:`DATA_FILE_BYTES` long."""
    return {f"data/{SAVE_ID}/{r}-0.bin": DATA_FILE_BYTES for r in range(job.world)}


def wanted_of(targets: list[tuple[str, Region]]) -> dict[str, list[Region]]:
    wanted: dict[str, list[Region]] = collections.defaultdict(list)
    for fqn, box in targets:
        if box.numel:
            wanted[fqn].append(box)
    return dict(wanted)


class Recording:
    """A storage that records the files read from it (and nothing else differs)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.read: set[str] = set()
        self.url = inner.url

    def read_ranges(self, path: str, ranges: Any, **kw: Any) -> None:
        self.read.add(path)
        self.inner.read_ranges(path, ranges, **kw)

    def read_files(self, reads: Any) -> None:
        self.read.update(path for path, _ in reads)
        self.inner.read_files(reads)

    def read_ranges_summed(self, path: str, ranges: Any, spans: Any) -> Any:
        self.read.add(path)
        return self.inner.read_ranges_summed(path, ranges, spans)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def prepare(root: Path, job: Job, entries: Entries, readers: list[int], cap: int) -> dict[str, Any]:
    """Write the checkpoint the ``readers`` load from; -> what each reader
    touches (ranks, segments, rows), and ``written``: whether it was written
    (False when they touch more than ``cap`` parts: then only counted)."""
    md_stub = types.SimpleNamespace(index=directory_stub(entries.buckets), tensors=job.specs())
    wants = {r: wanted_of(job.targets(r)) for r in readers}
    while True:
        every = entries.all()
        seen = {r: touched(every, md_stub, w, job.tiled_by_wide) for r, w in wants.items()}
        need = set().union(*(s[0] for s in seen.values())) - entries.real.keys()
        if len(need | entries.real.keys()) > cap:
            return {"written": False, "touched": {r: _counts(s) for r, s in seen.items()}}
        if not need:
            break
        for r in sorted(need):
            entries.add_real(r)
    pages, directory = build_directory(every, SAVE_ID, entries.buckets, job.specs())
    (root / "index" / SAVE_ID).mkdir(parents=True)
    (root / directory.file).write_bytes(b"".join(pages))
    for r, part in entries.real.items():
        if part.blobs:
            (root / part_file(SAVE_ID, r)).write_bytes(b"".join(part.blobs))
    from .scale_jobs import union

    described = union(job)  # the whole state's skeleton and tensors, as the coordinator merged them
    skeleton, specs = described.skeleton, described.tensors
    (root / fmt.METADATA_FILE).write_bytes(metadata_for(job, directory, data_files(job), skeleton, specs).to_bytes())
    return {"written": True, "touched": {r: _counts(s) for r, s in seen.items()},
            "parts_written": len(entries.real)}


def _counts(seen: tuple[set[int], int, int]) -> dict[str, int]:
    return {"parts": len(seen[0]), "segments": seen[1], "rows": seen[2]}


def written_parts(entries: Entries) -> set[str]:
    return {part_file(SAVE_ID, r) for r, p in entries.real.items() if p.blobs}


def load(storage: Recording, md: fmt.Metadata, job: Job, rank: int | None, written: set[str]) -> tuple[int, int, int]:
    """(one rank) read_parts for its targets, then plan_load: -> (rows, segments, reads).
    Fails if it read a part that was not written (one only the directory lists)."""
    storage.read.clear()
    targets = [t for t in job.targets(rank) if t[1].numel] if rank is not None else []
    wanted = wanted_of(targets)
    rows, segs = parts_read.read_parts(storage, md, wanted)  # type: ignore[arg-type]
    reqs = plan_load(targets, rows, itemsizes={f: 4 for f in wanted}) if targets else []
    assert md.index is not None and storage.read <= written | {md.index.file}, storage.read - written
    return len(rows), segs, len(reqs)
