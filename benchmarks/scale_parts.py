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

With experts FSDP-sharded over the data-parallel ranks (``Job.expert_fsdp``)
a rank's expert rows lie at ``j / (W / ep)`` of its tensors (``j = r // ep``)
while its dense rows lie at ``r / W``: no sample's bands scale to another
rank's. There every other rank's segments are laid out as ``build_part``
lays them out, from its rows' bands computed per shape (:class:`Layout`:
band segments cut by ``build_part``'s own ``_cut_bands``, wide segments
4,096 names apiece), their sizes fitted on the sample ranks' real parts.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from bytecp.format import parts_read
from bytecp.format.parts_build import BuiltPart, PartEntries, Scalar, _cut_bands, build_part
from bytecp.format.parts_schema import PAGE_ENTRIES, SEGMENT_ROWS, PartsDirectory, span_limit
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
    if job.expert_fsdp:  # where the ranks holding rows of an expert shape end
        h = job.holders()
        for _, s in job.groups[0]:
            cuts.add(job.ep * min(h, -(-s[0] // -(-s[0] // h))))
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
        # expert_fsdp: the samples' real parts, experts included (the fits of the sizes; commit's candidates)
        for _, _, picks in self.intervals:
            for s in picks:
                self.band[s] = real_part(job, s, buckets, experts=job.expert_fsdp).entries
        self.wide = self._wide_templates()
        self.fit = (0.0, 0.0)
        self.layout = Layout(job, buckets) if job.expert_fsdp else None
        self.band_fit = _fit([(r, z) for e in self.band.values()
                              for r, z in zip(e.rows[:len(e.lo)], e.size[:len(e.lo)], strict=True)])
        if job.groups:
            for r in sorted({0, job.world // 2, job.ep * (job.holders() // 3)}):
                self.add_real(r)

    def add_real(self, rank: int) -> BuiltPart:
        if rank not in self.real:
            self.real[rank] = real_part(self.job, rank, self.buckets)
            pts = [(rows, size) for p in self.real.values() for rows, size in
                   zip(p.entries.rows[len(p.entries.lo):], p.entries.size[len(p.entries.lo):], strict=True)]
            if pts:
                self.fit = _fit(pts)
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
        if self.layout is not None:
            return self.laid_out(rank)
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

    def laid_out(self, rank: int) -> PartEntries:
        """(``expert_fsdp``) Rank ``rank``'s entries as :class:`Layout` lays its rows out."""
        assert self.layout is not None
        lo, hi, rows, wide, elements = self.layout.segments(rank)
        job = self.job
        rank_file = f"data/{SAVE_ID}/{rank}-0.bin"
        scalars = [Scalar(job.steps[i], rank_file, 0, 4, 1234) for i in range(job.world - 1 - rank, len(job.steps),
                                                                                  job.world)]
        sizes = [max(64, int(self.band_fit[0] * n + self.band_fit[1])) for n in rows]
        sizes += [max(64, int(self.fit[0] * n + self.fit[1])) for _, n in wide]
        e = PartEntries(rank=rank, elements=elements + len(scalars), lo=lo, hi=hi, size=sizes,
                        rows=rows + [n for _, n in wide], crc=[0] * len(sizes), scalars=scalars)
        e.offset = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(int).tolist() if sizes else []
        e.nbytes = sum(sizes)
        for k, (names, _) in enumerate(wide):
            e.names += names
            e.name_seg += [k] * len(names)
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


def _fit(pts: list[tuple[int, int]]) -> tuple[float, float]:
    """(slope, intercept) of a segment's bytes over its rows."""
    if not pts:
        return 0.0, 0.0
    xs, ys = np.asarray(pts, float).T
    if len(set(xs)) < 2:
        return 0.0, float(ys.mean())
    slope, at0 = np.polyfit(xs, ys, 1)
    return float(slope), float(at0)


class Layout:
    """(``Job.expert_fsdp``) Any rank's part segments as ``build_part`` lays
    them out (band segments: ``[lo, hi]`` and rows; wide segments: names and
    rows), from its rows' bands, computed once per shape: a rank holds one row
    box of every tensor (FSDP rows over ``W`` ranks; an expert's over the
    ``W / ep`` of its EP index), and every tensor of a shape has the same
    bands. Rows of one first band are ordered by name, as ``build_part``
    orders them, where shapes of different last bands share it (elsewhere
    their order changes no segment)."""

    def __init__(self, job: Job, buckets: int) -> None:
        self.job, self.buckets, self.limit = job, buckets, span_limit(buckets)
        self.dense = _by_shape(job.sharded)
        self.experts = [_by_shape(g) for g in job.groups]
        every = sorted(f for kinds in (self.dense, *self.experts) for names in kinds.values() for f in names)
        at = {f: i for i, f in enumerate(every)}  # a name's place among all: orders a rank's names as its own do
        self.ids = {f: np.asarray([at[n] for n in names], np.int64)
                    for kinds in (self.dense, *self.experts) for names in kinds.values() for f in names[:1]}

    def rows(self, rank: int) -> tuple[list[tuple[int, int, int, str]], list[str], int]:
        """Rank ``rank``'s banded rows as (lo, hi, count, first name) per shape, its wide
        rows' names (sorted), and its rows' elements."""
        job, b = self.job, self.buckets
        band: list[tuple[int, int, int, str]] = []
        wide: list[str] = []
        elements = 0
        for kinds, n, i in ((self.dense, job.world, rank),
                            (self.experts[rank % job.ep], job.holders(), rank // job.ep)):
            for (rows, cols), names in kinds.items():
                step = -(-rows // n)
                a = min(i * step, rows)
                z = min(a + step, rows)
                if z <= a:
                    continue
                lo, hi = a * cols * b // (rows * cols), (z * cols - 1) * b // (rows * cols)
                elements += (z - a) * cols * len(names)
                if hi - lo + 1 <= self.limit:
                    band.append((lo, hi, len(names), names[0]))
                else:
                    wide += names
        return band, sorted(wide), elements

    def segments(self, rank: int) -> tuple[list[int], list[int], list[int], list[tuple[list[str], int]], int]:
        """(band segments' lo, hi, rows; wide segments' (names, rows); elements)."""
        band, wide, elements = self.rows(rank)
        band.sort(key=lambda t: t[0])
        counts = [t[2] for t in band]
        lo = np.repeat(np.asarray([t[0] for t in band], np.int64), counts)
        hi = np.repeat(np.asarray([t[1] for t in band], np.int64), counts)
        order = np.arange(len(lo))
        if len({(t[0], t[1]) for t in band}) > len({t[0] for t in band}):  # a first band, two last ones: by name
            order = np.lexsort((np.concatenate([self.ids[t[3]] for t in band]), lo))
        groups = _cut_bands(order, lo, self.limit)
        segs = [wide[s : s + SEGMENT_ROWS] for s in range(0, len(wide), SEGMENT_ROWS)]
        return ([int(lo[g].min()) for g in groups], [int(hi[g].max()) for g in groups], [len(g) for g in groups],
                [(names, len(names)) for names in segs], elements)


def _by_shape(tensors: list[tuple[str, tuple[int, ...]]]) -> dict[tuple[int, int], list[str]]:
    """(rows, elements per row) -> the tensors of that shape (sorted names)."""
    out: dict[tuple[int, int], list[str]] = {}
    for fqn, s in tensors:
        out.setdefault((s[0], math.prod(s[1:])), []).append(fqn)
    return {k: sorted(v) for k, v in out.items()}


def tiled_by_wide_rows(fqn: str) -> bool:
    """Whether the jobs' rows of ``fqn`` are all wide, so that its wide rows
    tile any box of it: an expert weight, cut by the planner into at most 56
    pieces, each more than the span limit's 1/64 of the tensor (the real
    reader finds this out from the rows; :func:`touched` is told it)."""
    return ".experts." in fqn


def touched(entries: list[PartEntries], md: Any, wanted: dict[str, list[Region]],
            tiled: Callable[[str, list[Region]], bool] | None = None) -> tuple[set[int], int, int]:
    """The ranks whose parts :func:`~bytecp.format.parts_read.read_parts` reads for
    ``wanted``, as it selects them (no band lookup for the boxes that wide
    rows tile: ``tiled(fqn, boxes)``, by default :func:`tiled_by_wide_rows`);
    and the segments (and scalar pages) and rows it reads."""
    tiled = tiled or (lambda f, _: tiled_by_wide_rows(f))
    bands = parts_read.wanted_bands(md, {f: b for f, b in wanted.items() if not tiled(f, b)})
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
