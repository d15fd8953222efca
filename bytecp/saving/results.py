"""What one save phase hands the next: frozen values, no state left behind.

Returned by the phases of :class:`~bytecp.saving.pipeline.SavePipeline` and
passed on by the schedules of :mod:`bytecp.saving.schedule` (every rank):
describe (and an async snapshot, of the :class:`Share` it copies) returns a
:class:`Described`, the plan a
:class:`SavePlanResult`, the stage a :class:`StagedBatch`; the write returns
the rank's :class:`~bytecp.saving.writer.RankOutput`, which the commit sends.
A phase whose failure is kept for the next collective returns the empty
value of its kind (:data:`NOTHING_DESCRIBED`, :func:`nothing_staged`); the
next collective raises the failure before anything reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bytecp.plan.planner import LocalSavePlan, WriteItem
from bytecp.saving.ahead import Ahead
from bytecp.saving.reuse import Reused, Tokens
from bytecp.saving.staging import Stager
from bytecp.saving.writer import RankOutput, Staged
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node
from bytecp.tree.state import FlatTree

if TYPE_CHECKING:
    from bytecp.saving.commit import Replaced

__all__ = ["Share", "Described", "SavePlanResult", "StagedBatch", "NOTHING_DESCRIBED", "nothing_staged"]


@dataclasses.dataclass(frozen=True)
class Share:
    """What an async snapshot copies (chosen by
    :meth:`~bytecp.saving.pipeline.SavePipeline.share`): this rank's share of
    the last committed plan when it has one for this state, else every box
    it holds. Only that plan's share is copied alone because every rank's
    is from that same plan, so the shares copied are disjoint."""

    #: every box this rank holds, and its fingerprint
    local: LocalSavePlan
    fingerprint: str
    #: the boxes copied (of the cached share: less those an incremental save
    #: references in its base, never written)
    items: tuple[WriteItem, ...]
    #: the cached share only: the boxes copied as a fixed plan (a new plan
    #: gives this rank exactly these, the other holders the rest)
    held: LocalSavePlan | None = None


@dataclasses.dataclass(frozen=True)
class Described:
    """The state being saved, as the later phases see it: views of the live
    tensors (describe), or, after an async snapshot, their copies."""

    flat: FlatTree
    framework: str = ""
    parallelism: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: after a snapshot: the stager that hands the writer the copies (None:
    #: the pipeline's own stager stages the boxes)
    stager: Stager | None = None
    #: after a snapshot: what it copied
    share: Share | None = None
    #: after a snapshot with replica checks: crc32c of every box this rank holds
    replica_crcs: Mapping[tuple[str, Region], int] | None = None
    #: each live shard's version token (:mod:`bytecp.saving.reuse`), taken
    #: before any copy; None where the framework writes behind the counters
    tokens: Tokens | None = None
    #: an event on each CUDA device's current stream, recorded on the
    #: caller's thread when the save was asked for: device copies of the live
    #: tensors wait for it, on any thread (:mod:`bytecp.device_memory`)
    ready: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    #: an eager save's guessed copies, running while it described the state
    #: (:class:`bytecp.saving.ahead.Ahead`; the snapshot takes or ends them)
    ahead: Ahead | None = None


@dataclasses.dataclass(frozen=True)
class SavePlanResult:
    """What the plan decided for this rank, and what the commit needs of it."""

    #: named by the coordinator
    save_id: str
    #: the boxes this rank writes
    items: tuple[WriteItem, ...]
    #: every box this rank holds (its replica checksums cover them all)
    local: LocalSavePlan
    #: this rank's state tree differs from the coordinator's: it writes the
    #: values the coordinator lacks
    skeleton_differs: bool = False
    #: the plan decision's key of every distinct skeleton and its lowest rank
    #: (:attr:`~bytecp.plan.decide.PlanDecision.specs_key`): the coordinator's
    #: commit reuses its last union of the skeletons sent when it is the same
    specs_key: str = ""
    #: (coordinator) the union of what the ranks describe for ``specs_key``:
    #: kept from its last commit (it said so in its vote, and no rank sent
    #: its skeleton), or gathered at this plan phase and merging on a thread
    #: (:func:`~bytecp.saving.union.gather_union`); None: the commit takes
    #: the coordinator's own (every rank's skeleton is the same)
    union: Any = None
    #: the names of the values the coordinator writes
    coordinator_objects: frozenset[str] = frozenset()
    #: (coordinator) the committed checkpoint an overwrite replaces
    replaced: Replaced | None = None
    #: what the plan cache learns once the save commits: (fingerprint, digest
    #: of every rank's, this rank's items) of a new plan, or the fingerprint
    #: of the reused one (``reused``); a plan that failed is never cached
    cache_entry: tuple[str, str, tuple[WriteItem, ...]] | None = None
    fingerprint: str = ""
    reused: bool = False
    #: the boxes this rank references in the base instead of writing them
    referenced: Reused = dataclasses.field(default_factory=Reused)


@dataclasses.dataclass(frozen=True)
class StagedBatch:
    """The staged boxes the write phase writes, and what the batches written
    while staging (under a memory budget) left for the commit."""

    staged: tuple[Staged, ...]
    written: RankOutput


NOTHING_DESCRIBED = Described(FlatTree(Node.container("dict", ()), {}, {}, {}, {}))


def nothing_staged() -> StagedBatch:
    """The value of a stage phase that failed (or was skipped): nothing to write."""
    return StagedBatch((), RankOutput())

