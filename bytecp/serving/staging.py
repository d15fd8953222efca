"""A follower's tensors: which boxes of which tensors this process holds,
how changed ones are staged, and how staged ones are swapped in.

Called by :class:`bytecp.serving.follow._Follower` on every rank of the
follower: :func:`state_boxes` once when it starts, :func:`stage` for each
update (after the changed tensors were decided, before the group agrees
every rank staged), :func:`swap_in` once every rank of the group staged and
verified.

A target is a box of a tensor's global index space and the local tensor
holding it: a full tensor in one process (a module's parameter, a dict's
tensor), a DTensor's local shard under FSDP2 or tensor parallelism (the
adapter's boxes, :func:`bytecp.adapter_api.detect_adapter`). Staging
buffers have the boxes' shapes and are kept between updates.

Swapping: a host tensor that alone holds its whole storage (no view of it
anywhere, no other tensor object: the storage's use count) takes the staged
storage (``param.data = staged``; no copy; its old storage stages the next
update). Any other target -- a view (a DTensor's shard inside FSDP2's padded
storage), memory something else shares, a CUDA tensor (CUDA graphs may hold
its pointer) -- is copied into, as is every target with ``mode="copy"``.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version

from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.loading.checks import block_bytes_of
from bytecp.loading.opened import OpenedCheckpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.regions import Region

__all__ = ["Box", "Held", "stage", "state_boxes", "swap_in"]

#: a staged box: (stored FQN, its box)
Box = tuple[str, Region]


@dataclasses.dataclass
class Held:
    """One tensor of the state: its global shape and dtype, and this process's boxes of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[Region, torch.Tensor]]


def state_boxes(state: dict[str, Any], ctx: Any, swap: str = "auto") -> tuple[dict[str, Held], dict[str, str]]:
    """The state's tensors by FQN as a save names them, with this process's
    boxes (``ctx``: the :class:`~bytecp.dist.DistContext` of the follower's
    group), and its aliases (tied FQN -> stored FQN). Full tensors are the
    objects the state holds (a module's parameters, not a state dict's
    detached views), so their storages may be swapped (``swap``: the
    follower's mode, :func:`swap_in`'s)."""
    if not isinstance(state, dict):
        raise ConfigError(f"state must be a dict such as {{'model': model}}, got {type(state).__name__}")
    out, aliases = _walk(state, ctx)  # returned: the walk's views of the targets are gone with its frame
    if swap == "auto" and any(_whole_storage(t) and not _owns_storage(t) for h in out.values() for _, t in h.boxes):
        # a reference cycle of the walk may still hold a view of a target that would otherwise
        # be swapped: collect it. Only then: a full collection of a large serving process costs
        # tenths of a second to seconds.
        gc.collect()
    return out, aliases


def _walk(state: dict[str, Any], ctx: Any) -> tuple[dict[str, Held], dict[str, str]]:
    """:func:`state_boxes`' walk of the state through its adapter."""
    from bytecp.adapter_api import describing_once, detect_adapter
    from bytecp.tree.state import flatten_tree

    with describing_once():  # no description kept: it would hold views of the storages a swap replaces
        flat = flatten_tree(detect_adapter(state).save_tree(state, ctx))
    live = _live_tensors(state)
    out: dict[str, Held] = {}
    for fqn, leaf in flat.tensors.items():
        boxes = []
        for sh in leaf.shards:
            t = sh.tensor
            obj = live.get(fqn)
            if (obj is not None and obj.data_ptr() == t.data_ptr() and obj.shape == t.shape
                    and obj.dtype == t.dtype and obj.stride() == t.stride()):
                t = obj
            boxes.append((sh.region, t))
        out[fqn] = Held(tuple(leaf.global_shape), leaf.dtype, boxes)
    return out, dict(flat.aliases)


def _live_tensors(state: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensor objects the state holds by FQN: modules' parameters and
    buffers (tied ones under each name), dicts' tensors."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            for n, t in (*v.named_parameters(remove_duplicate=False), *v.named_buffers(remove_duplicate=False)):
                out.setdefault(f"{prefix}{k}.{n}", t)
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
        elif isinstance(v, Mapping):
            out.update(_live_tensors(v, f"{prefix}{k}."))
    return out


def stage(opened: OpenedCheckpoint, held: Mapping[str, Held], wanted: Mapping[str, str], names: Sequence[str],
          rows: Mapping[str, list[fmt.ChunkRecord]], spare: dict[Box, torch.Tensor],
          io_threads: int) -> tuple[dict[Box, torch.Tensor], int]:
    """(every rank, local) This process's boxes of the stored tensors
    ``names`` read into staging tensors (``spare``'s, reused where shape and
    dtype match) through the load path's planned ranged reads, every whole
    chunk's crc32c checked; a target of another floating dtype than the
    stored one is read cast. ``wanted``: state FQN -> stored FQN. Returns
    the staged boxes and the bytes read."""
    staged: dict[Box, torch.Tensor] = {}
    for f, s in wanted.items():
        if s not in names:
            continue
        h = held[f]
        for box, _ in h.boxes:
            if (s, box) in staged:
                continue
            old = spare.pop((s, box), None)
            ok = old is not None and tuple(old.shape) == box.lengths and old.dtype == h.dtype
            staged[(s, box)] = old if ok and old is not None else torch.empty(box.lengths, dtype=h.dtype)
    if not staged:
        return staged, 0
    targets = [Target(s, box, t) for (s, box), t in staged.items()]
    chunks = [r for f in names for r in rows[f]]
    # the stored dtype's sizes: a target held in a serving dtype (``follow(dtype=)``) is read cast
    blocks = block_bytes_of(opened.metadata)
    reqs = plan_load([(t.fqn, t.box) for t in targets], chunks,
                     itemsizes={c.fqn: ITEMSIZES[c.dtype] for c in chunks}, block_bytes=blocks)
    nbytes = execute_reads(opened.storage, chunks, targets, reqs, io_threads=io_threads, verify=True,
                           trace=Trace("follow", opened.storage.url), block_bytes=blocks)
    return staged, nbytes


def _whole_storage(t: torch.Tensor) -> bool:
    """A host leaf tensor laid over the whole of its storage (a swap candidate)."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.storage_offset() and t.is_leaf
            and t.untyped_storage().nbytes() == t.nbytes)


def _owns_storage(t: torch.Tensor) -> bool:
    """A host tensor laid over the whole of a storage nothing else holds
    (no view, no other tensor object): its storage may be replaced."""
    if not _whole_storage(t):
        return False
    storage = t.untyped_storage()
    try:  # the tensor's own reference and ``storage`` above: 2
        return int(torch._C._storage_Use_Count(storage._cdata)) <= 2
    except AttributeError:  # pragma: no cover - a torch without it: copy
        return False


def _put(dst: torch.Tensor, src: torch.Tensor, swap: bool) -> None:
    """One staged tensor into its target (idempotent: a rerun after an interruption is harmless)."""
    if swap:
        if dst.data_ptr() != src.data_ptr():
            dst.data = src
    else:
        dst.copy_(src)
    increment_version(dst)  # incremental saves of the follower's state must see the change


def swap_in(held: Mapping[str, Held], wanted: Mapping[str, str], staged: dict[Box, torch.Tensor],
            mode: str = "auto") -> dict[Box, torch.Tensor]:
    """(every rank, once the group agreed every rank staged) Put every staged
    box into its target: storages swapped where the target owns its storage
    (``mode="auto"``), else copied; an interruption midway finishes the swap
    before it propagates, so the state is never mixed. Returns the staging
    tensors for the next update (the targets' old storages where swapped,
    the staged ones where copied)."""
    pairs = [((s, box), dst, staged[(s, box)]) for f, s in wanted.items() for box, dst in held[f].boxes
             if (s, box) in staged]
    uses: dict[int, int] = {}
    for _, _, src in pairs:
        uses[id(src)] = uses.get(id(src), 0) + 1
    swaps = [mode == "auto" and uses[id(src)] == 1 and src.device == dst.device and _owns_storage(dst)
             for _, dst, src in pairs]
    spare = {k: dst.detach() if sw else src for (k, dst, src), sw in zip(pairs, swaps, strict=True)}
    done = 0
    try:
        with torch.no_grad():
            for (_, dst, src), sw in zip(pairs, swaps, strict=True):
                _put(dst, src, sw)
                done += 1
    except BaseException:
        with torch.no_grad():
            for (_, dst, src), sw in list(zip(pairs, swaps, strict=True))[done:]:
                _put(dst, src, sw)
        raise
    return spare
