"""FSDP1 (``FullyShardedDataParallel``): saves the flat-parameter shards directly.

No state-dict conversion and no all-gather: each rank's shard of a
``FlatParameter`` is cut into the original parameters' flat ranges
(``_shard_param_infos``), each an irregular shard stored as a few contiguous
boxes. Works for ``use_orig_params`` True and False and every sharding
strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD — whose replicas write
once —, NO_SHARD). Optimizer state of a flat parameter is cut the same way
and keyed by the original parameters' FQNs, so it loads under any framework.
Buffers are full on every rank (replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import clean_tensor_name
from torch.distributed.fsdp._flat_param import FlatParameter

from bytecp.adapter_api import LoadTarget
from bytecp.dist import DistContext
from bytecp.dtypes import dtype_from_name
from bytecp.errors import ConfigError
from bytecp.format import Metadata
from bytecp.state import Slot, TensorLeaf, Whole

from .plain import PlainAdapter, param_groups_for_load

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


def _roots(state: dict[str, Any]) -> list[tuple[str, nn.Module]]:
    return [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]


class FSDP1Adapter(PlainAdapter):
    name = "fsdp1"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return any(isinstance(m, FSDP) for _, r in _roots(state) for m in r.modules())

    # ------------------------------------------------------------ layout
    def _layout(self, root: nn.Module) -> tuple[dict[int, list[_Piece]], list[tuple[str, torch.Tensor]]]:
        """Pieces per local flat tensor (by ``id`` of the flat param and of each
        original param), and the flat params with a representative name."""
        pieces: dict[int, list[_Piece]] = {}
        flats: list[tuple[str, torch.Tensor]] = []
        for prefix, m in root.named_modules():
            if not isinstance(m, FSDP) or m._handle is None:
                continue
            fp = m._handle.flat_param
            base = clean_tensor_name(prefix)
            mine: list[_Piece] = []
            orig = fp._params if getattr(fp, "_params", None) else None
            for i, info in enumerate(fp._shard_param_infos):
                fqn = clean_tensor_name(f"{base}.{fp._fqns[i]}" if base else fp._fqns[i])
                shape = tuple(fp._shapes[i])
                if info.in_shard:
                    assert info.offset_in_shard is not None and info.numel_in_shard is not None
                    assert info.intra_param_start_idx is not None
                    p = _Piece(fqn, shape, info.intra_param_start_idx, info.offset_in_shard, info.numel_in_shard)
                else:
                    p = _Piece(fqn, shape, 0, 0, 0)
                mine.append(p)
                if orig is not None:
                    pieces[id(orig[i])] = [dataclasses.replace(p, offset=0)]
            pieces[id(fp)] = mine
            flats.append((mine[0].fqn if mine else base, fp))
        # parameters FSDP does not manage (ignored_modules / ignored_states)
        # are full on every rank: one piece covering each
        for name, p in root.named_parameters():
            if id(p) in pieces or isinstance(p, FlatParameter):
                continue
            fqn = clean_tensor_name(name)
            pieces[id(p)] = [_Piece(fqn, tuple(p.shape), 0, 0, p.numel())]
            flats.append((fqn, p))
        return pieces, flats

    def _leaf(self, piece: _Piece, flat: torch.Tensor, dtype: torch.dtype) -> TensorLeaf:
        if piece.numel == 0:
            return TensorLeaf(piece.shape, dtype, [])
        view = flat.detach().reshape(-1)[piece.offset : piece.offset + piece.numel]
        return TensorLeaf.from_flat(piece.shape, dtype, piece.start, view)

    def _buffers(self, root: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for mname, mod in root.named_modules():
            for bname, buf in mod.named_buffers(recurse=False):
                if buf is None or bname in mod._non_persistent_buffers_set:
                    continue
                out[clean_tensor_name(f"{mname}.{bname}" if mname else bname)] = buf
        return out

    @staticmethod
    def _check_single_root(state: dict[str, Any]) -> None:
        roots = [k for k, r in _roots(state) if any(isinstance(m, FSDP) for m in r.modules())]
        if len(roots) > 1:
            raise ConfigError(
                f"FSDP1 models under several keys {roots}: save each with its own bytecp.save call"
            )

    # ------------------------------------------------------------ save
    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        self._check_single_root(state)
        self._layouts = {id(r): self._layout(r) for _, r in _roots(state)}
        self._all_pieces: dict[int, list[_Piece]] = {}
        for pieces, _ in self._layouts.values():
            self._all_pieces.update(pieces)
        self._pnames = {}
        return {k: self._save_value(v) for k, v in state.items()}

    def module_leaves(self, module: nn.Module) -> dict[str, Any]:
        pieces, flats = self._layouts[id(module)]
        out: dict[str, Any] = {}
        for _, fp in flats:
            for p in pieces[id(fp)]:
                out[p.fqn] = self._leaf(p, fp, fp.dtype)
        out.update(self._buffers(module))
        return out

    def _optimizer_tree(self, opt: torch.optim.Optimizer) -> Any:
        osd = opt.state_dict()
        params = self._optim_params(opt)

        def names(i: int) -> list[_Piece]:
            return self._all_pieces.get(id(params[i]), [])

        state: dict[str, Any] = {}
        for i, st in osd["state"].items():
            p = params[i]
            for piece in names(i):
                state[piece.fqn] = {
                    k: (self._leaf(piece, v, v.dtype) if isinstance(v, torch.Tensor) and v.dim() > 0
                        and v.numel() == p.numel() else v)
                    for k, v in st.items()
                }
        groups = []
        for g in osd["param_groups"]:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [piece.fqn for i in g["params"] for piece in names(i)]
            groups.append(g2)
        return {"state": state, "param_groups": Whole(groups)}

    # ------------------------------------------------------------ load
    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        self._layouts = {id(r): self._layout(r) for _, r in _roots(state)}
        self._all_pieces = {}
        for pieces, _ in self._layouts.values():
            self._all_pieces.update(pieces)
        return super().load_tree(state, ctx, md)

    def _collect_param_names(self, state: dict[str, Any]) -> dict[int, str]:
        return {}

    def module_targets(self, module: nn.Module) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
        target = self.module_leaves(module)
        return target, lambda values: None

    def _optimizer_target(
        self, opt: torch.optim.Optimizer, key: str, finalizers: list[Callable[[dict[str, Any]], None]]
    ) -> Any:
        params = self._optim_params(opt)
        target_state: dict[str, Any] = {}
        put: dict[int, dict[str, Any]] = {}
        slot_keys: dict[int, dict[str, str]] = {}
        for i, p in enumerate(params):
            pieces = self._all_pieces.get(id(p), [])
            for piece in pieces:
                node = self._nodes.get(f"{key}.state.{piece.fqn}")
                if node is None or "d" not in node:
                    continue
                entries: dict[str, Any] = {}
                for k, child in node["d"]:
                    full = f"{key}.state.{piece.fqn}.{k}"
                    if "tensor" in child:
                        info = self._md.tensors[child["tensor"]]
                        dtype = dtype_from_name(info["dtype"])
                        if tuple(info["shape"]) == piece.shape and len(piece.shape) > 0:
                            local = put.setdefault(i, {}).get(k)
                            if local is None:
                                existing = opt.state.get(p, {}).get(k)
                                if (
                                    isinstance(existing, torch.Tensor)
                                    and existing.dtype == dtype
                                    and existing.shape == p.shape
                                ):
                                    local = existing  # fill the optimizer's own state in place
                                else:
                                    local = torch.zeros(p.shape, dtype=dtype, device=p.device)
                                put[i][k] = local
                            entries[k] = self._leaf(piece, local, dtype)
                        else:
                            # a per-parameter scalar (step): one value serves the flat param
                            entries[k] = Slot()
                            slot_keys.setdefault(i, {}).setdefault(k, full)
                    else:
                        entries[k] = Slot()
                        slot_keys.setdefault(i, {}).setdefault(k, full)
                target_state[piece.fqn] = entries

        def finalize(values: dict[str, Any]) -> None:
            saved_groups = values.get(f"{key}.param_groups")
            if saved_groups is None:
                return
            current = [
                [piece.fqn for p in g["params"] for piece in self._all_pieces.get(id(p), [])]
                for g in opt.param_groups
            ]
            groups = param_groups_for_load(key, saved_groups, opt, current)
            osd_state: dict[int, dict[str, Any]] = {}
            for i in set(put) | set(slot_keys):
                st: dict[str, Any] = dict(put.get(i, {}))
                for k, full in slot_keys.get(i, {}).items():
                    st[k] = values[full]
                osd_state[i] = st
            opt.load_state_dict({"state": osd_state, "param_groups": groups})

        finalizers.append(finalize)
        return {"state": target_state, "param_groups": Slot()}

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": ctx.world_size}
        for _, r in _roots(state):
            for m in r.modules():
                if isinstance(m, FSDP):
                    out["sharding_strategy"] = str(m.sharding_strategy.name)
                    out["use_orig_params"] = bool(m._use_orig_params)
                    return out
        return out
