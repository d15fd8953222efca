"""A DeepSpeed universal checkpoint (``ds_to_universal`` output) read as a
bytecp checkpoint, without DeepSpeed installed.

What ``python -m deepspeed.checkpoint.ds_to_universal`` writes (the folder
``<dir>/global_stepN_universal/``; the root ``<dir>`` names it in
``latest_universal``):

- ``zero/<param name>/<key>.pt`` for each parameter: ``fp32`` (the master
  weights), ``exp_avg``, ``exp_avg_sq`` (each ``{"param": full tensor,
  "cat_dim": ...}``) and ``step`` (a bare 0-dim tensor), whatever the
  parallelism that saved them (tensor-parallel slices merged);
- ``zero/optimizer_state.pt``: the wrapped optimizer's param groups and the
  loss scaler;
- ``mp_rank_XX_model_states.pt``: the module's tensors in their saved dtype
  (empty at ZeRO 3), ``param_shapes``, the engine's counters and scheduler.

Each full tensor is one :class:`~bytecp.format.metadata.ChunkRecord` row
naming its file and byte range; the names are those of bytecp's DeepSpeed
adapter (:mod:`bytecp.interop.deepspeed_common`): ``model.<name>`` from the
module (or the fp32 masters where the module holds none),
``optimizer.state.<name>.<key>`` (``fp32`` only where the model is not
fp32), ``optimizer.param_groups``, ``engine.*``. Files are parsed with the
restricted unpickler (no code runs) and every range checked.

Who calls what: :func:`bytecp.interop.find_source` (the coordinator of a
load whose URL has no ``metadata.json``) calls :func:`detect`, then
:func:`bytecp.interop.read_source` calls :func:`read`.
"""

from __future__ import annotations

import re
from typing import Any

from bytecp.format import metadata as fmt
from bytecp.interop import deepspeed_common as dsc
from bytecp.storage_api import Storage

__all__ = ["NAMES", "LATEST", "ZERO", "OPTIMIZER_FILE", "folder", "detect", "read"]

#: names are bytecp's DeepSpeed adapter's, matched exactly
NAMES = "exact"
#: the file in a checkpoint root naming its newest universal folder
LATEST = "latest_universal"
ZERO = "zero"
OPTIMIZER_FILE = "zero/optimizer_state.pt"
_MODEL_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_KEY_FILE = re.compile(r"([A-Za-z0-9_]{1,64})\.pt")
_TAG = re.compile(r"[A-Za-z0-9._-]{1,255}")


def folder(storage: Storage) -> str | None:
    """``""`` when ``storage`` is a universal folder, ``"<tag>/"`` when it is a
    root whose ``latest_universal`` names one, None otherwise."""
    if storage.exists(OPTIMIZER_FILE):
        return ""
    if not storage.exists(LATEST) or storage.size(LATEST) > 4096:
        return None
    tag = storage.read_bytes(LATEST).decode("utf-8", "replace").strip()
    if not _TAG.fullmatch(tag) or tag in (".", ".."):
        return None
    return f"{tag}/" if storage.exists(f"{tag}/{OPTIMIZER_FILE}") else None


def detect(storage: Storage) -> bool:
    """Whether ``storage`` holds a universal checkpoint (or a root naming one)."""
    return folder(storage) is not None


def _full(storage: Storage, file: str, tree: Any) -> dsc.TensorAt:
    """The tensor of a ``zero/<name>/<key>.pt`` file (parsed: ``tree``): ``{"param": tensor}`` or the tensor itself."""
    t = tree.get("param") if isinstance(tree, dict) else tree
    if not isinstance(t, dsc.TensorAt):
        raise dsc.bad(f"{storage.url}/{file}", "holds no tensor (want {'param': tensor} or a tensor)")
    return t


def read(storage: Storage) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator) The universal folder's tensors as bytecp metadata and one row per tensor."""
    prefix = folder(storage)
    if prefix is None:
        raise dsc.bad(storage.url, "is not a DeepSpeed universal checkpoint folder")
    sizes = storage.file_sizes(prefix.rstrip("/"))
    model_files = sorted(p for p in sizes if "/" not in p[len(prefix):] and _MODEL_FILE.fullmatch(p[len(prefix):]))
    if not model_files:
        raise dsc.bad(storage.url + "/" + prefix, "has no mp_rank_XX_model_states.pt")
    ms = dsc.parse(storage, model_files[0], sizes[model_files[0]])
    if not isinstance(ms, dict) or not isinstance(ms.get("module"), dict):
        raise dsc.bad(model_files[0], "holds no module state dict")
    groups = ms.get("param_shapes")
    groups = [groups] if isinstance(groups, dict) else groups
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise dsc.bad(model_files[0], "has no param_shapes (a list of {name: shape})")
    names = [[str(n) for n in g] for g in groups]
    shape_of = {str(n): tuple(s) for g in groups for n, s in g.items()}
    tensors: dsc.Tensors = {}
    rows: list[fmt.ChunkRecord] = []

    def add(fqn: str, t: dsc.TensorAt, shape: tuple[int, ...]) -> None:
        if t.shape != shape:
            raise dsc.bad(f"{storage.url}/{t.file}", f"holds {fqn!r} of shape {t.shape}, param_shapes says {shape}")
        if t.begin < 0 or t.begin + t.numel * t.itemsize > sizes.get(t.file, -1):
            raise dsc.bad(f"{storage.url}/{t.file}", f"places {fqn!r} outside the file (truncated?)")
        tensors[fqn] = (t.dtype, shape)
        rows.extend(t.whole(fqn))

    module_dtype: dict[str, str] = {}
    for name, v in ms["module"].items():
        if not isinstance(v, dsc.TensorAt):
            raise dsc.bad(f"{storage.url}/{model_files[0]}", f"holds module entry {name!r:.80} as {type(v).__name__}")
        module_dtype[name] = v.dtype
        if v.numel or not shape_of.get(name):  # ZeRO 3 leaves the parameters empty: the masters stand for them
            add(f"model.{name}", v, shape_of.get(name, v.shape))
    keys: dict[str, dict[str, Any]] = {}
    per_name = {}
    for name in shape_of:
        base = f"{prefix}{ZERO}/{name}/"
        per_name[name] = sorted(p for p in sizes if p.startswith(base) and _KEY_FILE.fullmatch(p[len(base):]))
        if f"{base}fp32.pt" not in per_name[name]:
            raise dsc.bad(f"{storage.url}/{base}", f"has no fp32.pt for parameter {name!r}")
    every = [f for files in per_name.values() for f in files]
    trees = dict(zip(every, dsc.parse_all(storage, every, sizes), strict=True))  # a few requests each: at once
    for name, shape in shape_of.items():
        base = f"{prefix}{ZERO}/{name}/"
        state: dict[str, Any] = {}
        for f in per_name[name]:
            key = f[len(base):-len(".pt")]
            t = _full(storage, f, trees[f])
            if key == "fp32":
                if f"model.{name}" not in tensors:
                    add(f"model.{name}", t, shape)
                if module_dtype.get(name, "float32") == "float32":
                    continue  # the model's own weights
            add(f"optimizer.state.{name}.{key}", t, () if key == "step" else shape)
            state[key] = dsc.TENSOR
        keys[name] = state
    opt = dsc.parse(storage, prefix + OPTIMIZER_FILE, sizes.get(prefix + OPTIMIZER_FILE))
    if not isinstance(opt, dict):
        raise dsc.bad(f"{storage.url}/{prefix}{OPTIMIZER_FILE}", "holds no optimizer state dict")
    return dsc.build_metadata(
        tensors, rows, sizes, keys=keys, groups=dsc.param_groups(opt.get("param_groups"), names, OPTIMIZER_FILE),
        engine=dsc.engine_values(ms, opt.get("loss_scaler")), aliases={},
        parallelism={"world_size": 1, "universal": True}, save_id=f"deepspeed-universal:{prefix or '.'}")
