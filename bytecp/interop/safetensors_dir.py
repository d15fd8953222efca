"""A Hugging Face checkpoint directory read as a bytecp checkpoint, without
conversion: its safetensors headers become bytecp metadata and index rows.

A transformers directory holds one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard). A
safetensors file is ``u64 header_len | JSON header | data``; the header gives
each tensor's dtype, shape and ``data_offsets`` (relative to the data). Each
tensor becomes one :class:`~bytecp.format.metadata.ChunkRecord` (the whole
tensor, one box) whose file is the shard and whose ``byte_offset`` is
``8 + header_len + data_offsets[0]``, so the normal load pipeline plans and
reads only the byte ranges each rank needs.

Headers are hostile input, held to a budget as bytecp's own index is
(:mod:`bytecp.format.limits`): the index JSON and each header at most
:data:`MAX_HEADER_BYTES` and inside the file; file names plain; every dtype
known, every shape at most :data:`~bytecp.format.limits.MAX_NDIM`
non-negative integers; every byte range inside the file's data, of exactly
``prod(shape) * itemsize`` bytes, and no two overlapping. Every refusal is a
one-line :class:`~bytecp.errors.CorruptCheckpointError` naming the file and
the tensor.

Who calls what: :func:`bytecp.loading.opened.open_checkpoint` (the
coordinator of a load, ``load_state_dict``) calls :func:`is_hf_dir` when a
URL has no ``metadata.json``, then :func:`read_hf_dir`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import SUPPORTED_DTYPES
from bytecp.tree.skeleton import Node

__all__ = ["SINGLE_FILE", "INDEX_FILE", "CONFIG_FILE", "FRAMEWORK", "DTYPES", "MAX_HEADER_BYTES", "is_hf_dir", "read_hf_dir"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
#: ``Metadata.framework`` of a checkpoint read from a Hugging Face directory
FRAMEWORK = "huggingface"
#: the largest header (or index JSON) read; safetensors itself refuses headers over 100 MB
MAX_HEADER_BYTES = 100 << 20

#: safetensors dtype -> bytecp dtype name
DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]+\.safetensors")


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the Hugging Face checkpoint is corrupt or was tampered with")


def is_hf_dir(storage: Storage) -> bool:
    """Whether ``storage`` holds a transformers checkpoint (and, the caller
    knows, no ``metadata.json``)."""
    return storage.exists(INDEX_FILE) or storage.exists(SINGLE_FILE)


def _shard_files(storage: Storage) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files, and the index's ``weight_map`` (None: one file)."""
    if not storage.exists(INDEX_FILE):
        return [SINGLE_FILE], None
    where = f"{storage.url}/{INDEX_FILE}"
    size = storage.size(INDEX_FILE)
    if size > MAX_HEADER_BYTES:
        raise _bad(where, f"is {size} bytes, over the {MAX_HEADER_BYTES} byte budget")
    try:
        doc = json.loads(storage.read_bytes(INDEX_FILE))
    except (ValueError, RecursionError) as e:
        raise _bad(where, f"is not JSON ({str(e)[:80]})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise _bad(where, "has no weight_map of tensor names to file names")
    for name, f in wm.items():
        if not _FILE_NAME.fullmatch(f) or f in (".", ".."):
            raise _bad(where, f"maps tensor {name!r} to the file name {f[:80]!r} (want a plain NAME.safetensors)")
    return sorted(set(wm.values())), wm


def _header(storage: Storage, file: str) -> tuple[dict[str, Any], int, int]:
    """The parsed header of ``file``, where its data starts, and the file's size."""
    where = f"{storage.url}/{file}"
    try:
        size = storage.size(file)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing (named by {INDEX_FILE})") from None
    if size < 8:
        raise _bad(where, f"has {size} bytes, too few for a safetensors header")
    (n,) = struct.unpack("<Q", storage.read_bytes(file, 0, 8))
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise _bad(where, f"declares a {n} byte header (the file has {size} bytes, the budget is {MAX_HEADER_BYTES})")
    try:
        header = json.loads(storage.read_bytes(file, 8, n))
    except (ValueError, RecursionError) as e:
        raise _bad(where, f"has a header that is not JSON ({str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise _bad(where, "has a header that is not a JSON object")
    return header, 8 + n, size


def _tensor(where: str, name: str, info: Any, data_start: int, size: int) -> tuple[str, list[int], int, int]:
    """(bytecp dtype, shape, absolute begin, nbytes) of one header entry, checked."""
    if not isinstance(info, dict):
        raise _bad(where, f"describes tensor {name!r} as {info!r:.60}")
    dtype = DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None or dtype not in SUPPORTED_DTYPES:
        raise _bad(where, f"gives tensor {name!r} the unknown dtype {info.get('dtype')!r:.40}")
    shape, offs = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > limits.MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(where, f"gives tensor {name!r} the shape {shape!r:.80}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
        raise _bad(where, f"gives tensor {name!r} the data_offsets {offs!r:.80}")
    begin, end = offs
    if not 0 <= begin <= end or data_start + end > size:
        raise _bad(where, f"places tensor {name!r} at data bytes [{begin}, {end}), outside the file's "
                          f"{size - data_start} data bytes")
    nbytes = math.prod(shape) * SUPPORTED_DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise _bad(where, f"gives tensor {name!r} ({dtype} {shape}) {end - begin} bytes, want {nbytes}")
    return dtype, shape, data_start + begin, nbytes


def _tied(storage: Storage) -> bool:
    """Whether ``config.json`` says the output embedding is tied to the input
    one (absent or unreadable: not tied, as nothing says so)."""
    try:
        if storage.size(CONFIG_FILE) > MAX_HEADER_BYTES:
            return False
        cfg = json.loads(storage.read_bytes(CONFIG_FILE))
    except (FileNotFoundError, ValueError, RecursionError):
        return False
    return isinstance(cfg, dict) and cfg.get("tie_word_embeddings") is True


def read_hf_dir(storage: Storage) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator) The directory's headers as bytecp metadata and one
    whole-tensor row per tensor, every size checked (module docstring)."""
    files, weight_map = _shard_files(storage)
    tensors: dict[str, dict[str, Any]] = {}
    rows: list[fmt.ChunkRecord] = []
    sizes: dict[str, int] = {}
    for file in files:
        where = f"{storage.url}/{file}"
        header, data_start, size = _header(storage, file)
        sizes[file] = size
        spans: list[tuple[int, int, str]] = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise _bad(where, f"holds tensor {name!r} a second time")
            if weight_map is not None and weight_map.get(name) != file:
                raise _bad(where, f"holds tensor {name!r}, which {INDEX_FILE} places in {weight_map.get(name)!r}")
            dtype, shape, begin, nbytes = _tensor(where, name, info, data_start, size)
            tensors[name] = {"dtype": dtype, "shape": shape}
            spans.append((begin, nbytes, name))
            rows.append(fmt.ChunkRecord(name, dtype, tuple(shape), (0,) * len(shape), tuple(shape),
                                        file, begin, nbytes, 0))
        spans.sort()
        for (b0, n0, a), (b1, _, b) in zip(spans, spans[1:], strict=False):
            if b0 + n0 > b1:
                raise _bad(where, f"overlaps tensors {a!r} and {b!r} (bytes {b1}..{b0 + n0})")
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(tensors))
        if lost:
            raise _bad(f"{storage.url}/{INDEX_FILE}", f"lists {len(lost)} tensor(s) no shard holds, e.g. {lost[0]!r}")
    user = {"tie_word_embeddings": _tied(storage)}
    skeleton = Node.container("dict", [(name, Node.leaf("tensor", name)) for name in tensors])
    md = fmt.Metadata(
        save_id="huggingface", world_size=1, framework=FRAMEWORK, parallelism={}, skeleton=skeleton,
        tensors=tensors, objects={}, per_rank={}, index_files=[], data_files=sizes,
        user_metadata=user,
    )
    return md, rows


#: the source protocol of :data:`bytecp.interop.SOURCES`
detect = is_hf_dir
read = read_hf_dir
