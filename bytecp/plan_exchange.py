"""Agreeing on a save plan across ranks, and reusing it when nothing changed.

Called by the save pipeline's plan phase (every rank). Each rank describes
the boxes it holds as a :class:`~bytecp.planner.LocalSavePlan`; its
fingerprint and the fingerprints its cached plan was made for go out in one
all-gather (together with the coordinator's target check). When every rank
holds a cached plan made for exactly this set of fingerprints -- decided
alike on every rank from the same gathered data -- the plan is reused and
nothing else is exchanged. Otherwise the local plans are gathered to the
coordinator, which runs :func:`~bytecp.planner.plan_save` and scatters each
rank its share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

from .dtypes import dtype_name, itemsize
from .planner import LocalSavePlan, WriteItem
from .state import FlatTree

__all__ = ["PlanCache", "PLAN_CACHE", "PlanVote", "local_plan", "fingerprints_digest", "reusable"]


class PlanCache:
    """This rank's share of earlier global plans, by this rank's fingerprint.

    Each entry remembers the digest of every rank's fingerprints it was made
    for; an entry is reused only if every rank agrees (see :func:`reusable`).
    """

    MAX_ENTRIES = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[tuple[Any, str], tuple[str, list[WriteItem]]] = {}

    def get(self, key: Any, fp: str) -> tuple[str, list[WriteItem]] | None:
        """(digest of all ranks' fingerprints, this rank's items) or None."""
        with self._lock:
            return self._plans.get((key, fp))

    def put(self, key: Any, fp: str, digest: str, mine: list[WriteItem]) -> None:
        with self._lock:
            self._plans[(key, fp)] = (digest, mine)
            if len(self._plans) > self.MAX_ENTRIES:
                self._plans.pop(next(iter(self._plans)))

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


#: one cache per process (plans of different groups/world sizes never mix: see the key)
PLAN_CACHE = PlanCache()


@dataclasses.dataclass(frozen=True)
class PlanVote:
    """What every rank sends in the plan phase's all-gather."""

    #: fingerprint of this rank's local plan
    fingerprint: str
    #: digest of the fingerprints this rank's cached plan was made for (None: no cached plan)
    cached_for: str | None
    #: digest of this rank's state skeleton (a rank whose skeleton differs
    #: from the coordinator's sends it at commit)
    skeleton: str
    #: the coordinator's only: the new save's id (None on other ranks)
    save_id: str | None = None


def local_plan(flat: FlatTree, rank: int) -> LocalSavePlan:
    """(every rank) Every box this rank holds, for every tensor of its state."""
    items = []
    for fqn, leaf in flat.tensors.items():
        name = dtype_name(leaf.dtype)
        size = itemsize(leaf.dtype)
        shape = tuple(leaf.global_shape)
        for sh in leaf.shards:
            items.append(WriteItem(fqn, sh.region, name, size, shape))
    return LocalSavePlan(rank, tuple(items))


def fingerprints_digest(fingerprints: Sequence[str]) -> str:
    """One digest of every rank's fingerprint, in rank order."""
    return hashlib.blake2b("|".join(fingerprints).encode(), digest_size=16).hexdigest()


def reusable(votes: Sequence[PlanVote]) -> tuple[str, bool]:
    """``(digest of this save's fingerprints, whether every rank's cached plan
    was made for exactly them)``; the same answer on every rank. The digest
    is computed once: O(W) per rank."""
    digest = fingerprints_digest([v.fingerprint for v in votes])
    return digest, all(v.cached_for == digest for v in votes)
