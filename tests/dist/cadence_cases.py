"""Functions the cadence test runs on every rank of a spawned pool."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn

import bytecp
from bytecp.manager import CheckpointManager
from bytecp.tools import cadence


def seconds_cadence(run: str, skew: float) -> list[int]:
    """Save every 0.25 s by the coordinator's clock; rank 1's clock runs
    ``skew`` seconds ahead (it alone would save every step). -> the steps saved."""
    if dist.get_rank() == 1:
        real = time.monotonic
        cadence.time.monotonic = lambda: real() + skew  # type: ignore[attr-defined]
    try:
        mgr = CheckpointManager(run, every_n_steps=10**6, every_n_seconds=0.25, keep_last=None)
        torch.manual_seed(0)  # the same replica on every rank
        model = nn.Linear(2, 2)
        saved = []
        for step in range(1, 13):
            time.sleep(0.1)
            if mgr.maybe_save(step, {"model": model, "x": torch.full((2,), float(step))}):
                saved.append(step)
        return saved
    finally:
        if dist.get_rank() == 1:
            cadence.time.monotonic = real  # type: ignore[attr-defined]


def groups_of_many_managers(run: str, managers: int) -> tuple[int, int]:
    """``managers`` managers that vote (``every_n_seconds``: no signal
    handlers left on the pool's ranks), each saving two steps asynchronously,
    one after another in this process. -> the number of torch.distributed
    groups before and after."""
    before = len(dist.distributed_c10d._world.pg_map)
    model = nn.Linear(2, 2)
    for i in range(managers):
        mgr = CheckpointManager(f"{run}/{i}", every_n_steps=1, every_n_seconds=3600.0, async_save=True)
        for step in (1, 2):
            mgr.maybe_save(step, {"model": model})
        mgr.wait()
    return before, len(dist.distributed_c10d._world.pg_map)


def saves_across_an_in_process_restart(out: str, ports: list[int]) -> None:
    """Save (async, and by a voting manager), destroy the world and make it
    again on each port of ``ports`` in turn (an in-process restart), saving
    again each time; the pool goes on with the last world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for round_, port in enumerate([None, *ports]):
        if port is not None:
            dist.destroy_process_group()
            dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                    timeout=datetime.timedelta(seconds=60))
        state = {"w": torch.full((4,), float(10 * round_))}  # a replica: the same on every rank
        bytecp.async_save(f"{out}/async-{round_}", state).wait()
        mgr = CheckpointManager(f"{out}/run-{round_}", every_n_steps=1, every_n_seconds=3600.0, async_save=True)
        mgr.maybe_save(1, state)
        mgr.wait()


def saves_of_a_part_of_the_world(out: str) -> float:
    """Rank 0 alone saves (sync, async, and by a voting manager) with
    ``process_group=`` a group of rank 0 only; then every rank makes a group
    of the whole world and all-reduces on it (what the job's next
    ``new_group`` does: it hung when bytecp's own group over the part had
    moved the world's count of groups on rank 0 alone). -> the sum."""
    part = dist.new_group([0])  # (torch: every rank makes a group, member or not)
    if dist.get_rank() == 0:
        state = {"w": torch.arange(6.0)}
        bytecp.save(f"{out}/sync", state, process_group=part)
        bytecp.async_save(f"{out}/async", state, process_group=part).wait()
        mgr = CheckpointManager(f"{out}/run", every_n_steps=1, every_n_seconds=3600.0, async_save=True,
                                process_group=part)
        mgr.maybe_save(1, state)
        mgr.wait()
    everyone = dist.new_group([0, 1])
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    return float(total.item())
