"""The DeepSpeed adapter: engines, ZeRO optimizers and their layouts, online.

The package's docstring says what is saved; this module holds the adapter
(called through the registry on every rank: ``detect``, then ``save_tree``
or ``load_tree``) and :func:`expand_engines`, which turns an engine into
its module, optimizer and engine state.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bytecp.adapter_api import AdapterCall, LoadTarget, excluded
from bytecp.dist import DistContext
from bytecp.errors import ConfigError, StateMismatchError
from bytecp.format.metadata import Metadata
from bytecp.tree.dtypes import dtype_from_name
from bytecp.tree.state import ReplicaSet, Slot, TensorLeaf, Whole

from .._names import ModuleNames
from .._optim import ParamState, check_group
from ..plain import PlainAdapter
from .engine import EngineState
from .moe import ExpertNames
from .pipeline import is_pipeline_module, other_stages, pipeline_stages
from .tp import META as TP_META
from .tp import Piece, autotp_size, to_full, tp_rank
from .tp import pieces as tp_pieces
from .zero import (
    Fragment,
    ZeroLayout,
    check_supported,
    is_stage3,
    is_zero_optimizer,
    zero_layout,
)

__all__ = ["DeepSpeedAdapter", "expand_engines"]

Finalize = Callable[[dict[str, Any]], None]

#: the key an engine's optimizer is saved under when the state names only the engine
OPTIMIZER_KEY = "optimizer"
#: the key an engine's own state (counters, scheduler, loss scaler) is saved under
ENGINE_KEY = "engine"
#: the state key of the fp32 master weights under mixed precision
MASTER_KEY = "fp32"


def _is_engine(v: Any) -> bool:
    return isinstance(v, nn.Module) and type(v).__name__ in ("DeepSpeedEngine", "PipelineEngine") \
        and hasattr(v, "module") and hasattr(v, "optimizer")


def _engine_of(state: dict[str, Any], opt: Any) -> Any:
    return next((v for v in state.values() if _is_engine(v) and v.optimizer is opt), None)


def expand_engines(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each engine replaced by its module, its ZeRO optimizer
    added under ``"optimizer"`` (unless the state already holds it) and its
    own state under ``"engine"``; a ZeRO optimizer's wrapped ``torch.optim``
    optimizer stands for the ZeRO one. On load, a part ``exclude=`` names is
    not added (:func:`bytecp.adapter_api.excluded`)."""
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


def _frag_leaf(f: Fragment, flat: torch.Tensor, replicas: ReplicaSet | None,
               tp: tuple[tuple[int, ...], list[Piece]] | None = None) -> TensorLeaf:
    """The boxes of fragment ``f`` in ``flat`` (a flat partition or a state
    tensor shaped like it); with ``tp`` (an AutoTP shard's full shape and
    pieces) as boxes of the full tensor."""
    piece = flat.detach()[f.offset : f.offset + f.numel]
    leaf = TensorLeaf(f.shape, flat.dtype, [], replicas) if not f.numel else \
        TensorLeaf.from_flat(f.shape, flat.dtype, f.start, piece, replicas)
    return leaf if tp is None else to_full(leaf, *tp)


def _tp_layouts(lay: ZeroLayout) -> dict[str, tuple[tuple[int, ...], list[Piece]]]:
    """AutoTP: fqn -> (full shape, pieces) of each parameter it shards on this rank."""
    out: dict[str, tuple[tuple[int, ...], list[Piece]]] = {}
    rank: int | None = None
    for fqn, p in lay.params.items():
        if getattr(p, TP_META, None):
            rank = tp_rank() if rank is None else rank
            got = tp_pieces(p, rank, fqn)
            if got is not None:
                out[fqn] = got
    return out


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


def _z3_span(p: Any) -> tuple[torch.Tensor, int, int]:
    """``(piece, start, valid)``: this rank's flat piece of a ZeRO-3 parameter
    holds its elements ``[start, start+valid)``; the rest is padding."""
    local = p.ds_tensor.detach().view(-1)
    start = torch.distributed.get_rank(group=p.ds_process_group) * local.numel()
    return local, start, max(0, min(local.numel(), int(p.ds_numel) - start))


def _z3_param_leaf(p: Any, rank: int) -> TensorLeaf:
    """This rank's piece of a ZeRO-3 parameter, padding masked (``ds_numel``)."""
    local, start, valid = _z3_span(p)
    shape = tuple(p.ds_shape)
    if not valid:
        return TensorLeaf(shape, local.dtype, [], ReplicaSet.of((rank,)))
    return TensorLeaf.from_flat(shape, local.dtype, start, local[:valid], ReplicaSet.of((rank,)))


def _persistent(p: Any) -> bool:
    """A ZeRO-3 parameter kept whole on every rank (below ``stage3_param_persistence_threshold``)."""
    return bool(getattr(p, "ds_persist", False)) and p.data.numel() == int(p.ds_numel)


def _model_piece(lay: ZeroLayout, f: Fragment) -> torch.Tensor:
    """The model's values of fragment ``f`` (what the master weights are
    refreshed from): what a load fills, whichever finalizer runs first."""
    p: Any = lay.params[f.fqn]
    if lay.stage == 3 and not _persistent(p):
        return p.ds_tensor.detach().view(-1)[: f.numel]
    return p.detach().reshape(-1)[f.start : f.start + f.numel]


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
                _masters_from_model(lay)
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
        return LoadTarget(target.tree, finalize, elsewhere=[*target.elsewhere, *elsewhere])

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
                out[n] = v.detach() if loading and _persistent(v) else _z3_param_leaf(v, call.dist.rank)
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
                    if _persistent(p):
                        local, start, valid = _z3_span(p)
                        local[:valid].copy_(p.data.view(-1)[start : start + valid])

        return target, finalize

    # ------------------------------------------------------------- optimizer
    def _save_value(self, call: AdapterCall, v: Any) -> Any:
        if is_zero_optimizer(v):
            return self._optimizer_tree(call, v)
        return super()._save_value(call, v)

    def _target(self, call: AdapterCall, v: Any, fqn: str, parent: Any, key: Any, finalizers: list[Finalize]) -> Any:
        if is_zero_optimizer(v):
            tree, fin = self._optimizer_target(call, v, fqn)
            finalizers.append(fin)
            return tree
        return super()._target(call, v, fqn, parent, key, finalizers)

    def _optimizer_tree(self, call: AdapterCall, opt: Any) -> dict[str, Any]:
        """(every rank, save) This rank's fragments of every partition-shaped
        state tensor, per-group values under each parameter, named param groups."""
        lay = zero_layout(opt, call.param_names, "save")
        own = ReplicaSet.of((call.dist.rank,))
        tp = _tp_layouts(lay)
        state: dict[str, Any] = {}
        for f in lay.fragments:
            flat = lay.flats[f.group]
            entry: dict[str, Any] = {}
            for k, v in lay.inner.state.get(flat, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == flat.shape:
                    entry[k] = _frag_leaf(f, v, own, tp.get(f.fqn))
                else:  # a copy per parameter: torch.optim keeps one per parameter too
                    entry[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            if lay.params[f.fqn].dtype != flat.dtype:
                entry[MASTER_KEY] = _frag_leaf(f, flat, own, tp.get(f.fqn))
            state[f.fqn] = entry
        groups = []
        for g, fqns in zip(lay.inner.param_groups, lay.group_fqns, strict=True):
            groups.append({**{k: x for k, x in g.items() if k != "params"}, "params": list(fqns)})
        return {"state": state, "param_groups": Whole(groups)}

    def _optimizer_target(self, call: AdapterCall, opt: Any, key: str) -> tuple[dict[str, Any], Finalize]:
        """(every rank, load) Views of this rank's fragments in the partitions
        and state tensors (created where missing), and the finalizer that sets
        per-group values, refreshes the master weights and the hyperparameters."""
        assert call.md is not None
        md, lay = call.md, zero_layout(opt, call.param_names, "load")
        tp = _tp_layouts(lay)
        target: dict[str, Any] = {}
        rebuilt: dict[int, dict[str, str]] = {}  # flat -> state key -> fqn of the value
        masters: set[str] = set()
        for f in lay.fragments:
            node = call.nodes.get(f"{key}.state.{f.fqn}")
            if node is None or node.kind != "dict":
                continue
            flat, st = lay.flats[f.group], lay.state(f.group)
            entries: dict[str, Any] = {}
            full = tp[f.fqn][0] if f.fqn in tp else f.shape
            for k, child in node.items:
                info = md.tensors.get(child.name) if child.kind == "tensor" else None
                if info is not None and tuple(info["shape"]) == full and f.shape:
                    buf = flat
                    if k == MASTER_KEY:
                        masters.add(f.fqn)
                    else:
                        dtype = dtype_from_name(info["dtype"])
                        cur = st.get(k)
                        if isinstance(cur, torch.Tensor) and cur.shape == flat.shape and cur.dtype == dtype:
                            buf = cur
                        else:
                            buf = st[k] = torch.zeros_like(flat, dtype=dtype)
                    entries[str(k)] = _frag_leaf(f, buf, None, tp.get(f.fqn))
                else:
                    entries[str(k)] = Slot()
                    rebuilt.setdefault(f.group, {}).setdefault(str(k), f"{key}.state.{f.fqn}.{k}")
            target[f.fqn] = entries

        def finalize(values: dict[str, Any]) -> None:
            for i, keys in rebuilt.items():
                st = lay.state(i)
                for k, name in keys.items():
                    v = values[name]
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v
            _masters_from_model(lay, masters)
            _apply_groups(key, lay, values.get(f"{key}.param_groups"), frozenset(target))
            _relink(opt, lay)

        return {"state": target, "param_groups": Slot()}, finalize


def _is_optimizer(v: Any) -> bool:
    return isinstance(v, torch.optim.Optimizer) or is_zero_optimizer(v)


def _masters_from_model(lay: ZeroLayout, loaded: set[str] | frozenset[str] = frozenset()) -> None:
    """The fp32 master fragments of every parameter but ``loaded`` (those the
    checkpoint held) set from the module's values."""
    with torch.no_grad():
        for f in lay.fragments:
            if f.numel and f.fqn not in loaded:
                lay.flats[f.group][f.offset : f.offset + f.numel].copy_(_model_piece(lay, f))


def _relink(opt: Any, lay: ZeroLayout) -> None:
    """ZeRO-1/2: point each parameter's optimizer-state fragments (what
    ``deepspeed.utils.safe_get_full_optimizer_state`` reads) at the loaded
    state tensors; DeepSpeed links them lazily at the first step otherwise."""
    link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
    if lay.stage != 3 and callable(link) and all(lay.inner.state.get(f) for f in lay.flats):
        opt._hp_optimizer_states_linked = False
        link()


def _apply_groups(key: str, lay: ZeroLayout, saved: list[dict[str, Any]] | None, stored: frozenset[str]) -> None:
    """Hyperparameters of the saved param groups (parameters named by FQN) onto
    the wrapped optimizer's; ``stored``: the parameters whose state the
    checkpoint holds (a pipeline stage's groups stand for another stage's)."""
    if saved is None:
        return
    groups = lay.inner.param_groups
    if len(saved) != len(groups):
        raise StateMismatchError(
            f"optimizer {key!r}: the checkpoint has {len(saved)} param groups, the ZeRO optimizer {len(groups)}"
        )
    current = [list(names) for names in lay.group_fqns]
    for j, (sg, g) in enumerate(zip(saved, groups, strict=True)):
        check_group(key, j, sg["params"], current, stored)
        for k, v in sg.items():
            if k != "params":
                g[k] = v
