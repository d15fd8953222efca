"""Dtype names as stored in the format, and tensor <-> raw byte views.

Every dtype is stored by its torch name without the ``torch.`` prefix
(``float32``, ``bfloat16``, ``float8_e4m3fn``, ``complex64``, ``bool``...).
Bytes are little-endian, row-major, with no padding between elements.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

from bytecp.errors import CorruptCheckpointError
from bytecp.tree.dtype_names import ITEMSIZES

__all__ = ["dtype_name", "dtype_from_name", "itemsize", "byte_view", "host_memoryview", "tensor_bytes",
           "SUPPORTED_DTYPES"]

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in practice
    raise ImportError("bytecp stores little-endian bytes and runs on little-endian hosts only")

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in ITEMSIZES if isinstance(getattr(torch, n, None), torch.dtype)
}
_NAMES = {v: k for k, v in SUPPORTED_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"bytecp cannot store tensors of dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(
            f"unknown dtype {name!r} in checkpoint (this torch knows {sorted(SUPPORTED_DTYPES)})"
        ) from None


def itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous CPU tensor's elements (no copy)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a size-1 dim may keep any stride
        flat = flat.as_strided((flat.numel(),), (1,), flat.storage_offset())
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def host_memoryview(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    arr: Any = byte_view(t).numpy()
    return memoryview(arr)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable flat memoryview,
    made from its address with no torch call but a few attribute reads
    (about 1 us; :func:`host_memoryview` makes three views through torch,
    each of which lets go of the GIL: a reader thread of a load of tens of
    thousands of small tensors then waited for it back at each one). The
    view holds ``t`` (through the ctypes array it views), so its memory
    outlives any reader still filling it, a request abandoned at its
    timeout included."""
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    n = t.nbytes
    if not n:
        return memoryview(bytearray())
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._bytecp_owner = t  # type: ignore[attr-defined]  # (the view holds arr, arr holds t)
    return memoryview(arr).cast("B")
