"""Every rank's index part entries at up to 131,072 simulated ranks, without
building 131,072 parts (the scale benchmark's commit and load cases).

Real parts (:func:`~bytecp.format.parts_build.build_part` over the rank's
real chunk records, :meth:`benchmarks.scale_jobs.Job.chunks`) are built for

- *sample* ranks: a rank's band segments depend on which tensors it holds
  rows of, which changes only where a tensor's row count (or the ``step``
  writers) ends; between two such ranks the samples are spaced by 1.25x;
- the ranks a measured reader touches, and the measured ranks: these are
  the entries the directory lists for them, and their part files are written.

Every other rank ``r`` gets the entries of the sample ``s`` of its interval
nearest to it: the same band segments (count, rows, sizes) with their bands
scaled by ``r / s`` (a rank's rows lie at ``r / W`` of a tensor, or ``r /
rows`` where it holds one row: linear in ``r``), and the wide segments its
expert pieces make (the EP index 0 replica set's real plan, at the rank's
position among its holders, names moved to its experts; cut as
``build_part`` cuts them; sizes fitted on the real wide segments), and the
0-dim ``step`` values it writes (the directory's scalar pages list them).
"""

from __future__ import annotations

import bisect
import math
import re
from typing import Any

import numpy as np

from bytecp.format import parts_read
from bytecp.format.parts_build import BuiltPart, PartEntries, Scalar, build_part
from bytecp.format.parts_schema import PAGE_ENTRIES, SEGMENT_ROWS, PartsDirectory
from bytecp.tree.regions import Region

from .scale_jobs import SAVE_ID, Job

__all__ = ["real_part", "Entries"]


def real_part(job: Job, rank: int, buckets: int, *, experts: bool = True) -> BuiltPart:
    batch, specs, files = job.batch(job.chunks(rank, experts=experts), rank)
    return build_part(batch, specs, files, SAVE_ID, rank, buckets)


def _samples(job: Job) -> list[tuple[int, int, list[int]]]:
    """(start, end, sample ranks) of each interval of ranks holding rows of the same tensors."""
    w, n = job.world, len(job.steps)
    cuts = {0, w, max(0, w - n), w - n % w if n > w else 0}
    for _, s in job.sharded:
        cuts.add(min(w, -(-s[0] // -(-s[0] // w))))
    edges = sorted(c for c in cuts if 0 <= c <= w)
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        picks, x = {a, b - 1, (a + b) // 2}, max(1, a)
        while x < b:
            picks.add(x)
            x = max(x + 1, int(x * 1.25))
        out.append((a, b, sorted(picks)))
    return out


class Entries:
    """Every rank's :class:`PartEntries` of ``job`` (see the module docstring)."""

    def __init__(self, job: Job, buckets: int) -> None:
        self.job, self.buckets = job, buckets
        self.real: dict[int, BuiltPart] = {}
        self.band: dict[int, PartEntries] = {}
        self.intervals = _samples(job)
        for _, _, picks in self.intervals:
            for s in picks:
                self.band[s] = real_part(job, s, buckets, experts=False).entries
        self.wide = self._wide_templates()
        self.fit = (0.0, 0.0)
        if job.groups:
            for r in sorted({0, job.world // 2, job.ep * (job.holders() // 3)}):
                self.add_real(r)

    def add_real(self, rank: int) -> BuiltPart:
        if rank not in self.real:
            self.real[rank] = real_part(self.job, rank, self.buckets)
            pts = [(rows, size) for p in self.real.values() for rows, size in
                   zip(p.entries.rows[len(p.entries.lo):], p.entries.size[len(p.entries.lo):], strict=True)]
            if pts:
                xs, ys = np.asarray(pts, float).T
                self.fit = tuple(np.polyfit(xs, ys, 1)) if len(set(xs)) > 1 else (0.0, float(ys.mean()))
        return self.real[rank]

    def _wide_templates(self) -> dict[int, list[tuple[list[str], int]]]:
        """Per holder position of EP index 0: its wide segments (the names of
        their tensors, rows), cut as build_part cuts them (runs of SEGMENT_ROWS by name)."""
        out: dict[int, list[tuple[list[str], int]]] = {}
        for r, items in self.job.expert_plan(0).items():
            names = sorted(it.fqn for it in items)
            out[r // self.job.ep] = [(sorted(set(names[s : s + SEGMENT_ROWS])), len(names[s : s + SEGMENT_ROWS]))
                                     for s in range(0, len(names), SEGMENT_ROWS)]
        return out

    def rename(self, name: str, group: int) -> str:
        if not group:
            return name
        per = len(self.job.experts) // self.job.ep
        return _EXPERT.sub(lambda m: f".experts.{int(m.group(1)) + group * per}.", name, count=1)

    def synthetic(self, rank: int, renamed: dict[str, str] | None = None) -> PartEntries:
        picks = next(p for a, b, p in self.intervals if a <= rank < b)
        k = bisect.bisect_left(picks, rank)
        near = [p for p in picks[max(0, k - 1): k + 1] if p > 0] or picks[:1]
        s = min(near, key=lambda p: abs(math.log(max(rank, 1) / max(p, 1))))
        src = self.band[s]
        nb = len(src.lo)
        scale = rank / s if s else 1.0
        lo = [min(self.buckets - 1, int(x * scale)) for x in src.lo]
        hi = [min(self.buckets - 1, a + (h - x)) for a, h, x in zip(lo, src.hi, src.lo, strict=True)]
        e = PartEntries(rank=rank, nbytes=src.nbytes, elements=src.elements, lo=lo, hi=hi,
                        offset=list(src.offset[:nb]), size=list(src.size[:nb]), rows=list(src.rows[:nb]),
                        crc=list(src.crc[:nb]))
        rank_file = f"data/{SAVE_ID}/{rank}-0.bin"
        job = self.job
        e.scalars = [Scalar(job.steps[i], rank_file, 0, 4, 1234)
                     for i in range(job.world - 1 - rank, len(job.steps), job.world)]
        e.elements += len(e.scalars) - len(src.scalars)
        g = rank % self.job.ep if self.job.groups else 0
        off = src.nbytes
        for j, (names, rows) in enumerate(self.wide.get(rank // self.job.ep, []) if self.job.groups else []):
            if renamed is not None:
                names = [renamed.setdefault(n, self.rename(n, g)) for n in names]
            else:
                names = [self.rename(n, g) for n in names]
            size = max(64, int(self.fit[0] * rows + self.fit[1]))
            e.names += names
            e.name_seg += [j] * len(names)
            e.offset.append(off)
            e.size.append(size)
            e.rows.append(rows)
            e.crc.append(0)
            off += size
        e.nbytes = off
        return e

    def all(self) -> list[PartEntries]:
        """Every rank's entries: the real ones where built, else synthetic."""
        maps: list[dict[str, str]] = [{} for _ in range(max(1, self.job.ep))]
        out = []
        for r in range(self.job.world):
            p = self.real.get(r)
            out.append(p.entries if p is not None else
                       self.synthetic(r, maps[r % self.job.ep if self.job.groups else 0]))
        return out


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def touched(entries: list[PartEntries], md: Any, wanted: dict[str, list[Region]]) -> tuple[set[int], int, int]:
    """The ranks whose parts :func:`~bytecp.format.parts_read.read_parts` reads for
    ``wanted``, as it selects them; and the segments (and scalar pages) and rows it reads."""
    bands = parts_read.wanted_bands(md, wanted)
    names = sorted(wanted)
    ranks: set[int] = set()
    segs = rows = 0
    for e in entries:
        nb = len(e.lo)
        for k in range(nb):
            if parts_read._meets(bands, e.lo[k], e.hi[k]):
                ranks.add(e.rank)
                segs, rows = segs + 1, rows + e.rows[k]
        hit = {j for n, j in zip(e.names, e.name_seg, strict=True) if parts_read._names_in(names, n, n)}
        if hit:
            ranks.add(e.rank)
            segs, rows = segs + len(hit), rows + sum(e.rows[nb + j] for j in hit)
    scalars = sorted(s.fqn for e in entries for s in e.scalars)
    for s in range(0, len(scalars), PAGE_ENTRIES):
        page = scalars[s : s + PAGE_ENTRIES]
        if parts_read._names_in(names, page[0], page[-1]):
            segs, rows = segs + 1, rows + len(page)
    return ranks, segs, rows


def directory_stub(buckets: int) -> PartsDirectory:
    return PartsDirectory(SAVE_ID, buckets, [], [], 0, {}, {}, {})
