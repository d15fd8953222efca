"""Fp32 main (master) parameters refreshed after a load that filled a model
but not its optimizer's mains.

Under bf16/fp16, Megatron's optimizers (the distributed optimizer,
``Float16OptimizerWithFloat16Params``) keep fp32 copies of the model's
parameters apart from them (``param.main_param``; the distributed optimizer's
is this DP rank's flat range, ``main_param_sharded``) and every
``optimizer.step()`` copies the updated mains over the model. A load that
fills the model but not those mains (the optimizer excluded, not passed, or
absent from the checkpoint under ``strict=False``) would leave the job's old
mains in place, and the next step would overwrite the loaded weights with
them. Megatron's own loader then calls ``optimizer.reload_model_params()``;
the adapter (``adapter.py``, ``load_tree`` on every rank) plans the same copy
with :func:`plan_refresh` and runs it as its last finalizer, after the model's
own. fp32 training needs nothing: there the mains are the model's memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from bytecp.errors import ConfigError

__all__ = ["MainRefresh", "plan_refresh"]


def _ddp_buffers(value: Any, types: Any) -> list[Any]:
    """The param-and-grad buffers of the Megatron DDP wrappers ``value`` is or
    holds (a wrapped model, a list of them, a ``MegatronModel``)."""
    value = getattr(value, "model", value) if type(value).__name__ == "MegatronModel" else value
    out: list[Any] = []
    for v in value if isinstance(value, (list, tuple)) else [value]:
        while isinstance(v, types.DataParallel):
            out += [*getattr(v, "buffers", []), *getattr(v, "expert_parallel_buffers", [])]
            v = v.module
    return out


def _ranges_from_buffers(buffers: list[Any]) -> dict[int, Any]:
    """id(param) -> the range of its flat data this DP rank's distributed
    optimizer owns, computed by the optimizer's own rule from the DDP buckets."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out: dict[int, Any] = {}
    for buf in buffers:
        for i in range(len(buf.buckets)):
            for p, r in DistributedOptimizer._build_model_gbuf_range(buf, i)["param_map"].items():
                out[id(p)] = r["param"]
    return out


def _ranges_from_optimizers(parts: Iterable[Any]) -> dict[int, Any]:
    """id(param) -> its range, from the distributed optimizers themselves."""
    out: dict[int, Any] = {}
    for d in parts:
        for maps in getattr(d, "gbuf_ranges", []):
            for buckets in maps.values():
                for bucket in buckets:
                    for p, r in bucket["param_map"].items():
                        out[id(p)] = r["param"]
    return out


class MainRefresh:
    """(load finalizer, every rank) Copies each planned model parameter into
    its fp32 main: the whole tensor, or the distributed optimizer's range."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor, int | None]]) -> None:
        self.pairs = pairs

    def __call__(self, values: dict[str, Any]) -> None:
        with torch.no_grad():
            for main, param, start in self.pairs:
                src = param.detach()
                if start is not None:
                    src = src.reshape(-1)[start : start + main.numel()]
                main.copy_(src.view_as(main))


def plan_refresh(
    key: str, value: Any, chunks: list[Any], types: Any, *, loaded: set[int], optimizers: Iterable[Any] = ()
) -> MainRefresh | None:
    """(``load_tree``, every rank, before any read) The copies that refresh
    the mains of the model entry ``key`` whose parameters (by id) are not in
    ``loaded`` (the mains this load fills); None when there is nothing to
    refresh. A sharded main whose range neither the DDP wrapper nor an
    optimizer of the state tells is refused here, before the load."""
    params = [p for c in chunks for p in c.parameters()
              if getattr(p, "main_param", None) is not None and id(p) not in loaded]
    if not params:
        return None
    ranges: dict[int, Any] = {}
    if any(getattr(p, "main_param_sharded", False) for p in params):
        ranges = {**_ranges_from_buffers(_ddp_buffers(value, types)), **_ranges_from_optimizers(optimizers)}
    pairs: list[tuple[torch.Tensor, torch.Tensor, int | None]] = []
    for p in params:
        main = p.main_param
        if not getattr(p, "main_param_sharded", False):
            if main.numel() != p.numel():
                raise ConfigError(f"{key}: a parameter of shape {list(p.shape)} has an fp32 main of "
                                  f"{main.numel()} elements; bytecp cannot refresh it from the model")
            pairs.append((main, p, None))
            continue
        r = ranges.get(id(p))
        if r is None:
            raise ConfigError(
                f"{key}: this load fills the model but not the fp32 main parameters its distributed "
                "optimizer keeps apart, and bytecp cannot tell which range of each this rank holds; "
                "pass the Megatron-DDP-wrapped model (or the optimizer beside it), or call "
                "optimizer.reload_model_params() after the load"
            )
        if r.end - r.start != main.numel():
            raise ConfigError(f"{key}: a distributed optimizer's main of {main.numel()} elements "
                              f"does not match its range {r.start}:{r.end} of the model parameter")
        pairs.append((main, p, int(r.start)))
    return MainRefresh(pairs)
