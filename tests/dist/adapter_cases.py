"""States the adapter contract (``bytecp.adapters.testing``) builds on every
rank for bytecp's built-in adapters: the uneven ``Net`` of :mod:`.cases`,
wrapped by the framework and trained one step with AdamW."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .cases import Net, build

__all__ = ["plain_state", "ddp_state", "fsdp2_state", "hsdp_state"]


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 37, (4, 5), generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def plain_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(model, opt, seed)
    return {"model": model, "optimizer": opt, "extra": {"step": seed}}


def _framework_state(framework: str, seed: int, variant: str = "") -> dict[str, Any]:
    assert dist.is_initialized()
    model, opt = build(framework, seed=seed, variant=variant)
    _step(model, opt, seed)
    return {"model": model, "optimizer": opt, "extra": {"step": seed}}


def ddp_state(seed: int) -> dict[str, Any]:
    return _framework_state("ddp", seed)


def fsdp2_state(seed: int) -> dict[str, Any]:
    return _framework_state("fsdp2", seed)


def hsdp_state(seed: int) -> dict[str, Any]:
    """FSDP2 over a (replicate, shard) mesh: replica sets of two ranks."""
    return _framework_state("fsdp2", seed, "hsdp")
