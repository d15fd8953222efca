"""DDP: every rank holds the full model. Keys drop DDP's ``module.`` prefix so
the checkpoint loads under any other framework; the planner writes each
tensor once, split across the ranks (each writes about 1/W of the bytes)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bytecp.adapter_api import AdapterCall
from bytecp.dist import DistContext

from .plain import Finalize, PlainAdapter

__all__ = ["DDPAdapter"]


def _inner(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


class DDPAdapter(PlainAdapter):
    name = "ddp"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return any(isinstance(v, DistributedDataParallel) for v in state.values())

    def module_leaves(self, call: AdapterCall, module: nn.Module) -> dict[str, Any]:
        return super().module_leaves(call, _inner(module))

    def module_targets(self, call: AdapterCall, module: nn.Module) -> tuple[dict[str, Any], Finalize]:
        return super().module_targets(call, _inner(module))

    def param_names(self, module: nn.Module) -> dict[int, str]:
        return super().param_names(_inner(module))

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        return {"world_size": ctx.world_size, "data_parallel": ctx.world_size}
