"""What the two DeepSpeed sources share: the reviewed allowlist of DeepSpeed's
own pickled classes, the parse of one ``.pt`` file, and the state tree a
DeepSpeed checkpoint presents in the names bytecp's DeepSpeed adapter gives
an engine.

Called by :mod:`bytecp.interop.deepspeed_zero` and
:mod:`bytecp.interop.deepspeed_universal` (the coordinator of a load, from
their ``read``): :func:`parse` (:func:`parse_all`) once per file, :func:`engine_values` on the
model-states file, then :func:`build_metadata` with the tensors found.

The names (those of :mod:`bytecp.adapters.deepspeed` for ``{"model": engine}``,
so a DeepSpeed checkpoint loads into an engine at any stage or size, into a
plain module and ``torch.optim`` optimizer, and with ``load_state_dict``):

- ``model.<name>``: the module's tensors in their saved dtype;
- ``optimizer.state.<name>.<key>``: ``exp_avg``, ``exp_avg_sq`` (each
  partition-shaped tensor of the wrapped optimizer), ``step``, and ``fp32``
  (the master weights) where the model is not fp32;
- ``optimizer.param_groups``: the groups' hyperparameters, parameters by name;
- ``engine.<part>``: ``global_steps``, ``global_samples``, ``skipped_steps``,
  ``lr_scheduler``, ``data_sampler``, ``random_ltd``, ``loss_scaler``
  (:class:`bytecp.adapters.deepspeed.engine.EngineState`'s parts).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Mapping
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import SUPPORTED_DTYPES
from bytecp.tree.regions import flat_range_to_boxes
from bytecp.tree.skeleton import Node
from bytecp.tree.state import is_json_leaf

__all__ = [
    "FRAMEWORK", "ALLOWED", "Opaque", "SCALER_FIELDS", "TENSOR", "TensorAt", "Tensors", "bad", "parse", "PARSE_THREADS",
    "parse_all", "tensor_at", "plain",
    "engine_values", "build_metadata", "param_groups",
]

#: ``Metadata.framework`` of a checkpoint read from DeepSpeed's own files
FRAMEWORK = "deepspeed"

class Opaque:
    """What an allowlisted DeepSpeed class stands for while a file is
    unpickled: an object holding the attributes the pickle sets (BUILD fills
    its ``__dict__``) and the arguments it was made with; no method of
    DeepSpeed's class runs, nor is DeepSpeed imported."""

    def __new__(cls, *args: Any) -> Opaque:  # NEWOBJ: cls.__new__(cls, *args)
        obj = super().__new__(cls)
        obj.__dict__["args"] = args
        return obj

    def __init__(self, *args: Any) -> None:  # REDUCE: cls(*args)
        pass


class _Pair(tuple):
    """A named tuple read as a plain tuple (NEWOBJ: ``cls.__new__(cls, *fields)``;
    the empty state its pickle BUILDs lands in ``__dict__``)."""

    def __new__(cls, *fields: Any) -> _Pair:
        return super().__new__(cls, fields)


class _TensorType:
    """What ``torch.Tensor`` stands for: the type argument of
    ``_rebuild_from_type_v2``, never called."""


_TENSOR_TYPE = _TensorType()


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2`` for a plain tensor carrying
    Python attributes (ZeRO-3 tags its flat groups with ``ds_id``): the
    tensor only, its attributes dropped; any other type is refused."""
    if new_type is not _TENSOR_TYPE or not isinstance(args, tuple):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of a type other than torch.Tensor")
    return func(*args)


#: DeepSpeed's classes its checkpoint files pickle, reviewed: ``module.name``
#: -> (what stands for it while unpickling, why it is harmless). Any other
#: global is refused in one line naming it (:mod:`bytecp.interop.torch_zip`).
ALLOWED: dict[str, tuple[Any, str]] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler":
        (Opaque, "the static loss scaler: its attributes (numbers, a flag) are read, none of its methods run"),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler":
        (Opaque, "the dynamic loss scaler: numbers only (cur_scale, cur_iter, ...), read as attributes"),
    "deepspeed.runtime.zero.config.ZeroStageEnum": (int, "an int enum: the ZeRO stage, read as its int value"),
    "deepspeed.utils.tensor_fragment.fragment_address":
        (_Pair, "a named tuple (numel, start) of where a parameter lies in its partition"),
    "torch._tensor._rebuild_from_type_v2":
        (_rebuild_from_type, "ZeRO-3's flat groups: a tensor with a Python attribute; only torch.Tensor, "
                             "rebuilt by the archive's own tensor builder, attributes dropped"),
    "torch.Tensor": (_TENSOR_TYPE, "the type argument of _rebuild_from_type_v2, never called"),
}

#: the loss scaler numbers :class:`~bytecp.adapters.deepspeed.engine.EngineState` restores
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def bad(where: str, what: str) -> CorruptCheckpointError:
    """The one-line error of a DeepSpeed file that is not what it claims."""
    return CorruptCheckpointError(f"{where}: {what}; the DeepSpeed checkpoint is corrupt or was tampered with")


@dataclasses.dataclass(frozen=True)
class TensorAt:
    """Where a tensor's elements lie: a dtype, a shape and, row-major,
    ``numel`` elements from ``begin`` (absolute byte offset) of ``file``."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def rows(self, fqn: str, shape: tuple[int, ...], start: int, first: int, count: int) -> list[fmt.ChunkRecord]:
        """Rows of elements ``[first, first+count)`` of this (flat) tensor,
        holding elements ``[start, start+count)`` of the row-major tensor
        ``fqn`` of ``shape``: one row per contiguous box."""
        out = []
        at = self.begin + first * self.itemsize
        for box in flat_range_to_boxes(shape, start, start + count):
            n = box.numel * self.itemsize
            out.append(fmt.ChunkRecord(fqn, self.dtype, shape, box.offsets, box.lengths, self.file, at, n, 0))
            at += n
        return out

    def whole(self, fqn: str) -> list[fmt.ChunkRecord]:
        return self.rows(fqn, self.shape, 0, 0, self.numel)


#: fqn -> (dtype, shape)
Tensors = dict[str, tuple[str, tuple[int, ...]]]


def parse(storage: Storage, file: str, size: int | None = None) -> Any:
    """(coordinator) The object tree of the ``torch.save`` archive ``file``
    (of ``size`` bytes, from the folder's listing: None asks the storage),
    tensors as :class:`TensorAt`, read with small ranged reads and a
    restricted unpickler (:mod:`bytecp.interop.torch_zip`; DeepSpeed's own
    classes in :data:`ALLOWED` as plain values). A global outside the
    allowlist, a truncated or damaged archive: one line naming the file."""
    from bytecp.interop import torch_zip

    tree = torch_zip.read_torch_file(storage, file, length=size, allow={k: v[0] for k, v in ALLOWED.items()})
    where = f"{storage.url}/{file}"
    seen, stack, out = 0, [tree], None

    def leaf(v: Any) -> Any:
        return tensor_at(where, v) if isinstance(v, torch_zip.StoredTensor) else v

    out = leaf(tree)
    while stack:  # tensors replaced in place, no recursion (the tree was counted and depth-checked)
        v = stack.pop()
        seen += 1
        if isinstance(v, dict):
            for k, x in v.items():
                v[k] = leaf(x)
                stack.append(x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                v[i] = leaf(x)
                stack.append(x)
        elif isinstance(v, Opaque):
            stack.append(v.__dict__)
    return out


#: the most files parsed at once (each parse is a few small requests: on an object store, round trips)
PARSE_THREADS = 16


def parse_all(storage: Storage, files: list[str], sizes: Mapping[str, int]) -> list[Any]:
    """(coordinator) :func:`parse` of each of ``files`` (their sizes from the
    listing), in order. On a remote storage (``Storage.remote``: each request
    a round trip) more than 3 (a folder of many ranks, a universal folder's
    per-parameter files) are parsed on up to :data:`PARSE_THREADS` threads;
    on a local disk the parse is CPU-bound and threads only slow it down
    (48 universal files: 21 ms in turn, 35 ms on 16 threads, 2 cores).
    The first file (in order) that fails raises its one-line error."""
    if len(files) <= 3 or not storage.remote:
        return [parse(storage, f, sizes.get(f)) for f in files]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(PARSE_THREADS, len(files)), "bytecp-deepspeed-parse") as ex:
        return list(ex.map(lambda f: parse(storage, f, sizes.get(f)), files))


def tensor_at(where: str, t: Any) -> TensorAt:
    """A :class:`bytecp.interop.torch_zip.StoredTensor` as :class:`TensorAt`;
    one that is not contiguous row-major is refused (DeepSpeed saves none)."""
    if not t.contiguous:
        raise bad(where, f"holds a tensor of shape {list(t.shape)} with strides {list(t.stride)}, not contiguous")
    return TensorAt(t.file, t.dtype, tuple(t.shape), t.data_offset, SUPPORTED_DTYPES[t.dtype].itemsize)


def _get(obj: Any, name: str) -> Any:
    """An attribute of an allowlisted object read as a plain value (a dict of its state)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return obj.__dict__.get(name) if isinstance(obj, Opaque) else None


def plain(v: Any) -> Any:
    """A value as JSON where it is one (tuples as lists), else None."""
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, list):
        v = [plain(x) for x in v]
    elif isinstance(v, dict):
        v = {k: plain(x) for k, x in v.items()}
    return v if is_json_leaf(v) else None


def engine_values(model_states: Mapping[str, Any], scaler: Any = None) -> dict[str, Any]:
    """(coordinator) The engine's own state from a model-states file (and the
    optimizer file's loss scaler), as
    :class:`~bytecp.adapters.deepspeed.engine.EngineState` saves it."""
    dynamic = _get(scaler, "dynamic") if scaler is not None else None
    return {
        "global_steps": plain(model_states.get("global_steps", 0)),
        "global_samples": plain(model_states.get("global_samples", 0)),
        "skipped_steps": plain(model_states.get("skipped_steps", 0)),
        "lr_scheduler": plain(model_states.get("lr_scheduler")),
        "data_sampler": plain(model_states.get("data_sampler")),
        "random_ltd": plain(model_states.get("random_ltd")),
        "loss_scaler": {f: plain(_get(scaler, f)) for f in SCALER_FIELDS if _get(scaler, f) is not None}
        if dynamic else None,
    }


def param_groups(groups: Any, names: list[list[str]], where: str) -> list[dict[str, Any]]:
    """The wrapped optimizer's param groups, hyperparameters as JSON, each
    group's parameters by name (``names[g]``)."""
    if not isinstance(groups, list) or len(groups) != len(names):
        raise bad(where, f"holds {len(groups) if isinstance(groups, list) else 'no'} param groups for "
                         f"{len(names)} groups of parameters")
    out = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise bad(where, f"holds param group {g} as a {type(group).__name__}")
        hyper = {str(k): plain(v) for k, v in group.items() if k != "params"}
        out.append({**hyper, "params": list(names[g])})
    return out


class _Tensor:
    """A tensor leaf of the tree :func:`build_metadata` walks."""

    __slots__ = ()


#: marks a tensor (named by its place in the tree) among :func:`build_metadata`'s values
TENSOR: Any = _Tensor()


def _walk(v: Any, fqn: str, objects: dict[str, fmt.ObjectRecord], whole: frozenset[str]) -> Node:
    """The skeleton of ``v`` as :func:`bytecp.tree.state.flatten_tree` makes it
    (dicts, lists and tuples are containers; ``whole`` names values kept as one object)."""
    if v is TENSOR:
        return Node.leaf("tensor", fqn)
    if fqn not in whole and isinstance(v, dict) and all(type(k) is str for k in v):
        return Node.container("dict", [(k, _walk(x, f"{fqn}.{k}", objects, whole)) for k, x in v.items()])
    if fqn not in whole and isinstance(v, list):
        return Node.container("list", [(i, _walk(x, f"{fqn}.{i}", objects, whole)) for i, x in enumerate(v)])
    objects[fqn] = fmt.ObjectRecord(json=v)
    return Node.leaf("obj", fqn)


def build_metadata(tensors: Tensors, rows: list[fmt.ChunkRecord], sizes: dict[str, int], *,
                   keys: dict[str, dict[str, Any]], groups: list[dict[str, Any]], engine: dict[str, Any],
                   aliases: dict[str, str], parallelism: dict[str, Any], save_id: str
                   ) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator) The source's :class:`~bytecp.format.metadata.Metadata`:
    ``model`` (``model.*`` tensors in order), ``optimizer`` (``keys``: each
    parameter's state, :data:`TENSOR` for a tensor, else a JSON value; ``groups``) and ``engine``."""
    tree: dict[str, Any] = {
        "model": {k[len("model."):]: TENSOR for k in tensors if k.startswith("model.")},
        "engine": engine,
        "optimizer": {"state": keys, "param_groups": groups},
    }
    objects: dict[str, fmt.ObjectRecord] = {}
    items = [(k, _walk(v, k, objects, frozenset({"optimizer.param_groups"}))) for k, v in tree.items()]
    md = fmt.Metadata(
        save_id=save_id, world_size=int(parallelism.get("world_size", 1)), framework=FRAMEWORK,
        parallelism=parallelism, skeleton=Node.container("dict", items),
        tensors={k: {"dtype": d, "shape": list(s)} for k, (d, s) in tensors.items()},
        objects=objects, per_rank={}, index_files=[], data_files=sizes,
        step=engine.get("global_steps") if isinstance(engine.get("global_steps"), int) else None,
        aliases=aliases,
    )
    return md, rows
