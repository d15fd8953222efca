"""Megatron-Core: tensor, pipeline and data parallelism, and the distributed optimizer.

Input is Megatron's own description of its state: ``model.sharded_state_dict()``
and the optimizer's ``sharded_state_dict(model_sd, metadata=...)``, so any model
Megatron itself can checkpoint works. Each entry maps to the core's tree:

- ``ShardedTensor`` -> a :class:`~bytecp.tree.state.TensorLeaf` keyed by its
  checkpoint key, with one box per local piece: ``global_offset`` and the local
  shape with ``prepend_axis_num`` axes of length 1 (layer-stacked keys); a view
  of the live tensor, never a copy. Replicas (``replica_id`` != 0: DP ranks,
  TP ranks of a replicated layernorm) describe the same box, so the planner
  writes it once and balances the writers over the replicas.
- ``ShardedObject`` -> one object keyed by its ``unique_key`` (``key/shard_...``);
  replicas share the key and are written once.
- ``ShardedTensorFactory`` (gated MLP, fused QKV, ...) -> built on save; on
  load the built pieces are filled and the factory's ``merge_fn`` gives the
  tensor, copied into the live one in place.
- ``LocalNonpersistentObject`` -> not saved; on load the local value is used.
- anything else in the dict (Megatron's "common" state: optimizer param
  groups, the sharding type) -> one object, written by the coordinator, as
  Megatron writes it from rank 0.

Loading fills the live tensors in place (model) or the tensors the optimizer's
``sharded_state_dict(is_loading=True)`` asks for, then hands the optimizer the
state dict Megatron's own loader would (``optimizer.load_state_dict``). A
tensor with ``allow_shape_mismatch`` (padded vocabulary) whose saved first
dimension differs from the target's loads the rows both have; other rows keep
their values.

The distributed optimizer is saved in the ``model_space`` layout by default:
each DP rank writes the flat ranges of the parameters it owns (main params,
Adam moments) as boxes of the model-space tensors
``optimizer.state.<name>.<model key>`` (the core's flat-range decomposition;
factories such as the gated fc1 are followed piece by piece), with no gather
and no full-size copy; a load reads only the ranges each rank owns, straight
into the optimizer's shards. The tensors and keys are those of Megatron's
``fully_reshardable`` layout (which gathers the state over DP first), so a
checkpoint of either loads the other, under any TP, PP and DP. Pass
``OptimizerLayout(opt, "fully_reshardable")`` or ``"dp_reshardable"``
(Megatron's per-bucket flat buffers: DP changes only) to use Megatron's own
producers. The layout is recorded; a load uses the saved one.

This module imports Megatron only when the state may hold Megatron objects
(``megatron.core`` already imported), so detection costs nothing elsewhere.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from bytecp.adapter_api import Adapter, LoadTarget
from bytecp.dist import DistContext
from bytecp.errors import ConfigError, StateMismatchError
from bytecp.format.metadata import Metadata
from bytecp.tree.dtypes import dtype_from_name
from bytecp.tree.regions import Region, flat_range_to_boxes
from bytecp.tree.state import PerRank, Shard, Slot, TensorLeaf, Whole

from .plain import is_per_rank, is_stateful

__all__ = [
    "MegatronAdapter",
    "OptimizerLayout",
    "MegatronModel",
    "DEFAULT_OPTIMIZER_LAYOUT",
    "Translation",
    "translate",
    "sharded_tensor_region",
    "sharded_tensor_view",
    "clip_to_saved",
    "rebuild",
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
#: the tree key of the common (non-sharded) part of one sharded state dict
COMMON = "__common__"


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


@dataclasses.dataclass
class MegatronModel:
    """A Megatron model (module, DDP-wrapped module or list of virtual-pipeline
    chunks) and its real vocabulary size: tensors Megatron marks
    ``allow_shape_mismatch`` (embedding, output layer and their optimizer
    state) are saved with their first ``vocab_size`` rows only, so the
    checkpoint holds unpadded tensors; a load into any padded target fills
    those rows and leaves the padding rows as they are."""

    model: Any
    vocab_size: int

    def __post_init__(self) -> None:
        if int(self.vocab_size) < 1:
            raise ConfigError(f"vocab_size must be positive, got {self.vocab_size}")


# ------------------------------------------------------------------ megatron types
def _megatron_loaded() -> bool:
    return "megatron.core" in sys.modules


@dataclasses.dataclass(frozen=True)
class _Types:
    """Megatron's classes, imported on first use (typed ``Any``: Megatron ships no stubs)."""

    ShardedBase: Any
    ShardedTensor: Any
    ShardedObject: Any
    ShardedTensorFactory: Any
    LocalNonpersistentObject: Any
    MegatronModule: Any
    DataParallel: Any
    MegatronOptimizer: Any


def _types() -> _Types:
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedBase,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.module import MegatronModule

    return _Types(
        ShardedBase, ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject,
        MegatronModule, _BaseDataParallel, MegatronOptimizer,
    )


# ------------------------------------------------------------------ pure translation
def sharded_tensor_region(
    key: str,
    global_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
    local_shape: tuple[int, ...],
    prepend_axis_num: int,
) -> Region:
    """The box a ShardedTensor's local data covers in its global tensor."""
    lengths = (1,) * prepend_axis_num + tuple(int(n) for n in local_shape)
    if len(lengths) != len(global_shape) or len(global_offset) != len(global_shape):
        raise ConfigError(
            f"Megatron sharded tensor {key!r}: local shape {list(local_shape)} with {prepend_axis_num} "
            f"prepended axes and offset {list(global_offset)} do not match global shape "
            f"{list(global_shape)}; the model's sharded_state_dict() is inconsistent"
        )
    region = Region.of(global_offset, lengths)
    if any(e > g for e, g in zip(region.ends, global_shape, strict=True)):
        raise ConfigError(
            f"Megatron sharded tensor {key!r}: box {region} lies outside its global shape "
            f"{list(global_shape)}"
        )
    return region


def sharded_tensor_view(data: torch.Tensor, prepend_axis_num: int) -> torch.Tensor:
    """The local data as a view with the prepended (layer) axes; never a copy."""
    t = data.detach()
    for _ in range(prepend_axis_num):
        t = t.unsqueeze(0)
    return t


def clip_to_saved(
    leaf: TensorLeaf, saved_shape: tuple[int, ...]
) -> TensorLeaf:
    """A target leaf of a padded tensor (``allow_shape_mismatch``) clipped to the
    saved global shape: each box keeps the part the checkpoint holds."""
    full = Region((0,) * len(saved_shape), tuple(saved_shape))
    shards = []
    for sh in leaf.shards:
        part = sh.region.intersect(full)
        if part is None:
            continue
        shards.append(Shard(part, sh.tensor[part.relative_to(sh.region).slices()]))
    return TensorLeaf(tuple(saved_shape), leaf.dtype, shards)


Path = tuple[Any, ...]


@dataclasses.dataclass
class _Binding:
    """Where a value of the sharded state dict goes back after a load."""

    path: Path
    kind: str  # "tensor" | "object" | "local" | "factory"
    ref: Any  # ShardedTensor | unique key | local value | (factory, sub-translation)


@dataclasses.dataclass
class Translation:
    """One sharded state dict as the core's tree, and how to put values back.

    ``tensors``: checkpoint key -> leaf (views of the local data);
    ``objects``: ShardedObject unique key -> data; ``common``: the dict with
    every sharded entry removed (``None`` when nothing is left);
    ``duplicates``: (kept view, other view) pairs of one box held twice on this
    rank (filled once, copied on load).
    """

    tensors: dict[str, TensorLeaf]
    objects: dict[str, Any]
    common: Any
    bindings: list[_Binding]
    asm: set[str]  # keys whose ShardedTensors allow a shape mismatch (padding)
    duplicates: list[tuple[torch.Tensor, torch.Tensor]]

    def tree(self, *, target: bool) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.tensors)
        for k, v in self.objects.items():
            out[k] = Slot() if target else Whole(v)
        if self.common is not None:
            out[COMMON] = Slot() if target else Whole(self.common)
        return out


def _path_str(path: Path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def translate(sd: Any, types: _Types, *, where: str) -> Translation:
    """Walk a Megatron sharded state dict (dicts and lists) into a
    :class:`Translation`. ``where`` names the state entry in errors."""
    tr = Translation({}, {}, None, [], set(), [])
    _walk_into(tr, sd, (), types, where)
    tr.common = _strip(sd, types)
    return tr


def _walk_into(tr: Translation, node: Any, path: Path, types: _Types, where: str) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _walk_into(tr, v, (*path, k), types, where)
        return
    if isinstance(node, list):
        for i, v in enumerate(node):
            _walk_into(tr, v, (*path, i), types, where)
        return
    if isinstance(node, types.ShardedTensor):
        _add_tensor(tr, node, path, where)
        tr.bindings.append(_Binding(path, "tensor", node))
        return
    if isinstance(node, types.ShardedObject):
        key = node.unique_key
        tr.objects.setdefault(key, node.data)
        tr.bindings.append(_Binding(path, "object", key))
        return
    if isinstance(node, types.ShardedTensorFactory):
        try:
            built = node.build()
        except Exception as e:
            raise ConfigError(
                f"{where}: Megatron ShardedTensorFactory {node.key!r} at {_path_str(path)} failed to "
                f"build its tensors ({type(e).__name__}: {e}); bytecp saves what the factory builds, "
                "so the model's sharded_state_dict() must produce a factory that builds"
            ) from e
        sub = Translation(tr.tensors, tr.objects, None, [], tr.asm, tr.duplicates)
        _walk_into(sub, built, (), types, f"{where} (factory {node.key!r})")
        if _strip(built, types) is not None:
            raise ConfigError(
                f"{where}: Megatron ShardedTensorFactory {node.key!r} at {_path_str(path)} builds "
                "plain values besides sharded tensors/objects; bytecp cannot merge those back on "
                "load. Save this model with Megatron's dist_checkpointing, or report the factory"
            )
        tr.bindings.append(_Binding(path, "factory", (node, built, sub)))
        return
    if isinstance(node, types.LocalNonpersistentObject):
        tr.bindings.append(_Binding(path, "local", node))
        return
    if isinstance(node, types.ShardedBase):
        raise ConfigError(
            f"{where}: entry {_path_str(path)} is a Megatron {type(node).__name__} "
            f"(key {getattr(node, 'key', '?')!r}), which bytecp does not know how to save; "
            "it handles ShardedTensor, ShardedObject, ShardedTensorFactory and "
            "LocalNonpersistentObject. Build that entry as one of those, or save with "
            "Megatron's dist_checkpointing"
        )
    # anything else is common state (kept by _strip)


def _add_tensor(tr: Translation, st: Any, path: Path, where: str) -> None:
    if st.data is None:
        raise ConfigError(f"{where}: Megatron sharded tensor {st.key!r} at {_path_str(path)} has no data")
    if getattr(st, "flattened_range", None) is not None:
        raise ConfigError(
            f"{where}: Megatron sharded tensor {st.key!r} uses flattened_range, which Megatron-Core "
            "0.16 no longer supports; use the model_space, fully_reshardable or dp_reshardable optimizer layout"
        )
    region = sharded_tensor_region(
        st.key, tuple(st.global_shape), tuple(st.global_offset), tuple(st.local_shape), st.prepend_axis_num
    )
    view = sharded_tensor_view(st.data, st.prepend_axis_num)
    leaf = tr.tensors.get(st.key)
    if leaf is None:
        leaf = tr.tensors[st.key] = TensorLeaf(tuple(st.global_shape), st.dtype, [])
    elif (leaf.global_shape, leaf.dtype) != (tuple(st.global_shape), st.dtype):
        raise ConfigError(
            f"{where}: Megatron sharded tensor {st.key!r} appears twice on this rank with "
            f"different global shapes/dtypes ({list(leaf.global_shape)} {leaf.dtype} and "
            f"{list(st.global_shape)} {st.dtype})"
        )
    for sh in leaf.shards:
        if sh.region == region:
            if sh.tensor.data_ptr() != view.data_ptr():
                tr.duplicates.append((sh.tensor, view))
            return
    leaf.shards.append(Shard(region, view))
    if st.allow_shape_mismatch:
        tr.asm.add(st.key)


def _strip(node: Any, types: _Types) -> Any:
    """``node`` without its sharded entries (Megatron's "common" state), or None."""
    sharded = (types.ShardedBase, types.LocalNonpersistentObject)
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if isinstance(v, sharded):
                continue
            s = _strip(v, types)
            if s is not None or not isinstance(v, (dict, list)):
                out[k] = s
        return out or None
    if isinstance(node, list):
        items = [_strip(v, types) for v in node if not isinstance(v, sharded)]
        kept = [s for s, v in zip(items, [v for v in node if not isinstance(v, sharded)], strict=True)
                if s is not None or not isinstance(v, (dict, list))]
        return kept or None
    return node


def _set_path(root: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return root


def _skeleton(node: Any, types: _Types) -> Any:
    """A copy of the dict/list structure of a sharded state dict (leaves kept)."""
    if isinstance(node, dict):
        return {k: _skeleton(v, types) for k, v in node.items()}
    if isinstance(node, list):
        return [_skeleton(v, types) for v in node]
    return node


def _merge_common(structure: Any, common: Any) -> Any:
    """Megatron's merge: saved common values overwrite the structure's plain values."""
    if isinstance(structure, dict) and isinstance(common, dict):
        for k, v in common.items():
            structure[k] = _merge_common(structure[k], v) if k in structure else v
        return structure
    if isinstance(structure, list) and isinstance(common, list) and len(structure) == len(common):
        return [_merge_common(s, c) for s, c in zip(structure, common, strict=True)]
    return common


def rebuild(sd: Any, tr: Translation, objects: dict[str, Any], common: Any, types: _Types) -> Any:
    """The loaded state dict Megatron's own loader returns: the sharded dict's
    structure with tensors (already filled in place), loaded objects, merged
    factories, local values, and the saved common values."""
    out = _skeleton(sd, types)
    if common is not None:
        out = _merge_common(out, copy.deepcopy(common))
    with torch.no_grad():
        for kept, other in tr.duplicates:  # one box held twice on this rank: filled once
            other.copy_(kept)
    for b in tr.bindings:
        out = _set_path(out, b.path, _bound_value(b, objects, types))
    return out


def _bound_value(b: _Binding, objects: dict[str, Any], types: _Types) -> Any:
    if b.kind == "tensor":
        return b.ref.data
    if b.kind == "object":
        return objects[b.ref]
    if b.kind == "local":
        return b.ref.unwrap()
    factory, built, sub = b.ref
    loaded = _skeleton(built, types)
    for sb in sub.bindings:
        loaded = _set_path(loaded, sb.path, _bound_value(sb, objects, types))
    return factory.merge_fn(loaded)


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
    asm: set[str],
) -> None:
    """Add the boxes that ``flat`` -- elements ``[start, start+numel)`` of a
    parameter's local data -- covers, under ``prefix + piece key``, as views."""
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
            leaf = leaves[key] = TensorLeaf(pc.global_shape, flat.dtype, [])
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
    live: list[tuple[Any, str, torch.Tensor]]  # (model param, state name, tensor in the leaves)
    asm: set[str]  # keys of padded tensors (allow_shape_mismatch)
    model_keys: set[str]  # model keys of every parameter the optimizer's buffers hold


def _single_distributed(opt: Any) -> Any:
    """The one DistributedOptimizer ``opt`` is (or chains), on its standard path; else None."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError:  # pragma: no cover - megatron without the distributed optimizer
        return None
    subs = getattr(opt, "chained_optimizers", None)
    if subs is not None:
        if len(subs) != 1:
            return None
        opt = subs[0]
    if not isinstance(opt, DistributedOptimizer):
        return None
    cfg = getattr(opt, "config", None)
    if getattr(cfg, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return None
    if getattr(getattr(opt, "ddp_config", None), "use_megatron_fsdp", False):
        return None
    return opt


def _flat_state(d: Any, model_sd: Any, types: _Types, where: str) -> _FlatState:
    """(all ranks, no communication) Each parameter range this DP rank owns,
    for the main parameter and every optimizer state tensor, as boxes of the
    model-space tensors Megatron's fully_reshardable layout names
    ``optimizer.state.<name>.<model key>``."""
    meta: dict[int, Any] = {}
    for node in _leaves(model_sd):
        if isinstance(node, (types.ShardedTensor, types.ShardedTensorFactory)) and node.data is not None:
            meta[id(node.data)] = node
    leaves: dict[str, TensorLeaf] = {}
    asm: set[str] = set()
    live: list[tuple[Any, str, torch.Tensor]] = []
    model_keys: set[str] = set()
    for buffer in d.buffers:
        for param in buffer.param_index_map:
            m = meta.get(id(param))
            if m is not None:
                model_keys.update(pc.key for pc in _pieces(m, types, where))
    for gbuf_range_maps in d.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for param, ranges in bucket["param_map"].items():
                    m = meta.get(id(param))
                    if m is None:
                        raise ConfigError(
                            f"{where}: a parameter of the distributed optimizer (shape "
                            f"{list(param.shape)}) is not in the model's sharded_state_dict(); pass "
                            "the model whose parameters the optimizer holds"
                        )
                    pieces = _pieces(m, types, where)
                    r = ranges["param"]
                    for name, t in d._get_main_param_and_optimizer_states(param).items():
                        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != r.end - r.start:
                            continue  # "step" and other per-parameter scalars live in the common state
                        flat = t.detach()
                        model_space_leaves(pieces, r.start, flat, f"optimizer.state.{name}.", leaves, asm)
                        live.append((param, name, flat))
    common = dict(d.state_dict())
    common["param_state_sharding_type"] = "fully_reshardable"
    return _FlatState(leaves, common, live, asm, model_keys)


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


# ------------------------------------------------------------------ the adapter
def _unwrap(module: Any, types: _Types) -> Any:
    while isinstance(module, types.DataParallel):
        module = module.module
    return module


def _model_chunks(v: Any, types: _Types) -> list[Any] | None:
    """The Megatron model chunks ``v`` is (a module, a DDP-wrapped one, or a
    list of virtual-pipeline chunks), or None."""
    if isinstance(v, MegatronModel):
        return _model_chunks(v.model, types)
    if isinstance(v, types.MegatronModule):
        return [_unwrap(v, types)]
    if isinstance(v, (list, tuple)) and v and all(isinstance(c, types.MegatronModule) for c in v):
        return [_unwrap(c, types) for c in v]
    return None


def _is_optimizer(v: Any, types: _Types) -> bool:
    return isinstance(v, OptimizerLayout) or isinstance(v, types.MegatronOptimizer)


def _model_sharded(chunks: list[Any]) -> Any:
    """The model's sharded state dict as Megatron's training loop builds it
    (``model0``, ``model1``, ... for virtual pipeline chunks)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    from megatron.core import parallel_state

    out = {}
    for i, c in enumerate(chunks):
        parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        out[f"model{i}"] = c.sharded_state_dict()
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return out


@dataclasses.dataclass
class _Entry:
    key: str
    kind: str  # "model" | "optimizer" | "other"
    value: Any
    chunks: list[Any] | None = None
    sd: Any = None
    tr: Translation | None = None
    layout: str | None = None


def _vocab_size(entries: list[_Entry]) -> int | None:
    """The real vocabulary size a ``MegatronModel`` entry declares, if any."""
    sizes = {int(e.value.vocab_size) for e in entries if isinstance(e.value, MegatronModel)}
    return sizes.pop() if sizes else None


def _unpad(tree: dict[str, Any], leaves: dict[str, TensorLeaf], asm: set[str], vocab: int | None) -> dict[str, Any]:
    """(save) Padded tensors keep their first ``vocab`` rows."""
    if vocab is None:
        return tree
    for k in asm:
        leaf = leaves[k]
        if leaf.global_shape and leaf.global_shape[0] > vocab:
            tree[k] = clip_to_saved(leaf, (vocab, *leaf.global_shape[1:]))
    return tree


def _entries(state: dict[str, Any], types: _Types) -> list[_Entry]:
    out = []
    for k, v in state.items():
        chunks = _model_chunks(v, types)
        if chunks is not None:
            out.append(_Entry(str(k), "model", v, chunks))
        elif _is_optimizer(v, types):
            out.append(_Entry(str(k), "optimizer", v))
        else:
            out.append(_Entry(str(k), "other", v))
    models = [e for e in out if e.kind == "model"]
    if any(e.kind == "optimizer" for e in out) and len(models) != 1:
        raise ConfigError(
            "a Megatron optimizer is saved from the model's sharded state dict: pass exactly one "
            f"Megatron model (or list of virtual-pipeline chunks) beside it; found {len(models)}"
        )
    return out


def _optimizer_sharded(entry: _Entry, model_sd: Any, layout: str, *, loading: bool) -> Any:
    opt = entry.value.optimizer if isinstance(entry.value, OptimizerLayout) else entry.value
    return opt.sharded_state_dict(
        model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": layout}
    )


def _optimizer_of(v: Any) -> Any:
    return v.optimizer if isinstance(v, OptimizerLayout) else v


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


class MegatronAdapter(Adapter):
    """Megatron-Core models (TP/PP/DP, virtual pipeline chunks) and optimizers."""

    name = "megatron"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        if not _megatron_loaded():
            return False
        try:
            types = _types()
        except ImportError:
            return False
        return any(_model_chunks(v, types) is not None or _is_optimizer(v, types) for v in state.values())

    # ------------------------------------------------------------- save
    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        """(all ranks) The tree of every entry; the optimizer's sharded dict may
        run collectives (fully_reshardable gathers over DP), so all ranks call it."""
        types = _types()
        entries = _entries(state, types)
        tree: dict[str, Any] = {}
        vocab = _vocab_size(entries)
        model_sd = None
        for e in entries:
            if e.kind == "model":
                assert e.chunks is not None
                model_sd = _model_sharded(e.chunks)
                tr = translate(model_sd, types, where=e.key)
                tree[e.key] = _unpad(tr.tree(target=False), tr.tensors, tr.asm, vocab)
        for e in entries:
            if e.kind == "optimizer":
                layout = _save_layout(e.value)
                d = _single_distributed(_optimizer_of(e.value))
                if layout == "model_space" and d is not None:
                    fs = _flat_state(d, model_sd, types, e.key)
                    tree[e.key] = _unpad({**fs.leaves, COMMON: Whole(fs.common)}, fs.leaves, fs.asm, vocab)
                    continue
                megatron_layout = "fully_reshardable" if layout == "model_space" else layout
                sd = _optimizer_sharded(e, model_sd, megatron_layout, loading=False)
                tr = translate(sd, types, where=e.key)
                tree[e.key] = _unpad(tr.tree(target=False), tr.tensors, tr.asm, vocab)
            elif e.kind == "other":
                tree[e.key] = _plain_save(e.value)
        return {k: tree[str(k)] for k in state}

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": ctx.world_size}
        try:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                out["tensor_parallel"] = parallel_state.get_tensor_model_parallel_world_size()
                out["pipeline_parallel"] = parallel_state.get_pipeline_model_parallel_world_size()
                out["data_parallel"] = parallel_state.get_data_parallel_world_size()
        except Exception:  # pragma: no cover - informational only
            pass
        types = _types()
        layouts = {str(k): _save_layout(v) for k, v in state.items() if _is_optimizer(v, types)}
        vocab = {int(v.vocab_size) for v in state.values() if isinstance(v, MegatronModel)}
        if vocab:
            out["vocab_size"] = vocab.pop()
        if layouts:
            out["optimizer_layout"] = layouts
        return out

    # ------------------------------------------------------------- load
    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        """(all ranks) Targets: the live model tensors and the tensors the
        optimizer's loading sharded dict holds; ``finalize`` applies factories,
        objects and common values (model) and ``optimizer.load_state_dict``."""
        types = _types()
        entries = _entries(state, types)
        saved_layouts = md.parallelism.get("optimizer_layout") or {}
        tree: dict[str, Any] = {}
        finalizers: list[Callable[[dict[str, Any]], None]] = []
        model_sd = None
        for e in entries:
            if e.kind == "model":
                assert e.chunks is not None
                model_sd = _model_sharded(e.chunks)
                e.sd = model_sd
        for e in entries:
            if e.kind == "model":
                e.tr = translate(e.sd, types, where=e.key)
            elif e.kind == "optimizer":
                e.layout = _load_layout(e, saved_layouts)
                opt = _optimizer_of(e.value)
                _init_fresh_state(opt)
                d = _single_distributed(opt)
                if e.layout == "model_space" and d is not None:
                    fs = _flat_state(d, model_sd, types, e.key)
                    _add_unowned(e.key, fs, md)
                    tree[e.key] = _clip_padded(e.key, {**fs.leaves, COMMON: Slot()}, fs.leaves, fs.asm, md)
                    finalizers.append(_flat_finalizer(e.key, d, fs))
                    continue
                megatron_layout = "fully_reshardable" if e.layout == "model_space" else e.layout
                e.sd = _optimizer_sharded(e, model_sd, megatron_layout, loading=True)
                e.tr = translate(e.sd, types, where=e.key)
            if e.tr is not None:
                tree[e.key] = _clip_padded(e.key, e.tr.tree(target=True), e.tr.tensors, e.tr.asm, md)
                finalizers.append(_finalizer(e, types))
            else:
                tree[e.key] = _plain_target(e.key, e.value, state, finalizers)

        def finalize(values: dict[str, Any]) -> None:
            for f in finalizers:
                f(values)

        return LoadTarget({k: tree[str(k)] for k in state}, finalize)


def _save_layout(v: Any) -> str:
    return v.layout if isinstance(v, OptimizerLayout) else DEFAULT_OPTIMIZER_LAYOUT


def _load_layout(e: _Entry, saved: dict[str, Any]) -> str:
    """The layout to load with: the caller's if given (it must read what the
    checkpoint holds), else the saved one; model_space and fully_reshardable
    hold the same tensors, and both load the model_space way when possible."""
    saved_layout = saved.get(e.key)
    if isinstance(e.value, OptimizerLayout):
        want = e.value.layout
        if saved_layout is not None and saved_layout != want and not (
            saved_layout in _MODEL_SPACE and want in _MODEL_SPACE
        ):
            raise ConfigError(
                f"optimizer {e.key!r}: the checkpoint holds the {saved_layout!r} distributed-optimizer "
                f"layout, which {want!r} cannot read; load it with OptimizerLayout(opt, "
                f"{saved_layout!r}) or the plain optimizer"
            )
        return want
    layout = str(saved_layout or DEFAULT_OPTIMIZER_LAYOUT)
    return "model_space" if layout in _MODEL_SPACE else layout


def _clip_padded(
    key: str, tree: dict[str, Any], leaves: dict[str, TensorLeaf], asm: set[str], md: Metadata
) -> dict[str, Any]:
    """Padded tensors (allow_shape_mismatch) whose saved first dimension differs
    load the rows both have."""
    for k in asm:
        info = md.tensors.get(f"{key}.{k}")
        if info is None:
            continue
        saved = tuple(info["shape"])
        leaf = leaves[k]
        if saved != leaf.global_shape and len(saved) == len(leaf.global_shape) and saved[1:] == leaf.global_shape[1:]:
            tree[k] = clip_to_saved(leaf, saved)
    return tree


def _flat_finalizer(key: str, d: Any, fs: _FlatState) -> Callable[[dict[str, Any]], None]:
    """(all ranks) After the model-space ranges are read into the optimizer's
    own tensors: the non-parameter state (param groups, step, grad scaler)."""

    def finalize(values: dict[str, Any]) -> None:
        common = values.get(f"{key}.{COMMON}")
        if common is None:
            raise StateMismatchError(f"optimizer {key!r}: the checkpoint holds no optimizer param groups")
        rest = {k: v for k, v in common.items() if k != "param_state_sharding_type"}
        d.load_state_dict(rest)
        inner = getattr(d, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for st in inner.state.values():  # one step tensor per parameter (see _load_optimizer)
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].detach().clone()
        with torch.no_grad():
            for param, name, t in fs.live:
                cur = d._get_main_param_and_optimizer_states(param).get(name)
                if isinstance(cur, torch.Tensor) and cur.data_ptr() != t.data_ptr():
                    cur.copy_(t)  # the optimizer replaced the tensor we filled

    return finalize


def _finalizer(e: _Entry, types: _Types) -> Callable[[dict[str, Any]], None]:
    tr = e.tr
    assert tr is not None

    def objects_of(values: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        objs = {k: values[f"{e.key}.{k}"] for k in tr.objects if f"{e.key}.{k}" in values}
        missing = [k for k in tr.objects if k not in objs]
        if missing:
            raise StateMismatchError(
                f"{e.key}: the checkpoint lacks Megatron objects {missing[:5]}; was it saved "
                "from the same model?"
            )
        return objs, values.get(f"{e.key}.{COMMON}")

    if e.kind == "optimizer":
        def finalize_optimizer(values: dict[str, Any]) -> None:
            objs, common = objects_of(values)
            loaded = rebuild(e.sd, tr, objs, common, types)
            _load_optimizer(_optimizer_of(e.value), loaded)

        return finalize_optimizer

    def finalize_model(values: dict[str, Any]) -> None:
        objs, common = objects_of(values)
        loaded = rebuild(e.sd, tr, objs, common, types)
        with torch.no_grad():
            for b in tr.bindings:
                if b.kind == "factory":
                    factory = b.ref[0]
                    merged = _get_path(loaded, b.path)
                    if isinstance(merged, torch.Tensor) and merged.data_ptr() != factory.data.data_ptr():
                        factory.data.detach().copy_(merged)
        # non-tensor entries (extra state, common values) through the modules
        # themselves; tensors are already in place
        assert e.chunks is not None
        parts = [loaded] if len(e.chunks) == 1 else [loaded[f"model{i}"] for i in range(len(e.chunks))]
        for chunk, part in zip(e.chunks, parts, strict=True):
            own = set(chunk.state_dict(keep_vars=True))
            rest = {k: v for k, v in part.items() if k in own and not isinstance(v, torch.Tensor)}
            if rest:
                chunk.load_state_dict(rest, strict=False)

    return finalize_model


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


def _get_path(root: Any, path: Path) -> Any:
    for p in path:
        root = root[p]
    return root


def _leaves(tree: Any) -> list[Any]:
    """Every leaf of nested dicts and lists (a sharded state dict), iteratively."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        else:
            out.append(node)
    return out


# ------------------------------------------------------------------ other entries


def _plain_save(v: Any) -> Any:
    """Entries beside the Megatron ones (RNG, dataloader, step counters):
    per-rank values per rank, stateful objects by their state dict, the rest as is."""
    if is_per_rank(v):
        return PerRank(v.state_dict())
    if is_stateful(v):
        return v.state_dict()
    return v


def _plain_target(
    key: str, v: Any, parent: dict[str, Any], finalizers: list[Callable[[dict[str, Any]], None]]
) -> Any:
    if is_stateful(v):
        def apply(values: dict[str, Any]) -> None:
            if key in values:
                v.load_state_dict(values[key])

        finalizers.append(apply)
        return Slot(per_rank=is_per_rank(v))

    def put(values: dict[str, Any]) -> None:
        if key in values:
            parent[key] = values[key]

    finalizers.append(put)
    return Slot(default=v)
