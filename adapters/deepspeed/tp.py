"""DeepSpeed AutoTP: each tensor-parallel shard as boxes of the full tensor.

AutoTP training (``"tensor_parallel": {"autotp_size": N}``) replaces a
model's linear layers by ``LinearLayer`` (column-parallel: output rows
split), ``LinearAllreduce`` (row-parallel: input columns split), a split
``lm_head`` and, where a model fuses them, sub-parameter layouts (a fused
QKV: each of q, k and v split on its own, the pieces concatenated). Every
such parameter carries DeepSpeed's description of its layout
(``ds_autotp_universal_checkpoint_meta``: the full ``logical_shape`` and an
affine map of which pieces of the full tensor each tensor-parallel rank
holds where: ``{"ranks": {r: {"shard_shape", "pieces": [{"shape",
"source": [offset, strides], "dest": [offset, strides], "scale"?}]}}}``,
DeepSpeed's ``ParamAffineMap.to_dict()``). :func:`pieces` reads it as pairs of boxes -- where a piece is
in the full tensor and where in this rank's shard -- so the module's
tensors and the ZeRO optimizer's fragments of them are saved as boxes of
the full tensors: they load at another TP size, without TP (FSDP2, one
process) and under the Hugging Face names of the model.

Parameters without the description (embeddings, norms) are whole on every
tensor-parallel rank. A layout the map cannot say as boxes (a scaled
piece, strides that are not row-major) is refused, naming the parameter.

Used by :mod:`.adapter` on every rank (save and load); no collective runs.
"""

from __future__ import annotations

from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.tree.regions import Region, row_major_strides
from bytecp.tree.state import Shard, TensorLeaf

__all__ = ["META", "Piece", "pieces", "tp_rank", "to_full", "autotp_size"]

#: the attribute DeepSpeed's AutoTP layers set on each parameter they shard
META = "ds_autotp_universal_checkpoint_meta"

Piece = tuple[Region, Region]  # (box of the full tensor, the same elements' box in this rank's shard)


def tp_rank() -> int:
    """This process's tensor-parallel rank (DeepSpeed's tensor-model-parallel group)."""
    from deepspeed.utils import groups

    return int(groups.get_tensor_model_parallel_rank())


def _box(offset: int, strides: list[int], shape: tuple[int, ...], of: tuple[int, ...], what: str) -> Region:
    """The box a strided view (``torch.as_strided(shape, strides, offset)``) of a
    row-major tensor shaped ``of`` covers; refused where it is no box."""
    full = row_major_strides(of)
    if any(n > 1 and s != f for n, s, f in zip(shape, strides, full, strict=True)):
        raise ConfigError(f"DeepSpeed AutoTP: {what} holds a piece with strides {list(strides)} in a tensor of "
                          f"shape {list(of)} (row-major strides {list(full)}), which is not a box; bytecp cannot "
                          "checkpoint this layout: use engine.save_checkpoint")
    starts = []
    rest = offset
    for s in full:
        starts.append(rest // s if s else 0)
        rest = rest % s if s else rest
    return Region(tuple(starts), tuple(shape))


def pieces(p: torch.Tensor, rank: int, what: str) -> tuple[tuple[int, ...], list[Piece]] | None:
    """``(full shape, pieces)`` of a tensor-parallel parameter on TP rank
    ``rank``; None for a parameter AutoTP did not shard (whole on every rank)."""
    meta = getattr(p, META, None)
    if not meta or meta.get("replicated"):
        return None
    full = tuple(int(n) for n in meta["logical_shape"])
    local = tuple(p.shape)
    if full == local:
        return None
    amap = (meta.get("conversion") or {}).get("affine_map") or meta.get("affine_map")
    if isinstance(amap, dict) and amap.get("ranks"):
        ranks = amap["ranks"]
        mine = ranks.get(rank, ranks.get(str(rank)))
        if mine is None:
            raise ConfigError(f"DeepSpeed AutoTP: parameter {what!r} describes no pieces for tensor-parallel rank {rank}")
        shard_shape = tuple(int(n) for n in mine.get("shard_shape", local))
        out = []
        for piece in mine["pieces"]:
            if float(piece.get("scale", 1.0)) != 1.0:
                raise ConfigError(f"DeepSpeed AutoTP: parameter {what!r} holds a piece scaled by {piece['scale']}; "
                                  "bytecp cannot checkpoint this layout: use engine.save_checkpoint")
            shape = tuple(int(n) for n in piece["shape"])
            (src_offset, src_strides), (dest_offset, dest_strides) = piece["source"], piece["dest"]
            out.append((_box(int(src_offset), list(src_strides), shape, full, what),
                        _box(int(dest_offset), list(dest_strides), shape, shard_shape, what)))
        return full, out
    dim, sizes = meta.get("partition_dim"), meta.get("partition_sizes")
    if dim is None or not sizes:
        raise ConfigError(f"DeepSpeed AutoTP: parameter {what!r} of shape {list(local)} (full {list(full)}) describes "
                          "no partition bytecp can read; use engine.save_checkpoint")
    start = sum(int(n) for n in sizes[:rank])
    offsets = tuple(start if d == dim else 0 for d in range(len(full)))
    return full, [(Region(offsets, local), Region((0,) * len(local), local))]


def to_full(leaf: TensorLeaf | torch.Tensor, full: tuple[int, ...], parts: list[Piece]) -> TensorLeaf:
    """A leaf in this rank's shard coordinates (a whole shard, or the boxes of
    a flat fragment of it) as boxes of the full tensor."""
    if isinstance(leaf, torch.Tensor):
        shape = tuple(leaf.shape)
        leaf = TensorLeaf(shape, leaf.dtype, [Shard(Region((0,) * len(shape), shape), leaf)] if leaf.numel() else [])
    shards: list[Shard] = []
    for sh in leaf.shards:
        for src, dest in parts:
            common = sh.region.intersect(dest)
            if common is None or common.is_empty():
                continue
            view = sh.tensor[common.relative_to(sh.region).slices()]
            moved = Region(tuple(s + c - d for s, c, d in zip(src.offsets, common.offsets, dest.offsets, strict=True)),
                           common.lengths)
            shards.append(Shard(moved, view))
    return TensorLeaf(full, leaf.dtype, shards, leaf.replicas)


def autotp_size(engine: Any) -> int:
    """The AutoTP size an engine trains with (1 without AutoTP)."""
    size = getattr(engine, "autotp_size", None)
    return int(size() or 1) if callable(size) else 1
