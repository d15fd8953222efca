"""FSDP2 (``fully_shard``) and other DTensor-based models (tensor parallel
``parallelize_module``, FSDP2 x TP, HSDP, torchtitan's pipeline stages):
parameters and optimizer state are DTensors; each rank saves its own box of
each, replicas (HSDP's replicate dimension, and the ranks along root-mesh
dimensions outside a tensor's mesh) are written once, and loads fill the
local shards in place whatever the saving layout was."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bytecp.adapter_api import AdapterCall
from bytecp.dist import DistContext

from . import _watch
from ._dtensor import dtensor_leaf, dtensor_target, is_dtensor, mesh_info
from ._names import ModuleNames
from ._optim import ParamState
from .plain import PlainAdapter

__all__ = ["FSDP2Adapter"]


def _modules(state: dict[str, Any]) -> list[nn.Module]:
    return [v for v in state.values() if isinstance(v, nn.Module)]


def _leaf(v: torch.Tensor, fqn: str | None = None) -> Any:
    return dtensor_leaf(v, fqn) if is_dtensor(v) else v  # type: ignore[arg-type]


def _any_dtensor(v: Any, depth: int = 0) -> bool:
    """A DTensor anywhere in ``v``: a module's parameters, or a value of the
    state's dicts and lists (an adapter's tensors saved outside its module)."""
    if isinstance(v, nn.Module):
        return _watch.holds_parameter(v, is_dtensor)
    if type(v) is dict and depth < 8:
        return any(_any_dtensor(x, depth + 1) for x in v.values())
    if type(v) in (list, tuple) and depth < 8:
        return any(_any_dtensor(x, depth + 1) for x in v)
    return is_dtensor(v)


class FSDP2Adapter(PlainAdapter):
    name = "fsdp2"
    #: a DTensor's leaf is a function of its layout and local tensor, which the
    #: watch checks by identity: descriptions kept between saves
    reuses_descriptions = True

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return _any_dtensor(state)

    def _save_value(self, call: AdapterCall, v: Any) -> Any:
        """DTensors outside modules (``{"adapter": {name: dtensor}}``) are saved as their boxes."""
        return dtensor_leaf(v) if is_dtensor(v) else super()._save_value(call, v)

    def _target(self, call: AdapterCall, v: Any, fqn: str, parent: Any, key: Any, finalizers: list[Any],
                checks: list[Any]) -> Any:
        """A DTensor outside a module is loaded in place, into its local shard."""
        return dtensor_leaf(v) if is_dtensor(v) else super()._target(call, v, fqn, parent, key, finalizers, checks)

    def tensor_leaf(self, t: torch.Tensor) -> Any:
        """A DTensor's box on this rank (tied parameters share one leaf object:
        see :meth:`PlainAdapter.module_leaves`)."""
        return _leaf(t)

    def module_leaves(self, call: AdapterCall, module: nn.Module) -> dict[str, Any]:
        """As :meth:`PlainAdapter.module_leaves`, each DTensor's layout checked
        under its name (a layout bytecp cannot save fails here, at save)."""
        names = ModuleNames(module)
        sd, _ = names.state_dict()
        return names.tie({k: _leaf(v, k) if isinstance(v, torch.Tensor) else v for k, v in sd.items()})

    def param_state(self, call: AdapterCall, index: int, param: torch.Tensor) -> list[ParamState]:
        """A DTensor parameter's state is a DTensor laid out like it: its box is saved."""
        (place,) = super().param_state(call, index, param)
        if not is_dtensor(param):
            return [place]
        return [ParamState(
            fqn=place.fqn,
            shape=place.shape,
            leaf=lambda v: _leaf(v, f"optimizer.state.{place.fqn}"),
            new=lambda dtype: dtensor_target(param, dtype)[1],  # type: ignore[arg-type]
            fits=lambda t, dtype: is_dtensor(t) and t.dtype == dtype and tuple(t.shape) == place.shape,
        )]

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": ctx.world_size}
        for m in _modules(state):
            for p in _watch.parameters(m):
                if is_dtensor(p):
                    out.update(mesh_info(p))  # type: ignore[arg-type]
                    return out
        return out
