"""A Megatron-Core ``torch_dist`` checkpoint (Megatron-LM's and NeMo's default
format) read as a bytecp checkpoint, without conversion.

``megatron.core.dist_checkpointing.save`` with the torch_dist strategy
writes a folder (``iter_0000100/`` below a run folder whose
``latest_checkpointed_iteration.txt`` names the newest) holding
``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt``
(``torch.save`` of the state dict's values that are not sharded: the
iteration, Megatron-LM's ``args``, the optimizer's param groups) and a DCP
checkpoint (``.metadata`` and ``__<rank>_<n>.distcp``) of the sharded ones,
keyed by Megatron's checkpoint keys: layer-stacked model tensors
(``decoder.layers.self_attention.linear_qkv.weight``, the layers along a
prepended first axis), TP/PP/EP shards as DCP chunks, the distributed
optimizer's state under ``optimizer.state.<exp_avg|exp_avg_sq|param>.<key>``
(``fully_reshardable``) or ``optimizer.distributed.*`` (``dp_reshardable``),
module extra state and Megatron-LM's ``rng_state`` as values (each
``torch.save([data])``: read here, the data inline).

The DCP part is read by :func:`bytecp.interop.dcp.read_dcp_dir` (one row per
DCP chunk, naming its ``.distcp`` file and byte range; every rank reads only
the boxes it needs). The keys are then given the names bytecp's Megatron
adapter (:mod:`bytecp.adapters.megatron`) gives the same state when the
state dict is Megatron-LM's, ``{"model": model, "optimizer": optimizer}``:

- ``optimizer.*`` and ``chained_<i>.*`` (a chain: MoE's dense and expert
  optimizers) keys -> ``optimizer.<key>`` (a ``fully_reshardable`` chain's
  without the chain index: bytecp's model-space names, so it loads at
  another EP size too), and ``common.pt``'s
  ``optimizer`` value (the param groups, the sharding type) ->
  ``optimizer.__common__``;
- Megatron-LM's run state (:data:`RUN_STATE`: ``rng_state/shard_*``) keeps
  its key, at the top;
- every other key (the model's tensors and extra state) -> ``model.<key>``;
- ``common.pt``'s other values (``iteration``, ``args`` as a dict,
  ``checkpoint_version``, ...) -> top-level values of those names.

The adapter keeps layers stacked as Megatron's keys do, so nothing is
restacked: a load at another TP/PP/DP reads sub-boxes of the stacked
chunks, exactly as from a bytecp checkpoint of the same model. The
optimizer layout (``param_state_sharding_type`` in ``common.pt``) is
recorded as the saved ``optimizer_layout``, so the adapter reads
``fully_reshardable`` state into any layout and ``dp_reshardable`` state
at the same TP/PP.

``common.pt`` and every value (``rng_state``, module extra state) are read
once by the coordinator through :func:`bytecp.interop.torch_zip.read_torch_file`
(no ``torch.load``, so the same in every process, Megatron imported or not):
plain containers, tensors and the classes Megatron-Core's ``safe_globals``
admits, as data (:mod:`bytecp.interop.pickled_data`: ``args`` as a dict, its
enums as ``"ModelType.encoder_or_decoder"``, numpy's RNG state as a numpy
array). A ``common.pt`` naming any other global is refused in one line naming
it; a value naming one stays an arbitrary pickle (``allow_pickle=True`` loads
it). The values travel inline in the metadata broadcast.

Who calls what: :func:`bytecp.interop.find_source` calls :func:`detect`
(one small read of ``metadata.json``; a run folder's pointer file) when a
URL's ``metadata.json`` is not bytecp's; the coordinator of a load
(:func:`bytecp.loading.opened.open_checkpoint`) then :func:`read`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.interop import dcp, pickled_data, torch_zip
from bytecp.storage_api import Storage
from bytecp.tree.skeleton import Node

__all__ = ["NAMES", "FRAMEWORK", "MARKER", "LATEST", "COMMON_FILE", "RUN_STATE", "MAX_COMMON_BYTES",
           "is_torch_dist", "folder", "state_name", "detect", "read"]

#: names are the state's (Megatron-LM's ``model``/``optimizer``), matched exactly, never cast
NAMES = "exact"
#: ``Metadata.framework`` of a checkpoint read from a torch_dist folder
FRAMEWORK = "megatron_torch_dist"
#: the file Megatron's ``dist_checkpointing`` writes first and names its backend in
MARKER = "metadata.json"
#: Megatron-LM's pointer to a run folder's newest checkpoint
LATEST = "latest_checkpointed_iteration.txt"
#: the non-sharded values
COMMON_FILE = "common.pt"
#: sharded keys of Megatron-LM's state dict that belong to neither model nor optimizer
RUN_STATE = ("rng_state", "rerun_state_machine")
#: the largest ``common.pt`` the coordinator decodes
MAX_COMMON_BYTES = 64 << 20
_MAX_MARKER = 64 << 10
_COMMON = "__common__"  # the adapter's name for an entry's non-sharded values (adapters.megatron.COMMON)
_GROUPS = ("model", "optimizer")
_HEAD = re.compile(r"[./]")
_CHAINED = re.compile(r"chained_\d+\.")  # a ChainedOptimizer's (MoE: dense and expert) keys
_CHAIN_STATE = re.compile(r"^optimizer\.chained_\d+\.optimizer\.state\.")


def is_torch_dist(storage: Storage, prefix: str = "") -> bool:
    """(any process; one small read) Whether ``prefix``'s ``metadata.json``
    is Megatron's and names the torch_dist backend."""
    path = f"{prefix}{MARKER}"
    try:
        if storage.size(path) > _MAX_MARKER:
            return False
        doc = json.loads(storage.read_bytes(path))
    except (FileNotFoundError, NotADirectoryError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist"


def folder(storage: Storage) -> str | None:
    """``""`` when ``storage`` is a torch_dist checkpoint folder, ``"iter_NNNNNNN/"``
    (or ``"release/"``) when it is a Megatron-LM run folder whose pointer
    names one, None when it is neither."""
    if is_torch_dist(storage):
        return ""
    try:
        if storage.size(LATEST) > 64:
            return None
        text = storage.read_bytes(LATEST).decode("ascii", "replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None or not is_torch_dist(storage, f"{name}/"):
        return None
    from bytecp.tools.resume import check_pointer

    check_pointer(storage, name, LATEST)  # the run folder's newest checkpoint, whatever its format
    return f"{name}/"


def detect(storage: Storage) -> bool:
    """(the source protocol of :data:`bytecp.interop.SOURCES`) A torch_dist folder or a run folder pointing at one."""
    return folder(storage) is not None


def state_name(key: str) -> str:
    """The name bytecp's Megatron adapter gives torch_dist key ``key`` (module docstring)."""
    if key.startswith("optimizer.") or _CHAINED.match(key):
        return f"optimizer.{key}"
    if _HEAD.split(key, maxsplit=1)[0] in RUN_STATE:
        return key
    return f"model.{key}"


def _plain(v: Any, storage: Storage) -> Any:
    """A value as plain data: tensors read, Megatron's classes as data (:mod:`.pickled_data`)."""
    return pickled_data.as_data(v, lambda t: torch_zip.materialize(storage, t))


def _common(storage: Storage) -> dict[str, Any]:
    """(coordinator) ``common.pt``'s values, through the restricted unpickler."""
    where = f"{storage.url}/{COMMON_FILE}"
    try:
        size = storage.size(COMMON_FILE)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing: a torch_dist checkpoint's non-sharded values (the "
                                     "iteration, the optimizer's param groups) are there") from None
    if size > MAX_COMMON_BYTES:
        raise CorruptCheckpointError(f"{where} is {size} bytes, over the {MAX_COMMON_BYTES} byte budget")
    got = torch_zip.read_torch_file(storage, COMMON_FILE, where=where, allow=pickled_data.ALLOW)
    if not isinstance(got, dict) or not all(isinstance(k, str) for k in got):
        raise CorruptCheckpointError(f"{where} holds a {type(got).__name__}, not Megatron's dict of common values")
    return {k: _plain(v, storage) for k, v in got.items()}


def _unwrapped(storage: Storage, key: str, rec: fmt.ObjectRecord, prefix: str) -> fmt.ObjectRecord:
    """A ShardedObject's value: torch_dist stores ``[data]`` (one ``torch.save``
    per object); the data, inline, read by the restricted unpickler with
    Megatron's classes as data (never ``torch.load``, whose allowlist is the
    process's: ``import megatron.core`` widens it). A value naming any other
    global stays a blob (``allow_pickle=True`` loads it, as stored)."""
    where = f"{storage.url}/{rec.file} (value {key!r})"
    if rec.is_blob:
        assert rec.file is not None
        try:
            value = _plain(torch_zip.read_torch_file(storage, rec.file, start=rec.byte_offset, length=rec.nbytes,
                                                     allow=pickled_data.ALLOW, where=where), storage)
        except torch_zip.RefusedGlobal:
            return dataclasses.replace(rec, file=prefix + rec.file, pickle=True)
    else:
        value = rec.json
    if type(value) is not list or len(value) != 1:
        raise CorruptCheckpointError(f"{where} is a {type(value).__name__}, not the one-element list "
                                     "Megatron's torch_dist strategy stores a ShardedObject's data in")
    return fmt.ObjectRecord(json=value[0])


def _layout(common: dict[Any, Any]) -> str | None:
    """The distributed optimizer's sharding type: its own, or a chain's
    (``{0: {...}, 1: {...}}``) when every member has the same."""
    if "param_state_sharding_type" in common:
        return common["param_state_sharding_type"] if isinstance(common["param_state_sharding_type"], str) else None
    kinds = {_layout(v) if isinstance(v, dict) else None for v in common.values()}
    return kinds.pop() if len(kinds) == 1 else None


def _collapse_chain(names: dict[str, str]) -> bool:
    """A chain's (MoE: dense and expert optimizers) ``fully_reshardable``
    state without the chain index, in place: the model-space names bytecp's
    own saves use whichever optimizer holds a parameter, so it loads into
    any chain (another EP size) the model-space way. False (nothing
    changed) when there is no chain or two names would meet."""
    collapsed = {k: _CHAIN_STATE.sub("optimizer.optimizer.state.", n) for k, n in names.items()}
    if collapsed == names or len(set(collapsed.values())) != len(collapsed):
        return False
    names.update(collapsed)
    return True


def _chain_common(common: dict[Any, Any]) -> dict[str, Any]:
    """A chain's non-parameter state as one optimizer's: the first member's,
    with the param groups of every member (each keeps its identity: the
    adapter gives each optimizer of the loading chain its own)."""
    members = [v for _, v in sorted(common.items(), key=lambda kv: str(kv[0])) if isinstance(v, dict)]
    first = dict(members[0])
    groups = [g for m in members for g in (m.get("optimizer") or {}).get("param_groups", [])]
    first["optimizer"] = {**(first.get("optimizer") or {}), "param_groups": groups}
    first["param_state_sharding_type"] = "fully_reshardable"
    return first


def read(storage: Storage) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator) The checkpoint's tensors under the adapter's names and one
    row per DCP chunk; ``common.pt``'s values inline (module docstring)."""
    prefix = folder(storage)
    if prefix is None:
        raise CorruptCheckpointError(f"{storage.url}: not a Megatron torch_dist checkpoint (no {MARKER} naming "
                                     f"sharded_backend torch_dist, no {LATEST} pointing at one)")
    sub = storage.child(prefix.rstrip("/")) if prefix else storage
    if not sub.exists(dcp.METADATA_FILE):
        raise CorruptCheckpointError(
            f"{sub.url}/{dcp.METADATA_FILE} is missing: {MARKER} says this is a Megatron torch_dist checkpoint, "
            f"whose tensors .metadata describes; the save did not finish or the file was lost")
    common = _common(sub)
    md, rows = dcp.read_dcp_dir(sub)
    opt_common = common.get("optimizer")
    layout = _layout(opt_common) if isinstance(opt_common, dict) else None
    names = {k: state_name(k) for k in (*md.tensors, *md.objects)}
    if layout == "fully_reshardable" and _collapse_chain(names):
        common = {**common, "optimizer": _chain_common(opt_common)}  # type: ignore[arg-type]
    rows = [dataclasses.replace(r, fqn=names[r.fqn], file=prefix + r.file) for r in rows]
    tensors = {names[k]: v for k, v in md.tensors.items()}
    objects = {names[k]: _unwrapped(sub, k, o, prefix) for k, o in md.objects.items()}
    groups: dict[str, list[tuple[str, Node]]] = {g: [] for g in _GROUPS}
    top: list[tuple[str, Node]] = []
    for keys, kind in ((md.tensors, "tensor"), (md.objects, "obj")):
        for key in keys:
            name = names[key]
            group, _, child = name.partition(".") if name != key else ("", "", key)
            (groups[group] if group else top).append((child, Node.leaf(kind, name)))  # type: ignore[arg-type]
    for k, v in common.items():
        if k in _GROUPS and isinstance(v, dict):
            if v:
                objects[f"{k}.{_COMMON}"] = fmt.ObjectRecord(json=v)
                groups[k].append((_COMMON, Node.leaf("obj", f"{k}.{_COMMON}")))
        else:
            objects[k] = fmt.ObjectRecord(json=v)
            top.append((k, Node.leaf("obj", k)))
    skeleton = Node.container("dict", [*((g, Node.container("dict", items)) for g, items in groups.items() if items),
                                       *top])
    iteration = common.get("iteration")
    meta = fmt.Metadata(
        save_id=md.save_id, world_size=md.world_size, framework=FRAMEWORK,
        parallelism={"optimizer_layout": {"optimizer": layout}} if isinstance(layout, str) else {},
        skeleton=skeleton, tensors=tensors, objects=objects, per_rank={}, index_files=[],
        data_files={prefix + f: n for f, n in md.data_files.items()},
        step=iteration if type(iteration) is int else None,
        user_metadata={"megatron_folder": prefix.rstrip("/"), "dcp_version": md.user_metadata.get("dcp_version", "")},
    )
    return meta, rows
