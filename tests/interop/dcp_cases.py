"""What each rank runs in the DCP source tests (tests/interop/test_dcp_dist.py):
a tiny model trained two Adam steps under FSDP2 and saved with
``torch.distributed.checkpoint.save`` (``get_state_dict``'s names), then
loaded by bytecp into FSDP2 or DDP at another world size; each returns its
full state (rank 0) for a bitwise comparison in the test process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["build", "fsdp2", "train", "full_state", "save_fsdp2", "load_fsdp2", "load_ddp", "EXTRA"]

#: the non-tensor values saved beside model and optimizer
EXTRA = {"step": 2, "note": "dcp", "betas": (0.5, 0.25)}


def build(seed: int) -> nn.Module:
    """7 output rows: uneven shards on 2 and on 3 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7))


def fsdp2(model: nn.Module) -> nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    torch.manual_seed(7)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """(every rank) Full model and optimizer state dicts, on rank 0 (``get_state_dict``'s names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def save_fsdp2(path: str) -> dict[str, Any]:
    """(every rank) Train under FSDP2 and save with DCP; the full state it saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fsdp2(build(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "extra": dict(EXTRA)}, checkpoint_id=path)
    return full_state(model, opt)


def load_fsdp2(path: str) -> dict[str, Any]:
    """(every rank) A fresh FSDP2 model and optimizer (no state yet) loaded by bytecp."""
    import bytecp

    model = fsdp2(build(1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    state = {"model": model, "optim": opt, "extra": {"step": 0, "note": "", "betas": ()}}
    res = bytecp.load(path, state)
    return {**full_state(model, opt), "extra": state["extra"], "keys": (res.missing_keys, res.unexpected_keys)}


def load_ddp(path: str) -> dict[str, Any]:
    """(every rank) A DDP model whose optimizer has stepped already, loaded by bytecp."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytecp

    model = DDP(build(1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    train(model, opt, steps=1)
    state = {"model": model, "optim": opt, "extra": {"step": 0, "note": "", "betas": ()}}
    res = bytecp.load(path, state)
    return {**full_state(model, opt), "extra": state["extra"], "keys": (res.missing_keys, res.unexpected_keys)}
