"""The state of a DeepSpeed ZeRO optimizer as the core's tree, and back.

Called by :class:`.adapter.DeepSpeedAdapter` on every rank: on save,
:func:`optimizer_tree` gives this rank's fragments of every partition-shaped
state tensor (and of the fp32 masters where the model is not fp32), the
per-group values under each parameter and the param groups named by FQN; on
load, :func:`optimizer_target` gives views of the same fragments to fill in
place (state tensors created before the first step) and the finalizer that
sets the per-group values, refreshes the masters from the module where the
checkpoint has none, and applies the hyperparameters. AutoTP shards'
fragments are boxes of the full tensor (:mod:`.tp`); ZeRO-3's persistent
parameters are whole on every rank (:func:`persistent`). No collective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bytecp.errors import StateMismatchError
from bytecp.format.metadata import Metadata
from bytecp.tree.dtypes import dtype_from_name
from bytecp.tree.skeleton import Node
from bytecp.tree.state import ReplicaSet, Slot, TensorLeaf, Whole

from .._optim import check_group
from .tp import META as TP_META
from .tp import Piece, to_full, tp_rank
from .tp import pieces as tp_pieces
from .zero import Fragment, ZeroLayout, zero_layout

__all__ = [
    "optimizer_tree", "optimizer_target", "frag_leaf", "tp_layouts", "masters_from_model", "z3_span",
    "z3_param_leaf", "persistent", "MASTER_KEY",
]

Finalize = Callable[[dict[str, Any]], None]

#: the state key of the fp32 master weights under mixed precision
MASTER_KEY = "fp32"


def frag_leaf(f: Fragment, flat: torch.Tensor, replicas: ReplicaSet | None,
               tp: tuple[tuple[int, ...], list[Piece]] | None = None) -> TensorLeaf:
    """The boxes of fragment ``f`` in ``flat`` (a flat partition or a state
    tensor shaped like it); with ``tp`` (an AutoTP shard's full shape and
    pieces) as boxes of the full tensor."""
    piece = flat.detach()[f.offset : f.offset + f.numel]
    leaf = TensorLeaf(f.shape, flat.dtype, [], replicas) if not f.numel else \
        TensorLeaf.from_flat(f.shape, flat.dtype, f.start, piece, replicas)
    return leaf if tp is None else to_full(leaf, *tp)


def tp_layouts(lay: ZeroLayout) -> dict[str, tuple[tuple[int, ...], list[Piece]]]:
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


def z3_span(p: Any) -> tuple[torch.Tensor, int, int]:
    """``(piece, start, valid)``: this rank's flat piece of a ZeRO-3 parameter
    holds its elements ``[start, start+valid)``; the rest is padding."""
    local = p.ds_tensor.detach().view(-1)
    start = torch.distributed.get_rank(group=p.ds_process_group) * local.numel()
    return local, start, max(0, min(local.numel(), int(p.ds_numel) - start))


def z3_param_leaf(p: Any, rank: int) -> TensorLeaf:
    """This rank's piece of a ZeRO-3 parameter, padding masked (``ds_numel``)."""
    local, start, valid = z3_span(p)
    shape = tuple(p.ds_shape)
    if not valid:
        return TensorLeaf(shape, local.dtype, [], ReplicaSet.of((rank,)))
    return TensorLeaf.from_flat(shape, local.dtype, start, local[:valid], ReplicaSet.of((rank,)))


def persistent(p: Any) -> bool:
    """A ZeRO-3 parameter kept whole on every rank (below ``stage3_param_persistence_threshold``)."""
    return bool(getattr(p, "ds_persist", False)) and p.data.numel() == int(p.ds_numel)


def _model_piece(lay: ZeroLayout, f: Fragment) -> torch.Tensor:
    """The model's values of fragment ``f`` (what the master weights are
    refreshed from): what a load fills, whichever finalizer runs first."""
    p: Any = lay.params[f.fqn]
    if lay.stage == 3 and not persistent(p):
        return p.ds_tensor.detach().view(-1)[: f.numel]
    return p.detach().reshape(-1)[f.start : f.start + f.numel]


def optimizer_tree(opt: Any, names: dict[int, str], rank: int) -> dict[str, Any]:
    """(every rank, save) This rank's fragments of every partition-shaped
    state tensor, per-group values under each parameter, named param groups."""
    lay = zero_layout(opt, names, "save")
    own = ReplicaSet.of((rank,))
    tp = tp_layouts(lay)
    state: dict[str, Any] = {}
    for f in lay.fragments:
        flat = lay.flats[f.group]
        entry: dict[str, Any] = {}
        for k, v in lay.inner.state.get(flat, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == flat.shape:
                entry[k] = frag_leaf(f, v, own, tp.get(f.fqn))
            else:  # a copy per parameter: torch.optim keeps one per parameter too
                entry[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        if lay.params[f.fqn].dtype != flat.dtype:
            entry[MASTER_KEY] = frag_leaf(f, flat, own, tp.get(f.fqn))
        state[f.fqn] = entry
    groups = []
    for g, fqns in zip(lay.inner.param_groups, lay.group_fqns, strict=True):
        groups.append({**{k: x for k, x in g.items() if k != "params"}, "params": list(fqns)})
    return {"state": state, "param_groups": Whole(groups)}

def optimizer_target(opt: Any, names: dict[int, str], md: Metadata, nodes: dict[str, Node],
                 key: str) -> tuple[dict[str, Any], Finalize]:
    """(every rank, load) Views of this rank's fragments in the partitions
    and state tensors (created where missing), and the finalizer that sets
    per-group values, refreshes the master weights and the hyperparameters."""
    lay = zero_layout(opt, names, "load")
    tp = tp_layouts(lay)
    target: dict[str, Any] = {}
    rebuilt: dict[int, dict[str, str]] = {}  # flat -> state key -> fqn of the value
    masters: set[str] = set()
    for f in lay.fragments:
        node = nodes.get(f"{key}.state.{f.fqn}")
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
                entries[str(k)] = frag_leaf(f, buf, None, tp.get(f.fqn))
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
        masters_from_model(lay, masters)
        _apply_groups(key, lay, values.get(f"{key}.param_groups"), frozenset(target))
        _relink(opt, lay)

    return {"state": target, "param_groups": Slot()}, finalize


def masters_from_model(lay: ZeroLayout, loaded: set[str] | frozenset[str] = frozenset()) -> None:
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
