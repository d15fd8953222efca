"""Simulated data-parallel ranks of real torchdata loaders, in one process.

``DistributedSampler`` takes its rank and number of replicas as arguments, so
W ranks' loaders (workers included) run side by side here; each "rank"
records its position at a save exactly as the adapters do
(:func:`bytecp.data.position_of`), the coordinator's merge is the commit's
(:func:`bytecp.data.positions.merge_positions`), and each new rank's state
comes from the load's own decision (:func:`bytecp.data.restore.restore_data`)
over the merged record, reading saved ranks' states only when it asks.
What is checked is what the loaders then yield.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from bytecp.data import position_of
from bytecp.data.positions import merge_positions
from bytecp.data.restore import restore_data

__all__ = ["Setup", "Saved", "make", "uninterrupted", "save_after", "resume", "steps_of", "Step"]

#: one global step: the sorted sample ids every rank's batch held
Step = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One job's data pipeline: ``world`` ranks of ``batch`` samples each."""

    world: int
    batch: int
    n: int = 144
    sampler: str = "DistributedSampler"
    shuffle: bool = True
    drop_last: bool = False  # the sampler's
    loader_drop_last: bool = False
    workers: int = 0
    epoch: int = 0
    seed: int = 7
    torch_batch_sampler: bool = False  # torch's BatchSampler passed as batch_sampler (fast-forwards by batches)
    unbatched: bool = False  # batch_size=None: one sample per step

    def with_(self, **kw: Any) -> Setup:
        return dataclasses.replace(self, **kw)


def make(setup: Setup, rank: int) -> StatefulDataLoader:
    """Rank ``rank``'s loader (its sampler's epoch set, as a training loop does)."""
    cls = StatefulDistributedSampler if setup.sampler == "StatefulDistributedSampler" else DistributedSampler
    data = list(range(setup.n))
    sampler = cls(data, num_replicas=setup.world, rank=rank, shuffle=setup.shuffle, seed=setup.seed,
                  drop_last=setup.drop_last)
    sampler.set_epoch(setup.epoch)
    kw: dict[str, Any] = {"num_workers": setup.workers}
    if setup.workers:
        kw.update(prefetch_factor=2, multiprocessing_context="fork")
    if setup.unbatched:
        return StatefulDataLoader(data, batch_size=None, sampler=sampler, **kw)
    if setup.torch_batch_sampler:
        return StatefulDataLoader(data, batch_sampler=BatchSampler(sampler, setup.batch, setup.loader_drop_last), **kw)
    return StatefulDataLoader(data, batch_size=setup.batch, sampler=sampler, drop_last=setup.loader_drop_last, **kw)


def steps_of(per_rank: list[list[list[int]]]) -> list[Step]:
    """Global steps from each rank's batches (ranks may run out at the epoch's end)."""
    n = max((len(b) for b in per_rank), default=0)
    return [tuple(sorted(x for b in per_rank if k < len(b) for x in b[k])) for k in range(n)]


def _drain(it: Any, limit: int | None = None) -> list[list[int]]:
    out = []
    for batch in it:
        out.append([int(batch)] if isinstance(batch, int) or getattr(batch, "dim", lambda: 1)() == 0
                   else [int(x) for x in batch])
        if limit is not None and len(out) == limit:
            break
    return out


def uninterrupted(setup: Setup) -> list[Step]:
    """Every global step of one epoch without a resume."""
    return steps_of([_drain(iter(make(setup, r))) for r in range(setup.world)])


@dataclasses.dataclass
class Saved:
    """What a save at ``steps`` recorded: each rank's state and the merged position."""

    setup: Setup
    steps: list[Step]
    states: list[Any]
    record: dict[str, Any]

    def read(self, rank: int) -> Any:
        self.reads.append(rank)
        return json.loads(json.dumps(self.states[rank]))  # as a load reads it back

    def __post_init__(self) -> None:
        self.reads: list[int] = []


def save_after(setup: Setup, k: int) -> Saved:
    """Every rank trains ``k`` steps (workers prefetching ahead), then saves."""
    loaders = [make(setup, r) for r in range(setup.world)]
    iters = [iter(dl) for dl in loaders]
    taken = [_drain(it, k) for it in iters]
    states = [dl.state_dict() for dl in loaders]
    texts = {r: json.dumps(position_of(dl, st), sort_keys=True) for r, (dl, st) in enumerate(zip(loaders, states, strict=True))}
    for it in iters:  # workers stop
        del it
    return Saved(setup, steps_of(taken), states, merge_positions(texts, setup.world))


def resume(saved: Saved, new: Setup, mode: str = "exact", fqn: str = "dataloader",
           check: Callable[[Any], None] | None = None) -> tuple[list[Step], list[str]]:
    """Every new rank restores through the load's decision and runs to the
    epoch's end; -> (its global steps, the warnings the load gave)."""
    loaders, notes = [make(new, r) for r in range(new.world)], []
    for r, dl in enumerate(loaders):
        got = restore_data(fqn, dl, saved.record, saved.setup.world, r, new.world, saved.read, mode)
        if got is None:  # the same layout: the rank's own saved state
            state = saved.read(r)
        elif got.as_saved:
            state = saved.read(r % saved.setup.world)
        else:
            state = got.value
        notes += [got.warning] if got is not None and got.warning else []
        dl.load_state_dict(state)
        if got is not None and got.after is not None:
            got.after()
    if check is not None:
        check(loaders)
    return steps_of([_drain(iter(dl)) for dl in loaders]), notes


def seen(steps: list[Step]) -> list[int]:
    return sorted(x for s in steps for x in s)


__all__ += ["seen"]
_ = torch  # (the loaders collate into tensors)
