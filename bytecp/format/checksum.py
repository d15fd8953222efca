"""crc32c of stored bytes (hardware-accelerated by the ``crc32c`` package).

Computed by the writer while it lays out each data file and checked by the
reader and ``bytecp verify``."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))
