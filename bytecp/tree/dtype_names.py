"""The dtype names the format stores, with their element sizes, without torch.

Read by :mod:`bytecp.format.limits` (every reader validates a checkpoint's
dtypes and sizes before anything is allocated) so that the tools that only
read metadata (``bytecp ls``, the wrong-path diagnosis, ``inspect``'s
summary) start without importing torch. :mod:`bytecp.tree.dtypes` maps the
names this torch build knows onto ``torch.dtype``; a name listed here that
the running torch lacks fails there, when a tensor of it is loaded.
"""

from __future__ import annotations

__all__ = ["ITEMSIZES"]

#: stored name (torch's, without ``torch.``) -> bytes per element
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
}  # fmt: skip
