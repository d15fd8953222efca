"""FSDP1 (``FullyShardedDataParallel``): saves the flat-parameter shards directly.

No state-dict conversion and no all-gather: each rank's shard of a
``FlatParameter`` is cut into the original parameters' flat ranges
(``_shard_param_infos``), each an irregular shard stored as a few contiguous
boxes. Works for ``use_orig_params`` True and False and every sharding
strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD — whose replicas write
once —, NO_SHARD). Optimizer state of a flat parameter is cut the same way
and keyed by the original parameters' FQNs, so it loads under any framework.
Buffers are full on every rank (replicated). A parameter shared by several
modules of one FSDP unit (tied embeddings) is flattened once; its other
names are saved as aliases of the first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._flat_param import FlatParameter

from bytecp.adapter_api import AdapterCall
from bytecp.dist import DistContext
from bytecp.errors import ConfigError
from bytecp.format.metadata import Metadata
from bytecp.tree.state import EVERY_RANK, ReplicaSet, TensorLeaf

from . import _watch
from ._names import ModuleNames
from ._optim import ParamState
from .plain import Finalize, PlainAdapter

__all__ = ["FSDP1Adapter"]


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Original parameter ``fqn`` (global ``shape``) has its flat elements
    ``[start, start+numel)`` at ``[offset, offset+numel)`` of a local flat tensor."""

    fqn: str
    shape: tuple[int, ...]
    start: int
    offset: int
    numel: int
    #: the ranks holding the same elements (None: unknown)
    replicas: ReplicaSet | None = None


def _replicas(m: FSDP) -> ReplicaSet | None:
    """Who holds the same shard of ``m``'s flat parameter (global ranks):
    this rank alone when it is sharded, its replicas across HSDP's
    replicate group, everyone of FSDP's group with NO_SHARD."""
    if not dist.is_initialized():
        return EVERY_RANK
    name = m.sharding_strategy.name
    if name in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return ReplicaSet.of((dist.get_rank(),))
    group = getattr(m, "_inter_node_pg", None) if "HYBRID" in name else m.process_group
    if group is None:
        return None
    return ReplicaSet.of(tuple(dist.get_process_group_ranks(group)))


def _roots(state: dict[str, Any]) -> list[tuple[str, nn.Module]]:
    return [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]


@dataclasses.dataclass
class _Call(AdapterCall):
    """FSDP1's per-call facts: pieces per local flat tensor (by ``id``), and
    the flat tensors of each root module."""

    pieces: dict[int, list[_Piece]] = dataclasses.field(default_factory=dict)
    flats: dict[int, list[tuple[str, torch.Tensor]]] = dataclasses.field(default_factory=dict)
    #: per root module (by ``id``): (name of a shared parameter, the name FSDP flattened it under)
    shared: dict[int, list[tuple[str, str]]] = dataclasses.field(default_factory=dict)


def _layout(
    root: nn.Module, pieces: dict[int, list[_Piece]], shared: list[tuple[str, str]]
) -> list[tuple[str, torch.Tensor]]:
    """Add the pieces of every local flat tensor of ``root`` (by ``id`` of the
    flat param and of each original param) to ``pieces``, and the names of
    shared (tied) parameters with the name they share storage with to
    ``shared``; return the flat params with a representative name."""
    names = ModuleNames(root)
    flats: list[tuple[str, torch.Tensor]] = []
    for prefix, m in root.named_modules():
        if not isinstance(m, FSDP) or m._handle is None:
            continue
        fp = m._handle.flat_param
        replicas = _replicas(m)

        def clean(name: str, prefix: str = prefix) -> str:
            return names.clean(f"{prefix}.{name}" if prefix else name)

        mine: list[_Piece] = []
        orig = fp._params if getattr(fp, "_params", None) else None
        for spi in fp._shared_param_infos:  # a parameter FSDP flattened once, under its first name
            shared.append((clean(_join(spi.module_name, spi.param_name)),
                           clean(_join(spi.prim_module_name, spi.prim_param_name))))
        for i, info in enumerate(fp._shard_param_infos):
            fqn = clean(fp._fqns[i])
            shape = tuple(fp._shapes[i])
            if info.in_shard:
                assert info.offset_in_shard is not None and info.numel_in_shard is not None
                assert info.intra_param_start_idx is not None
                p = _Piece(fqn, shape, info.intra_param_start_idx, info.offset_in_shard, info.numel_in_shard,
                           replicas)
            else:
                p = _Piece(fqn, shape, 0, 0, 0, replicas)
            mine.append(p)
            if orig is not None:
                pieces[id(orig[i])] = [dataclasses.replace(p, offset=0)]
        pieces[id(fp)] = mine
        flats.append((mine[0].fqn if mine else names.clean(prefix), fp))
    # parameters FSDP does not manage (ignored_modules / ignored_states)
    # are full on every rank: one piece covering each
    for name, param in root.named_parameters():
        if id(param) in pieces or isinstance(param, FlatParameter):
            continue
        fqn = names.clean(name)
        pieces[id(param)] = [_Piece(fqn, tuple(param.shape), 0, 0, param.numel(), EVERY_RANK)]
        flats.append((fqn, param))
    return flats


def _leaf(piece: _Piece, flat: torch.Tensor, dtype: torch.dtype) -> TensorLeaf:
    """The piece's elements of a local flat tensor, as the original parameter's boxes."""
    if piece.numel == 0:
        return TensorLeaf(piece.shape, dtype, [], piece.replicas)
    view = flat.detach().reshape(-1)[piece.offset : piece.offset + piece.numel]
    return TensorLeaf.from_flat(piece.shape, dtype, piece.start, view, piece.replicas)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    names = ModuleNames(root)
    out = {}
    for mname, mod in root.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is None or bname in mod._non_persistent_buffers_set:
                continue
            out[names.clean(_join(mname, bname))] = buf
    return out


class FSDP1Adapter(PlainAdapter):
    name = "fsdp1"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return any(_watch.holds_module(r, FSDP) for _, r in _roots(state))

    def begin(self, state: dict[str, Any], ctx: DistContext, md: Metadata | None) -> AdapterCall:
        roots = [k for k, r in _roots(state) if any(isinstance(m, FSDP) for m in r.modules())]
        if len(roots) > 1:
            raise ConfigError(
                f"FSDP1 models under several keys {roots}: save each with its own bytecp.save call"
            )
        call = _Call(state, ctx, md, md.skeleton.index() if md is not None else {})
        for _, r in _roots(state):
            call.flats[id(r)] = _layout(r, call.pieces, call.shared.setdefault(id(r), []))
        return call

    def module_leaves(self, call: AdapterCall, module: nn.Module) -> dict[str, Any]:
        """Each original parameter's piece of the local flat shards; a shared
        (tied) parameter's other names hold the very leaf of its first name,
        so it is stored once and recorded as an alias."""
        assert isinstance(call, _Call)
        out: dict[str, Any] = {}
        for _, fp in call.flats[id(module)]:
            for p in call.pieces[id(fp)]:
                out[p.fqn] = _leaf(p, fp, fp.dtype)
        for name, first in call.shared[id(module)]:
            if first in out:
                out[name] = out[first]
        out.update(_buffers(module))
        return out

    def module_targets(self, call: AdapterCall, module: nn.Module) -> tuple[dict[str, Any], Finalize]:
        return self.module_leaves(call, module), lambda values: None

    def param_state(self, call: AdapterCall, index: int, param: torch.Tensor) -> list[ParamState]:
        """A flat parameter's state is a flat tensor like it: each original
        parameter's piece of it is saved under that parameter's FQN."""
        assert isinstance(call, _Call)
        flat_shape = tuple(param.shape)
        numel = param.numel()

        def place(piece: _Piece) -> ParamState:
            return ParamState(
                fqn=piece.fqn,
                shape=piece.shape,
                # state tensors sharded like the flat param are cut; the others (step)
                # are copied for each original parameter: one tensor shared by the
                # pieces of a flat parameter is FSDP's layout, not a tie between them
                leaf=lambda v: _leaf(piece, v, v.dtype) if v.dim() > 0 and v.numel() == numel else v.detach().clone(),
                new=lambda dtype: torch.zeros(flat_shape, dtype=dtype, device=param.device),
                fits=lambda t, dtype: t.dtype == dtype and tuple(t.shape) == flat_shape,
            )

        return [place(piece) for piece in call.pieces.get(id(param), [])]

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": ctx.world_size}
        for _, r in _roots(state):
            for m in r.modules():
                if isinstance(m, FSDP):
                    out["sharding_strategy"] = str(m.sharding_strategy.name)
                    out["use_orig_params"] = bool(m._use_orig_params)
                    return out
        return out
