"""DTensor <-> TensorLeaf, shared by the FSDP2 (and any DTensor-based) adapter.

The box a rank holds comes from torch's own layout function, so every
placement works: ``Shard``, ``Replicate`` (replicas hold identical boxes and
the planner writes them once; HSDP), uneven and empty shards, and the
``_StridedShard`` of FSDP2+TP (rectangular blocks, not in naive order).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from bytecp.tree.regions import Region
from bytecp.tree.state import ReplicaSet, Shard, TensorLeaf

__all__ = ["is_dtensor", "dtensor_region", "dtensor_leaf", "dtensor_replicas", "dtensor_target", "mesh_info"]


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
    """The ranks holding the same box as this rank: those whose mesh
    coordinates differ only along ``Replicate`` dimensions (HSDP's replicate
    dimension; a set of one rank for FSDP's pure sharding)."""
    return _replicas(t.device_mesh, tuple(t.placements))


@functools.lru_cache(maxsize=256)
def _replicas(mesh: Any, placements: tuple[Any, ...]) -> ReplicaSet | None:
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(placements, coord, strict=True))
    return ReplicaSet.of(tuple(int(r) for r in mesh.mesh[index].flatten().tolist()))


def dtensor_leaf(t: DTensor) -> TensorLeaf:
    """The leaf for a DTensor: its global shape, this rank's box (a view) and its replicas."""
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
