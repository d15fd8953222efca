"""When a training run saves: every N steps, every S seconds of wall-clock
time, or now (a pre-emption signal on any rank); and which checkpoints
retention keeps beside the newest (milestones).

Used by :class:`~bytecp.manager.CheckpointManager` at every ``maybe_save``
(every rank). Steps are the same on every rank, so ``every_n_steps`` needs
no agreement. Wall-clock time and signals differ between ranks, so they are
decided by one vote: one all-reduce (max) of one small integer on a gloo
group of bytecp's own (never the training's group, nor the background
saves'; one per set of ranks, shared by the process's managers over those
ranks: :func:`bytecp.dist_raw.side_group`), only when the manager has
``every_n_seconds`` or ``save_on_signal``. Managers sharing it vote in the
order their ``maybe_save`` calls come, which must be the same on every rank
(one training thread calling them in the same order: an SPMD loop). Time
is read on the coordinator alone (rank 0 of the manager's group): every
rank saves the same steps, however their clocks drift. Without ``torch.distributed`` the vote is local.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from bytecp.dist_raw import finish, retire_side_group, side_group
from bytecp.errors import ConfigError

__all__ = ["Cadence", "Decision", "milestones"]

_SIGNALLED, _TIME_DUE = 1, 2


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every rank agreed at one ``maybe_save``."""

    #: save this step (its step is due, its time is due, or it was forced)
    save: bool
    #: some rank was signalled: save this step, then exit
    signalled: bool
    #: the save is due by wall-clock time (``every_n_seconds``)
    by_time: bool = False


class Cadence:
    """The save decisions of one manager (all ranks)."""

    def __init__(self, every_n_steps: int, every_n_seconds: float | None = None, *, vote: bool = False,
                 process_group: Any = None, coordinator_rank: int = 0) -> None:
        if every_n_seconds is not None and not every_n_seconds > 0:
            raise ConfigError(f"every_n_seconds must be > 0 or None, got {every_n_seconds!r}")
        self.every_n_steps, self.every_n_seconds = every_n_steps, every_n_seconds
        self._last = time.monotonic()
        self._vote = (vote or every_n_seconds is not None) and dist.is_available() and dist.is_initialized()
        self._process_group, self._coordinator_rank = process_group, coordinator_rank
        if self._vote:
            side_group("votes", process_group)  # (collective: made while every rank constructs its manager)

    def decide(self, step: int, *, signalled: bool = False, force: bool = False) -> Decision:
        """(every rank, at every ``maybe_save``) Whether to save ``step``, agreed by every rank.

        The votes' group is asked for at every call (a dictionary lookup): a
        manager that outlives an in-process restart votes on the new world's."""
        mine = _SIGNALLED if signalled else 0
        group = side_group("votes", self._process_group) if self._vote else None
        coordinator = group is None or dist.get_rank(group) == self._coordinator_rank
        if coordinator and self.every_n_seconds is not None \
                and time.monotonic() - self._last >= self.every_n_seconds:
            mine |= _TIME_DUE
        if group is not None:
            flag = torch.tensor([mine], dtype=torch.int32)
            try:  # (kept by dist_raw: a gloo thread never frees it at exit)
                finish(group, [dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)])
            except BaseException:
                retire_side_group("votes", self._process_group)  # an abandoned vote never pairs with a later one
                raise
            mine = int(flag.item())
        by_time = bool(mine & _TIME_DUE)
        return Decision(save=force or by_time or step % self.every_n_steps == 0, signalled=bool(mine & _SIGNALLED),
                        by_time=by_time)

    def saved(self) -> None:
        """(every rank) A save was started: the wall-clock interval counts from now."""
        self._last = time.monotonic()


def milestones(names: list[str], steps: list[int | None], every: int | None) -> set[str]:
    """The checkpoints (``names``, with their ``steps``) that retention never
    deletes: those whose step is a multiple of ``every`` (None: none)."""
    if every is None:
        return set()
    return {n for n, s in zip(names, steps, strict=True) if s is not None and s % every == 0}
