"""Dtype names as stored in the format, and tensor <-> raw byte views.

Every dtype is stored by its torch name without the ``torch.`` prefix
(``float32``, ``bfloat16``, ``float8_e4m3fn``, ``complex64``, ``bool``...).
Bytes are little-endian, row-major, with no padding between elements.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from bytecp.errors import CorruptCheckpointError
from bytecp.tree.dtype_names import ITEMSIZES

__all__ = ["dtype_name", "dtype_from_name", "itemsize", "byte_view", "host_memoryview", "SUPPORTED_DTYPES"]

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


class _HostBytes:
    """A contiguous CPU tensor's bytes as NumPy takes them
    (``__array_interface__``); the array made of it holds it, and so the tensor."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.nbytes,), "typestr": "|u1",
                                    "version": 3}


def host_memoryview(t: torch.Tensor, *, checked: bool = False) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable flat memoryview (no
    copy), made from its address with no torch operation (about 2 us: the
    torch views it took before each let go of the GIL, and a load's reader
    threads then queued for it back at every one of tens of thousands of
    small tensors). The view holds ``t``, so its memory outlives any reader
    still filling it (a request abandoned at its timeout included).
    ``checked``: the caller has just made sure ``t`` is such a tensor (the
    loader, once per request: the checks cost about 3 us)."""
    if not checked and (not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg()):
        raise ValueError(f"host_memoryview needs a contiguous CPU tensor without conj/neg bits, not {t.device} "
                         f"{t.dtype} of strides {t.stride()}")
    if not t.nbytes:
        return memoryview(bytearray())
    arr: Any = np.asarray(_HostBytes(t))
    return memoryview(arr)
