"""Agreeing on a save plan across ranks without gathering every rank's boxes.

Called by the save pipeline's plan phase (every rank). Each rank describes
the boxes it holds (:func:`local_plan`) and sorts them by the replica hint
its adapter gave (:class:`~bytecp.tree.state.ReplicaSet`):

- boxes only this rank holds (FSDP shards): it writes them, nobody needs to
  hear about them;
- boxes of a replica set (DDP, HSDP's replicate dimension, plain tensors on
  every rank): every member computes the same split of the set's boxes over
  the set's ranks (:func:`~bytecp.plan.planner.plan_replicated`) -- the members
  only compare a fingerprint of what they hold;
- boxes without a hint, and the boxes of a set whose members turn out to
  hold different things: the coordinator finds the replicas by comparing
  those boxes (:func:`~bytecp.plan.planner.plan_save`) and sends each rank its
  share.

One all-gather of a :class:`PlanVote` per rank (a few fingerprints, O(1) in
the world size, encoded as flat bytes: :mod:`bytecp.plan.votes`) carries
everything the decision needs; the decision (:func:`decide`,
:mod:`bytecp.plan.decide`: NumPy over every vote's columns) is computed
alike on every rank from the same votes. Only
when some rank holds boxes without a (valid) hint are those boxes gathered.
When every rank holds a cached plan made for exactly this set of
fingerprints, nothing is recomputed at all.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from bytecp.plan.decide import PlanDecision, decide, fingerprints_digest, sends_specs
from bytecp.plan.planner import LocalSavePlan, WriteItem, plan_fingerprint, plan_replicated
from bytecp.plan.share import share_of
from bytecp.plan.votes import PlanVote, read_vote
from bytecp.tree.dtypes import dtype_name, itemsize
from bytecp.tree.kept import memoized, state_digest
from bytecp.tree.state import EVERY_RANK, FlatTree, ReplicaSet

__all__ = [
    "PlanCache",
    "PLAN_CACHE",
    "PlanVote",
    "PlanDecision",
    "read_vote",
    "sends_specs",
    "local_plan",
    "vote_for",
    "plan_key",
    "fingerprints_digest",
    "decide",
    "planned_locally",
    "needs_coordinator",
    "specs_digest",
    "holdings",
    "ballot",
    "PlanStats",
    "PLAN_STATS",
]


class PlanCache:
    """This rank's share of earlier global plans, by this rank's fingerprint.

    Each entry remembers the digest of every rank's fingerprints it was made
    for; an entry is reused only if every rank agrees (see :func:`decide`).
    The entry of the last committed save (per key) is also the one an async
    snapshot may copy alone (:meth:`latest`): every rank's latest entry
    belongs to the same global plan, so the shares copied are disjoint.
    """

    MAX_ENTRIES = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[tuple[Any, str], tuple[str, list[WriteItem]]] = {}
        self._latest: dict[Any, str] = {}

    def get(self, key: Any, fp: str) -> tuple[str, list[WriteItem]] | None:
        """(digest of all ranks' fingerprints, this rank's items) or None."""
        with self._lock:
            return self._plans.get((key, fp))

    def latest(self, key: Any, fp: str) -> tuple[str, list[WriteItem]] | None:
        """The entry for ``fp`` only if it is the plan of the last save
        committed under ``key`` (what the other ranks' latest entries belong
        to as well)."""
        with self._lock:
            return self._plans.get((key, fp)) if self._latest.get(key) == fp else None

    def put(self, key: Any, fp: str, digest: str, mine: list[WriteItem]) -> None:
        """(after a commit) This rank's share of the plan just committed."""
        with self._lock:
            self._plans[(key, fp)] = (digest, mine)
            self._latest[key] = fp
            if len(self._plans) > self.MAX_ENTRIES:
                self._plans.pop(next(iter(self._plans)))

    def touch(self, key: Any, fp: str) -> None:
        """(after a commit that reused the entry for ``fp``) It is the latest."""
        with self._lock:
            if (key, fp) in self._plans:
                self._latest[key] = fp

    def forget(self, key: Any) -> None:
        """(after a failed save) No entry is the latest: the next async
        snapshot copies every box the rank holds."""
        with self._lock:
            self._latest.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._latest.clear()


#: one cache per process (plans of different groups/world sizes never mix: see the key)
PLAN_CACHE = PlanCache()


@dataclasses.dataclass
class PlanStats:
    """What this process's save plans cost (read by tests and benchmarks):
    plans made (not reused), of those how many the coordinator took part in,
    the boxes this rank sent it, the replica sets split by stage, and the
    saves at which it sent its skeleton and tensor specs."""

    planned: int = 0
    coordinated: int = 0
    boxes_sent: int = 0
    split_sets: int = 0
    #: saves at which this rank sent its skeleton and tensor specs (bytecp.saving.union.gather_union)
    specs_sent: int = 0


#: counted by the save pipeline's plan phase
PLAN_STATS = PlanStats()


def local_plan(
    flat: FlatTree, rank: int, world_size: int = 1,
    to_group: Callable[[tuple[int, ...]], tuple[int, ...] | None] | None = None,
) -> LocalSavePlan:
    """(every rank) Every box this rank holds, with its replica set; a hint
    naming ranks outside the group, or not this rank, counts as no hint.
    ``to_group`` turns the global ranks adapters name into the checkpoint
    group's ranks (:meth:`bytecp.dist.DistContext.group_ranks`)."""
    items: list[WriteItem] = []
    sets: list[ReplicaSet | None] = []
    resolved: dict[int, ReplicaSet | None] = {}
    for fqn, leaf in flat.tensors.items():
        hint = leaf.replicas
        rs: ReplicaSet | None = None
        if hint is not None:
            if id(hint) not in resolved:
                resolved[id(hint)] = _resolve(hint, rank, world_size, to_group)
            rs = resolved[id(hint)]
        name = dtype_name(leaf.dtype)
        size = itemsize(leaf.dtype)
        shape = tuple(leaf.global_shape)
        for sh in leaf.shards:
            items.append(WriteItem(fqn, sh.region, name, size, shape))
            sets.append(rs)
    return LocalSavePlan(rank, tuple(items), tuple(sets))


def holdings(
    flat: FlatTree, rank: int, world_size: int = 1,
    to_group: Callable[[tuple[int, ...]], tuple[int, ...] | None] | None = None,
    group: Any = None,
) -> tuple[LocalSavePlan, str]:
    """(every rank, the save's plan phase or an async snapshot before it)
    Every box this rank holds (:func:`local_plan`) and its fingerprint
    (:func:`plan_key`), the key of this rank's cached plans. A state made
    only of :class:`~bytecp.tree.state.Prebuilt` pieces whose tensors are
    those of the last call (a description kept between saves) gets that
    call's answer again (``group``: the group ``to_group`` maps into)."""
    def make() -> tuple[LocalSavePlan, str]:
        plan = local_plan(flat, rank, world_size, to_group)
        return plan, plan_key(plan)

    return memoized(flat, ("holdings", rank, world_size, id(group)), make)


def ballot(
    held: LocalSavePlan, fingerprint: str, flat: FlatTree, cache_key: Any, save_id: str | None,
    objects: tuple[str, ...] = (), target: str = "", step: int | None = None, context: int = 0,
    unions: tuple[str, ...] = (),
) -> tuple[bytes, tuple[str, list[WriteItem]] | None]:
    """(every rank, inside the plan phase's all-gather) This rank's vote for
    the boxes it writes from (``held``), with the digest its cached plan for
    ``fingerprint`` was made for and the digest of its state's specs,
    encoded (:meth:`PlanVote.encode`); and that cached plan (None: none).
    ``save_id``, ``objects`` and ``unions`` (the specs keys of the unions of
    skeletons it keeps): the coordinator's; ``target``, ``step``
    and ``context``: which save this is (:mod:`bytecp.saving.resync`)."""
    cached = PLAN_CACHE.get(cache_key, fingerprint)
    vote = vote_for(held, fingerprint, cached[0] if cached else None, specs_digest(flat), save_id)
    return dataclasses.replace(vote, objects=objects, target=target, step=step, context=context,
                               unions=unions).encode(), cached


def _resolve(
    hint: ReplicaSet, rank: int, world_size: int,
    to_group: Callable[[tuple[int, ...]], tuple[int, ...] | None] | None,
) -> ReplicaSet | None:
    if hint is EVERY_RANK or not hint.ranks:
        return ReplicaSet.world(world_size)
    ranks = to_group(hint.ranks) if to_group is not None else hint.ranks
    if not ranks or ranks[0] < 0 or ranks[-1] >= world_size:
        return None
    i = bisect.bisect_left(ranks, rank)
    if i == len(ranks) or ranks[i] != rank:
        return None
    return hint if ranks is hint.ranks else ReplicaSet.of(ranks)


def specs_digest(flat: FlatTree) -> str:
    """The state's skeleton and aliases and its tensors' names, dtypes and
    shapes, as one digest."""
    h = hashlib.blake2b(state_digest(flat).encode(), digest_size=16)
    h.update(memoized(flat, ("specs digest",), lambda: _tensors_digest(flat), specs=True))
    return h.hexdigest()


def _tensors_digest(flat: FlatTree) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for fqn, leaf in flat.tensors.items():
        h.update(f"{fqn}|{dtype_name(leaf.dtype)}|{tuple(leaf.global_shape)};".encode())
    return h.digest()


def plan_key(plan: LocalSavePlan) -> str:
    """The fingerprint of a local plan with its replica hints (the plan cache's key)."""
    h = hashlib.blake2b(plan_fingerprint(plan).encode(), digest_size=16)
    for rs in plan.sets:
        h.update(b"-" if rs is None else rs.key.encode())
    return h.hexdigest()


def vote_for(
    plan: LocalSavePlan, fingerprint: str, cached_for: str | None, skeleton: str, save_id: str | None
) -> PlanVote:
    """(every rank) This rank's vote: fingerprints of its plan and of each replica set's boxes."""
    own, sets, unknown, own_fp = plan.digests
    return PlanVote(fingerprint, cached_for, skeleton, save_id, own, sets, unknown, own_fp=own_fp,
                    fixed=plan.fixed)


def planned_locally(
    plan: LocalSavePlan, decision: PlanDecision, *, split_bytes: int,
    shared: dict[tuple[tuple[int, ...], tuple[WriteItem, ...]], dict[int, list[WriteItem]]] | None = None,
) -> list[WriteItem]:
    """(every rank) The boxes this rank writes of those planned without the
    coordinator: its own boxes, and its share of every sound replica set
    (merged sets: over all their ranks); nothing when the coordinator plans
    (:func:`needs_coordinator` sends it every box, one copy per set).
    ``shared``: plans of replica sets already made, by (set's ranks, its
    boxes) -- every member makes the same one, so a simulation of many ranks
    in one process makes each once."""
    if decision.coordinated:
        return []
    mine: list[WriteItem] = []
    by_set: dict[str, tuple[tuple[int, ...], list[WriteItem]]] = {}
    own = f"own:{plan.rank}"
    for it, rs in zip(plan.items, plan.sets or (None,) * len(plan.items), strict=True):
        if rs is None or rs.key in decision.bad_sets:
            continue
        key = own if rs.size == 1 else rs.key
        ranks = decision.merged.get(key)
        if key in decision.split:  # this rank's group of a set split by stage
            ranks = next(g for g in decision.split[key] if plan.rank in g)
        if ranks is None and rs.size == 1:
            mine.append(it)
        else:
            by_set.setdefault(key, (ranks or rs.ranks, []))[1].append(it)
    loads = np.asarray(decision.base_load, dtype=np.int64) if by_set and shared is None else None
    for ranks, items in by_set.values():
        if shared is None:  # a real rank: its share alone (the same as plan_replicated's)
            assert loads is not None  # (made above whenever a real rank has a set)
            mine.extend(share_of(items, ranks, loads, plan.rank, split_bytes=split_bytes))
            continue
        memo = (tuple(ranks), tuple(items))  # frozen boxes: hashed by value, no text made
        share = shared.get(memo)
        if share is None:
            share = shared[memo] = plan_replicated(items, ranks, decision.base_load, split_bytes=split_bytes)
        mine.extend(share.get(plan.rank, []))
    return mine


def needs_coordinator(plan: LocalSavePlan, decision: PlanDecision) -> LocalSavePlan:
    """(every rank, when the decision is coordinated) The boxes the
    coordinator plans, with the ranks holding them: this rank's own boxes
    and those without a hint; a replica set's boxes from its lowest member
    only (a bad set's: from the lowest member of each group that holds the
    same boxes), so the coordinator compares one copy per group and finds
    boxes held under different hints, or none. A rank writing a cached share
    as it is (``fixed``) sends it all (:func:`~bytecp.plan.planner.plan_save`)."""
    if plan.fixed:
        return LocalSavePlan(plan.rank, plan.items, fixed=True)
    items: list[WriteItem] = []
    holders: list[tuple[int, ...] | None] = []
    chosen: dict[str, tuple[int, ...] | None] = {}
    for it, rs in zip(plan.items, plan.sets or (None,) * len(plan.items), strict=True):
        if rs is None or rs.size == 1:
            items.append(it)
            holders.append(None)
            continue
        if rs.key not in chosen:
            members = next((g for g in decision.groups.get(rs.key, ()) if plan.rank in g), (plan.rank,))
            chosen[rs.key] = members if members[0] == plan.rank else None
        group = chosen[rs.key]
        if group is not None:
            items.append(it)
            holders.append(group)
    return LocalSavePlan(plan.rank, tuple(items), fixed=False, holders=tuple(holders))
