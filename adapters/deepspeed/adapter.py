"""The DeepSpeed adapter: engines, ZeRO optimizers and their layouts, online.

The package's docstring says what is saved; this module holds the adapter
(called through the registry on every rank: ``detect``, then ``save_tree``
or ``load_tree``) and :func:`expand_engines`, which turns an engine into
its module, optimizer and engine state.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bytecp.adapter_api import AdapterCall, LoadTarget, excluded
from bytecp.dist import DistContext
from bytecp.errors import ConfigError
from bytecp.format.metadata import Metadata
from bytecp.tree.state import Slot, TensorLeaf

from .._names import ModuleNames
from .._optim import ParamState
from ..plain import PlainAdapter
from .data import LoaderPosition, loader_of
from .engine import EngineState
from .moe import ExpertNames
from .optim_state import (
    masters_from_model,
    optimizer_target,
    optimizer_tree,
    persistent,
    z3_param_leaf,
    z3_span,
)
from .pipeline import is_pipeline_module, other_stages, pipeline_stages
from .tp import META as TP_META
from .tp import autotp_size, to_full, tp_rank
from .tp import pieces as tp_pieces
from .zero import (
    check_supported,
    is_stage3,
    is_zero_optimizer,
    zero_layout,
)

__all__ = ["DeepSpeedAdapter", "expand_engines"]

Finalize = Callable[[dict[str, Any]], None]

log = logging.getLogger("bytecp")

#: the key an engine's optimizer is saved under when the state names only the engine
OPTIMIZER_KEY = "optimizer"
#: the key an engine's own state (counters, scheduler, loss scaler) is saved under
ENGINE_KEY = "engine"
#: the key the position of an engine's training data loader is saved under (per rank)
LOADER_KEY = "training_dataloader"


def _is_engine(v: Any) -> bool:
    return isinstance(v, nn.Module) and type(v).__name__ in ("DeepSpeedEngine", "PipelineEngine") \
        and hasattr(v, "module") and hasattr(v, "optimizer")


def _engine_of(state: dict[str, Any], opt: Any) -> Any:
    return next((v for v in state.values() if _is_engine(v) and v.optimizer is opt), None)


def expand_engines(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each engine replaced by its module, its ZeRO optimizer
    added under ``"optimizer"`` (unless the state already holds it) and its
    own state under ``"engine"``; a ZeRO optimizer's wrapped ``torch.optim``
    optimizer stands for the ZeRO one; the position of its training data
    loader (``deepspeed.initialize(training_data=...)``) goes under
    ``"training_dataloader"`` (:mod:`.data`). On load, a part ``exclude=``
    names is not added (:func:`bytecp.adapter_api.excluded`)."""
    inner = {id(v.optimizer.optimizer): v.optimizer for v in state.values()
             if _is_engine(v) and is_zero_optimizer(v.optimizer)}
    ids = {id(v) for v in state.values()}
    given = ids | {id(zero) for i, zero in inner.items() if i in ids}  # already in the state, in either form
    out: dict[str, Any] = {}
    added: dict[str, Any] = {}
    for k, v in state.items():
        if _is_engine(v):
            out[k] = v.module
            if not excluded(ENGINE_KEY):
                if ENGINE_KEY in state or ENGINE_KEY in added:
                    raise ConfigError(
                        f"DeepSpeed engine {k!r}: its own state (steps, scheduler, loss scaler) would be saved "
                        f"under {ENGINE_KEY!r}, which the state already uses; rename that entry (one engine per "
                        "state)"
                    )
                added[ENGINE_KEY] = EngineState(v, k)
            loader = loader_of(v)
            if loader is not None and not excluded(LOADER_KEY) and LOADER_KEY not in state:
                added[LOADER_KEY] = LoaderPosition(loader)
            opt = v.optimizer
            if opt is None or id(opt) in given or excluded(OPTIMIZER_KEY):
                continue
            if not is_zero_optimizer(opt) and not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(
                    f"DeepSpeed engine {k!r}: its optimizer is a {type(opt).__name__} (ZeRO stage 0 with "
                    "mixed precision), which bytecp cannot checkpoint; use ZeRO stage 1 or more"
                )
            if OPTIMIZER_KEY in state:
                raise ConfigError(
                    f"DeepSpeed engine {k!r}: its optimizer would be saved under {OPTIMIZER_KEY!r}, which the "
                    f"state already uses; pass the engine's optimizer yourself: {{{k!r}: engine, "
                    "'opt': engine.optimizer}"
                )
            added[OPTIMIZER_KEY] = opt
        else:
            out[k] = inner.get(id(v), v)
    out.update(added)
    return out


def _zero3(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


def _autotp_leaves(module: nn.Module, leaves: dict[str, Any]) -> dict[str, Any]:
    """A module's leaves (or load targets) with each AutoTP shard as boxes of the full tensor."""
    sharded = [(n, p) for n, p in module.named_parameters() if getattr(p, TP_META, None)]
    if not sharded:
        return leaves
    names = ModuleNames(module)
    rank = tp_rank()
    out = dict(leaves)
    for n, p in sharded:
        name = names.clean(n)
        got = tp_pieces(p, rank, name)
        if got is not None and isinstance(out.get(name), (torch.Tensor, TensorLeaf)):
            out[name] = to_full(out[name], *got)
    return out


class DeepSpeedAdapter(PlainAdapter):
    """DeepSpeed engines and ZeRO optimizers; everything else as the plain adapter."""

    name = "deepspeed"
    #: ZeRO writes parameters from its flat buffers and master copies behind their version counters
    tracks_versions = False

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        if "deepspeed" not in sys.modules:
            return False
        return any(_is_engine(v) or is_zero_optimizer(v) or (isinstance(v, nn.Module) and _zero3(v))
                   for v in state.values())

    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        self._check(state, ctx, "save")
        return super().save_tree(expand_engines(state), ctx)

    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        self._check(state, ctx, "load")
        expanded = expand_engines(state)
        if LOADER_KEY not in state and isinstance(expanded.get(LOADER_KEY), LoaderPosition) \
                and LOADER_KEY not in md.per_rank:
            # a checkpoint saved before positions were kept, or from a job without training_data
            del expanded[LOADER_KEY]
            log.warning("bytecp: the checkpoint holds no position of the DeepSpeed engine's training_dataloader: "
                        "its epoch starts from the beginning")
        target = super().load_tree(expanded, ctx, md)
        zeros = [v.optimizer for v in state.values() if _is_engine(v) and is_zero_optimizer(v.optimizer)]
        zeros += [v for v in expanded.values() if is_zero_optimizer(v) and all(v is not z for z in zeros)]
        # an engine whose optimizer is left out (exclude=["optimizer"]): its fp32 masters
        # follow the loaded module, or its next step would write the old weights back
        kept = [opt for opt in zeros if not any(o is opt for o in expanded.values())]
        names = self.begin(expanded, ctx, md).param_names if kept else {}
        layouts = [zero_layout(opt, names, "load") for opt in kept]

        def finalize(values: dict[str, Any]) -> None:
            target.finalize(values)
            for lay in layouts:
                masters_from_model(lay)
            for opt in zeros:  # hpZ: the secondary copies of the old weights would serve the next gathers
                if is_stage3(opt) and callable(getattr(opt, "invalidate_secondary_tensor", None)):
                    opt.invalidate_secondary_tensor()

        optimizers = [str(o) for o, x in expanded.items() if _is_optimizer(x)]
        elsewhere = [name for k, v in expanded.items() if is_pipeline_module(v)
                     for name in other_stages(str(k), v, optimizers)]
        for k, v in expanded.items():  # DeepSpeed-MoE: the experts of the other expert-parallel ranks
            experts = ExpertNames(v) if isinstance(v, nn.Module) else None
            if experts:
                others = experts.other_experts()
                elsewhere += [f"{k}.{n}" for n in others] + [f"{o}.state.{n}" for o in optimizers for n in others]
        return LoadTarget(target.tree, finalize, elsewhere=[*target.elsewhere, *elsewhere], check=target.check)

    def _check(self, state: dict[str, Any], ctx: DistContext, where: str) -> None:
        for v in state.values():
            opt = v.optimizer if _is_engine(v) else v
            if is_zero_optimizer(opt):
                check_supported(opt, _engine_of(state, opt), ctx.world_size, where)

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        engines = [v for v in state.values() if _is_engine(v)]
        stages = max([pipeline_stages(v) for v in engines] or [1])
        tp = max([autotp_size(v) for v in engines] or [1])
        out: dict[str, Any] = {"world_size": ctx.world_size, "data_parallel": ctx.world_size // (stages * tp)}
        if stages > 1:
            out["pipeline_parallel"] = stages
        if tp > 1:
            out["tensor_parallel"] = tp
        for v in expand_engines(state).values():
            if type(v).__name__ == "BF16_Optimizer":
                out["zero_stage"] = 0
                out["bf16_optimizer"] = True
            elif is_zero_optimizer(v):
                out["zero_stage"] = 3 if is_stage3(v) else (2 if getattr(v, "partition_gradients", False) else 1)
        return out

    # ------------------------------------------------------------- model
    def param_names(self, module: nn.Module) -> dict[int, str]:
        """The plain adapter's names, DeepSpeed-MoE experts by global index."""
        names = super().param_names(module)
        experts = ExpertNames(module)
        return {pid: experts(n) for pid, n in names.items()} if experts else names

    def param_state(self, call: AdapterCall, index: int, param: torch.Tensor) -> list[ParamState]:
        """A torch optimizer's state (ZeRO stage 0): an AutoTP shard's state as
        boxes of the full tensor, like the shard itself."""
        states = super().param_state(call, index, param)
        got = tp_pieces(param, tp_rank(), states[0].fqn) if getattr(param, TP_META, None) else None
        if got is None:
            return states
        full, parts = got
        local = tuple(param.shape)

        def leaf(v: Any) -> Any:  # state shaped like the shard (moments); the rest (step) as it is
            return to_full(v, full, parts) if isinstance(v, torch.Tensor) and tuple(v.shape) == local else v

        return [dataclasses.replace(states[0], shape=full, leaf=leaf)]

    def module_leaves(self, call: AdapterCall, module: nn.Module) -> dict[str, Any]:
        """ZeRO-3: each parameter's piece on this rank; ZeRO-1/2: the full module
        (replicated); AutoTP shards as boxes of the full tensors; DeepSpeed-MoE
        experts by global index."""
        if not _zero3(module):
            leaves = _autotp_leaves(module, super().module_leaves(call, module))
        else:
            leaves, _ = self._z3_leaves(call, module, loading=False)
        experts = ExpertNames(module)
        return {experts(k): v for k, v in leaves.items()} if experts else leaves

    def module_targets(self, call: AdapterCall, module: nn.Module) -> tuple[dict[str, Any], Finalize]:
        target, finalize = self._module_targets(call, module)
        if not _zero3(module):
            target = _autotp_leaves(module, target)
        experts = ExpertNames(module)
        if not experts:
            return target, finalize
        local = {experts(k): k for k in target}

        def by_local_names(values: dict[str, Any]) -> None:
            finalize({local.get(k, k): v for k, v in values.items()})

        return {experts(k): v for k, v in target.items()}, by_local_names

    def _z3_leaves(self, call: AdapterCall, module: nn.Module, *, loading: bool
                   ) -> tuple[dict[str, Any], dict[str, str]]:
        """Each parameter's piece on this rank; a load fills persistent
        parameters whole (every rank holds them) and their pieces from them."""
        names = ModuleNames(module)
        out: dict[str, Any] = {}
        raw: dict[str, str] = {}
        for k, v in module.state_dict(keep_vars=True).items():
            n = names.clean(k)
            raw[n] = k
            if isinstance(v, torch.Tensor) and hasattr(v, "ds_tensor"):
                out[n] = v.detach() if loading and persistent(v) else z3_param_leaf(v, call.dist.rank)
            else:
                out[n] = v.detach() if isinstance(v, torch.Tensor) else v
        return names.tie(out), raw

    def _module_targets(self, call: AdapterCall, module: nn.Module) -> tuple[dict[str, Any], Finalize]:
        """ZeRO-3: this rank's pieces, filled in place; persistent parameters
        whole, then their pieces copied from them (no collective)."""
        if not _zero3(module):
            return super().module_targets(call, module)
        target, raw = self._z3_leaves(call, module, loading=True)
        slots = [k for k, v in target.items() if not isinstance(v, (torch.Tensor, TensorLeaf))]
        for k in slots:
            target[k] = Slot()

        def finalize(values: dict[str, Any]) -> None:
            if slots:
                module.load_state_dict({raw[k]: values[k] for k in slots if values.get(k) is not None}, strict=False)
            with torch.no_grad():
                for p in module.parameters():
                    if persistent(p):
                        local, start, valid = z3_span(p)
                        local[:valid].copy_(p.data.view(-1)[start : start + valid])

        return target, finalize

    # ------------------------------------------------------------- optimizer
    def _save_value(self, call: AdapterCall, v: Any) -> Any:
        if is_zero_optimizer(v):
            return optimizer_tree(v, call.param_names, call.dist.rank)
        return super()._save_value(call, v)

    def _target(self, call: AdapterCall, v: Any, fqn: str, parent: Any, key: Any, finalizers: list[Finalize],
                checks: list[Finalize]) -> Any:
        if is_zero_optimizer(v):
            assert call.md is not None
            tree, fin = optimizer_target(v, call.param_names, call.md, call.nodes, fqn)
            finalizers.append(fin)
            return tree
        return super()._target(call, v, fqn, parent, key, finalizers, checks)

def _is_optimizer(v: Any) -> bool:
    return isinstance(v, torch.optim.Optimizer) or is_zero_optimizer(v)
