"""The plain adapter: modules, optimizers and ``Stateful`` objects in one process
(or replicated on every rank), and the base class of the framework adapters.

Optimizer state is keyed by parameter FQN (``optimizer.state.<param fqn>.exp_avg``,
see :mod:`bytecp.adapters._optim`), so it reshards like the parameters and
loads under any other framework. Framework adapters override the hooks
(``begin``, ``module_leaves``, ``module_targets``, ``param_names``,
``param_state``); the walk over ``state`` is shared. Every hook takes the
per-call :class:`~bytecp.adapter_api.AdapterCall`: nothing is kept on ``self``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bytecp.adapter_api import Adapter, AdapterCall, LoadTarget
from bytecp.data import claims, position_of
from bytecp.dist import DistContext
from bytecp.extras import PerRankState, RNGState
from bytecp.format.metadata import Metadata
from bytecp.tree.state import PerRank, Slot

from . import _watch
from ._names import ModuleNames
from ._optim import ParamState, optimizer_target, optimizer_tree, param_groups_for_load

__all__ = ["PlainAdapter", "Finalize", "is_stateful", "is_per_rank", "per_rank_leaf", "per_rank_slot",
           "param_groups_for_load"]

Finalize = Callable[[dict[str, Any]], None]


def is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def is_per_rank(v: Any) -> bool:
    """RNG states, explicit per-rank wrappers and data loaders (by their class
    name, a registered resharder or their own ``reshard`` method:
    :mod:`bytecp.data`) are per rank."""
    if isinstance(v, (RNGState, PerRankState)):
        return True
    return is_stateful(v) and claims(v)


def per_rank_leaf(v: Any) -> PerRank:
    """(save) A per-rank value's state, with its data position when it is a data loader."""
    sd = v.state_dict()
    return PerRank(sd, data=position_of(v, sd))


def per_rank_slot(v: Any) -> Slot:
    """(load) The slot restoring a per-rank value, the live object kept so
    that a data loader's position reshards when the layout changed."""
    return Slot(per_rank=True, live=v)


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor's local shard
    return int(local.untyped_storage().data_ptr())


def _live_storages(module: nn.Module) -> set[int]:
    """The storages of the module's parameters and buffers (local shards of DTensors)."""
    return {_storage_ptr(x) for x in (*module.parameters(), *module.buffers())}


class PlainAdapter(Adapter):
    """Full tensors on every rank that has them (one process, or replicated)."""

    name = "plain"
    #: this class's description of a module or an optimizer is a function of
    #: what :mod:`bytecp.adapters._watch` checks, so it is kept between saves
    #: (read from each class's own body: a subclass overriding the hooks says
    #: so again, or its saves describe every module afresh)
    reuses_descriptions = True

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return True

    # ------------------------------------------------------------- hooks
    def begin(self, state: dict[str, Any], ctx: DistContext, md: Metadata | None) -> AdapterCall:
        """The per-call context (framework adapters add their own facts)."""
        call = AdapterCall(state, ctx, md, md.skeleton.index() if md is not None else {})
        mods = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
        for k, m in mods:
            for pid, n in self.param_names(m).items():
                call.param_names[pid] = n if len(mods) == 1 else f"{k}.{n}"
        return call

    def tensor_leaf(self, t: torch.Tensor) -> Any:
        """What a tensor of a module's state dict is saved as (a full tensor;
        framework adapters return a :class:`~bytecp.tree.state.TensorLeaf` of a sharded one)."""
        return t

    def module_leaves(self, call: AdapterCall, module: nn.Module) -> dict[str, Any]:
        """The module's state as FQN -> tensor / TensorLeaf / value (views, no
        copies), named without wrapper prefixes, tied tensors as one object."""
        names = ModuleNames(module)
        sd, _ = names.state_dict()
        return names.tie({k: self.tensor_leaf(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()})

    def module_targets(self, call: AdapterCall, module: nn.Module) -> tuple[dict[str, Any], Finalize]:
        """Targets to fill in place, and what to do with the non-tensor values
        (slots applied through ``load_state_dict`` under the module's own keys)."""
        names = ModuleNames(module)
        sd, raw = names.state_dict()
        target = names.tie({k: self.tensor_leaf(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()})
        slots = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        for k in slots:
            target[k] = Slot()
        # tensors a state-dict hook made (torchtitan splits its fused wqkv into
        # wq/wk/wv copies): filled in place, they reach the module only through
        # load_state_dict, whose pre-hooks put them back
        live_storages = _live_storages(module)
        copies = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and _storage_ptr(v) not in live_storages]

        def finalize(values: dict[str, Any]) -> None:
            if slots or copies:
                live = module.state_dict()
                for k in slots:
                    live[raw[k]] = values[k]
                for k in copies:
                    live[raw[k]] = sd[k]
                module.load_state_dict(live)

        return target, finalize

    def param_names(self, module: nn.Module) -> dict[int, str]:
        """``id(param) -> FQN`` for the parameters an optimizer may hold
        (named like the module's tensors: no wrapper prefix, a tied
        parameter by its first name)."""
        return ModuleNames(module).params()

    def param_state(self, call: AdapterCall, index: int, param: torch.Tensor) -> list[ParamState]:
        """Where the optimizer state of ``param`` (its ``index`` in the
        optimizer's state dict) lives: one full tensor shaped like it."""
        shape = tuple(param.shape)
        return [ParamState(
            fqn=call.param_names.get(id(param), str(index)),
            shape=shape,
            leaf=lambda v: v,
            new=lambda dtype: torch.empty(shape, dtype=dtype, device=param.device),
            fits=lambda t, dtype: t.dtype == dtype and tuple(t.shape) == shape,
        )]

    # ------------------------------------------------------------- save
    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        """The state tree: modules and optimizers at the top of ``state`` as
        the pieces kept from the last save while they are unchanged
        (:func:`bytecp.adapters._watch.describe`), when this class says so."""
        if _watch.reuses(type(self)):
            return _watch.describe(self, state, ctx)
        call = self.begin(state, ctx, None)
        return {k: self._save_value(call, v) for k, v in state.items()}

    def _save_value(self, call: AdapterCall, v: Any) -> Any:
        if isinstance(v, nn.Module):
            return self.module_leaves(call, v)
        if isinstance(v, torch.optim.Optimizer):
            return optimizer_tree(v, lambda i, p: self.param_state(call, i, p))
        if is_per_rank(v):
            return per_rank_leaf(v)
        if is_stateful(v):
            return self._save_value(call, v.state_dict())
        if type(v) is dict:
            return {k: self._save_value(call, x) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(self._save_value(call, x) for x in v)
        return v

    # ------------------------------------------------------------- load
    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        call = self.begin(state, ctx, md)
        finalizers: list[Finalize] = []
        checks: list[Finalize] = []
        tree = {k: self._target(call, v, str(k), state, k, finalizers, checks) for k, v in state.items()}

        def finalize(values: dict[str, Any]) -> None:
            for f in finalizers:
                f(values)

        def check(values: dict[str, Any]) -> None:
            for c in checks:
                c(values)

        return LoadTarget(tree, finalize, check=check if checks else None)

    def _target(self, call: AdapterCall, v: Any, fqn: str, parent: Any, key: Any, finalizers: list[Finalize],
                checks: list[Finalize]) -> Any:
        if isinstance(v, nn.Module):
            target, fin = self.module_targets(call, v)
            finalizers.append(lambda values: fin({k: values.get(f"{fqn}.{k}") for k in target}))
            return target
        if isinstance(v, torch.optim.Optimizer):
            assert call.md is not None
            tree, fin, check = optimizer_target(v, fqn, call.md, call.nodes, lambda i, p: self.param_state(call, i, p))
            finalizers.append(fin)
            checks.append(check)
            return tree
        if is_per_rank(v) or is_stateful(v):
            finalizers.append(lambda values: v.load_state_dict(values[fqn]) if fqn in values else None)
            return per_rank_slot(v) if is_per_rank(v) else Slot()
        if type(v) is dict:
            return {k: self._target(call, x, f"{fqn}.{k}", v, k, finalizers, checks) for k, x in v.items()}
        if isinstance(v, torch.Tensor) and type(v) in (torch.Tensor, nn.Parameter):
            return v.detach()
        if isinstance(parent, dict):
            def put(values: dict[str, Any]) -> None:
                if fqn in values:
                    parent[key] = values[fqn]

            finalizers.append(put)
        return Slot(default=v)
