"""DDP: every rank holds the full model. Keys drop DDP's ``module.`` prefix so
the checkpoint loads under any other framework; the planner writes each
tensor once, split across the ranks (each writes about 1/W of the bytes)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bytecp.dist import DistContext

from .plain import PlainAdapter

__all__ = ["DDPAdapter"]


class DDPAdapter(PlainAdapter):
    name = "ddp"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return any(isinstance(v, DistributedDataParallel) for v in state.values())

    @staticmethod
    def _inner(module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def module_leaves(self, module: nn.Module) -> dict[str, Any]:
        return super().module_leaves(self._inner(module))

    def module_targets(self, module: nn.Module):  # type: ignore[no-untyped-def]
        return super().module_targets(self._inner(module))

    def param_names(self, module: nn.Module) -> dict[int, str]:
        return super().param_names(self._inner(module))

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        return {"world_size": ctx.world_size, "data_parallel": ctx.world_size}
