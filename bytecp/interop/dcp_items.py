"""The pieces of :mod:`bytecp.interop.dcp`: DCP's ``.metadata`` unpickled
into inert stand-ins and checked, its storage items located, its tensor
chunks found inside their ``torch.save`` archives, its values decoded, and
its state tree rebuilt from ``planner_data``.

Called by :func:`bytecp.interop.dcp.read_dcp_dir` only (the coordinator of
a load); every refusal is one line naming the file and the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bytecp.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    PickleNotAllowedError,
)
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.interop import torch_zip
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import SUPPORTED_DTYPES, dtype_name
from bytecp.tree.skeleton import Node
from bytecp.tree.state import is_json_leaf

__all__ = ["MAX_VALUE_BYTES", "Item", "bad", "read_metadata", "storage_items", "tensor_entry", "locate_chunks",
           "read_value", "skeleton", "save_id", "world_size", "version"]

#: the largest non-tensor value (a ``torch.save`` blob) the coordinator decodes
MAX_VALUE_BYTES = 1 << 30
_FILE = re.compile(r"[A-Za-z0-9._-]+\.distcp")
_RANK = re.compile(r"__(\d+)_")
_MD = "torch.distributed.checkpoint.metadata."
_DCP_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta")

#: (key, chunk offsets; None for a value) -> (file, offset, length)
Item = tuple[str, int, int]


class _Record:
    """An inert stand-in for one of DCP's metadata classes: its pickled fields, nothing run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        else:
            self.state = state


#: the save plans Megatron-Core's torch_dist strategy keeps in ``.metadata`` (``all_local_plans``): read, never used
_PLAN_CLASSES = ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
_STANDINS: dict[str, type[_Record]] = {n: type(n, (_Record,), {})
                                       for n in (*_DCP_CLASSES, *_PLAN_CLASSES, "_StorageInfo")}


def _path(*parts: Any) -> str:
    """``pathlib`` paths (``StorageMeta.checkpoint_id``) as plain text."""
    return "/".join(str(p) for p in parts)


_ALLOW: dict[str, Any] = {
    **{_MD + n: _STANDINS[n] for n in _DCP_CLASSES},
    **{f"torch.distributed.checkpoint.planner.{n}": _STANDINS[n] for n in _PLAN_CLASSES},
    **{f"torch.distributed._shard.sharded_tensor.metadata.{n}": _STANDINS[n] for n in ("TensorProperties",)},
    _MD + "_MEM_FORMAT_ENCODING": lambda v: v,
    "torch.distributed.checkpoint.filesystem._StorageInfo": _STANDINS["_StorageInfo"],
    **{f"pathlib.{n}": _path for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
}


def bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the DCP checkpoint is corrupt or was tampered with")


def _unsupported(where: str, what: str) -> FormatVersionError:
    return FormatVersionError(f"{where}: {what}, which bytecp does not read; load it with "
                              "torch.distributed.checkpoint.load")


def _is(v: Any, name: str) -> bool:
    return isinstance(v, _STANDINS[name])


def _ints(v: Any) -> tuple[int, ...] | None:
    """A tuple (``torch.Size``) of non-negative ints, else None."""
    if not isinstance(v, (tuple, list)) or len(v) > limits.MAX_NDIM or not all(type(x) is int and x >= 0 for x in v):
        return None
    return tuple(v)


def read_metadata(storage: Storage, where: str) -> Any:
    """``.metadata`` through the restricted unpickler (DCP's classes as stand-ins), within the budget."""
    try:
        size = storage.size(".metadata")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} is missing: {storage.url} is not a DCP checkpoint") from None
    if size > torch_zip.MAX_PICKLE_BYTES:
        raise bad(where, f"is {size} bytes, over the {torch_zip.MAX_PICKLE_BYTES} byte budget")
    md = torch_zip.restricted_loads(storage.read_bytes(".metadata"), where, _ALLOW)
    if not _is(md, "Metadata") or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise bad(where, f"holds a {type(md).__name__}, not DCP's Metadata")
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise _unsupported(where, "has no storage_data (a storage writer other than FileSystemWriter?)")
    return md


def storage_items(md: Any, where: str, sizes: dict[str, int]) -> dict[tuple[str, tuple[int, ...] | None], Item]:
    """Every storage item: its key and chunk offsets -> (file, offset, length), each inside its file."""
    out: dict[tuple[str, tuple[int, ...] | None], Item] = {}
    for index, info in md.storage_data.items():
        fqn, off = getattr(index, "fqn", None), getattr(index, "offset", None)
        offsets = None if off is None else _ints(off)
        if not _is(index, "MetadataIndex") or not isinstance(fqn, str) or (off is not None and offsets is None):
            raise bad(where, f"has a malformed storage index {vars(index) if isinstance(index, _Record) else index!r:.80}")
        if not _is(info, "_StorageInfo"):
            raise bad(where, f"describes the storage of {fqn!r} as {type(info).__name__}")
        file, start, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if getattr(info, "transform_descriptors", None):
            raise _unsupported(where, f"stores {fqn!r} through the transforms "
                                      f"{list(info.transform_descriptors)[:4]!r:.80} (compressed?)")
        if not isinstance(file, str) or not _FILE.fullmatch(file):
            raise bad(where, f"places {fqn!r} in the file {file!r:.80} (want a plain NAME.distcp)")
        if file not in sizes:
            raise CorruptCheckpointError(f"{where}: {fqn!r} is stored in {file}, which is missing")
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise bad(where, f"gives {fqn!r} the byte range {start!r:.20}+{length!r:.20}")
        if start + length > sizes[file]:
            raise CorruptCheckpointError(f"{storage_where(where, file)} is truncated: {fqn!r} lies at bytes "
                                         f"[{start}, {start + length}), the file has {sizes[file]}")
        out[(fqn, offsets)] = (file, start, length)
    return out


def storage_where(where: str, file: str) -> str:
    return f"{where.rsplit('/', 1)[0]}/{file}"


def tensor_entry(where: str, key: str, entry: Any
                 ) -> tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(dtype name, global shape, chunks as (offsets, sizes)) of one tensor, checked."""
    if not _is(entry, "TensorStorageMetadata"):
        raise bad(where, f"describes {key!r} as {type(entry).__name__}")
    props = getattr(entry, "properties", None)
    state = getattr(props, "state", None)
    dtype = state[0] if isinstance(state, tuple) and state else getattr(props, "dtype", None)
    layout = state[1] if isinstance(state, tuple) and len(state) > 1 else getattr(props, "layout", torch.strided)
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES.values():
        raise bad(where, f"gives tensor {key!r} the dtype {dtype!r:.40}")
    if layout is not torch.strided:
        raise _unsupported(where, f"stores tensor {key!r} with the layout {layout}")
    shape = _ints(getattr(entry, "size", None))
    if shape is None:
        raise bad(where, f"gives tensor {key!r} the shape {getattr(entry, 'size', None)!r:.80}")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        raise bad(where, f"gives tensor {key!r} no list of chunks")
    boxes, volume = [], 0
    for c in chunks:
        offsets, sizes = _ints(getattr(c, "offsets", None)), _ints(getattr(c, "sizes", None))
        if (not _is(c, "ChunkStorageMetadata") or offsets is None or sizes is None or len(offsets) != len(shape)
                or len(sizes) != len(shape) or any(o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True))):
            raise bad(where, f"gives tensor {key!r} {list(shape)} a chunk outside it")
        boxes.append((offsets, sizes))
        volume += math.prod(sizes)
    if volume != math.prod(shape) or len({b[0] for b in boxes}) != len(boxes):
        raise bad(where, f"gives tensor {key!r} {list(shape)} chunks that do not tile it ({volume} elements)")
    return dtype_name(dtype), shape, boxes


def _locate(storage: Storage, chunk: tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], Item]
            ) -> fmt.ChunkRecord:
    key, dtype, shape, offsets, lengths, (file, start, length) = chunk
    where = f"{storage.url}/{file} (tensor {key!r}, chunk {list(offsets)})"
    try:
        t = torch_zip.read_torch_file(storage, file, start=start, length=length, where=where)
    except CorruptCheckpointError:
        head = storage.read_bytes(file, 0, 9)
        if len(head) == 9 and head[8:9] == b"{":  # a safetensors file: u64 header length, then JSON
            raise _unsupported(f"{storage.url}/{file}", "is written with serialization_format=SAFETENSORS") from None
        raise
    if not isinstance(t, torch_zip.StoredTensor):
        raise bad(where, f"holds a {type(t).__name__}, not a tensor")
    if t.dtype != dtype or t.shape != lengths:
        raise bad(where, f"holds a {t.dtype} {list(t.shape)} tensor, .metadata says {dtype} {list(lengths)}")
    if not t.contiguous:
        raise _unsupported(where, f"holds a tensor that is not dense (stride {list(t.stride)})")
    return fmt.ChunkRecord(key, dtype, shape, offsets, lengths, file, t.data_offset, t.nbytes, 0)


def locate_chunks(storage: Storage, chunks: Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...],
                                                          tuple[int, ...], Item]]) -> list[fmt.ChunkRecord]:
    """One row per chunk, its bytes found inside its archive (headers only, read in parallel)."""
    if len(chunks) <= 1:
        return [_locate(storage, c) for c in chunks]
    with ThreadPoolExecutor(min(16, len(chunks)), thread_name_prefix="bytecp-dcp") as pool:
        return list(pool.map(lambda c: _locate(storage, c), chunks))


def read_value(storage: Storage, key: str, item: Item) -> fmt.ObjectRecord:
    """A non-tensor value: inline when it is JSON, else its blob (checksummed now; an
    arbitrary pickle is marked so only ``allow_pickle=True`` loads it)."""
    file, start, length = item
    where = f"{storage.url}/{file} (value {key!r})"
    if length > MAX_VALUE_BYTES:
        raise bad(where, f"is {length} bytes, over the {MAX_VALUE_BYTES} byte budget")
    blob = storage.read_bytes(file, start, length)
    if len(blob) != length:
        raise CorruptCheckpointError(f"{where} is cut short: the file is truncated")
    try:
        value = limits.load_blob(blob, where, safe=True)
    except PickleNotAllowedError:
        return fmt.ObjectRecord(file=file, byte_offset=start, nbytes=length, crc32c=crc32c(blob), pickle=True)
    if is_json_leaf(value):
        return fmt.ObjectRecord(json=value)
    return fmt.ObjectRecord(file=file, byte_offset=start, nbytes=length, crc32c=crc32c(blob))


def _nest(paths: dict[str, tuple[Any, ...]], kinds: dict[str, str]) -> Node | None:
    """The tree of ``paths`` (key -> path in the state dict), or None when they conflict."""
    root: dict[Any, Any] = {}
    for key, path in paths.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return None
        if path[-1] in node:
            return None
        node[path[-1]] = key

    def build(d: dict[Any, Any]) -> Node:
        items = [(k, build(v) if isinstance(v, dict) else Node.leaf(kinds[v], v)) for k, v in d.items()]  # type: ignore[arg-type]
        if items and all(type(k) is int for k, _ in items) and sorted(k for k, _ in items) == list(range(len(items))):
            return Node.container("list", sorted(items, key=lambda kv: kv[0]))
        return Node.container("dict", items)

    return build(root)


def skeleton(md: Any, where: str, tensors: dict[str, Any], objects: dict[str, Any]) -> Node:
    """The state tree from ``planner_data`` (DCP's paths of its flattened keys);
    a flat dict of the keys when it is absent or does not fit them."""
    kinds = {**{k: "tensor" for k in tensors}, **{k: "obj" for k in objects}}
    planner = getattr(md, "planner_data", None)
    paths: dict[str, tuple[Any, ...]] = {}
    if isinstance(planner, dict):
        for key in kinds:
            p = planner.get(key)
            if (not isinstance(p, tuple) or not p or len(p) > limits.MAX_SKELETON_DEPTH
                    or not all(type(x) in (str, int) for x in p) or ".".join(map(str, p)) != key):
                break
            paths[key] = p
    tree = _nest(paths, kinds) if len(paths) == len(kinds) else None
    return tree if tree is not None else Node.container("dict", [(k, Node.leaf(v, k)) for k, v in kinds.items()])  # type: ignore[arg-type]


def save_id(md: Any) -> str:
    sid = getattr(getattr(md, "storage_meta", None), "save_id", None)
    return sid if isinstance(sid, str) and sid else "dcp"


def version(md: Any) -> str:
    v = getattr(md, "version", None)
    return v if isinstance(v, str) else ""


def world_size(sizes: dict[str, int]) -> int:
    """The ranks that wrote the files (``__<rank>_<n>.distcp``), at least 1."""
    ranks = [int(m.group(1)) for f in sizes if (m := _RANK.match(f))]
    return min(max(ranks, default=0) + 1, 1 << 20)
