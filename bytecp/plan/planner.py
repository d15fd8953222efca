"""Save and load planning: pure functions over regions, no I/O, no torch.distributed.

Save (called through :mod:`bytecp.plan.exchange`: every rank builds its
:class:`LocalSavePlan`; each member of a replica set runs
:func:`plan_replicated` alone; the coordinator runs :func:`plan_save` over
the boxes without a sound replica hint and scatters back):

- regions held by several ranks (replicas: DDP, HSDP, Megatron's DP) are
  written once; a replicated region of at least ``split_bytes`` is cut along
  its first dimension into one piece per replica (up to the dimension's
  length), so under DDP every rank writes about 1/W of the bytes;
- each piece goes to the least-loaded rank that holds it (largest first);
  a large replica set instead gives each member one run (:mod:`bytecp.plan.runs`).

Load (every rank, on its own targets): :func:`bytecp.plan.load_plan.plan_load`
turns target boxes into ranged reads; :func:`assign_shared` spreads the whole tensors every rank wants over
the ranks for zero-redundancy loading.

Tests run these for thousands of simulated ranks in one process.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bytecp.errors import ConfigError
from bytecp.plan.runs import plan_runs, uses_runs
from bytecp.tree.regions import Region, row_major_strides
from bytecp.tree.state import ReplicaSet

__all__ = [
    "WriteItem",
    "LocalSavePlan",
    "plan_save",
    "plan_replicated",
    "plan_fingerprint",
    "DEFAULT_SPLIT_BYTES",
    "plan_shared_reads",
    "assign_shared",
    "find_overlap",
    "contiguous_boxes",
    "tiling_error",
    "check_replicas",
    "MIN_PIECE_BYTES",
]

DEFAULT_SPLIT_BYTES = 4 * 1024 * 1024
#: a replicated box is never split into pieces smaller than this
MIN_PIECE_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True, order=True)
class WriteItem:
    """A box of a tensor that one rank holds (local plan) or writes (global plan)."""

    fqn: str
    region: Region
    dtype: str
    itemsize: int
    global_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.itemsize

    @property
    def key(self) -> bytes:
        """What a plan's digests hash of this box: equal keys, the same box of the same tensor."""
        return f"{self.fqn}|{self.region.offsets}|{self.region.lengths}|{self.dtype}|{self.global_shape};".encode()


@dataclasses.dataclass(frozen=True)
class LocalSavePlan:
    """Every box this rank holds, for every tensor of the state.

    ``sets`` (parallel to ``items``, or empty: no hints) is the replica set
    each box belongs to -- the ranks that hold the very same box -- as the
    adapter knows it; ``None`` where it does not. Plans made for thousands
    of ranks use the hints instead of comparing every rank's boxes
    (:mod:`bytecp.plan.exchange`).
    """

    rank: int
    items: tuple[WriteItem, ...]
    sets: tuple[ReplicaSet | None, ...] = ()
    #: the rank writes exactly these boxes, as they are (an eager snapshot
    #: copied them and nothing else); the planner gives other holders only
    #: what they leave uncovered
    fixed: bool = False
    #: (parallel to ``items``, or empty) the ranks holding each box, where
    #: one rank sends the boxes of a whole replica set; ``None``: this rank
    holders: tuple[tuple[int, ...] | None, ...] = ()

    @functools.cached_property
    def digests(self) -> tuple[int, tuple[tuple[str, int, str], ...], bool, str]:
        """What a vote tells of the plan (:func:`bytecp.plan.exchange.vote_for`):
        the bytes this rank alone holds, each replica set's (key, size, digest
        of its boxes), whether a box has no replica hint, and the digest of the
        boxes this rank alone holds. Made once: a plan never changes, and a
        kept description's is voted with at every save."""
        own = owned = 0
        own_h = hashlib.blake2b(digest_size=16)
        per_set: dict[str, tuple[ReplicaSet, Any]] = {}
        unknown = False
        for it, rs in zip(self.items, self.sets or (None,) * len(self.items), strict=True):
            if rs is None:
                unknown = True
            elif rs.size == 1:
                own, owned = own + it.nbytes, owned + 1
                own_h.update(it.key)
            else:
                entry = per_set.get(rs.key)
                if entry is None:
                    entry = per_set[rs.key] = (rs, hashlib.blake2b(digest_size=16))
                entry[1].update(it.key)
        sets = tuple(sorted((k, rs.size, h.hexdigest()) for k, (rs, h) in per_set.items()))
        return own, sets, unknown, own_h.hexdigest() if owned else ""


def find_overlap(boxes: Sequence[Region], dim: int = 0) -> tuple[Region, Region] | None:
    """Two distinct boxes that overlap, or ``None`` (sweep along ``dim``: pick
    the dimension the boxes are split along, so few are active at once)."""
    if len(boxes) < 2 or not boxes[0].ndim:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    order = sorted(boxes, key=lambda b: b.offsets[dim])
    active: list[Region] = []
    for b in order:
        active = [a for a in active if a.offsets[dim] + a.lengths[dim] > b.offsets[dim]]
        for a in active:
            if a.intersect(b) is not None:
                return a, b
        if b.numel:
            active.append(b)
    return None


def contiguous_boxes(offs: np.ndarray, lens: np.ndarray, shapes: np.ndarray) -> np.ndarray:
    """Per box (rows of offsets ``offs`` and lengths ``lens``, in tensors of
    ``shapes``, one row each or broadcast): whether it is one range of its tensor
    in row-major order (row slabs, flat-range pieces, whole tensors), so
    that overlaps can be found as 1-d ranges."""
    full = (offs == 0) & (lens == shapes)
    after = np.ones((len(offs), offs.shape[1] + 1), bool)
    after[:, : offs.shape[1]] = np.logical_and.accumulate(full[:, ::-1], axis=1)[:, ::-1]
    gt1 = lens > 1
    k = np.argmax(gt1, axis=1)
    out: np.ndarray = ~gt1.any(axis=1) | after[np.arange(len(offs)), k + 1]
    return out


def tiling_error(shape: tuple[int, ...], boxes: Sequence[Region]) -> str | None:
    """Why ``boxes`` (distinct) do not tile a tensor of ``shape`` exactly, or
    ``None``: vectorized for boxes that are row-major ranges (the usual
    shards), a sweep (:func:`find_overlap`) for the others. The check of
    :func:`plan_save` when it is given every rank's boxes; a save checks the
    tiling of what was written at commit (:mod:`bytecp.format.index_build`)."""
    total = math.prod(shape)
    n, nd = len(boxes), len(shape)
    offs = np.array([b.offsets for b in boxes], np.int64).reshape(n, nd)
    lens = np.array([b.lengths for b in boxes], np.int64).reshape(n, nd)
    numel = lens.prod(axis=1)
    held = int(numel.sum())
    if held < total or n < 2:  # (more than the tensor: the overlap is named below)
        return f"the ranks' shards hold {held} of its {total} elements" if held != total else None
    if bool(contiguous_boxes(offs, lens, np.asarray(shape, np.int64)).all()):
        some = np.flatnonzero(numel > 0)
        start = (offs[some] * np.asarray(row_major_strides(shape) or (1,), np.int64)[:nd]).sum(axis=1)
        order = np.argsort(start, kind="stable")
        s, m = start[order], numel[some][order]
        clash = np.flatnonzero(s[1:] < s[:-1] + m[:-1])
        pair = (boxes[some[order[clash[0]]]], boxes[some[order[clash[0] + 1]]]) if len(clash) else None
    else:
        pair = find_overlap(boxes, dim=int(np.argmax((offs > 0).sum(axis=0))) if nd else 0)
    if pair is not None:
        return f"shards {pair[0]} and {pair[1]} overlap"
    return f"the ranks' shards hold {held} of its {total} elements" if held != total else None


def check_replicas(held: Sequence[dict[tuple[str, Region], int] | None]) -> None:
    """``held[r]``: rank ``r``'s checksum of every box it holds. Raise
    :class:`ConfigError` naming the first box whose replicas differ, with
    the ranks on each side (a replica must be bitwise the same everywhere)."""
    first: dict[tuple[str, Region], tuple[int, int]] = {}
    for rank, crcs in enumerate(held):
        for key, crc in (crcs or {}).items():
            seen = first.setdefault(key, (rank, crc))
            if seen[1] != crc:
                fqn, region = key
                same = [r for r, c in enumerate(held) if c and c.get(key) == seen[1]]
                other = [r for r, c in enumerate(held) if c and key in c and c[key] != seen[1]]
                raise ConfigError(
                    f"tensor {fqn!r} region {region}: the ranks hold it as a replica but their copies "
                    f"differ (ranks {same} vs {other}); replicas must be identical -- diverged "
                    "data-parallel weights, or a model-parallel tensor saved through a framework "
                    "adapter that does not know its sharding (pass framework=)"
                )


def plan_fingerprint(plan: LocalSavePlan) -> str:
    """A stable digest of a local plan: equal digests mean an equal plan."""
    h = hashlib.blake2b(digest_size=16)
    for it in plan.items:
        h.update(it.key)
    return h.hexdigest()


def plan_save(
    plans: Sequence[LocalSavePlan],
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    base_load: Sequence[int] | None = None,
    check_coverage: bool = True,
) -> list[list[WriteItem]]:
    """Global save plan: for each rank, the boxes it writes.

    Replicas are found by comparing every rank's boxes: the plan for boxes
    without a replica hint. ``base_load[r]``: bytes rank ``r`` writes
    anyway (balanced around). ``check_coverage=False`` when the plans hold
    only part of the state (the rest is checked at commit).

    Identical boxes (same tensor, box and dtype) are one box, whoever holds
    them and whatever their hints said: one holder writes each. A box a
    plan sends for a whole replica set names its ranks (``holders``).

    Raises :class:`ConfigError` when ranks disagree on a tensor's dtype or
    global shape, when two distinct boxes of a tensor overlap (a conflicting
    layout: the ranks and boxes are named), or, with ``check_coverage``,
    when the boxes held do not cover a tensor exactly.
    """
    world = len(plans)
    # box -> (its first item, the ranks holding it), keyed by plain tuples
    # (hashed in C): this loop runs once per box of every rank
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[WriteItem, list[int]]] = {}
    meta: dict[str, tuple[WriteItem, int]] = {}
    grouped: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    for rank, plan in enumerate(plans):
        if plan.rank != rank:
            raise ValueError(f"plan {rank} claims rank {plan.rank}")
        for i, it in enumerate(plan.items):
            seen = meta.get(it.fqn)
            if seen is None:
                meta[it.fqn] = (it, rank)
            elif seen[0].dtype != it.dtype or seen[0].global_shape != it.global_shape:
                raise ConfigError(
                    f"tensor {it.fqn!r}: rank {seen[1]} has dtype {seen[0].dtype} shape "
                    f"{list(seen[0].global_shape)} but rank {rank} has dtype {it.dtype} shape "
                    f"{list(it.global_shape)}; every rank must describe the same global tensor"
                )
            key = (it.fqn, it.region.offsets, it.region.lengths)
            entry = holders.get(key)
            group = plan.holders[i] if plan.holders and plan.holders[i] is not None else None
            if entry is None:
                holders[key] = (it, list(group) if group is not None else [rank])
                if group is not None:
                    grouped.add(key)
            elif group is not None or key in grouped:  # (rare: rank lists that are not in rank order)
                have = set(entry[1])
                entry[1].extend(r for r in (group or (rank,)) if r not in have)
                grouped.add(key)
            elif entry[1][-1] != rank:
                entry[1].append(rank)

    boxes: dict[str, list[Region]] = defaultdict(list)
    for it, _ in holders.values():
        boxes[it.fqn].append(it.region)
    if check_coverage:
        for fqn, (it, _) in meta.items():
            error = tiling_error(it.global_shape, boxes[fqn])
            if error is not None:
                raise ConfigError(f"tensor {fqn!r} of shape {list(it.global_shape)}: {error}")
    else:  # (boxes of fixed shares may overlap others: pieces of them)
        _refuse_overlaps(boxes, holders, meta, {r for r, p in enumerate(plans) if p.fixed})

    load = list(base_load) if base_load is not None else [0] * world
    out: list[list[WriteItem]] = [[] for _ in range(world)]
    cuts: dict[str, list[Region]] = defaultdict(list)
    for it in (it for plan in plans if plan.fixed for it in plan.items):
        cuts[it.fqn].append(it.region)
    # fixed shares that overlap (cached from different plans): the lowest rank's wins
    clash = {f for f, regions in cuts.items() if len(regions) > 1 and find_overlap(regions) is not None}
    done: dict[str, list[Region]] = defaultdict(list)
    for plan in plans:
        if plan.fixed:  # written as they are; the others' boxes lose these parts
            for it in plan.items:
                parts = [it.region]
                if it.fqn in clash:
                    parts = _minus(parts, done[it.fqn])
                    done[it.fqn].append(it.region)
                for p in parts:
                    w = it if p == it.region else dataclasses.replace(it, region=p)
                    out[plan.rank].append(w)
                    load[plan.rank] += w.nbytes
    todo: list[tuple[WriteItem, list[int]]] = []
    for it, ranks in holders.values():
        if len(ranks) == 1 and not cuts:  # one holder (a sharded box): nothing to decide
            out[ranks[0]].append(it)
            load[ranks[0]] += it.nbytes
            continue
        free = [r for r in ranks if not plans[r].fixed]
        if not free:  # (rows only fixed ranks hold and none copied fail the commit's tiling check)
            continue
        parts = _minus([it.region], cuts.get(it.fqn, []))
        todo += [(it if p == it.region else dataclasses.replace(it, region=p), free) for p in parts]
    _assign(todo, load, out, split_bytes)
    for items in out:
        items.sort(key=_order)
    return out


def _refuse_overlaps(
    boxes: dict[str, list[Region]], holders: dict[Any, tuple[WriteItem, list[int]]],
    meta: dict[str, tuple[WriteItem, int]], fixed: set[int],
) -> None:
    """Raise :class:`ConfigError` naming the ranks and boxes of the first
    tensor two distinct boxes of which overlap (a conflicting layout)."""
    for fqn, regions in boxes.items():
        if len(regions) < 2:
            continue
        if fixed:
            regions = [b for b in regions if not set(holders[(fqn, b.offsets, b.lengths)][1]) <= fixed]
        pair = find_overlap(regions) if len(regions) > 1 else None
        if pair is None:
            continue
        by = [sorted(holders[(fqn, b.offsets, b.lengths)][1]) for b in pair]
        shape = list(meta[fqn][0].global_shape)
        raise ConfigError(
            f"tensor {fqn!r} of shape {shape}: rank(s) {by[0]} hold its box {pair[0]} and rank(s) "
            f"{by[1]} its box {pair[1]}, which overlap without being the same box; every rank must hold "
            "whole shards of one layout (redistribute the tensor to one sharding, or pass the "
            "framework= adapter that describes it)"
        )


def _minus(parts: list[Region], cuts: Sequence[Region]) -> list[Region]:
    for cut in cuts:
        parts = [p for part in parts for p in part.subtract(cut)]
    return parts


def _order(w: WriteItem) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return w.fqn, w.region.offsets, w.region.lengths


def plan_replicated(
    items: Sequence[WriteItem],
    ranks: Sequence[int],
    base_load: Sequence[int],
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
) -> dict[int, list[WriteItem]]:
    """The boxes of one replica set -- ``items``, held identically by every
    rank in ``ranks`` -- spread over those ranks as :func:`plan_save` would
    (large boxes split, least-loaded rank first, starting from
    ``base_load[r]``). Pure and deterministic: every member computes the same
    answer from the same inputs, so no rank has to send its boxes anywhere.
    Returns ``{rank: boxes it writes}`` for the ranks that write something.
    A large set (:func:`~bytecp.plan.runs.uses_runs`) gives each rank one run instead."""
    if uses_runs(items, len(ranks), split_bytes, MIN_PIECE_BYTES):
        return plan_runs(items, ranks, base_load, split_bytes=split_bytes, min_piece=MIN_PIECE_BYTES)
    load = {r: base_load[r] for r in ranks}
    out: dict[int, list[WriteItem]] = {}
    _assign([(it, ranks) for it in items], load, out, split_bytes)
    for mine in out.values():
        mine.sort(key=lambda w: (w.fqn, w.region))
    return out


def _assign(
    held: Sequence[tuple[WriteItem, Sequence[int]]],
    load: Any,
    out: Any,
    split_bytes: int,
) -> None:
    """Give each box to one of its holders: largest first, a replicated box of
    at least ``split_bytes`` cut into one piece per holder (none below
    :data:`MIN_PIECE_BYTES`), each piece to the least-loaded holder (ties:
    the lowest rank). ``load`` and ``out`` are indexed by rank (lists or
    dicts) and updated in place. Each holder set keeps one heap of its ranks
    (stale entries are refreshed when popped), so a box costs O(pieces log
    holders), not O(holders)."""
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for it, ranks in sorted(held, key=lambda h: (-h[0].nbytes, h[0].fqn, h[0].region)):
        if len(ranks) == 1:  # held by one rank: nothing to decide
            r = ranks[0]
            _put(out, r, it)
            load[r] += it.nbytes
            continue
        key = tuple(ranks)
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = [(load[r], r) for r in ranks]
            heapq.heapify(heap)
        if it.nbytes >= split_bytes:
            pieces = it.region.split(min(len(ranks), max(1, it.nbytes // MIN_PIECE_BYTES)))
        else:
            pieces = [it.region]
        for piece in sorted(pieces, key=lambda p: -p.numel):
            while True:  # the least-loaded holder, refreshing entries other sets made stale
                ld, r = heapq.heappop(heap)
                if ld == load[r]:
                    break
                heapq.heappush(heap, (load[r], r))
            w = it if len(pieces) == 1 else dataclasses.replace(it, region=piece)
            _put(out, r, w)
            load[r] += w.nbytes
            heapq.heappush(heap, (load[r], r))


def _put(out: Any, rank: int, it: WriteItem) -> None:
    if isinstance(out, dict):
        out.setdefault(rank, []).append(it)
    else:
        out[rank].append(it)


def plan_shared_reads(
    specs: Sequence[Sequence[tuple[str, Region]]],
    itemsizes: dict[str, int],
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
) -> list[list[tuple[str, Region, Region]]]:
    """Zero-redundancy load plan for boxes that *every* rank targets.

    ``specs[r]`` are rank ``r``'s target boxes. Each box all ranks want is read
    once: a large one is split into one piece per rank, a small one goes whole
    to the least-loaded rank. Returns, per rank, ``(fqn, box, piece)`` to read
    and then send to every other rank.
    """
    world = len(specs)
    if world < 2:
        return [[] for _ in range(world)]
    common = set(specs[0])
    for s in specs[1:]:
        common &= set(s)
    return assign_shared(common, world, itemsizes, split_bytes=split_bytes)


def assign_shared(
    common: Iterable[tuple[str, Region]],
    world: int,
    itemsizes: dict[str, int],
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
) -> list[list[tuple[str, Region, Region]]]:
    """The pieces of the boxes ``common`` -- wanted by every one of ``world``
    ranks -- each rank reads (see :func:`plan_shared_reads`). Pure and
    deterministic: ranks that know every rank wants the same boxes compute it
    alike, without exchanging them. O(pieces log world)."""
    out: list[list[tuple[str, Region, Region]]] = [[] for _ in range(world)]
    if world < 2:
        return out
    heap = [(0, r) for r in range(world)]  # (bytes assigned, rank): already a heap
    keys = sorted(set(common), key=lambda k: (-k[1].numel * itemsizes[k[0]], k[0], k[1]))
    for fqn, box in keys:
        nbytes = box.numel * itemsizes[fqn]
        if nbytes == 0:
            continue
        # as on save: one piece per rank, none below MIN_PIECE_BYTES
        pieces = box.split(min(world, max(1, nbytes // MIN_PIECE_BYTES))) if nbytes >= split_bytes else [box]
        for piece in sorted(pieces, key=lambda p: -p.numel):
            ld, r = heapq.heappop(heap)
            out[r].append((fqn, box, piece))
            heapq.heappush(heap, (ld + piece.numel * itemsizes[fqn], r))
    for items in out:
        items.sort(key=lambda t: (t[0], t[1], t[2]))
    return out
