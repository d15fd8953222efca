"""Where a follower takes its next checkpoint from: the run in storage and,
when given, its memory tier (``keeper://``), whichever has the newest step.

Called by the coordinator of :func:`bytecp.serving.follow.follow` once per
poll (:meth:`Sources.newest`), before it pins and broadcasts what to take,
and by every rank for the options of the tier it reads
(:meth:`Sources.options_for`).

Each poll lists both tiers: storage through the resume decision
(:func:`bytecp.tools.resume.decide`: a run folder whose newest checkpoint
cannot be told, or a storage error while listing, is raised, never read
as "nothing newer"), the memory tier with the same
listing checked by :meth:`bytecp.tools.tiers.MemoryTier.latest` (only a
*complete* memory checkpoint, every file held by a live keeper, is a
candidate; an unreachable keeper is no candidate, never an error). The
newer step wins, memory first on a tie (it is there first: the drain copies
it to storage later). A checkpoint whose ``save_id`` is the one the
follower holds is the same save in the other tier -- the drain copies a
memory checkpoint byte for byte, ``metadata.json`` included -- and is not
read again; nor is a step older than the one held (the other tier lagging).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from bytecp.catalog import CheckpointInfo, list_checkpoints
from bytecp.errors import StorageError
from bytecp.format.header import read_header
from bytecp.storage_api import open_storage
from bytecp.tools.resume import decide
from bytecp.tools.tiers import MemoryTier, restore_order

__all__ = ["Held", "Newest", "Sources"]

log = logging.getLogger("bytecp")


@dataclasses.dataclass(frozen=True)
class Held:
    """What the follower holds: its URL, step and save id (None: nothing yet)."""

    url: str | None = None
    step: int | None = None
    save_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Newest:
    """The checkpoint to take next, its tier and the steps passed over to reach it."""

    info: CheckpointInfo
    tier: str  # "storage" or "memory"
    skipped: int
    save_id: str
    #: the newest committed step either tier listed (the follower's lag counts from it)
    newest_step: int | None = None


class Sources:
    """The run's tiers as one source of checkpoints, newest step first."""

    def __init__(self, run_url: str, options: Mapping[str, Any], memory_url: str | None,
                 memory_options: Mapping[str, Any] | None) -> None:
        self.run_url, self.options = run_url.rstrip("/"), dict(options)
        self.memory = (MemoryTier(memory_url, 1, None, dict(memory_options or {}))
                       if memory_url is not None else None)

    def tier_of(self, url: str) -> str:
        """The tier a checkpoint URL lies in (``held=``)."""
        if self.memory is not None and url.rstrip("/").startswith(self.memory.url + "/"):
            return "memory"
        return "storage"

    def options_for(self, tier: str) -> dict[str, Any]:
        if tier == "memory":
            assert self.memory is not None
            return dict(self.memory.storage_options)
        return dict(self.options)

    def _memory_listing(self) -> list[CheckpointInfo]:
        assert self.memory is not None
        try:
            return list_checkpoints(self.memory.url, storage_options=self.memory.storage_options)
        except StorageError as e:
            log.debug("bytecp.follow: memory tier %s unavailable (%s)", self.memory.url, e)
            return []

    def newest(self, held: Held, failed: set[str]) -> Newest | None:
        """(coordinator, each poll) The checkpoint to take, or None: nothing
        newer than ``held`` (the same save in the other tier, an older step,
        one that ``failed`` already)."""
        stored = list(decide(self.run_url, self.options).candidates()[::-1])  # (raises when undecided)
        mem_list = self._memory_listing() if self.memory is not None else []
        mem = self.memory.latest(mem_list) if self.memory is not None and mem_list else None
        if self.memory is None:  # one tier: its newest, whatever its step (as before the memory tier)
            pick = stored[-1] if stored else None
            order = [(pick, "storage")] if pick is not None else []
        else:
            cands = restore_order(mem, {}, stored[-1] if stored else None, {})
            order = [(c.info, c.tier) for c in cands]
        for info, tier in order:
            if info.url in failed or info.url == held.url:
                continue
            if self.memory is not None and _older(info.step, held.step):
                continue
            sid = self._save_id(info, tier)
            if sid is not None and sid == held.save_id:
                continue  # the same save, drained to the other tier: already held
            return Newest(info, tier, _skipped(stored + mem_list, held, info, failed), sid or "",
                          max((c.step for c in stored + mem_list if c.step is not None), default=None))
        return None

    def _save_id(self, info: CheckpointInfo, tier: str) -> str | None:
        try:  # the header alone (the whole document is parsed once, when the checkpoint is taken)
            head = read_header(open_storage(info.url, **self.options_for(tier)), committed=True)
            return head.save_id if head is not None else None
        except Exception:  # noqa: BLE001 - gone since listed: taking it fails and is reported
            return None


def _skipped(listed: list[CheckpointInfo], held: Held, newest: CheckpointInfo, failed: AbstractSet[str] = frozenset()
             ) -> int:
    """Distinct committed steps of either tier between the held one and ``newest``,
    but for those that ``failed`` (reported already, as failed updates)."""
    if newest.step is None:
        return 0
    lo = held.step if held.step is not None else -1  # nothing held: every older step was passed over
    bad = {c.step for c in listed if c.url in failed}
    return len({c.step for c in listed if c.step is not None and lo < c.step < newest.step} - bad)


def _older(step: int | None, than: int | None) -> bool:
    return step is not None and than is not None and step < than
