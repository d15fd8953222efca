"""The first members of a JSON object, decoded from the start of its text
without the rest (docs/FORMAT.md §6.2 "Header").

Called by :mod:`bytecp.format.header` (a checkpoint's header from the first
64 KiB of its ``metadata.json``) and by
:meth:`bytecp.format.metadata.Metadata.from_bytes`, which checks that the
header a tool reads this way is the one the whole file holds.
:func:`decode_members` decodes a whole object one member at a time (what
``from_bytes`` reads ``metadata.json`` with).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from bytecp.errors import CorruptCheckpointError

__all__ = ["leading_members", "scan_header", "check_header", "decode_members", "MemberDecoder", "HEADER_KEYS", "HEADER_BYTES"]

#: the members a version-4 writer writes before any other, in this order (§6.2 "Header")
HEADER_KEYS = ("format", "format_version", "bytecp_version", "save_id", "created", "world_size", "framework",
               "parallelism", "step", "user_metadata", "references")
_WS = re.compile(r"[ \t\n\r]*")
_DEC = json.JSONDecoder()


def _ws(text: str, i: int) -> int:
    """Past the JSON whitespace at ``i``."""
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def _opened(text: str) -> int | None:
    """Where the first member of the JSON object ``text`` begins with (past its ``{``); None: not an object."""
    i = _ws(text, 0)
    return _ws(text, i + 1) if text.startswith("{", i) else None


def leading_members(text: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The members named in ``keys`` at the start of the JSON object ``text``
    begins, up to the first other member or the object's end; None when the
    text ends (or stops being JSON) before that, or a member comes twice."""
    dec, ws = _DEC, functools.partial(_ws, text)
    i = _opened(text)
    if i is None:
        return None
    out: dict[str, Any] = {}
    try:
        while True:
            key, i = dec.raw_decode(text, ws(i))
            i = ws(i)
            if not isinstance(key, str) or key in out or not text.startswith(":", i):
                return None
            if key not in keys:
                return out
            out[key], i = dec.raw_decode(text, ws(i + 1))
            i = ws(i)
            if text.startswith("}", i):
                return out
            if not text.startswith(",", i):
                return None
            i += 1
    except (ValueError, RecursionError):  # cut off inside a value, or not JSON
        return None


#: a member's decoder: (text, where its value starts, the members before it) -> (value, where it ends)
MemberDecoder = Callable[[str, int, dict[str, Any]], tuple[Any, int]]


def decode_members(data: bytes, decoders: Mapping[str, MemberDecoder]) -> dict[str, Any] | None:
    """``json.loads(data)`` of a JSON object, one member at a time: the value
    of a member named in ``decoders`` is what that function makes of it
    (:meth:`bytecp.format.metadata.Metadata.from_bytes` turns each large
    member into what it keeps before the next is read, so that the JSON of
    all of them never exists at once). None when ``data`` is not one JSON
    object with distinct member names: ``json.loads`` then gives the
    answer (the last of two equal names wins; the error of what is not JSON)."""
    if not isinstance(data, bytes | bytearray):
        return None
    try:
        text = data.decode(json.detect_encoding(data), "surrogatepass")
    except ValueError:
        return None
    dec = _DEC  # (the text is cut as it is read: _ws(text, ...) sees the current one)
    start = _opened(text)
    if start is None:
        return None
    out: dict[str, Any] = {}
    i = start
    try:
        if text.startswith("}", i):
            return out if _ws(text, i + 1) == len(text) else None
        while True:
            if not text.startswith('"', i):
                return None
            key, i = dec.raw_decode(text, i)
            i = _ws(text, i)
            if key in out or not text.startswith(":", i):
                return None
            i = _ws(text, i + 1)
            decode = decoders.get(key)
            if decode is None:
                out[key], i = dec.raw_decode(text, i)
            else:  # a large member: the text read so far goes first (a MoE's: 29 MB, 22 MB, 8 MB)
                if i >= 1 << 20:
                    text, i = text[i:], 0
                out[key], i = decode(text, i, out)
            i = _ws(text, i)
            if text.startswith("}", i):
                return out if _ws(text, i + 1) == len(text) else None
            if not text.startswith(",", i):
                return None
            i = _ws(text, i + 1)
    except (ValueError, RecursionError):  # not JSON: json.loads says where
        return None


#: bytes of ``metadata.json`` a tool reads for its header (bytecp.format.header)
HEADER_BYTES = 64 << 10


def scan_header(text: str, keys: tuple[str, ...] = HEADER_KEYS) -> dict[str, Any] | None:
    """The members named in ``keys`` at the start of a version-4 ``metadata.json``
    (``text``: its first bytes), up to the first other member or its end;
    None when they may go on past ``text``, it holds no ``references``
    there (a writer before they moved into the header put them last), or it
    is no version-4 document: then it is parsed whole."""
    out = leading_members(text, keys)
    if out is None or "references" not in out:
        return None
    version = out.get("format_version")
    return out if type(version) is int and version >= 4 else None


def check_header(d: dict[str, Any], data: bytes, where: str) -> None:
    """(version 4) What a tool reads from the file's first :data:`HEADER_BYTES`
    (the header members up to the first other one, when ``references`` is
    among them) is what the whole file ``d`` holds: no header member named
    twice, none after the other members."""
    head = scan_header(data[:HEADER_BYTES].decode("utf-8", "ignore"))
    if head is not None and (
            any(d.get(k) != v for k, v in head.items()) or any(k in d and k not in head for k in HEADER_KEYS)):
        raise CorruptCheckpointError(f"{where}: metadata.json names a header member twice or after its other "
                                     "members (format version 4 writes them first, once; FORMAT.md §6.2)")
