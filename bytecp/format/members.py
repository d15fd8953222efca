"""``metadata.json``'s large members, each made into what a reader keeps as
soon as it is read (:meth:`bytecp.format.metadata.Metadata.from_bytes`).

``json.loads`` of a MoE's ``metadata.json`` (181,580 tensors, 131,072
ranks: 29 MB) holds 98 MB of JSON objects, and the tensor table, the
skeleton and the index were built beside all of it: 154 MB at the peak.
Read member by member (:func:`bytecp.format.json_head.decode_members`),
the tensors become their :class:`TensorTable` before the skeleton is read,
the skeleton its nodes as it is read (:func:`bytecp.tree.skeleton.decode_compact`),
and so on: 96 MB at the peak, 86 MB kept. Each result is :class:`Parsed`; a member these functions cannot
make (a fault, an unusual form, a version not yet known) stays JSON, and
``from_bytes`` makes it, and names its fault, as it would have.
"""

from __future__ import annotations

import json
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format.json_head import MemberDecoder
from bytecp.format.parts_schema import PartsDirectory
from bytecp.format.tensor_table import TensorTable
from bytecp.tree.skeleton import decode_compact

__all__ = ["Parsed", "MEMBER_DECODERS"]

_raw = json.JSONDecoder().raw_decode
_FAULTS = (CorruptCheckpointError, KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError)


class Parsed:
    """A member already made into what :class:`~bytecp.format.metadata.Metadata` keeps."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _interned(values: list[int]) -> list[int]:
    """``values`` with one ``int`` object per distinct value (JSON makes one
    per occurrence: 32 bytes each)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(v, v) for v in values]


def _v4(before: dict[str, Any]) -> bool:
    """The document read so far says format version 4 or 5 (it names it once: a
    document that names a member twice is read whole)."""
    v = before.get("format_version")
    return type(v) is int and v in (4, 5)


def _tensors(text: str, i: int, before: dict[str, Any]) -> tuple[Any, int]:
    d, end = _raw(text, i)
    if _v4(before) and isinstance(d, dict) and "names" in d:
        try:
            return Parsed(TensorTable.from_json(d, "")), end
        except _FAULTS:
            pass
    return d, end


def _skeleton(text: str, i: int, before: dict[str, Any]) -> tuple[Any, int]:
    tensors = before.get("tensors")
    if isinstance(tensors, Parsed):
        node, end = decode_compact(text, i, tensors.value.shared)
        if node is not None:
            return Parsed(node), end
    return _raw(text, i)


def _data_files(text: str, i: int, before: dict[str, Any]) -> tuple[Any, int]:
    d, end = _raw(text, i)
    if isinstance(d, dict) and all(type(v) is int for v in d.values()):
        seen: dict[int, int] = {}
        for k, v in d.items():
            d[k] = seen.setdefault(v, v)
        return Parsed(d), end
    return d, end


def _index(text: str, i: int, before: dict[str, Any]) -> tuple[Any, int]:
    d, end = _raw(text, i)
    if _v4(before):
        try:
            index = PartsDirectory.from_json(d, "")
            index.part_nbytes = _interned(index.part_nbytes)  # (parts of a few sizes)
            return Parsed(index), end
        except _FAULTS:
            pass
    return d, end


MEMBER_DECODERS: dict[str, MemberDecoder] = {
    "tensors": _tensors, "skeleton": _skeleton, "data_files": _data_files, "index": _index}
