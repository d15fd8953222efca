"""The Megatron-Core adapter: which state entries are Megatron models and
optimizers, their trees on save, their targets and finalizers on load.

The core reaches it through the adapter registry
(``bytecp.adapter_api``: "megatron"); it calls :meth:`MegatronAdapter.detect`,
then ``save_tree``/``parallelism`` (save, all ranks) or ``load_tree`` (load,
all ranks). Translation is in ``translate.py``, the distributed optimizer's
layouts in ``optimizer_layout.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from bytecp.adapter_api import Adapter, LoadTarget, excluded
from bytecp.dist import DistContext
from bytecp.errors import ConfigError, StateMismatchError
from bytecp.format.metadata import Metadata
from bytecp.tree.state import Slot, TensorLeaf, Whole

from ..plain import is_per_rank, is_stateful, per_rank_leaf, per_rank_slot
from .mains import plan_refresh
from .optimizer_layout import (
    _MODEL_SPACE,
    DEFAULT_OPTIMIZER_LAYOUT,
    OptimizerLayout,
    _add_unowned,
    _distributed_parts,
    _flat_finalizer,
    _flat_state,
    _init_fresh_state,
    _load_optimizer,
    _save_layout,
)
from .replicas import hints as replica_hints
from .translate import (
    COMMON,
    Translation,
    _get_path,
    _megatron_loaded,
    _Types,
    _types,
    clip_to_saved,
    rebuild,
    translate,
)

__all__ = ["MegatronAdapter", "MegatronModel"]

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

class MegatronAdapter(Adapter):
    """Megatron-Core models (TP/PP/DP, virtual pipeline chunks) and optimizers."""

    name = "megatron"
    #: the distributed optimizer copies into model parameters through ``.data``
    tracks_versions = False

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
        hints = replica_hints()
        model_sd = None
        for e in entries:
            if e.kind == "model":
                assert e.chunks is not None
                model_sd = _model_sharded(e.chunks)
                tr = translate(model_sd, types, where=e.key, hint=hints.model if hints else None)
                tree[e.key] = _unpad(tr.tree(target=False), tr.tensors, tr.asm, vocab)
        for e in entries:
            if e.kind == "optimizer":
                layout = _save_layout(e.value)
                parts = _distributed_parts(_optimizer_of(e.value))
                if layout == "model_space" and parts is not None:
                    fs = _flat_state(parts, model_sd, types, e.key, hints.optimizer if hints else None)
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
                out["context_parallel"] = parallel_state.get_context_parallel_world_size()
                out["expert_parallel"] = parallel_state.get_expert_model_parallel_world_size()
                out["expert_tensor_parallel"] = parallel_state.get_expert_tensor_parallel_world_size()
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
        model_sd = model_chunks = None
        optimizers: list[Any] = []
        mains_loaded: set[int] = set()  # id of each parameter whose fp32 main this load fills
        for e in entries:
            if e.kind == "model":
                assert e.chunks is not None
                model_sd, model_chunks = _model_sharded(e.chunks), e.chunks
                e.sd = model_sd
        for e in entries:
            if e.kind == "model":
                e.tr = translate(e.sd, types, where=e.key)
            elif e.kind == "optimizer":
                e.layout = _load_layout(e, saved_layouts)
                if e.layout == "model_space" and any(k.startswith(f"{e.key}.chained_") for k in md.tensors):
                    # Megatron's own producer saved a chain (dense + expert
                    # optimizers): its keys carry the chain index, so the
                    # checkpoint loads through Megatron's loader (same chain)
                    e.layout = "fully_reshardable"
                opt = _optimizer_of(e.value)
                optimizers.append(opt)
                _init_fresh_state(opt)
                parts = _distributed_parts(opt)
                absent = not _holds(md, e.key)  # strict=False only: the match refuses it otherwise
                if e.layout == "model_space" and parts is not None:
                    fs = _flat_state(parts, model_sd, types, e.key)
                    _add_unowned(e.key, fs, md)
                    tree[e.key] = _clip_padded(e.key, {**fs.leaves, COMMON: Slot()}, fs.leaves, fs.asm, md)
                    if not absent:
                        finalizers.append(_flat_finalizer(e.key, opt, parts, fs))
                        mains_loaded |= {i for i, keys in fs.param_keys.items()
                                         if all(_held(md, f"{e.key}.optimizer.state.param.{k}") for k in keys)}
                    continue
                megatron_layout = "fully_reshardable" if e.layout == "model_space" else e.layout
                e.sd = _optimizer_sharded(e, model_sd, megatron_layout, loading=True)
                e.tr = translate(e.sd, types, where=e.key)
                if absent:
                    tree[e.key] = e.tr.tree(target=True)
                    continue
                mains_loaded |= {id(p) for c in (model_chunks or []) for p in c.parameters()}
            if e.tr is not None:
                tree[e.key] = _clip_padded(e.key, e.tr.tree(target=True), e.tr.tensors, e.tr.asm, md)
                if e.kind == "model":
                    _skip_others_extra_state(e.key, tree[e.key], md)
                finalizers.append(_finalizer(e, types, md))
            else:
                tree[e.key] = _plain_target(e.key, e.value, state, finalizers)

        for e in entries:  # last: after the model's own finalizer (factories) has run
            if e.kind == "model" and e.chunks is not None:
                refresh = plan_refresh(e.key, e.value, e.chunks, types, loaded=mains_loaded, optimizers=optimizers)
                if refresh is not None:
                    finalizers.append(refresh)

        def finalize(values: dict[str, Any]) -> None:
            for f in finalizers:
                f(values)

        return LoadTarget({k: tree[str(k)] for k in state}, finalize)

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


def _held(md: Metadata, fqn: str) -> bool:
    """Whether this load reads the tensor ``fqn``: the checkpoint holds it and it is not excluded."""
    return (fqn in md.tensors or fqn in md.aliases) and not excluded(fqn)


def _holds(md: Metadata, key: str) -> bool:
    """Whether the checkpoint holds anything under the entry ``key``."""
    p = f"{key}."
    return any(k.startswith(p) for names in (md.tensors, md.aliases, md.objects) for k in names)


def _skip_others_extra_state(key: str, tree: dict[str, Any], md: Metadata) -> None:
    """(load) Module extra state (``*._extra_state/shard_...`` objects) that
    another rank holds: each expert-parallel rank holds the extra state of its
    own experts only, keyed by the global expert index, so the checkpoint holds
    every expert's and this rank reads its own. The others are read into
    slots nobody applies, so a strict load sees every saved key wanted."""
    prefix = f"{key}."
    for fqn in md.objects:
        if fqn.startswith(prefix) and "._extra_state/shard_" in fqn:
            rest = fqn[len(prefix):]
            if rest not in tree:
                tree[rest] = Slot()


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

def _finalizer(e: _Entry, types: _Types, md: Metadata) -> Callable[[dict[str, Any]], None]:
    tr = e.tr
    assert tr is not None
    lacking = [k for k in tr.tensors if not _held(md, f"{e.key}.{k}")]

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
            if lacking:  # strict=False: Megatron would copy its unfilled (empty) buffers into the state
                raise StateMismatchError(
                    f"optimizer {e.key!r}: the checkpoint lacks {len(lacking)} of its {len(tr.tensors)} "
                    f"tensors (e.g. {lacking[0]!r}) and Megatron's loader cannot load part of a state; "
                    f"load with exclude=[{e.key!r}] (the fp32 main parameters then come from the model)"
                )
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

# ------------------------------------------------------------------ other entries


def _plain_save(v: Any) -> Any:
    """Entries beside the Megatron ones (RNG, dataloader, step counters):
    per-rank values per rank, stateful objects by their state dict, the rest as is."""
    if is_per_rank(v):
        return per_rank_leaf(v)
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
        return per_rank_slot(v) if is_per_rank(v) else Slot()

    def put(values: dict[str, Any]) -> None:
        if key in values:
            parent[key] = values[key]

    finalizers.append(put)
    return Slot(default=v)
