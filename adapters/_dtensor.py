"""DTensor <-> TensorLeaf, shared by the FSDP2 (and any DTensor-based) adapter.

The box a rank holds comes from torch's own layout function, so every
placement works: ``Shard``, ``Replicate`` (replicas hold identical boxes and
the planner writes them once; HSDP), uneven and empty shards, and the
``_StridedShard`` of FSDP2+TP (rectangular blocks, not in naive order).

Replicas are a property of the world, not of the DTensor's mesh: a DTensor
on a sub-mesh (FSDP over ``dp`` of a ``dp x tp`` mesh, norms left out of
the TP plan) is held identically by every rank that differs from this one
only along the root mesh's other dimensions. :func:`dtensor_replicas`
names them from the root mesh; when the root mesh does not span the world
(meshes built apart per stage or group) it gives no hint, and the
coordinator finds the replicas by comparing boxes. Placements whose local
values are not the tensor's values (``Partial``) or whose layout torch's
layout function does not know fail the save on every rank, naming the
tensor, its mesh and its placements (:class:`UnsupportedLayoutError`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard as ShardPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from bytecp.errors import ConfigError
from bytecp.tree.regions import Region
from bytecp.tree.state import ReplicaSet, Shard, TensorLeaf

__all__ = [
    "is_dtensor",
    "dtensor_region",
    "dtensor_leaf",
    "dtensor_replicas",
    "dtensor_target",
    "mesh_info",
    "describe_layout",
    "check_layout",
    "replica_ranks",
    "UnsupportedLayoutError",
]


class UnsupportedLayoutError(ConfigError):
    """A DTensor laid out in a way bytecp cannot save (raised while the save
    describes the state, so it fails on every rank before anything is written)."""


def is_dtensor(t: Any) -> bool:
    return isinstance(t, DTensor)


@functools.lru_cache(maxsize=8192)
def _region(shape: tuple[int, ...], mesh: Any, placements: tuple[tuple[type, Any], ...]) -> Region:
    """This rank's box of a DTensor laid out so: a pure function of the
    global shape, the mesh (whose coordinate for this rank never changes)
    and the placements, cached because torch's layout function costs tens
    of microseconds per tensor and every save describes every tensor."""
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, [p for _, p in placements])
    return Region.of(offset, local_shape)


def dtensor_region(t: DTensor) -> Region:
    # the placement's type is part of the key: placements of different types may compare equal
    return _region(tuple(t.shape), t.device_mesh, tuple((type(p), p) for p in t.placements))


def _local(t: DTensor) -> torch.Tensor:
    """The local tensor of a DTensor (no autograd: saves read values only)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def dtensor_replicas(t: DTensor) -> ReplicaSet | None:
    """The ranks of the world holding the same box as this rank: those whose
    coordinates on the DTensor's mesh differ only along ``Replicate``
    dimensions (HSDP's replicate dimension), and every rank that differs only
    along the dimensions of the root mesh outside the DTensor's mesh (the
    ``tp`` ranks of a norm FSDP shards over ``dp`` alone). ``None`` (no hint:
    the coordinator compares boxes) where the root mesh does not span the
    world or the mesh is not a slab of it."""
    return _replicas(t.device_mesh, tuple(t.placements), _world_size())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@functools.lru_cache(maxsize=256)
def _replicas(mesh: Any, placements: tuple[Any, ...], world: int) -> ReplicaSet | None:
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    ranks = replica_ranks(root.mesh, mesh.mesh, coord, tuple(p.is_replicate() for p in placements), world)
    return None if ranks is None else ReplicaSet.of(ranks)


def replica_ranks(
    grid: torch.Tensor, sub: torch.Tensor, coord: list[int], replicate: tuple[bool, ...], world: int
) -> tuple[int, ...] | None:
    """(pure; tested for simulated meshes of many ranks) The ranks holding
    the same box as the rank at ``coord`` of the mesh ``sub`` (its ranks, a
    slab of the root mesh ``grid``) for placements replicated along the dims
    ``replicate`` marks: ``sub``'s ranks that differ only along those dims,
    and every rank of ``grid`` that differs from one of them only along
    the root dims ``sub`` does not span. ``None`` where ``grid`` does not
    hold the ``world`` or ``sub`` is not a slab of it."""
    index = tuple(slice(None) if rep else c for rep, c in zip(replicate, coord, strict=True))
    within = [int(r) for r in sub[index].flatten().tolist()]
    if grid.numel() != world:
        return None  # ranks outside the root mesh may hold these boxes too: the coordinator compares them
    if grid.numel() == sub.numel():
        return tuple(sorted(within))
    # where each rank sits on the root mesh; the dims the DTensor's mesh spans
    where = {int(r): i for i, r in enumerate(grid.flatten().tolist())}
    shape = tuple(grid.shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    if any(int(r) not in where for r in sub.flatten().tolist()):
        return None
    coords = [[(where[int(r)] // strides[d]) % shape[d] for d in range(len(shape))]
              for r in sub.flatten().tolist()]
    spanned = [d for d in range(len(shape)) if len({c[d] for c in coords}) > 1]
    if math.prod(shape[d] for d in spanned) != sub.numel():
        return None  # not a slab of the root mesh: no sound hint
    ranks: set[int] = set()
    for r in within:
        at = where[r]
        slab = tuple((at // strides[d]) % shape[d] if d in spanned else slice(None) for d in range(len(shape)))
        ranks.update(int(x) for x in grid[slab].flatten().tolist())
    return tuple(sorted(ranks))


def describe_layout(t: DTensor) -> str:
    """``mesh (dp=2, tp=2) placements (S(0), R)``: for error messages."""
    mesh = t.device_mesh
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"mesh ({dims}) placements ({', '.join(str(p) for p in t.placements)})"


def check_layout(t: DTensor, fqn: str | None) -> None:
    """Raise :class:`UnsupportedLayoutError` unless every placement is one
    whose local tensor is a box of the global values (``Shard``,
    ``_StridedShard``, ``Replicate``)."""
    for p in t.placements:
        if isinstance(p, (ShardPlacement, _StridedShard)) or p.is_replicate():
            continue
        if p.is_partial():
            what = "holds partial values (a pending reduction)"
            fix = "t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])"
        else:
            what = f"has a placement bytecp does not know ({p})"
            fix = "t.redistribute(placements=...) with Shard(dim) or Replicate() on every mesh dimension"
        name = "a tensor" if fqn is None else f"tensor {fqn!r}"
        raise UnsupportedLayoutError(
            f"{name} of shape {list(t.shape)} on {describe_layout(t)} {what}; bytecp saves only Shard "
            f"and Replicate placements -- redistribute it before saving: {fix}"
        )


def dtensor_leaf(t: DTensor, fqn: str | None = None) -> TensorLeaf:
    """The leaf for a DTensor: its global shape, this rank's box (a view) and
    its replicas; ``fqn`` names it in the error of a layout bytecp cannot save."""
    check_layout(t, fqn)
    local = _local(t)
    region = dtensor_region(t)
    if tuple(local.shape) != region.lengths:
        # FSDP2 may pad the local shard of uneven dims; the box is the unpadded part
        local = local[tuple(slice(0, n) for n in region.lengths)]
    # in-place ops move the DTensor's version counter, not its local tensor's
    return TensorLeaf(tuple(t.shape), t.dtype, [Shard(region, local.detach())], dtensor_replicas(t), versioned=t)


def dtensor_target(like: DTensor, dtype: torch.dtype) -> tuple[TensorLeaf, DTensor]:
    """A fresh DTensor laid out like ``like`` (for optimizer state) and its leaf."""
    region = dtensor_region(like)
    local = torch.empty(region.lengths, dtype=dtype, device=like.to_local().device)
    dt = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                            shape=like.shape, stride=like.stride())
    return TensorLeaf(tuple(like.shape), dtype, [Shard(region, local)]), dt


def mesh_info(t: DTensor) -> dict[str, Any]:
    mesh = t.device_mesh
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names or []),
        "placements": [str(p) for p in t.placements],
    }
