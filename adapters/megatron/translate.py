"""Megatron's sharded state dict as the core's tree, and back.

:func:`translate` walks ``sharded_state_dict()`` output (ShardedTensor,
ShardedObject, ShardedTensorFactory, LocalNonpersistentObject and common
values) into a :class:`Translation`; :func:`rebuild` gives, after a load, the
dict Megatron's own loader returns. Pure functions of Megatron's objects: the
adapter (``adapter.py``) and the optimizer layouts (``optimizer_layout.py``)
call them on every rank, with no communication.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.tree.regions import Region
from bytecp.tree.state import Shard, Slot, TensorLeaf, Whole

__all__ = [
    "COMMON",
    "Translation",
    "translate",
    "rebuild",
    "sharded_tensor_region",
    "sharded_tensor_view",
    "clip_to_saved",
]

#: the tree key of the common (non-sharded) part of one sharded state dict
COMMON = "__common__"

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
    return TensorLeaf(tuple(saved_shape), leaf.dtype, shards, leaf.replicas)


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
    #: (save) the replica hint of a tensor: (key, local shape, global shape,
    #: prepended axes) -> ReplicaSet or None (``replicas.Hints.model``)
    hint: Any = None

    def tree(self, *, target: bool) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.tensors)
        for k, v in self.objects.items():
            out[k] = Slot() if target else Whole(v)
        if self.common is not None:
            out[COMMON] = Slot() if target else Whole(self.common)
        return out


def _path_str(path: Path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def translate(sd: Any, types: _Types, *, where: str, hint: Any = None) -> Translation:
    """Walk a Megatron sharded state dict (dicts and lists) into a
    :class:`Translation`. ``where`` names the state entry in errors; ``hint``
    gives each tensor its replica set (save)."""
    tr = Translation({}, {}, None, [], set(), [], hint)
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
        sub = Translation(tr.tensors, tr.objects, None, [], tr.asm, tr.duplicates, tr.hint)
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
        replicas = None
        if tr.hint is not None:
            replicas = tr.hint(st.key, tuple(st.local_shape), tuple(st.global_shape), st.prepend_axis_num)
        leaf = tr.tensors[st.key] = TensorLeaf(tuple(st.global_shape), st.dtype, [], replicas)
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
