"""The state tree adapters hand the core, and its JSON skeleton.

An adapter turns the user's ``state`` (modules, optimizers, ``Stateful``
objects, tensors, plain values) into a *tree* of dicts/lists/tuples whose
leaves are:

- ``torch.Tensor`` -- a full tensor, replicated on every rank that has it;
- :class:`TensorLeaf` -- a tensor sharded across ranks: its global shape and
  the boxes this rank holds, each with a local view (no copy);
- :class:`PerRank` -- a value that differs per rank (RNG, dataloader);
- :class:`Whole` -- a value stored as one object however nested;
- any other value -- JSON when it is JSON-able, else a ``torch.save`` blob.

For loading, adapters build a target tree of the same shape whose leaves are
destination tensors / :class:`TensorLeaf` views to fill in place, and
:class:`Slot` for everything rebuilt from the checkpoint.

Every leaf has an FQN: the keys on its path joined by ``.``
(``model.layers.0.weight``, ``optimizer.state.layers.0.weight.exp_avg``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .dtypes import dtype_name
from .errors import ConfigError
from .regions import Region, flat_range_to_boxes, full_region
from .skeleton import MAX_DEPTH, Node

__all__ = [
    "Shard",
    "TensorLeaf",
    "PerRank",
    "Whole",
    "Slot",
    "FlatTree",
    "flatten_tree",
    "is_json_leaf",
]


@dataclasses.dataclass(slots=True)
class Shard:
    """A box of a tensor's global index space and the local tensor holding it."""

    region: Region
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if tuple(self.tensor.shape) != self.region.lengths:
            raise ValueError(
                f"shard tensor of shape {tuple(self.tensor.shape)} does not match region {self.region}"
            )


@dataclasses.dataclass(slots=True)
class TensorLeaf:
    """A (possibly sharded) tensor: global shape, dtype and this rank's boxes."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: list[Shard]

    @classmethod
    def full(cls, t: torch.Tensor) -> TensorLeaf:
        shape = tuple(t.shape)
        return cls(shape, t.dtype, [Shard(full_region(shape), t)])

    @classmethod
    def from_flat(
        cls, global_shape: tuple[int, ...], dtype: torch.dtype, start: int, flat: torch.Tensor
    ) -> TensorLeaf:
        """An irregular shard: ``flat`` holds elements ``[start, start+numel)``
        of the row-major tensor; it is cut into contiguous boxes (no copy)."""
        if flat.dim() != 1:
            raise ValueError("a flat shard must be a 1-D tensor")
        shards = []
        pos = 0
        for box in flat_range_to_boxes(global_shape, start, start + flat.numel()):
            n = box.numel
            shards.append(Shard(box, flat[pos : pos + n].view(box.lengths)))
            pos += n
        return cls(tuple(global_shape), dtype, shards)

    @property
    def nbytes_local(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.shards)


@dataclasses.dataclass
class PerRank:
    """A value saved separately by every rank and restored by the same rank."""

    value: Any


@dataclasses.dataclass
class Whole:
    """A value stored as one object (JSON or blob), not split into leaves."""

    value: Any


@dataclasses.dataclass
class Slot:
    """Load target: rebuild whatever the checkpoint holds at this FQN.

    ``per_rank`` slots take this rank's value of a :class:`PerRank` entry.
    ``default`` is returned when the key is absent and ``strict=False``.
    """

    per_rank: bool = False
    default: Any = None


_JSON_SCALARS = (str, int, bool, type(None))


def is_json_leaf(v: Any) -> bool:
    """Whether ``v`` round-trips exactly through JSON (finite floats, exact types)."""
    if type(v) in _JSON_SCALARS:
        return True
    if type(v) is float:
        return math.isfinite(v)
    if type(v) is list:
        return all(is_json_leaf(x) for x in v)
    if type(v) is dict:
        return all(type(k) is str and is_json_leaf(x) for k, x in v.items())
    return False


@dataclasses.dataclass
class FlatTree:
    """A tree flattened into its skeleton and leaves by FQN."""

    skeleton: Node
    tensors: dict[str, TensorLeaf]
    objects: dict[str, Any]  # fqn -> value stored as one object (JSON or blob)
    per_rank: dict[str, Any]  # fqn -> this rank's value
    slots: dict[str, Slot]  # load targets only


def _key_ok(k: Any) -> bool:
    return type(k) in (str, int, bool) or k is None


def flatten_tree(tree: Any, *, target: bool = False) -> FlatTree:
    """Walk a state tree into its :class:`~bytecp.skeleton.Node` skeleton and
    leaves by FQN (dicts with JSON-able keys, lists and tuples are containers;
    everything else is a leaf). With ``target=True`` (a load target)
    non-tensor leaves become slots.
    """
    out = FlatTree(Node.container("dict", ()), {}, {}, {}, {})
    seen: set[str] = set()

    def claim(fqn: str) -> str:
        if fqn in seen:
            raise ConfigError(
                f"two entries of the state map to the same key {fqn!r} (a dict key containing "
                "'.' collides with a nested key); rename one of them"
            )
        seen.add(fqn)
        return fqn

    def walk(v: Any, fqn: str, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise ConfigError(f"{fqn!r}: the state is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, TensorLeaf):
            out.tensors[claim(fqn)] = v
            return Node.leaf("tensor", fqn)
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                raise ConfigError(
                    f"{fqn!r} is a {type(v).__name__}, a tensor subclass bytecp cannot treat as a "
                    "full tensor; pass the model/optimizer so the framework adapter handles it, "
                    "or pass framework= explicitly"
                )
            dtype_name(v.dtype)  # fails early for unsupported dtypes
            out.tensors[claim(fqn)] = TensorLeaf.full(v.detach())
            return Node.leaf("tensor", fqn)
        if isinstance(v, Slot):
            out.slots[claim(fqn)] = v
            return Node.leaf("rank" if v.per_rank else "obj", fqn)
        if isinstance(v, PerRank):
            if target:
                out.slots[claim(fqn)] = Slot(per_rank=True)
            else:
                out.per_rank[claim(fqn)] = v.value
            return Node.leaf("rank", fqn)
        if isinstance(v, Whole):
            if target:
                out.slots[claim(fqn)] = Slot()
            else:
                out.objects[claim(fqn)] = v.value
            return Node.leaf("obj", fqn)
        if type(v) is dict and all(_key_ok(k) for k in v):
            return Node.container(
                "dict", [(k, walk(x, f"{fqn}.{k}" if fqn else str(k), depth + 1)) for k, x in v.items()]
            )
        if type(v) in (list, tuple):
            items = [(i, walk(x, f"{fqn}.{i}" if fqn else str(i), depth + 1)) for i, x in enumerate(v)]
            return Node.container("list" if type(v) is list else "tuple", items)
        if target:
            out.slots[claim(fqn)] = Slot()
        else:
            out.objects[claim(fqn)] = v
        return Node.leaf("obj", fqn)

    out.skeleton = walk(tree, "", 0)
    return out
