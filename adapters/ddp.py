"""DDP: every rank holds the full model. Keys drop DDP's ``module.`` prefix
(as every module adapter drops wrapper prefixes, see :mod:`._names`) so the
checkpoint loads under any other framework; the planner writes each tensor
once, split across the ranks (each writes about 1/W of the bytes)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bytecp.dist import DistContext

from . import _watch
from .plain import PlainAdapter

__all__ = ["DDPAdapter"]


class DDPAdapter(PlainAdapter):
    name = "ddp"
    #: the plain adapter's descriptions (no hook of its own): kept between saves
    reuses_descriptions = True

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        """A DDP module anywhere in a module of the state (``torch.compile(DDP(model))`` too)."""
        return any(_watch.holds_module(v, DistributedDataParallel) for v in state.values() if isinstance(v, nn.Module))

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        return {"world_size": ctx.world_size, "data_parallel": ctx.world_size}
