"""FSDP2 (``fully_shard``) and other DTensor-based models: parameters and
optimizer state are DTensors; each rank saves its own box of each, replicas
(HSDP's replicate dimension) are written once, and loads fill the local
shards in place whatever the saving layout was."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bytecp.dist import DistContext

from ._dtensor import dtensor_leaf, dtensor_target, is_dtensor, mesh_info
from .plain import PlainAdapter

__all__ = ["FSDP2Adapter"]


def _modules(state: dict[str, Any]) -> list[nn.Module]:
    return [v for v in state.values() if isinstance(v, nn.Module)]


class FSDP2Adapter(PlainAdapter):
    name = "fsdp2"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return any(is_dtensor(p) for m in _modules(state) for p in m.parameters())

    def module_leaves(self, module: nn.Module) -> dict[str, Any]:
        return {k: dtensor_leaf(v) if is_dtensor(v) else v for k, v in module.state_dict().items()}

    def module_targets(self, module: nn.Module):  # type: ignore[no-untyped-def]
        sd = module.state_dict()
        target: dict[str, Any] = {}
        for k, v in sd.items():
            target[k] = dtensor_leaf(v) if is_dtensor(v) else v
        return super()._targets_from(module, sd, target)

    def optim_leaf(self, param: torch.Tensor, value: torch.Tensor) -> Any:
        return dtensor_leaf(value) if is_dtensor(value) else value

    def optim_target(self, param: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):  # type: ignore[no-untyped-def]
        if is_dtensor(param) and tuple(shape) == tuple(param.shape):
            return dtensor_target(param, dtype)  # type: ignore[arg-type]
        return super().optim_target(param, shape, dtype)

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": ctx.world_size}
        for m in _modules(state):
            for p in m.parameters():
                if is_dtensor(p):
                    out.update(mesh_info(p))  # type: ignore[arg-type]
                    return out
        return out
