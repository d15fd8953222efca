"""The state tree adapters hand the core, and its JSON skeleton.

An adapter turns the user's ``state`` (modules, optimizers, ``Stateful``
objects, tensors, plain values) into a *tree* of dicts/lists/tuples whose
leaves are:

- ``torch.Tensor`` -- a full tensor, replicated on every rank that has it;
- :class:`TensorLeaf` -- a tensor sharded across ranks: its global shape and
  the boxes this rank holds, each with a local view (no copy);
- :class:`PerRank` -- a value that differs per rank (RNG, dataloader), with
  the data position of a data loader beside it (:mod:`bytecp.data`);
- :class:`Whole` -- a value stored as one object however nested;
- any other value -- JSON when it is JSON-able, else a ``torch.save`` blob.

Tensors that share storage (tied embeddings, a layer used twice, a parameter
registered under two names) are stored once: a tensor leaf that is the same
object as an earlier one, or a full tensor with exactly the same memory
(device, data pointer, shape, strides and dtype; not empty) as an earlier
one, becomes an *alias* of the first FQN (:attr:`FlatTree.aliases`). Views
of different parts of one buffer (other offsets, shapes or strides) are not
aliases: each is stored as its own tensor. Adapters give tied tensors of a
sharded model the same :class:`TensorLeaf` object.

An adapter may hand over a subtree it flattened at an earlier save, as a
:class:`Prebuilt` piece (a module's or an optimizer's description kept while
its structure is unchanged: :mod:`bytecp.adapters._watch`);
:func:`flatten_tree` splices it in where it stands instead of walking it.

For loading, adapters build a target tree of the same shape whose leaves are
destination tensors / :class:`TensorLeaf` views to fill in place, and
:class:`Slot` for everything rebuilt from the checkpoint.

Every leaf has an FQN: the keys on its path joined by ``.``
(``model.layers.0.weight``, ``optimizer.state.layers.0.weight.exp_avg``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.tree.dtypes import dtype_name
from bytecp.tree.regions import Region, flat_range_to_boxes, full_region
from bytecp.tree.skeleton import MAX_DEPTH, Node, key_ok

__all__ = [
    "Shard",
    "ReplicaSet",
    "EVERY_RANK",
    "TensorLeaf",
    "PerRank",
    "Whole",
    "Slot",
    "FlatTree",
    "Prebuilt",
    "PieceShard",
    "flatten_tree",
    "prebuild",
    "is_json_leaf",
    "merge_aliases",
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


@dataclasses.dataclass(frozen=True)
class ReplicaSet:
    """The ranks (of the checkpoint's process group) that hold the very same
    boxes of a tensor: an adapter's hint that lets the save plan be made
    without gathering every rank's boxes (see :mod:`bytecp.plan.exchange`).

    ``ranks`` is sorted; ``()`` means *every rank of the group* (resolved
    with the world size when the plan is made). A hint is verified: the
    members compare what they hold, and a set whose members disagree is
    planned by the coordinator as if there were no hint. A set of one rank
    means the boxes are this rank's alone (FSDP shards).
    """

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = tuple(sorted(set(int(r) for r in self.ranks)))
        if ranks != self.ranks:
            object.__setattr__(self, "ranks", ranks)

    @functools.cached_property
    def key(self) -> str:
        """A digest naming the set (alike on every rank)."""
        return hashlib.blake2b(repr(self.ranks).encode(), digest_size=12).hexdigest()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def of(ranks: tuple[int, ...]) -> ReplicaSet:
        """The (cached) set of these ranks."""
        return ReplicaSet(tuple(ranks))

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def world(world_size: int) -> ReplicaSet:
        return ReplicaSet(tuple(range(world_size)))


#: the hint of a full tensor handed over as a plain ``torch.Tensor``: replicated on every rank
EVERY_RANK = ReplicaSet(())


@dataclasses.dataclass(slots=True)
class TensorLeaf:
    """A (possibly sharded) tensor: global shape, dtype and this rank's boxes.

    ``replicas``: which ranks hold the same boxes as this rank (a
    :class:`ReplicaSet` hint from the adapter), or ``None`` when the adapter
    does not know -- the coordinator then finds the replicas by comparing
    every rank's boxes. ``versioned``: the tensor whose version counter moves
    when the shards change in place, where theirs does not (a DTensor's:
    in-place ops run on its local tensor below the counter); None: the shards'.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: list[Shard]
    replicas: ReplicaSet | None = None
    versioned: torch.Tensor | None = None

    @classmethod
    def full(cls, t: torch.Tensor, replicas: ReplicaSet | None = EVERY_RANK) -> TensorLeaf:
        shape = tuple(t.shape)
        return cls(shape, t.dtype, [Shard(full_region(shape), t)], replicas)

    @classmethod
    def from_flat(
        cls, global_shape: tuple[int, ...], dtype: torch.dtype, start: int, flat: torch.Tensor,
        replicas: ReplicaSet | None = None,
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
        return cls(tuple(global_shape), dtype, shards, replicas)

    @property
    def nbytes_local(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.shards)


@dataclasses.dataclass
class PerRank:
    """A value saved separately by every rank and restored by the same rank.

    ``data``: a data loader's position, small and JSON-able (a resharder's
    :meth:`~bytecp.data.Resharder.position`, ``"kind"`` among its keys),
    recorded beside the value and merged over the ranks at the commit into
    the checkpoint's compact data position (FORMAT.md §6.8), from which a
    load under another world size reshards it; None for other per-rank
    values (RNG states).
    """

    value: Any
    data: dict[str, Any] | None = None


@dataclasses.dataclass
class Whole:
    """A value stored as one object (JSON or blob), not split into leaves."""

    value: Any


@dataclasses.dataclass
class Slot:
    """Load target: rebuild whatever the checkpoint holds at this FQN.

    ``per_rank`` slots take this rank's value of a :class:`PerRank` entry.
    ``default`` is returned when the key is absent and ``strict=False``.
    ``live``: the live object a per-rank slot restores (a data loader), so
    that its position can be resharded when the data-parallel layout changed
    (:mod:`bytecp.data`).
    """

    per_rank: bool = False
    default: Any = None
    live: Any = None


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
    #: alias FQN -> the FQN in ``tensors`` whose memory it shares (first seen
    #: in tree order); aliases are tensor leaves of the skeleton, not in ``tensors``
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    #: per-rank fqn -> this rank's data position (:attr:`PerRank.data`)
    data: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: (a description of the live state) the :class:`Prebuilt` pieces spliced
    #: in, and the tensors the walk described itself; ``loose`` is None when
    #: there are no pieces (every tensor is the walk's)
    pieces: tuple[Prebuilt, ...] = ()
    loose: list[str] | None = None
    #: values inside ``objects`` that no one mutates, shared between saves
    #: (a deep copy of the objects may keep them as they are)
    shared: tuple[Any, ...] = ()
    #: (an async snapshot's tree) the live tree it copies, whose tensors have the
    #: same names, dtypes and shapes (:mod:`bytecp.tree.kept` keeps answers about them there)
    copy_of: FlatTree | None = None

    def loose_tensors(self) -> Iterable[tuple[str, TensorLeaf]]:
        """``(fqn, leaf)`` of the tensors the walk described itself (all, without pieces)."""
        if self.loose is None:
            return self.tensors.items()
        return [(fqn, self.tensors[fqn]) for fqn in self.loose]

    def digest(self, skeleton: str | None = None) -> str:
        """Equal digests mean equal skeletons and equal aliases; ``skeleton``:
        the skeleton's digest when the caller has it (kept between saves:
        :func:`bytecp.tree.kept.state_digest`)."""
        skeleton = self.skeleton.digest() if skeleton is None else skeleton
        if not self.aliases:
            return skeleton
        return skeleton + ":" + hashlib.blake2b(
            json.dumps(sorted(self.aliases.items())).encode(), digest_size=16).hexdigest()


#: one shard of a piece, as a save's version tokens need it (:mod:`bytecp.saving.reuse`):
#: (FQN, its box, the tensor whose version counter moves, data pointer, device)
PieceShard = tuple[str, Region, torch.Tensor, int, str]


@dataclasses.dataclass(frozen=True, eq=False)
class Prebuilt:
    """A subtree of a state tree flattened at an earlier save, spliced by
    :func:`flatten_tree` at ``fqn`` as if it had been walked there.

    (an adapter's ``save_tree``, every rank, describe) Made by :func:`prebuild`
    and kept by the adapter while what it describes keeps its structure
    (names, shapes, dtypes, layouts and the very tensor objects and memory);
    :meth:`with_objects` gives this save's values of its objects. A piece
    whose tensors share memory with a tensor described outside it (an alias
    across pieces), or whose names collide, is walked instead (:meth:`expand`).
    """

    fqn: str
    #: the subtree's skeleton node, tensors, objects, per-rank values and aliases
    flat: FlatTree
    #: every name it claims
    names: frozenset[str]
    #: the first FQN of each tensor object and of each full tensor's memory (as the walk keeps them)
    by_id: dict[int, str]
    by_memory: dict[tuple[Any, ...], str]
    #: the data pointers among ``by_memory``'s keys (cheap to compare: tuple keys hash anew each time)
    pointers: frozenset[int]
    #: every shard of its tensors, in order
    shards: tuple[PieceShard, ...]
    #: one tensor on each CUDA device its tensors use
    cuda: tuple[torch.Tensor, ...] = ()
    #: values inside its objects shared between saves and never mutated
    shared: tuple[Any, ...] = ()
    #: the object the walk met at each tensor leaf's FQN (kept: ids stay unique while the piece lives)
    origin: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: answers computed from the pieces of a state whose first piece this is
    #: (shared by its copies :meth:`with_objects` makes; dropped with the piece)
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def with_objects(self, objects: dict[str, Any], shared: tuple[Any, ...] = ()) -> Prebuilt:
        """This piece with this save's ``objects`` (the same names as its own)."""
        return dataclasses.replace(self, flat=dataclasses.replace(self.flat, objects=objects), shared=shared)

    def expand(self) -> Any:
        """The subtree as the adapter's tree held it (tensor leaves, ``Whole``
        objects, ``PerRank`` values), to be walked like any other."""
        flat = self.flat

        def leaf(kind: str, name: str) -> Any:
            if kind == "tensor":
                return self.origin[name]
            if kind == "rank":
                return PerRank(flat.per_rank[name], flat.data.get(name))
            return Whole(flat.objects[name])

        return flat.skeleton.build(leaf)


def _memory(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What identifies exactly the elements a full tensor shows (None: never
    an alias by memory, only by identity: empty and meta tensors)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def flatten_tree(tree: Any, *, target: bool = False) -> FlatTree:
    """Walk a state tree into its :class:`~bytecp.tree.skeleton.Node` skeleton and
    leaves by FQN (dicts with JSON-able keys, lists and tuples are containers;
    everything else is a leaf). With ``target=True`` (a load target)
    non-tensor leaves become slots. :class:`Prebuilt` pieces are spliced in
    where they stand.
    """
    return _Walk(target).run(tree, "")


class _Walk:
    """One walk of :func:`flatten_tree` (or :func:`prebuild`): the tree it
    builds and what it has met so far."""

    def __init__(self, target: bool) -> None:
        self.target = target
        self.out = FlatTree(Node.container("dict", ()), {}, {}, {}, {})
        self.names: set[str] = set()
        #: every name claimed: the walk's, then each piece's
        self.seen: list[AbstractSet[str]] = [self.names]
        #: the first FQN of each tensor object and of each full tensor's memory
        self.by_id: dict[int, str] = {}
        self.by_memory: dict[tuple[Any, ...], str] = {}
        #: ... and each spliced piece's
        self.by_ids: list[dict[int, str]] = [self.by_id]
        self.by_memories: list[dict[tuple[Any, ...], str]] = [self.by_memory]
        self.pointers: set[int] = set()
        self.pointer_sets: list[AbstractSet[int]] = [self.pointers]
        #: the object the walk met at each tensor leaf's FQN (ids stay unique while the walk runs)
        self.origin: dict[str, Any] = {}
        self.pieces: list[Prebuilt] = []
        self.loose: list[str] = []

    def run(self, tree: Any, prefix: str) -> FlatTree:
        out = self.out
        out.skeleton = self.walk(tree, prefix, prefix.count(".") + 1 if prefix else 0)
        if self.pieces:
            out.pieces, out.loose = tuple(self.pieces), self.loose
            out.shared = tuple(x for p in self.pieces for x in p.shared)
        return out

    def first_of(self, v: Any, mem: tuple[Any, ...] | None) -> str | None:
        for ids in self.by_ids:
            first = ids.get(id(v))
            if first is not None:
                return first
        if mem is not None:
            for i, mems in enumerate(self.by_memories):
                first = mems.get(mem)
                if first is not None and (i == 0 or self._still_at(self.pieces[i - 1], first, mem)):
                    return first
        return None

    @staticmethod
    def _still_at(p: Prebuilt, name: str, mem: tuple[Any, ...]) -> bool:
        """Whether piece ``p``'s tensor ``name`` still shows the memory it showed
        when the piece was made (a storage reallocated in place moves it)."""
        t = p.origin.get(name)
        return not isinstance(t, torch.Tensor) or _memory(t) == mem

    def tensor(self, v: Any, fqn: str) -> Node:
        """A tensor leaf; an alias when ``v`` shares its memory with an earlier one."""
        mem = _memory(v) if isinstance(v, torch.Tensor) else None
        first = self.first_of(v, mem)
        self.origin[fqn] = v
        if first is not None:
            self.out.aliases[self.claim(fqn)] = first
            return Node.leaf("tensor", fqn)
        self.by_id[id(v)] = fqn
        if mem is not None:
            self.by_memory[mem] = fqn
            self.pointers.add(mem[2])
        if not isinstance(v, TensorLeaf):  # a state dict's tensors are detached already
            v = TensorLeaf.full(v.detach() if v.requires_grad or type(v) is not torch.Tensor else v)
        self.out.tensors[self.claim(fqn)] = v
        self.loose.append(fqn)
        return Node.leaf("tensor", fqn)

    def claim(self, fqn: str) -> str:
        if any(fqn in claimed for claimed in self.seen):
            raise ConfigError(
                f"two entries of the state map to the same key {fqn!r} (a dict key containing "
                "'.' collides with a nested key); rename one of them"
            )
        self.names.add(fqn)
        return fqn

    def splice(self, p: Prebuilt) -> bool:
        """Take piece ``p`` whole, unless a name or a tensor of it was met before."""
        def apart(a: AbstractSet[Any], b: AbstractSet[Any]) -> bool:
            return (a.isdisjoint(b) if len(a) >= len(b) else b.isdisjoint(a))  # (iterates the smaller)

        if not (all(apart(claimed, p.names) for claimed in self.seen)
                and all(apart(ids.keys(), p.by_id.keys()) for ids in self.by_ids)
                and (all(apart(ptrs, p.pointers) for ptrs in self.pointer_sets)
                     or all(apart(mems.keys(), p.by_memory.keys()) for mems in self.by_memories))):
            return False
        self.seen.append(p.names)
        self.by_ids.append(p.by_id)
        self.by_memories.append(p.by_memory)
        self.pointer_sets.append(p.pointers)
        out = self.out
        out.tensors.update(p.flat.tensors)
        out.objects.update(p.flat.objects)
        out.per_rank.update(p.flat.per_rank)
        out.data.update(p.flat.data)
        out.aliases.update(p.flat.aliases)
        self.pieces.append(p)
        return True

    def walk(self, v: Any, fqn: str, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise ConfigError(f"{fqn!r}: the state is nested deeper than {MAX_DEPTH} levels")
        out, target = self.out, self.target
        if isinstance(v, Prebuilt):
            if v.fqn == fqn and not target and self.splice(v):
                return v.flat.skeleton
            return self.walk(v.expand(), fqn, depth)
        if isinstance(v, TensorLeaf):
            return self.tensor(v, fqn)
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                advice = ("leave framework= unset (DTensors anywhere in the state select the DTensor adapter) "
                          "or pass framework='fsdp2'") if type(v).__name__ == "DTensor" else (
                          "pass it as a plain tensor (t.as_subclass(torch.Tensor)), or the module/optimizer "
                          "holding it so that its framework's adapter describes it")
                raise ConfigError(f"{fqn!r} is a {type(v).__name__}, a tensor subclass the chosen adapter "
                                  f"cannot save as a full tensor; {advice}")
            dtype_name(v.dtype)  # fails early for unsupported dtypes
            return self.tensor(v, fqn)
        if isinstance(v, Slot):
            out.slots[self.claim(fqn)] = v
            return Node.leaf("rank" if v.per_rank else "obj", fqn)
        if isinstance(v, PerRank):
            if target:
                out.slots[self.claim(fqn)] = Slot(per_rank=True)
            else:
                out.per_rank[self.claim(fqn)] = v.value
                if v.data is not None:
                    out.data[fqn] = v.data
            return Node.leaf("rank", fqn)
        if isinstance(v, Whole):
            if target:
                out.slots[self.claim(fqn)] = Slot()
            else:
                out.objects[self.claim(fqn)] = v.value
            return Node.leaf("obj", fqn)
        if type(v) is dict and all(key_ok(k) for k in v):
            return Node.container(
                "dict", [(k, self.walk(x, f"{fqn}.{k}" if fqn else str(k), depth + 1)) for k, x in v.items()]
            )
        if type(v) in (list, tuple):
            items = [(i, self.walk(x, f"{fqn}.{i}" if fqn else str(i), depth + 1)) for i, x in enumerate(v)]
            return Node.container("list" if type(v) is list else "tuple", items)
        if target:
            out.slots[self.claim(fqn)] = Slot()
        else:
            out.objects[self.claim(fqn)] = v
        return Node.leaf("obj", fqn)


def prebuild(tree: Any, fqn: str, *, shared: tuple[Any, ...] = ()) -> Prebuilt:
    """(an adapter's ``save_tree``, every rank) ``tree``, the subtree of the
    state at ``fqn``, flattened into a :class:`Prebuilt` piece: the same
    leaves, names and aliases a walk of the whole state makes of it there
    (when nothing outside it shares its tensors or names). ``shared``: values
    inside its objects that no one mutates."""
    w = _Walk(False)
    flat = w.run(tree, fqn)
    if flat.pieces:
        raise ValueError("a piece holds no pieces")
    flat.loose = None
    shards: list[PieceShard] = []
    cuda: dict[Any, torch.Tensor] = {}
    for name, leaf in flat.tensors.items():
        for sh in leaf.shards:
            t = sh.tensor
            shards.append((name, sh.region, t if leaf.versioned is None else leaf.versioned, t.data_ptr(),
                           str(t.device)))
            if t.device.type == "cuda":
                cuda.setdefault(t.device, t)
    names = frozenset(w.names)
    return Prebuilt(fqn, flat, names, w.by_id, w.by_memory, frozenset(w.pointers), tuple(shards),
                    tuple(cuda.values()), shared, w.origin)


def merge_aliases(
    mine: dict[str, str], others: list[tuple[int, dict[str, str]]], stored: Collection[str], coordinator: int
) -> dict[str, str]:
    """(coordinator, on the union's thread) The checkpoint's aliases: the coordinator's
    and those of every rank whose tree differs (``others``: rank, aliases).

    A tensor one rank stores and another rank saves as an alias would have
    only some of its boxes written, so such a save is refused (ties come from
    the model's structure and are the same on every rank; only a state built
    differently per rank can disagree).
    """
    out = dict(mine)
    for r, theirs in others:
        for alias, first in theirs.items():
            if out.setdefault(alias, first) != first:
                raise ConfigError(
                    f"tensor {alias!r} shares memory with {out[alias]!r} on rank {coordinator} but with {first!r} "
                    f"on rank {r}; build the state alike on every rank (the same tied parameters everywhere)"
                )
    conflicts = sorted(a for a in out if a in stored)
    if conflicts:
        ranks = sorted({coordinator for a in conflicts if a in mine}
                       | {r for r, theirs in others for a in conflicts if a in theirs})
        raise ConfigError(
            f"tensor(s) {conflicts[:5]} share memory with another tensor of the state on rank(s) {ranks} "
            "but are separate tensors on other ranks; build the state alike on every rank (the same "
            "tied parameters everywhere) or save the differing tensors under their own keys"
        )
    return out
