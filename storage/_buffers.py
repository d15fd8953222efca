"""Byte views of the caller's buffers, shared by every backend.

The engine hands backends tensors' buffers of any format (``memoryview`` of
a float tensor, numpy arrays, ``bytes``); each backend's ``write_file``,
``write_stream``, ``read_into`` and ``read_ranges`` first views them as flat
unsigned bytes, zero-copy, with these helpers.
"""

from __future__ import annotations

from collections.abc import Iterable

from bytecp.storage_api import Buffer

__all__ = ["byte_view", "byte_views"]


def byte_view(buf: Buffer) -> memoryview:
    """``buf`` as a flat view of unsigned bytes (never a copy); a view that
    already is one comes back as it is."""
    v = buf if isinstance(buf, memoryview) else memoryview(buf)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def byte_views(buffers: Iterable[Buffer]) -> list[memoryview]:
    """The non-empty buffers of ``buffers`` as byte views, in order."""
    return [v for v in map(byte_view, buffers) if len(v)]
