"""The distributed optimizer's layouts, and its model-space state.

``model_space`` (the default): each DP rank's flat ranges of the main
parameters and Adam moments as boxes of the model-space tensors
``optimizer.state.<name>.<model key>`` (:func:`model_space_leaves`), no
gather and no full-size copy; the same tensors and keys as Megatron's
``fully_reshardable``. The adapter (``adapter.py``) builds the leaves with
:func:`_flat_state` on save and load (all ranks, no communication), and
finishes a load with :func:`_flat_finalizer` or :func:`_load_optimizer`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from bytecp.errors import ConfigError, StateMismatchError
from bytecp.format.metadata import Metadata
from bytecp.tree.dtypes import dtype_from_name
from bytecp.tree.regions import Region, flat_range_to_boxes
from bytecp.tree.state import Shard, TensorLeaf

from .translate import COMMON, _leaves, _Types

__all__ = [
    "DEFAULT_OPTIMIZER_LAYOUT",
    "LAYOUTS",
    "OptimizerLayout",
    "flat_range_boxes",
    "model_space_leaves",
]

#: the distributed optimizer layout saved unless the caller picks another:
#: model-space tensors that reload under any TP, PP and DP, written by each
#: DP rank from its own flat ranges (no gather); the same tensors and keys as
#: Megatron's "fully_reshardable", which gathers every DP rank's state first
DEFAULT_OPTIMIZER_LAYOUT = "model_space"
#: the layouts bytecp saves a distributed optimizer in
LAYOUTS = ("model_space", "fully_reshardable", "dp_reshardable")
#: layouts whose checkpoints hold the same tensors (each loads the other)
_MODEL_SPACE = ("model_space", "fully_reshardable")

@dataclasses.dataclass
class OptimizerLayout:
    """A Megatron optimizer with the distributed-optimizer layout to save it in."""

    optimizer: Any
    layout: str = DEFAULT_OPTIMIZER_LAYOUT

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(
                f"distributed optimizer layout {self.layout!r} is not supported; use one of {list(LAYOUTS)}"
            )

# ------------------------------------------------------------------ model-space flat ranges
def flat_range_boxes(
    local_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
    prepend_axis_num: int,
    start: int,
    end: int,
) -> list[tuple[Region, int]]:
    """Elements ``[start, end)`` of a ShardedTensor's row-major local data as
    boxes of its global tensor, each with its position in the flat range."""
    out = []
    pos = 0
    lead = tuple(global_offset[:prepend_axis_num])
    inner = tuple(global_offset[prepend_axis_num:])
    for box in flat_range_to_boxes(local_shape, start, end):
        region = Region(
            lead + tuple(o + b for o, b in zip(inner, box.offsets, strict=True)),
            (1,) * prepend_axis_num + box.lengths,
        )
        out.append((region, pos))
        pos += box.numel
    return out


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Local elements ``[first, first+numel)`` of a model parameter are the
    row-major data of a ShardedTensor (``key``, box at ``global_offset``)."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    prepend_axis_num: int
    first: int
    numel: int
    allow_shape_mismatch: bool = False


def _pieces(meta: Any, types: _Types, where: str) -> list[_Piece]:
    """The ShardedTensors a parameter's local data forms: itself, or what its
    factory builds. A factory is built on a tensor of element indices, so its
    pieces say which local elements each built box holds; each must be a
    contiguous run of them (chunks along the first dimension are)."""
    if isinstance(meta, types.ShardedTensor):
        sts = [meta]
        firsts = [0]
    else:
        index = torch.arange(meta.data.numel(), dtype=torch.int64).view(meta.data.shape)
        built = dataclasses.replace(meta, data=index).build()
        sts, firsts = [], []
        for node in _leaves(built):
            if isinstance(node, types.ShardedTensor):
                flat = node.data.reshape(-1)
                first = int(flat[0]) if flat.numel() else 0
                if flat.numel() and not torch.equal(flat, torch.arange(first, first + flat.numel())):
                    raise ConfigError(
                        f"{where}: the factory of {meta.key!r} builds {node.key!r} from elements of "
                        "the parameter that are not one contiguous run; save this optimizer with "
                        "OptimizerLayout(opt, 'fully_reshardable')"
                    )
                sts.append(node)
                firsts.append(first)
    return [
        _Piece(st.key, tuple(st.global_shape), tuple(st.global_offset), tuple(st.local_shape),
               st.prepend_axis_num, first, math.prod(st.local_shape), bool(st.allow_shape_mismatch))
        for st, first in zip(sts, firsts, strict=True)
    ]


def model_space_leaves(
    pieces: list[_Piece], start: int, flat: torch.Tensor, prefix: str, leaves: dict[str, TensorLeaf],
    asm: set[str], hint: Any = None,
) -> None:
    """Add the boxes that ``flat`` -- elements ``[start, start+numel)`` of a
    parameter's local data -- covers, under ``prefix + piece key``, as views;
    ``hint`` (save) gives a new leaf its replica set (``replicas.Hints.optimizer``)."""
    end = start + flat.numel()
    for pc in pieces:
        lo, hi = max(start, pc.first), min(end, pc.first + pc.numel)
        if hi <= lo:
            continue
        key = prefix + pc.key
        if pc.allow_shape_mismatch:
            asm.add(key)
        leaf = leaves.get(key)
        if leaf is None:
            replicas = hint(pc.key, pc.local_shape, pc.global_shape, pc.prepend_axis_num) if hint else None
            leaf = leaves[key] = TensorLeaf(pc.global_shape, flat.dtype, [], replicas)
        base = lo - start
        for region, pos in flat_range_boxes(pc.local_shape, pc.global_offset, pc.prepend_axis_num,
                                            lo - pc.first, hi - pc.first):
            n = region.numel
            leaf.shards.append(Shard(region, flat[base + pos : base + pos + n].view(region.lengths)))


@dataclasses.dataclass
class _FlatState:
    """A distributed optimizer's state as model-space leaves of this rank's ranges."""

    leaves: dict[str, TensorLeaf]
    common: dict[str, Any]
    live: list[tuple[Any, Any, str, torch.Tensor]]  # (optimizer, model param, state name, tensor in the leaves)
    asm: set[str]  # keys of padded tensors (allow_shape_mismatch)
    model_keys: set[str]  # model keys of every parameter the optimizer's buffers hold
    param_keys: dict[int, set[str]] = dataclasses.field(default_factory=dict)  # id(param) -> its model keys


def _distributed_parts(opt: Any) -> list[Any] | None:
    """The DistributedOptimizers ``opt`` is or chains (one, or Megatron's dense
    and expert optimizers under expert parallelism), each on its standard
    path; else None (the caller then uses Megatron's own producers)."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError:  # pragma: no cover - megatron without the distributed optimizer
        return None
    subs = getattr(opt, "chained_optimizers", None)
    parts = list(subs) if subs is not None else [opt]
    if not parts:
        return None
    for d in parts:
        if not isinstance(d, DistributedOptimizer):
            return None
        if getattr(getattr(d, "config", None), "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            return None
        if getattr(getattr(d, "ddp_config", None), "use_megatron_fsdp", False):
            return None
    return parts


def _flat_state(parts: list[Any], model_sd: Any, types: _Types, where: str, hint: Any = None) -> _FlatState:
    """(all ranks, no communication) Each parameter range this rank owns in
    each of ``parts`` (the dense and expert optimizers of a chain: their DP
    groups differ), for the main parameter and every optimizer state tensor,
    as boxes of the model-space tensors Megatron's fully_reshardable layout
    names ``optimizer.state.<name>.<model key>``; expert tensors carry the
    global expert axis, so the names do not depend on the chain or on EP. The
    common state is one param-group list for the whole chain (see
    :func:`_chain_common`)."""
    meta: dict[int, Any] = {}
    for node in _leaves(model_sd):
        if isinstance(node, (types.ShardedTensor, types.ShardedTensorFactory)) and node.data is not None:
            meta[id(node.data)] = node
    leaves: dict[str, TensorLeaf] = {}
    asm: set[str] = set()
    live: list[tuple[Any, Any, str, torch.Tensor]] = []
    model_keys: set[str] = set()
    param_keys: dict[int, set[str]] = {}
    for buffer in (b for d in parts for b in d.buffers):
        for param in buffer.param_index_map:
            m = meta.get(id(param))
            if m is not None:
                model_keys.update(pc.key for pc in _pieces(m, types, where))
    for d, gbuf_range_maps in ((part, m) for part in parts for m in part.gbuf_ranges):
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for param, ranges in bucket["param_map"].items():
                    m = meta.get(id(param))
                    if m is None:
                        raise ConfigError(
                            f"{where}: parameter {_param_name(d, param)!r} (shape {list(param.shape)}, "
                            f"{_group_of(param, parts.index(d), len(parts))}) of the distributed "
                            "optimizer is not in the model's sharded_state_dict(); pass the model "
                            "(or the Megatron-DDP-wrapped model) this optimizer was built on"
                        )
                    pieces = _pieces(m, types, where)
                    param_keys[id(param)] = {pc.key for pc in pieces}
                    r = ranges["param"]
                    for name, t in d._get_main_param_and_optimizer_states(param).items():
                        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != r.end - r.start:
                            continue  # "step" and other per-parameter scalars live in the common state
                        flat = t.detach()
                        model_space_leaves(pieces, r.start, flat, f"optimizer.state.{name}.", leaves, asm, hint)
                        live.append((d, param, name, flat))
    return _FlatState(leaves, _chain_common(parts), live, asm, model_keys, param_keys)


def _param_name(d: Any, param: Any) -> str:
    """The parameter's name in the model the optimizer was built on, or '?'."""
    for chunk in getattr(d, "model_chunks", None) or []:
        for name, p in chunk.named_parameters():
            if p is param:
                return str(name)
    return "?"


def _group_of(param: Any, i: int, n: int) -> str:
    """Which Megatron group holds ``param``: experts (expert data-parallel
    group) or dense, and its optimizer in the chain."""
    kind = "expert-parallel" if not getattr(param, "allreduce", True) else "dense data-parallel"
    return f"Megatron {kind} group, optimizer {i + 1} of {n} in the chain"


def _group_id(group: dict[str, Any]) -> tuple[Any, ...]:
    """Megatron's identity of a param group (``param_group_identifier_keys``)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def _chain_common(parts: list[Any]) -> dict[str, Any]:
    """The non-parameter state of every optimizer of the chain as one
    DistributedOptimizer state dict: the param groups of all of them (each
    identified by Megatron's group keys, wd/lr multipliers and
    ``is_expert_parallel``), so any chain (EP=2: dense + expert, EP=1: one)
    finds its groups in it on load."""
    first = dict(parts[0].state_dict())
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for d in parts:
        for g in d.state_dict()["optimizer"]["param_groups"]:
            groups.setdefault(_group_id(g), g)
    first["optimizer"] = {**first["optimizer"], "param_groups": list(groups.values())}
    first["param_state_sharding_type"] = "fully_reshardable"
    return first


def _add_unowned(key: str, fs: _FlatState, md: Metadata) -> None:
    """(load) Empty leaves for the saved state of parameters this DP rank owns
    no range of, so the strict key check sees the whole model on every rank."""
    prefix = f"{key}.optimizer.state."
    for fqn, info in md.tensors.items():
        if not fqn.startswith(prefix):
            continue
        name, _, model_key = fqn[len(prefix):].partition(".")
        leaf_key = fqn[len(key) + 1 :]
        if model_key in fs.model_keys and leaf_key not in fs.leaves:
            fs.leaves[leaf_key] = TensorLeaf(tuple(info["shape"]), dtype_from_name(info["dtype"]), [])

def _init_fresh_state(opt: Any) -> None:
    """(load, all ranks) Give a never-stepped optimizer its state, as Megatron's
    ``init_state_fn`` does, plus torch Adam's ``step``: Megatron 0.16 without
    Apex/TE cannot describe an optimizer whose state is empty (its
    ``state_dict`` reads every parameter's ``step``). The values are
    overwritten by the load."""
    for o in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = getattr(o, "optimizer", None)
        init = getattr(o, "init_state_fn", None)
        if inner is None or init is None or not isinstance(inner, torch.optim.Optimizer):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not any(len(inner.state[p]) == 0 for p in params):
            continue
        init(inner, getattr(o, "config", None))
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for p in params:
                inner.state[p].setdefault("step", torch.tensor(0.0))

def _save_layout(v: Any) -> str:
    return v.layout if isinstance(v, OptimizerLayout) else DEFAULT_OPTIMIZER_LAYOUT

def _groups_for(key: str, d: Any, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved param groups ``d`` finds its own in. A group saved under the
    other ``is_expert_parallel`` flag stands in for a missing one with the same
    multipliers: at EP=1 Megatron keeps experts in the dense groups, at EP > 1
    in an expert optimizer of their own."""
    have = {_group_id(g): g for g in saved}
    out = list(saved)
    for g in d.optimizer.param_groups:
        want = _group_id(g)
        if want in have:
            continue
        twin = next((s for i, s in have.items() if _same_but_expert_flag(i, want)), None)
        if twin is None:
            raise StateMismatchError(
                f"optimizer {key!r}: the checkpoint has no param group {want} (wd_mult, lr_mult, "
                f"is_expert_parallel, is_decoupled_lr); it holds {sorted(have, key=str)}. Load with "
                "the optimizer settings (weight-decay and learning-rate multipliers) the job was saved with"
            )
        flag = "is_expert_parallel" if "is_expert_parallel" in twin else "pre_is_expert_parallel"
        have[want] = {**twin, flag: g.get("is_expert_parallel", g.get("pre_is_expert_parallel"))}
        out.append(have[want])
    return out


def _same_but_expert_flag(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    i = param_group_identifier_keys.index("is_expert_parallel")
    return a[:i] + a[i + 1 :] == b[:i] + b[i + 1 :]


def _flat_finalizer(key: str, opt: Any, parts: list[Any], fs: _FlatState) -> Callable[[dict[str, Any]], None]:
    """(all ranks) After the model-space ranges are read into the optimizers'
    own tensors: the non-parameter state (param groups, step, grad scaler) of
    every optimizer of the chain, from the saved groups with the same identity."""

    def finalize(values: dict[str, Any]) -> None:
        common = values.get(f"{key}.{COMMON}")
        if common is None:
            raise StateMismatchError(f"optimizer {key!r}: the checkpoint holds no optimizer param groups")
        rest = {k: v for k, v in common.items() if k != "param_state_sharding_type"}
        groups = list(rest.get("optimizer", {}).get("param_groups", []))
        for d in parts:
            rest = {**rest, "optimizer": {**rest["optimizer"], "param_groups": _groups_for(key, d, groups)}}
            d.load_state_dict(rest)
            inner = getattr(d, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer):
                for st in inner.state.values():  # one step tensor per parameter (see _load_optimizer)
                    if isinstance(st.get("step"), torch.Tensor):
                        st["step"] = st["step"].detach().clone()
        with torch.no_grad():
            for d, param, name, t in fs.live:
                cur = d._get_main_param_and_optimizer_states(param).get(name)
                if isinstance(cur, torch.Tensor) and cur.data_ptr() != t.data_ptr():
                    cur.copy_(t)  # the optimizer replaced the tensor we filled
        sync = getattr(opt, "_synchronize_steps", None)
        if len(parts) > 1 and callable(sync):
            sync()

    return finalize

def _load_optimizer(opt: Any, loaded: Any) -> None:
    """(all ranks) ``opt.load_state_dict(loaded)``, as Megatron's own loader
    calls it, except for one Megatron 0.16 defect: with torch's Adam (no
    Apex/TE) the distributed optimizer keeps ``step`` in every parameter's
    state and its parameter-state loaders then look for a ``step`` tensor the
    checkpoint format never holds (KeyError), and all parameters share one
    ``step`` tensor (so the next step advances it once per parameter). There
    the non-parameter state is loaded first (it sets ``step`` from the param
    groups), the parameter state with ``step`` set aside, and every parameter
    gets its own ``step``."""
    subs = getattr(opt, "chained_optimizers", None)
    if subs is not None:
        if len(subs) == 1:
            _load_optimizer(subs[0], loaded)
            return
        parts = (v for _, v in sorted(loaded.items())) if isinstance(loaded, dict) else loaded
        with torch.no_grad():
            for sub, part in zip(subs, parts, strict=True):
                _load_optimizer(sub, part)
        sync = getattr(opt, "_synchronize_steps", None)
        if callable(sync):
            sync()
        return
    inner = getattr(opt, "optimizer", None)
    kind = loaded.get("param_state_sharding_type") if isinstance(loaded, dict) else None
    load_params = getattr(opt, f"load_parameter_state_from_{kind}", None) if kind else None
    if load_params is None or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        opt.load_state_dict(loaded)
        return
    rest = {k: v for k, v in loaded.items() if k not in ("param_state", "param_state_sharding_type")}
    opt.load_state_dict(rest)
    steps = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
    try:
        with torch.no_grad():
            load_params(loaded["param_state"])
    finally:
        # one tensor per parameter: Megatron hands every parameter the same
        # step tensor, which torch's Adam then increments once per parameter
        for p, step in steps.items():
            inner.state[p]["step"] = step.detach().clone()
