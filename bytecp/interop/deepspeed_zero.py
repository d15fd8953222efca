"""A DeepSpeed ZeRO checkpoint (``engine.save_checkpoint``) read as a bytecp
checkpoint, without conversion and without DeepSpeed installed.

What DeepSpeed writes, per tag folder (``<dir>/global_stepN/``; the root
``<dir>`` names its newest tag in ``latest``):

- ZeRO 1/2: ``mp_rank_00_model_states.pt`` (the module's tensors in their
  saved dtype, ``param_shapes``, the engine's counters and scheduler) and,
  per data-parallel rank ``r``, ``[bf16_]zero_pp_rank_r_mp_rank_00_optim_states.pt``:
  per parameter group ``g`` this rank's flat fp32 partition
  (``single_partition_of_fp32_groups[g]``) and the wrapped optimizer's state
  shaped like it (``exp_avg``, ``exp_avg_sq``). The group's parameters lie
  one after the other (each followed by its ``param_alignment_paddings``) in
  the concatenation of the ranks' partitions, as ``zero_to_fp32`` cuts them.
- ZeRO 3: ``zero_pp_rank_r_mp_rank_00_{model,optim}_states.pt``; the module
  holds no parameter data. Each parameter has ``ceil(numel / W)`` elements on
  every rank, at the same offset of the concatenation of that rank's
  ``fp32_flat_groups``; its elements ``[r*n, (r+1)*n)`` are rank ``r``'s, the
  last rank's tail is padding.

So every parameter's master weights and moments are byte ranges of the
partition files: each becomes a few :class:`~bytecp.format.metadata.ChunkRecord`
rows (one per contiguous box of the parameter), and a load reads only the
ranges each rank needs. The names are those of bytecp's DeepSpeed adapter
(:mod:`bytecp.interop.deepspeed_common`); at ZeRO 3 the model's weights are
the fp32 masters (cast on load where the model is bf16 or fp16).

The files are read with small ranged reads and a restricted unpickler
(:func:`bytecp.interop.deepspeed_common.parse`): no code in them runs. Every
size, shape and offset is checked against the files; each refusal is one
line naming the file (and the tensor). Pipeline- and tensor-parallel
checkpoints (``mp_rank_01``) are refused: ``ds_to_universal`` merges them
(:mod:`bytecp.interop.deepspeed_universal`).

Who calls what: :func:`bytecp.interop.find_source` (the coordinator of a load
whose URL has no ``metadata.json``; :mod:`bytecp.interop.runs` for a run
folder's ``global_stepN``) calls :func:`detect`, then
:func:`bytecp.interop.read_source` calls :func:`read`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.interop import deepspeed_common as dsc
from bytecp.storage_api import Storage

__all__ = ["NAMES", "LATEST", "MODEL_FILE", "OPTIM_FILE", "MAX_FILES", "folder", "detect", "read", "z12_pieces", "z3_pieces"]

#: names are bytecp's DeepSpeed adapter's, matched exactly (not as transformers matches them)
NAMES = "exact"
#: the file in a checkpoint root naming its newest tag
LATEST = "latest"
MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
#: the most files a tag folder may hold (a crafted listing must not size anything)
MAX_FILES = 1 << 16
_TAG = re.compile(r"[A-Za-z0-9._-]{1,255}")

#: (rank, group, first element in the rank's partition of the group, first element of the parameter, count)
Piece = tuple[int, int, int, int, int]


def folder(storage: Storage) -> str | None:
    """``""`` when ``storage`` is a tag folder, ``"<tag>/"`` when it is a root
    whose ``latest`` names one, None when it is neither (names, one small read)."""
    names = storage.list_children("")
    if any(OPTIM_FILE.fullmatch(n) for n in names):
        return ""
    if LATEST not in names or storage.size(LATEST) > 4096:
        return None
    tag = storage.read_bytes(LATEST).decode("utf-8", "replace").strip()
    if not _TAG.fullmatch(tag) or tag in (".", ".."):
        return None
    if not any(OPTIM_FILE.fullmatch(n) for n in storage.list_children(tag)):
        return None
    from bytecp.tools.resume import check_pointer

    check_pointer(storage, tag, LATEST)  # the run folder's newest checkpoint, whatever its format
    return f"{tag}/"


def detect(storage: Storage) -> bool:
    """Whether ``storage`` holds a DeepSpeed ZeRO checkpoint (a tag folder, or a root with ``latest``)."""
    return folder(storage) is not None


def _int(v: Any, where: str, what: str) -> int:
    v = getattr(v, "value", v)  # an allowlisted enum
    if type(v) is not int or v < 0:
        raise dsc.bad(where, f"gives {what} as {v!r:.60}")
    return v


def _files(storage: Storage, prefix: str) -> tuple[dict[str, int], list[str], dict[int, str]]:
    """Sizes of the tag folder's files, its optimizer files by rank and its model files by rank."""
    sizes = {p: s for p, s in storage.file_sizes(prefix.rstrip("/")).items() if "/" not in p[len(prefix):]}
    if len(sizes) > MAX_FILES:
        raise dsc.bad(storage.url + "/" + prefix, f"holds {len(sizes)} files, over the {MAX_FILES} budget")
    optim: dict[int, str] = {}
    model: dict[int, str] = {}
    for p in sizes:
        name = p[len(prefix):]
        m, o = MODEL_FILE.fullmatch(name), OPTIM_FILE.fullmatch(name)
        hit = m or o
        mp = int(hit.group(2)) if hit is not None else 0
        if mp:
            raise ConfigError(f"{storage.url}/{p}: a tensor- or pipeline-parallel DeepSpeed checkpoint (model-parallel "
                              "rank > 0); convert it with deepspeed.checkpoint.ds_to_universal and load that folder")
        if o:
            optim[int(o.group(1))] = p
        elif m:
            model[int(m.group(1) or 0)] = p
    where = storage.url + "/" + prefix
    if not optim or sorted(optim) != list(range(len(optim))):
        raise dsc.bad(where, f"holds optimizer files of ranks {sorted(optim)[:8]} (want 0..W-1)")
    if 0 not in model:
        raise dsc.bad(where, "has no mp_rank_00_model_states.pt (nor zero_pp_rank_0_mp_rank_00_model_states.pt)")
    return sizes, [optim[r] for r in range(len(optim))], model


def z12_pieces(shapes: list[tuple[str, tuple[int, ...]]], parts: list[int], paddings: list[int],
               group: int, where: str) -> dict[str, list[Piece]]:
    """ZeRO 1/2: where each parameter of a group lies in the ranks' partitions
    (``parts[r]`` elements on rank ``r``: DeepSpeed saves them without the
    group's padding, so the last may be shorter), parameters one after the
    other, each followed by its alignment padding, as ``zero_to_fp32`` reads them."""
    starts = [sum(parts[:r]) for r in range(len(parts) + 1)]
    out: dict[str, list[Piece]] = {}
    off = 0
    for i, (name, shape) in enumerate(shapes):
        n = math.prod(shape)
        if off + n > starts[-1]:
            raise dsc.bad(where, f"places parameter {name!r} ({n} elements) at {off}, past the group's "
                                 f"{starts[-1]} elements")
        pieces = []
        for r in range(len(parts)):
            lo, hi = max(off, starts[r]), min(off + n, starts[r + 1])
            if lo < hi:
                pieces.append((r, group, lo - starts[r], lo - off, hi - lo))
        out[name] = pieces
        off += n + paddings[i]
    return out


def z3_pieces(shapes: list[tuple[str, tuple[int, ...]]], groups: list[int], world: int,
              where: str) -> dict[str, list[Piece]]:
    """ZeRO 3: where each parameter's ``ceil(numel / W)`` elements per rank lie
    in the concatenation of every rank's flat groups (of ``groups`` elements)."""
    ends = [sum(groups[: g + 1]) for g in range(len(groups))]
    out: dict[str, list[Piece]] = {}
    off = 0
    for name, shape in shapes:
        n = math.prod(shape)
        each = -(-n // world)
        if off + each > (ends[-1] if ends else 0):
            raise dsc.bad(where, f"places parameter {name!r} ({each} elements a rank) at {off}, past the ranks' "
                                 f"{ends[-1] if ends else 0} elements")
        pieces = []
        for r in range(world):
            first, count = r * each, min(n, (r + 1) * each) - r * each
            pos = off
            while count > 0:  # a piece may cross from one flat group into the next
                g = next(g for g, e in enumerate(ends) if pos < e)
                take = min(count, ends[g] - pos)
                pieces.append((r, g, pos - (ends[g] - groups[g]), first, take))
                pos, first, count = pos + take, first + take, count - take
        out[name] = pieces
        off += each
    return out


def _shapes(ms: Mapping[str, Any], where: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    groups = ms.get("param_shapes")
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise dsc.bad(where, "has no param_shapes (a list of {name: shape})")
    out = []
    for g in groups:
        got = []
        for name, shape in g.items():
            dims = tuple(shape) if isinstance(shape, (list, tuple)) else None
            if not isinstance(name, str) or dims is None or not all(type(d) is int and d >= 0 for d in dims):
                raise dsc.bad(where, f"gives parameter {name!r:.80} the shape {shape!r:.80}")
            got.append((name, dims))
        out.append(got)
    return out


def _tensor(v: Any, where: str, what: str) -> dsc.TensorAt:
    if not isinstance(v, dsc.TensorAt):
        raise dsc.bad(where, f"holds {what} as a {type(v).__name__}, not a tensor")
    return v


def _check_range(t: dsc.TensorAt, sizes: Mapping[str, int], what: str) -> None:
    if t.begin < 0 or t.begin + t.numel * t.itemsize > sizes.get(t.file, -1):
        raise dsc.bad(t.file, f"places {what} ({t.numel} x {t.itemsize} bytes at {t.begin}) outside the file")


def read(storage: Storage) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator) The tag folder's tensors as bytecp metadata and rows (module docstring)."""
    prefix = folder(storage)
    if prefix is None:
        raise dsc.bad(storage.url, "is not a DeepSpeed ZeRO checkpoint folder")
    sizes, optim_files, model_files = _files(storage, prefix)
    model_file = model_files[0]
    ms, *trees = dsc.parse_all(storage, [model_file, *optim_files], sizes)
    if not isinstance(ms, dict) or not isinstance(ms.get("module"), dict):
        raise dsc.bad(model_file, "holds no module state dict")
    shapes = _shapes(ms, model_file)
    world = len(optim_files)
    osds = []
    for f, tree in zip(optim_files, trees, strict=True):
        osd = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
        if not isinstance(osd, dict):
            raise dsc.bad(f, "holds no optimizer_state_dict")
        osds.append(osd)
    stage = _int(osds[0].get("zero_stage"), optim_files[0], "the ZeRO stage")
    counts = osds[0].get("partition_count")
    count = max(counts) if isinstance(counts, list) and counts else counts
    if _int(count, optim_files[0], "the partition count") != world:
        raise dsc.bad(optim_files[0], f"says {count} data-parallel ranks saved, the folder holds {world} optimizer files")
    flat_key, inner_key = ("fp32_flat_groups", "optimizer_state_dict") if stage == 3 else \
        ("single_partition_of_fp32_groups", "base_optimizer_state")
    flats, states = [], []
    for f, osd in zip(optim_files, osds, strict=True):
        fl, inner = osd.get(flat_key), osd.get(inner_key)
        if not isinstance(fl, list) or not isinstance(inner, dict) or not isinstance(inner.get("state"), dict):
            raise dsc.bad(f, f"holds no {flat_key} and {inner_key}")
        flats.append([_tensor(t, f, f"{flat_key}[{g}]") for g, t in enumerate(fl)])
        states.append(inner["state"])
    ngroups = len(flats[0])
    module: dict[str, Any] = ms["module"]
    if stage == 3:
        groups_numel = [t.numel for t in flats[0]]
        pieces = z3_pieces([p for g in shapes for p in g], groups_numel, world, optim_files[0])
        if any([t.numel for t in fl] != groups_numel for fl in flats):
            raise dsc.bad(optim_files[0], "and the other ranks' files hold flat groups of different sizes")
    else:
        if len(shapes) != ngroups:
            raise dsc.bad(model_file, f"lists {len(shapes)} parameter groups, the optimizer files {ngroups}")
        paddings = osds[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
        pieces = {}
        for g, group in enumerate(shapes):
            parts = [fl[g].numel if g < len(fl) else -1 for fl in flats]
            if any(p > parts[0] or (p != parts[0] and r < world - 1) for r, p in enumerate(parts)):
                raise dsc.bad(optim_files[-1], f"and the other ranks' files hold partitions of group {g} of "
                                               f"{parts[:4]} elements (all but the last alike, none longer)")
            pad = [_int(x, optim_files[0], "a padding") for x in paddings[g]] if g < len(paddings) else []
            if len(pad) != len(group):
                raise dsc.bad(optim_files[0], f"gives {len(pad)} alignment paddings for {len(group)} parameters")
            pieces.update(z12_pieces(group, parts, pad, g, optim_files[0]))
    frozen = _frozen(storage, sizes, ms, model_files, world) if stage == 3 else {}
    return _tensors(storage, sizes, ms, module, shapes, pieces, flats, states, osds, stage, world, inner_key,
                    model_file, optim_files, frozen)


def _frozen(storage: Storage, sizes: dict[str, int], ms: dict[str, Any], model_files: dict[int, str],
            world: int) -> dict[str, list[fmt.ChunkRecord]]:
    """ZeRO 3: the rows of each frozen parameter (no optimizer owns it): rank
    ``r``'s model-states file holds its elements ``[r*n, (r+1)*n)``, ``n =
    ceil(numel / W)``, in ``frozen_param_fragments`` (as ``zero_to_fp32`` reads them)."""
    shapes = ms.get("frozen_param_shapes")
    if not isinstance(shapes, dict) or not shapes:
        return {}
    missing = [r for r in range(world) if r not in model_files]
    if missing:
        raise dsc.bad(model_files[0], f"lists frozen parameters, but rank {missing[0]} has no model-states file")
    frags = []
    for r, tree in enumerate([ms, *dsc.parse_all(storage, [model_files[r] for r in range(1, world)], sizes)]):
        f = model_files[r]
        got = tree.get("frozen_param_fragments") if isinstance(tree, dict) else None
        if not isinstance(got, dict):
            raise dsc.bad(f, "holds no frozen_param_fragments for the frozen parameters")
        frags.append((f, got))
    out: dict[str, list[fmt.ChunkRecord]] = {}
    for name, shape in _shapes({"param_shapes": [shapes]}, model_files[0])[0]:
        n = math.prod(shape)
        each, rows = -(-n // world), []
        for r, (f, got) in enumerate(frags):
            t = _tensor(got.get(name), f, f"frozen fragment {name!r}")
            count = max(0, min(n, (r + 1) * each) - r * each)
            if t.numel < count:
                raise dsc.bad(f, f"holds {t.numel} elements of frozen {name!r}, want {count}")
            _check_range(t, sizes, f"frozen fragment {name!r}")
            rows += t.rows(f"model.{name}", shape, r * each, 0, count) if count else []
        out[name] = rows
    return out


def _tensors(storage: Storage, sizes: dict[str, int], ms: dict[str, Any], module: dict[str, Any],
             shapes: list[list[tuple[str, tuple[int, ...]]]], pieces: dict[str, list[Piece]],
             flats: list[list[dsc.TensorAt]], states: list[dict[Any, Any]], osds: list[dict[str, Any]],
             stage: int, world: int, inner_key: str, model_file: str, optim_files: list[str],
             frozen: dict[str, list[fmt.ChunkRecord]]) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """The rows of the model (``frozen``: ZeRO-3's frozen parameters' own rows),
    the masters and every state tensor, and the metadata."""
    tensors: dsc.Tensors = {}
    rows: list[fmt.ChunkRecord] = []
    for t in [t for fl in flats for t in fl]:
        _check_range(t, sizes, "a flat partition")

    def add(fqn: str, t: dsc.TensorAt, got: list[fmt.ChunkRecord]) -> None:
        tensors[fqn] = (t.dtype, got[0].global_shape if got else t.shape)
        rows.extend(got)

    def partitioned(fqn: str, name: str, shape: tuple[int, ...], of: Any) -> None:
        """Tensor ``fqn`` of ``shape`` from parameter ``name``'s pieces of the
        flat tensors ``of(rank, group)``."""
        got: list[fmt.ChunkRecord] = []
        dtype = "float32"
        for r, g, first, start, n in pieces[name]:
            t = of(r, g)
            if first + n > t.numel:
                raise dsc.bad(t.file, f"holds {t.numel} elements of group {g}, too few for {name!r} ({first}+{n})")
            got += t.rows(fqn, shape, start, first, n)
            dtype = t.dtype
        tensors[fqn] = (dtype, shape)
        rows.extend(got)

    keys: dict[str, dict[str, Any]] = {}
    names = [[n for n, _ in g] for g in shapes]
    shape_of = {n: s for g in shapes for n, s in g}
    model_dtype = {}
    for name, v in module.items():
        t = _tensor(v, model_file, f"module tensor {name!r}")
        model_dtype[name] = t.dtype
        if name in frozen:  # ZeRO 3 saves the module's parameters empty
            add(f"model.{name}", t, frozen[name])
            continue
        if name in shape_of and (stage == 3 or t.shape != shape_of[name]):
            if stage != 3:
                raise dsc.bad(model_file, f"holds {name!r} of shape {t.shape}, param_shapes says {shape_of[name]}")
            continue  # ZeRO 3: the weights are the masters, below
        _check_range(t, sizes, f"module tensor {name!r}")
        add(f"model.{name}", t, t.whole(f"model.{name}"))
    def fp32_of(r: int, g: int) -> dsc.TensorAt:
        return flats[r][g]

    for name, shape in shape_of.items():
        if stage == 3:
            partitioned(f"model.{name}", name, shape, fp32_of)
        if model_dtype.get(name, "float32") != "float32":
            partitioned(f"optimizer.state.{name}.fp32", name, shape, fp32_of)
    for g, group in enumerate(names):
        got = [s.get(g) for s in states]
        st: list[dict[Any, Any]] = [x for x in got if isinstance(x, dict)]
        if len(st) != len(got):
            continue  # no state yet (saved before the first step)
        for k, v in st[0].items():
            if not isinstance(k, str):
                raise dsc.bad(optim_files[0], f"holds optimizer state key {k!r:.40}")
            if isinstance(v, dsc.TensorAt) and v.shape == flats[0][g].shape and v.shape:
                per = [_tensor(x.get(k), f, f"{inner_key} state {g}.{k}") for x, f in zip(st, optim_files, strict=True)]
                for r, t in enumerate(per):
                    _check_range(t, sizes, f"optimizer state {k!r} of group {g}")
                    if len(t.shape) != 1 or t.numel < flats[r][g].numel:  # the last rank's keeps the padding
                        raise dsc.bad(t.file, f"holds state {k!r} of group {g} of shape {t.shape}, smaller than "
                                              f"its partition's {flats[r][g].numel} elements")
                for name in group:
                    partitioned(f"optimizer.state.{name}.{k}", name, shape_of[name], lambda r, _g, per=per: per[r])
                    keys.setdefault(name, {})[k] = dsc.TENSOR
            elif isinstance(v, dsc.TensorAt):
                _check_range(v, sizes, f"optimizer state {k!r} of group {g}")
                for name in group:
                    add(f"optimizer.state.{name}.{k}", v, v.whole(f"optimizer.state.{name}.{k}"))
                    keys.setdefault(name, {})[k] = dsc.TENSOR
            else:
                for name in group:
                    keys.setdefault(name, {})[k] = dsc.plain(v)
    for name in shape_of:
        if f"optimizer.state.{name}.fp32" in tensors:
            keys.setdefault(name, {})["fp32"] = dsc.TENSOR
    inner = osds[0].get(inner_key)
    groups = dsc.param_groups(inner.get("param_groups") if isinstance(inner, dict) else None, names, optim_files[0])
    engine = dsc.engine_values(ms, osds[0].get("loss_scaler"))
    shared = ms.get("shared_params")
    aliases = {f"model.{a}": f"model.{b}" for a, b in shared.items()
               if isinstance(a, str) and isinstance(b, str) and f"model.{b}" in tensors
               and f"model.{a}" not in tensors} if isinstance(shared, dict) else {}
    parallelism = {"world_size": world, "data_parallel": world, "zero_stage": stage}
    return dsc.build_metadata(tensors, rows, sizes, keys=keys, groups=groups, engine=engine, aliases=aliases,
                              parallelism=parallelism, save_id=f"deepspeed:{model_file.rsplit('/', 1)[0]}")
