"""The decision every rank computes alike from every rank's plan vote.

Called by the save pipeline's plan phase (every rank, right after the plan
all-gather; through :mod:`bytecp.plan.exchange`, which re-exports it): the
votes arrive as W encoded byte strings (:mod:`bytecp.plan.votes`) and are
read as NumPy columns; every step below is a sort or a reduction over
them -- O((W + set entries) log W), no Python object per rank. What the
decision holds per replica set (``groups``, ``merged``) is read lazily:
a rank looks up only the sets it is in, so ``"own:<rank>"`` entries for W
ranks are never built unless someone walks the whole mapping (tests).
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import numpy as np

from bytecp.errors import DistributedCheckpointError
from bytecp.plan.votes import CACHED, FIXED, OWN, UNKNOWN, PlanVote, VoteTable, key_text

__all__ = ["PlanDecision", "decide", "fingerprints_digest", "sends_specs"]

Groups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class PlanDecision:
    """What the votes say, computed alike on every rank."""

    #: digest of every rank's fingerprint, in rank order
    digest: str
    #: every rank holds a plan cached for exactly this digest
    reuse: bool
    #: replica sets whose members do not all hold the same boxes
    bad_sets: frozenset[str]
    #: bytes every rank writes of its own boxes, by rank
    base_load: tuple[int, ...]
    #: sound replica sets (``"own:<rank>"`` for a rank's own boxes) whose
    #: boxes other sets hold as well (equal fingerprints): set key -> every
    #: rank holding them, planned as one set
    merged: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: the ranks of every set (bad sets: per group of members holding the
    #: same boxes, ordered by their lowest rank), for the boxes sent to the
    #: coordinator: set key -> groups
    groups: Mapping[str, Groups] = dataclasses.field(default_factory=dict)
    #: some rank holds boxes without a hint
    unknown: bool = False
    #: bad sets whose groups hold different tensors (pipeline stages), each
    #: group planned locally as a set of its own (:mod:`bytecp.plan.split_sets`)
    split: Mapping[str, Groups] = dataclasses.field(default_factory=dict)
    #: by rank: the lowest rank whose state skeleton digest is the same (at
    #: a job's first save only those ranks send their skeleton and specs); None: not known
    skeletons: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    #: digest of every distinct state skeleton (its specs digest) with its
    #: lowest rank: equal keys, equal union of what the ranks describe (the
    #: coordinator's commit reuses the union it built for the last such key)
    specs_key: str = dataclasses.field(default="", compare=False)

    @property
    def coordinated(self) -> bool:
        """Whether the coordinator plans some boxes (a gather and a scatter follow)."""
        return bool(self.bad_sets) or self.unknown

    def skeleton_leader(self, rank: int) -> int:
        """The lowest rank whose state skeleton is the same as ``rank``'s."""
        return rank if self.skeletons is None else int(self.skeletons[rank])

    def skeletons_differ(self, coordinator: int) -> bool:
        """Whether some rank's state skeleton differs from the coordinator's
        (then the lowest rank of each other skeleton sends it: :func:`sends_specs`)."""
        if self.skeletons is None:
            return True
        return bool((self.skeletons != self.skeleton_leader(coordinator)).any())


def sends_specs(decision: PlanDecision, rank: int, coordinator: int) -> tuple[bool, bool]:
    """(every rank, end of the plan phase) Whether ``rank``'s state skeleton
    differs from the coordinator's (it writes the values the coordinator
    lacks), and whether it sends its skeleton and tensor specs when the
    coordinator holds no union of them yet (:func:`~bytecp.saving.union.gather_union`):
    only the lowest rank of each skeleton other than the coordinator's
    does; the coordinator's merge of them covers every rank of that skeleton."""
    leader = decision.skeleton_leader(rank)
    differs = leader != decision.skeleton_leader(coordinator)
    return differs, differs and leader == rank


def fingerprints_digest(fingerprints: Sequence[str]) -> str:
    """One digest of every rank's fingerprint, in rank order."""
    return hashlib.blake2b("|".join(fingerprints).encode(), digest_size=16).hexdigest()


def _digest_of(fps: np.ndarray) -> str:
    """:func:`fingerprints_digest` of 16-byte fingerprints (``V16``), without a string per rank."""
    w = len(fps)
    text = np.empty((w, 33), np.uint8)
    text[:, :32] = np.frombuffer(binascii.hexlify(fps.tobytes()), np.uint8).reshape(w, 32)
    text[:, 32] = ord("|")
    return hashlib.blake2b(text.tobytes()[:-1], digest_size=16).hexdigest()


def _ids(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of the distinct values of a ``V16`` column (equal values,
    equal ids) and, by id, the lowest index holding the value: one stable
    sort of two 64-bit words per value."""
    words = col.view("<u8").reshape(len(col), 2)
    order = np.lexsort((words[:, 1], words[:, 0]))
    ordered = words[order]
    new = np.ones(len(col), bool)
    new[1:] = (ordered[1:, 0] != ordered[:-1, 0]) | (ordered[1:, 1] != ordered[:-1, 1])
    ids = np.empty(len(col), np.int32)
    ids[order] = np.cumsum(new, dtype=np.int32) - 1
    return ids, order[new]


def _refuse_other_targets(table: VoteTable) -> None:
    differ = table.targets_differ()
    if differ.size:  # paired collectives of two saves: never commit them
        first = table.target_of(0)
        raise DistributedCheckpointError("save/plan", {r: (
            f"saving to {table.target_of(r)} while rank 0 saves to {first}: the ranks are in different saves "
            "(a rank that missed a deadline is a save behind); nothing is committed") for r in differ.tolist()})


def decide(votes: Sequence[bytes | PlanVote] | VoteTable) -> PlanDecision:
    """(every rank, the same answer everywhere) Reuse the cached plans, or
    which replica sets are sound and whether the coordinator must plan.
    ``votes``: every rank's encoded vote (:meth:`PlanVote.encode`; a
    :class:`PlanVote` is encoded first), or their :class:`VoteTable` when
    the caller built it already (the save's plan phase). Refuses votes naming different
    targets (:class:`DistributedCheckpointError` naming each rank).

    Sets whose members hold different boxes are bad (the coordinator plans
    them, one copy per group of members that agree); sound sets (and ranks'
    own boxes) whose fingerprints are equal hold the same boxes under
    different hints and are merged into one set, so no box is written twice."""
    if isinstance(votes, VoteTable):
        table = votes
    else:
        if votes and isinstance(votes[0], PlanVote):  # (tests, benchmarks: votes not sent anywhere)
            votes = [v.encode() for v in cast("Sequence[PlanVote]", votes)]
        table = VoteTable.of(cast("Sequence[bytes]", votes))
    _refuse_other_targets(table)
    heads = table.heads
    digest = _digest_of(table.column16("fingerprint"))
    base = tuple(heads["own_bytes"].tolist())
    specs = table.column16("skeleton")
    ids, first = _ids(specs)
    skeletons = first[ids]
    leaders = np.sort(first)
    key = hashlib.blake2b(leaders.astype("<i8").tobytes() + specs[leaders].tobytes(), digest_size=16).hexdigest()
    if table.flag(CACHED).all() and (table.column16("cached_for") == np.void(bytes.fromhex(digest))).all():
        return PlanDecision(digest, True, frozenset(), base, skeletons=skeletons, specs_key=key)
    units = _Units(table)
    unknown = bool(table.flag(UNKNOWN).any())
    groups: Mapping[str, Groups] = {} if table.flag(FIXED).any() else _GroupsView(units)
    # (a cached share written as it is: every rank sends all it holds, no groups)
    return PlanDecision(digest, False, units.bad_keys(), base, _MergedView(units), groups, unknown,
                        skeletons=skeletons, specs_key=key)


class _Units:
    """Every replica set voted (by key) and every rank's own boxes
    (``own:<rank>``), as units: unit ``u < K`` is the set ``keys[u]``, unit
    ``K + i`` the own boxes of ``own_ranks[i]``. Each unit's members (rank
    order) and their fingerprint ids, and which units are bad or merged."""

    def __init__(self, table: VoteTable) -> None:
        key_id, key_first = _ids(table.set_column16("key"))
        self.keys = [key_text(bytes(k)) for k in table.sets["key"][key_first]]
        self.key_index = {k: i for i, k in enumerate(self.keys)}
        n_keys, n_sets = len(self.keys), len(table.sets)
        own_ranks = np.flatnonzero(table.flag(OWN)).astype(np.int32)
        self.n_keys, self.own_ranks = n_keys, own_ranks
        self.own_unit = np.full(len(table.heads), -1, np.int32)
        self.own_unit[own_ranks] = n_keys + np.arange(len(own_ranks), dtype=np.int32)
        # set entries by unit (stable: each unit's in rank order), then one entry per own unit
        order = np.argsort(key_id, kind="stable")
        fp_id = _ids(np.concatenate([table.set_column16("fp"), table.column16("own_fp")[own_ranks]]))[0]
        set_fp, own_fp = fp_id[:n_sets][order], fp_id[n_sets:]
        self.rank = np.concatenate([table.set_rank[order], own_ranks])
        self.fp_id = np.concatenate([set_fp, own_fp])
        count = np.concatenate([np.bincount(key_id, minlength=n_keys), np.ones(len(own_ranks), np.int64)])
        self.start = np.concatenate([[0], np.cumsum(count)])
        # a set is bad if its members vote different fingerprints or sizes, or
        # are not as many as the size says (a rank's own boxes never are)
        fp_lo, bad = own_fp, np.zeros(len(count), bool)
        if n_keys:
            at, size = self.start[:n_keys], table.sets["size"][order]
            lo = np.minimum.reduceat(set_fp, at)
            s_lo = np.minimum.reduceat(size, at)
            bad[:n_keys] = (lo != np.maximum.reduceat(set_fp, at)) | (s_lo != np.maximum.reduceat(size, at)) \
                | (count[:n_keys] != s_lo)
            fp_lo = np.concatenate([lo, own_fp])
        self.bad = bad
        # sound units of equal fingerprints: merged, each over the union of their members
        sound = np.flatnonzero(~bad)
        vals, counts = np.unique(fp_lo[sound], return_counts=True)
        merged = sound[np.isin(fp_lo[sound], vals[counts > 1])]
        self.merged_fp = np.full(len(count), -1, np.int64)
        self.merged_fp[merged] = fp_lo[merged]
        entry = np.repeat(self.merged_fp >= 0, count)
        world = max(1, len(table.heads))
        pairs = np.unique(self.fp_id[entry].astype(np.int64) * world + self.rank[entry])
        self.merged_fps, cut = np.unique(pairs // world, return_index=True)
        self.merged_ranks, self.merged_cut = pairs % world, np.append(cut, len(pairs))
        self.merged_units = merged
        self._ranks_of_fp: dict[int, tuple[int, ...]] = {}

    def unit_of(self, key: str) -> int:
        """The unit of a set key or ``own:<rank>``; -1: not voted."""
        if key.startswith("own:"):
            r = key[4:]
            return int(self.own_unit[int(r)]) if r.isdigit() and int(r) < len(self.own_unit) else -1
        return self.key_index.get(key, -1)

    def key_of(self, u: int) -> str:
        return self.keys[u] if u < self.n_keys else f"own:{int(self.own_ranks[u - self.n_keys])}"

    def bad_keys(self) -> frozenset[str]:
        return frozenset(self.keys[u] for u in np.flatnonzero(self.bad[:self.n_keys]).tolist())

    def groups(self, u: int) -> Groups:
        """The unit's members, per fingerprint, groups ordered by their lowest rank."""
        ranks, fps = self.rank[self.start[u]:self.start[u + 1]], self.fp_id[self.start[u]:self.start[u + 1]]
        if not self.bad[u]:
            return (tuple(ranks.tolist()),)
        _, first, which = np.unique(fps, return_index=True, return_inverse=True)  # (one set: W at most)
        return tuple(tuple(ranks[which.reshape(-1) == g].tolist()) for g in np.argsort(first).tolist())

    def merged_ranks_of(self, u: int) -> tuple[int, ...]:
        fp = int(self.merged_fp[u])
        got = self._ranks_of_fp.get(fp)
        if got is None:
            i = int(np.searchsorted(self.merged_fps, fp))
            got = self._ranks_of_fp[fp] = tuple(self.merged_ranks[self.merged_cut[i]:self.merged_cut[i + 1]].tolist())
        return got


class _GroupsView(Mapping[str, Groups]):
    """``PlanDecision.groups`` read from the units on demand."""

    def __init__(self, units: _Units) -> None:
        self._units = units

    def __getitem__(self, key: str) -> Groups:
        u = self._units.unit_of(key)
        if u < 0:
            raise KeyError(key)
        return self._units.groups(u)

    def __iter__(self) -> Iterator[str]:
        return (self._units.key_of(u) for u in range(len(self._units.bad)))

    def __len__(self) -> int:
        return len(self._units.bad)


class _MergedView(Mapping[str, tuple[int, ...]]):
    """``PlanDecision.merged`` read from the units on demand."""

    def __init__(self, units: _Units) -> None:
        self._units = units

    def __getitem__(self, key: str) -> tuple[int, ...]:
        u = self._units.unit_of(key)
        if u < 0 or self._units.merged_fp[u] < 0:
            raise KeyError(key)
        return self._units.merged_ranks_of(u)

    def __iter__(self) -> Iterator[str]:
        return (self._units.key_of(u) for u in self._units.merged_units.tolist())

    def __len__(self) -> int:
        return len(self._units.merged_units)
