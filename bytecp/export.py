"""``bytecp export``: a checkpoint as one safetensors file or a plain torch
state dict, for evaluation and serving jobs.

The safetensors writer streams: the header is computed from the metadata,
then each tensor is assembled from its chunks (ranged reads) and appended,
so memory holds one tensor at a time, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from .dtypes import dtype_from_name, host_memoryview, itemsize
from .errors import ConfigError
from .planner import plan_load
from .reader import Target, execute_reads, read_chunks, read_metadata
from .recorder import Trace
from .regions import full_region
from .storage_api import Storage

__all__ = ["export_safetensors", "export_torch", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def _select(md: Any, prefix: str, strip: bool) -> list[tuple[str, str]]:
    names = sorted(f for f in md.tensors if f.startswith(prefix))
    if not names:
        raise ConfigError(f"no tensor of the checkpoint starts with {prefix!r}")
    return [(f, f[len(prefix):] if strip else f) for f in names]


def _read_full(storage: Storage, md: Any, chunks: list[Any], fqn: str) -> torch.Tensor:
    info = md.tensors[fqn]
    t = torch.empty(tuple(info["shape"]), dtype=dtype_from_name(info["dtype"]))
    target = Target(fqn, full_region(t.shape), t)
    reqs = plan_load([(fqn, target.box)], chunks, itemsizes={fqn: itemsize(t.dtype)})
    execute_reads(storage, chunks, [target], reqs, io_threads=8, verify=True, trace=Trace("export", storage.url))
    return t


def export_safetensors(storage: Storage, out_path: str, *, prefix: str = "", strip_prefix: bool = True) -> int:
    """Write the tensors whose FQN starts with ``prefix`` to ``out_path``; returns bytes written."""
    md = read_metadata(storage)
    chunks = read_chunks(storage, md)
    names = _select(md, prefix, strip_prefix)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "bytecp_save_id": md.save_id,
                                                "step": str(md.step)}}
    pos = 0
    for fqn, name in names:
        info = md.tensors[fqn]
        code = SAFETENSORS_DTYPES.get(info["dtype"])
        if code is None:
            raise ConfigError(f"safetensors has no dtype for {fqn!r} ({info['dtype']}); use --format torch")
        n = math.prod(info["shape"]) * itemsize(dtype_from_name(info["dtype"]))
        header[name] = {"dtype": code, "shape": info["shape"], "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    chunks_by = [c for c in chunks if c.fqn.startswith(prefix)]
    with open(out_path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for fqn, _ in names:
            t = _read_full(storage, md, chunks_by, fqn)
            if t.numel():
                f.write(host_memoryview(t))
    return 8 + len(raw) + pos


def export_torch(storage: Storage, out_path: str, *, prefix: str = "", strip_prefix: bool = True) -> int:
    """``torch.save`` a flat ``{name: tensor}`` dict (loads with ``weights_only=True``)."""
    md = read_metadata(storage)
    chunks = read_chunks(storage, md)
    sd = {name: _read_full(storage, md, chunks, fqn) for fqn, name in _select(md, prefix, strip_prefix)}
    torch.save(sd, out_path)
    return sum(t.numel() * t.element_size() for t in sd.values())


