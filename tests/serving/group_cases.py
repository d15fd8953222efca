"""Rank functions of the process-group follower tests (spawned gloo ranks of
:class:`tests.dist.pool.WorkerPool`): a follower of 2 ranks whose state is an
FSDP2 x2 or a TP=2 model, kept between calls in module globals."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp

__all__ = ["arm_failure", "arm_race", "damage", "model", "start", "take"]

_G: dict[str, Any] = {}


def model(seed: int) -> nn.Module:
    """The trainer's and the follower's model (different seeds: different weights)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 16))


def _shard(m: nn.Module, layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return m


def start(run: str, layout: str, memory_url: str | None = None, memory_options: dict[str, Any] | None = None,
          dtype: torch.dtype | None = None, pin: bool = True) -> bool:
    """(every rank) A new follower of ``run`` (and its memory tier, when given) with a freshly sharded model
    (held in ``dtype`` when given: ``bytecp.follow(..., dtype=)``; ``pin=False``: without pins)."""
    if "gen" in _G:
        _G["gen"].close()
    m = model(seed=dist.get_rank() + 11)
    _G["model"] = _shard(m if dtype is None else m.to(dtype), layout)
    _G["gen"] = bytecp.follow(run, {"model": _G["model"]}, poll_s=0.01, idle_timeout_s=60, memory_url=memory_url,
                              memory_storage_options=memory_options, dtype=dtype, pin=pin)
    _G["fail"] = False
    return True


def damage(path: str, at: int, rank: int) -> bool:
    """(every rank) Rank ``rank`` flips the byte at ``at`` of ``path`` (a delta file every rank reads)."""
    if dist.get_rank() == rank:
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x5A]))
    dist.barrier()
    return True


def arm_failure(rank: int) -> bool:
    """(every rank) The next update's read fails on rank ``rank``."""
    from bytecp.serving import staging

    if dist.get_rank() != rank:
        return False

    real = staging.execute_reads

    def failing(*args: Any, **kwargs: Any) -> int:
        staging.execute_reads = real
        raise OSError("injected read failure")

    staging.execute_reads = failing
    return True


def arm_race(run: str, state: dict[str, torch.Tensor], step: int) -> bool:
    """(every rank) After the coordinator opened the checkpoint its decision chose (and pinned,
    unless the follower runs without pins) and before the next update reads it, rank 0 commits
    ``state`` (the model's) as step ``step`` of ``run`` with ``keep_last=1``, through a group of
    itself, while the others wait: a trainer's commit whose retention retires that checkpoint
    (its ``metadata.json`` moved aside; its data and index files stay while a pin holds them)."""
    from bytecp.serving import follow as follow_mod

    solo = dist.new_group([0])  # (every rank makes it)
    real = follow_mod._Follower.update

    def unpatch() -> None:
        follow_mod._Follower.update = real  # type: ignore[method-assign]

    def a_commit_first(self: Any, d: Any) -> Any:
        unpatch()
        if dist.get_rank() == 0:
            m = model(seed=0)
            m.load_state_dict(state)
            bytecp.CheckpointManager(run, every_n_steps=1, keep_last=1, process_group=solo).save(step, {"model": m})
        dist.barrier()
        return real(self, d)

    follow_mod._Follower.update = a_commit_first  # type: ignore[method-assign]
    _G["unpatch"] = unpatch  # (take puts the real update back whatever happens: the pool's later tests use it)
    return True


def take() -> dict[str, Any]:
    """(every rank) The next update, and this rank's shards afterwards:
    FQN -> (global offsets, local tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    try:
        up = next(_G["gen"])
    finally:
        _G.pop("unpatch", lambda: None)()
    shards: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
    for n, p in _G["model"].state_dict().items():
        if isinstance(p, DTensor):
            _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            shards[n] = (tuple(offsets), p.to_local().clone())
        else:
            shards[n] = ((0,) * p.dim(), p.clone())
    return {"up": up.to_json(), "shards": shards, "rank": dist.get_rank()}
