"""The plain adapter: modules, optimizers and ``Stateful`` objects in one process
(or replicated on every rank), and the base class of the framework adapters.

Optimizer state is keyed by parameter FQN (``optimizer.state.<param fqn>.exp_avg``),
so it reshards like the parameters and loads under any other framework.
Framework adapters override the hooks (``module_leaves``, ``module_targets``,
``param_names``, ``optim_leaf``, ``optim_target``); the walk over ``state``
is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bytecp.adapter_api import Adapter, LoadTarget
from bytecp.dist import DistContext
from bytecp.dtypes import dtype_from_name
from bytecp.errors import StateMismatchError
from bytecp.extras import PerRankState, RNGState
from bytecp.format import Metadata
from bytecp.state import PerRank, Slot, Whole, iter_skeleton

__all__ = ["PlainAdapter", "is_stateful", "is_per_rank", "param_groups_for_load"]


def is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def is_per_rank(v: Any) -> bool:
    """RNG states, explicit per-rank wrappers and data loaders are per rank."""
    if isinstance(v, (RNGState, PerRankState)):
        return True
    return is_stateful(v) and "dataloader" in type(v).__name__.lower()


def param_groups_for_load(
    key: str, saved_groups: list[dict[str, Any]], opt: torch.optim.Optimizer, current: list[list[str]]
) -> list[dict[str, Any]]:
    """Saved param groups (parameters named by FQN) as ``opt.load_state_dict``
    wants them: hyperparameters from the checkpoint, parameters by position.
    ``current[j]`` are the FQNs group ``j`` of ``opt`` holds now."""
    if len(saved_groups) != len(opt.param_groups):
        raise StateMismatchError(
            f"optimizer {key!r}: the checkpoint has {len(saved_groups)} param groups, "
            f"the optimizer {len(opt.param_groups)}"
        )
    groups = []
    pos = 0
    for j, (sg, cg) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        if sorted(sg["params"]) != sorted(current[j]):
            raise StateMismatchError(
                f"optimizer {key!r} param group {j}: the checkpoint holds parameters "
                f"{sorted(set(sg['params']) - set(current[j]))[:5]} the optimizer lacks and lacks "
                f"{sorted(set(current[j]) - set(sg['params']))[:5]}"
            )
        g = {k: v for k, v in sg.items() if k != "params"}
        g["params"] = list(range(pos, pos + len(cg["params"])))
        groups.append(g)
        pos += len(cg["params"])
    return groups


class PlainAdapter(Adapter):
    """Full tensors on every rank that has them (one process, or replicated)."""

    name = "plain"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return True

    # ------------------------------------------------------------- hooks
    def module_leaves(self, module: nn.Module) -> dict[str, Any]:
        """The module's state as FQN -> tensor / TensorLeaf / value (views, no copies)."""
        return dict(module.state_dict())

    def module_targets(self, module: nn.Module) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
        """Targets to fill in place, and what to do with the non-tensor values."""
        sd = module.state_dict()
        return self._targets_from(module, sd, dict(sd))

    def _targets_from(
        self, module: nn.Module, sd: dict[str, Any], target: dict[str, Any]
    ) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
        """Non-tensor entries of ``sd`` become slots applied by ``load_state_dict``."""
        slots = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        for k in slots:
            target[k] = Slot()

        def finalize(values: dict[str, Any]) -> None:
            if slots:
                for k in slots:
                    sd[k] = values[k]
                module.load_state_dict(sd)

        return target, finalize

    def param_names(self, module: nn.Module) -> dict[int, str]:
        """``id(param) -> FQN`` for the parameters an optimizer may hold."""
        return {id(p): n for n, p in module.named_parameters()}

    def optim_leaf(self, param: torch.Tensor, value: torch.Tensor) -> Any:
        """The saved leaf for an optimizer state tensor of ``param``."""
        return value

    def optim_target(
        self, param: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[Any, torch.Tensor]:
        """(target leaf, tensor to put into the optimizer state) for one saved entry."""
        t = torch.empty(shape, dtype=dtype, device=param.device)
        return t, t

    # ------------------------------------------------------------- save
    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        self._pnames = self._collect_param_names(state)
        return {k: self._save_value(v) for k, v in state.items()}

    def _collect_param_names(self, state: dict[str, Any]) -> dict[int, str]:
        mods = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
        names: dict[int, str] = {}
        for k, m in mods:
            for pid, n in self.param_names(m).items():
                names[pid] = n if len(mods) == 1 else f"{k}.{n}"
        return names

    def _save_value(self, v: Any) -> Any:
        if isinstance(v, nn.Module):
            return self.module_leaves(v)
        if isinstance(v, torch.optim.Optimizer):
            return self._optimizer_tree(v)
        if is_per_rank(v):
            return PerRank(v.state_dict())
        if is_stateful(v):
            return self._save_value(v.state_dict())
        if type(v) is dict:
            return {k: self._save_value(x) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(self._save_value(x) for x in v)
        return v

    def _optim_params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def _optimizer_tree(self, opt: torch.optim.Optimizer) -> Any:
        osd = opt.state_dict()
        params = self._optim_params(opt)

        def fqn(i: int) -> str:
            return self._pnames.get(id(params[i]), str(i))

        state: dict[str, Any] = {}
        for i, st in osd["state"].items():
            p = params[i]
            state[fqn(i)] = {
                k: self.optim_leaf(p, val) if isinstance(val, torch.Tensor) else val for k, val in st.items()
            }
        groups = []
        for g in osd["param_groups"]:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [fqn(i) for i in g["params"]]
            groups.append(g2)
        return {"state": state, "param_groups": Whole(groups)}

    # ------------------------------------------------------------- load
    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        self._pnames = self._collect_param_names(state)
        self._nodes = dict(iter_skeleton(md.skeleton))
        self._md = md
        finalizers: list[Callable[[dict[str, Any]], None]] = []
        tree = {k: self._target(v, str(k), state, k, finalizers) for k, v in state.items()}

        def finalize(values: dict[str, Any]) -> None:
            for f in finalizers:
                f(values)

        return LoadTarget(tree, finalize)

    def _target(
        self, v: Any, fqn: str, parent: Any, key: Any, finalizers: list[Callable[[dict[str, Any]], None]]
    ) -> Any:
        if isinstance(v, nn.Module):
            target, fin = self.module_targets(v)
            finalizers.append(lambda values: fin({k: values.get(f"{fqn}.{k}") for k in target}))
            return target
        if isinstance(v, torch.optim.Optimizer):
            return self._optimizer_target(v, fqn, finalizers)
        if is_per_rank(v) or is_stateful(v):
            finalizers.append(lambda values: v.load_state_dict(values[fqn]) if fqn in values else None)
            return Slot(per_rank=is_per_rank(v))
        if type(v) is dict:
            return {k: self._target(x, f"{fqn}.{k}", v, k, finalizers) for k, x in v.items()}
        if isinstance(v, torch.Tensor) and type(v) in (torch.Tensor, nn.Parameter):
            return v.detach()
        if isinstance(parent, dict):
            def put(values: dict[str, Any]) -> None:
                if fqn in values:
                    parent[key] = values[fqn]

            finalizers.append(put)
        return Slot(default=v)

    def _optimizer_target(
        self, opt: torch.optim.Optimizer, key: str, finalizers: list[Callable[[dict[str, Any]], None]]
    ) -> Any:
        params = self._optim_params(opt)
        fqns = [self._pnames.get(id(p), str(i)) for i, p in enumerate(params)]
        index = {f: i for i, f in enumerate(fqns)}
        target_state: dict[str, Any] = {}
        put: dict[int, dict[str, torch.Tensor]] = {}
        for f, i in index.items():
            node = self._nodes.get(f"{key}.state.{f}")
            if node is None or "d" not in node:
                continue
            entries: dict[str, Any] = {}
            for k, child in node["d"]:
                if "tensor" in child:
                    info = self._md.tensors[child["tensor"]]
                    shape, dtype = tuple(info["shape"]), dtype_from_name(info["dtype"])
                    existing = opt.state.get(params[i], {}).get(k)
                    if (
                        isinstance(existing, torch.Tensor)
                        and existing.dtype == dtype
                        and tuple(existing.shape) == shape
                    ):
                        # fill the optimizer's own state in place: no new memory
                        leaf, t = self.optim_leaf(params[i], existing), existing
                    else:
                        leaf, t = self.optim_target(params[i], shape, dtype)
                    entries[k] = leaf
                    put.setdefault(i, {})[k] = t
                else:
                    entries[k] = Slot()
            target_state[f] = entries

        def finalize(values: dict[str, Any]) -> None:
            saved_groups = values.get(f"{key}.param_groups")
            if saved_groups is None:
                return
            per_group, pos = [], 0
            for g in opt.param_groups:
                per_group.append(fqns[pos : pos + len(g["params"])])
                pos += len(g["params"])
            groups = param_groups_for_load(key, saved_groups, opt, per_group)
            osd_state: dict[int, dict[str, Any]] = {}
            for f, entries in target_state.items():
                i = index[f]
                osd_state[i] = {
                    k: put[i][k] if k in put.get(i, {}) else values[f"{key}.state.{f}.{k}"]
                    for k in entries
                }
            opt.load_state_dict({"state": osd_state, "param_groups": groups})

        finalizers.append(finalize)
        return {"state": target_state, "param_groups": Slot()}


