"""Serving deltas on storage (FORMAT.md §13): the optional files a checkpoint
may carry so that processes holding the model in a *serving dtype* (bf16)
take each new checkpoint by reading only the elements whose serving-dtype
value changed.

Written by :mod:`bytecp.saving.serving` (every rank of a save that asks for
them, on the save's write path) and read by :mod:`bytecp.serving.deltas`
(followers, ``iter_weights``). This module is the format in code: the file
names, the JSON documents and their checks, the position encoding and the
element checksum -- no I/O, no torch.

```
serving/<save_id>/serving.json      the manifest (the save's coordinator)
serving/<save_id>/<rank>.json       a rank's entries: one per box it wrote or referenced
serving/<save_id>/<rank>.bin        that rank's changed elements (absent when it has none)
serving/<save_id>/<rank>.whole.bin  that rank's boxes in the serving dtype, whole (whole saves only)
```

The *element checksum* of a box is ``sum(w(i) * b_i) mod 2**64`` over its
elements, ``b_i`` the element's bits as an unsigned integer, ``i`` its
row-major linear index in the whole tensor and ``w(i)`` the ``(i+1)``-th
output of SplitMix64 seeded with 0. It is a sum, so a box's is the sum of
its parts' (a reader holding any layout adds up its pieces), and a change
of a few elements changes it by ``sum(w(i) * (new_i - old_i))``: a reader
checks an applied delta from the changed elements alone. That half --
positions, their encoding, the checksum, the in-place writes -- is
:mod:`bytecp.format.serving_elements`, re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format.serving_elements import (
    bits_dtype,
    box_checksum,
    change_sum,
    change_sum_reference,
    decode_positions,
    decode_positions_reference,
    element_weights,
    encode_positions,
    relocate,
    run_start,
    scatter_bits,
    swap_bits,
)
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.regions import Region

__all__ = [
    "SERVING_DIR", "FORMAT", "VERSION", "ALIGN", "Link", "DeltaPart", "WholePart", "Entry", "RankEntries",
    "Manifest", "serving_dtype_name", "bits_dtype", "manifest_path", "entries_path", "delta_path", "whole_path",
    "relocate", "run_start", "element_weights", "change_sum", "change_sum_reference", "swap_bits",
    "scatter_bits", "box_checksum", "encode_positions", "decode_positions",
    "decode_positions_reference",
    "hex64", "parse_hex64", "volume", "FOLLOWERS_DIR", "held_marker", "kept_files", "ELEMENT_BYTES", "delta_cost",
]

SERVING_DIR = "serving"
#: a run's followers' folder (``<run>/.followers``): their leases, and the
#: markers of the step a serving follower holds (``held/<id>.json``)
FOLLOWERS_DIR = ".followers"
FORMAT = "bytecp-serving"
VERSION = 1
#: every payload region starts at a multiple of this many bytes of its file
ALIGN = 8
#: what a changed element costs a reader beside its bytes -- decoding its
#: position, checking it, gathering the value it replaces and scattering the
#: new one -- counted in bytes read: on the reference benchmark's host an
#: element costs about what reading and checking 16 to 40 bytes whole does.
#: The reference writer writes a box whole instead of its delta when the
#: delta costs more by this count; the reference follower chooses the same way
ELEMENT_BYTES = 16
_M64 = (1 << 64) - 1
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64"}


def serving_dtype_name(value: Any) -> str:
    """A serving dtype (``torch.bfloat16``, ``"bf16"``, ``"bfloat16"``) as its
    stored name; a floating dtype of 1 to 8 bytes, else :class:`ConfigError`."""
    name = str(value).removeprefix("torch.") if value is not None else ""
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZES or not name.startswith(("float", "bfloat")) or ITEMSIZES[name] > 8:
        raise ConfigError(f"serving_dtype must be a floating dtype such as torch.bfloat16 or 'bf16', got {value!r}")
    return name


def hex64(x: int) -> str:
    return f"{x & _M64:016x}"


def parse_hex64(s: Any, where: str) -> int:
    if not isinstance(s, str) or len(s) != 16:
        raise CorruptCheckpointError(f"{where}: a checksum {s!r:.40} is not 16 hex digits")
    try:
        return int(s, 16)
    except ValueError:
        raise CorruptCheckpointError(f"{where}: a checksum {s!r:.40} is not 16 hex digits") from None


def manifest_path(save_id: str) -> str:
    return f"{SERVING_DIR}/{save_id}/serving.json"


def entries_path(save_id: str, rank: int) -> str:
    return f"{SERVING_DIR}/{save_id}/{rank}.json"


def delta_path(save_id: str, rank: int) -> str:
    return f"{SERVING_DIR}/{save_id}/{rank}.bin"


def whole_path(save_id: str, rank: int) -> str:
    return f"{SERVING_DIR}/{save_id}/{rank}.whole.bin"


def delta_cost(nbytes: int, count: int) -> int:
    """A delta of ``count`` changed elements in ``nbytes``, counted in bytes read (see :data:`ELEMENT_BYTES`)."""
    return nbytes + ELEMENT_BYTES * count


def held_marker(follower_id: str) -> str:
    """A serving follower's marker in ``<run>/.followers``: ``{"name", "save_id", "step"}`` of what it holds."""
    return f"held/{follower_id}.json"


def kept_files(files: Sequence[str], save_id: str) -> list[str]:
    """Of a checkpoint's files, the serving deltas of its save that a follower
    behind still needs (retention keeps these beyond the checkpoint): the
    manifest and every rank's entries and changes, not the whole copies."""
    head = f"{SERVING_DIR}/{save_id}/"
    return [p for p in files if p.startswith(head) and not p.endswith(".whole.bin")]


# -- the documents ------------------------------------------------------------
def _int(d: Any, key: str, where: str, lo: int = 0) -> int:
    v = d.get(key) if isinstance(d, dict) else None
    if type(v) is not int or v < lo:
        raise CorruptCheckpointError(f"{where}: {key!r} must be an integer >= {lo}, got {v!r:.40}")
    return v


def _str(d: Any, key: str, where: str) -> str:
    v = d.get(key) if isinstance(d, dict) else None
    if not isinstance(v, str) or not v:
        raise CorruptCheckpointError(f"{where}: {key!r} must be a non-empty string, got {v!r:.40}")
    return v


@dataclasses.dataclass(frozen=True)
class Link:
    """The checkpoint a delta is relative to: its name in the run, save id and step."""

    name: str
    save_id: str
    step: int | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "save_id": self.save_id, "step": self.step}

    @classmethod
    def from_json(cls, d: Any, where: str) -> Link | None:
        if d is None:
            return None
        name, sid = _str(d, "name", where), _str(d, "save_id", where)
        if not _NAME.match(name) or name in (".", "..") or not _NAME.match(sid):
            raise CorruptCheckpointError(f"{where}: 'previous' names {name!r:.60} / {sid!r:.60}, not a checkpoint")
        step = d.get("step")
        if step is not None and type(step) is not int:
            raise CorruptCheckpointError(f"{where}: 'previous' step {step!r:.40} is not an integer")
        return cls(name, sid, step)


@dataclasses.dataclass(frozen=True)
class DeltaPart:
    """A box's changed elements in ``<rank>.bin``: ``count`` values (the
    serving dtype's bytes), then their positions (LEB128 gaps, ``positions_nbytes``)."""

    offset: int
    count: int
    positions_nbytes: int
    nbytes: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any, itemsize: int, numel: int, where: str) -> DeltaPart:
        part = cls(_int(d, "offset", where), _int(d, "count", where), _int(d, "positions_nbytes", where),
                   _int(d, "nbytes", where), _int(d, "crc32c", where))
        if part.count > numel or part.nbytes != part.count * itemsize + part.positions_nbytes \
                or part.crc32c > 0xFFFFFFFF or (part.count and part.offset % ALIGN):
            raise CorruptCheckpointError(f"{where}: a delta of {part.count} elements in {part.nbytes} bytes does "
                                         f"not fit its box of {numel} ({itemsize}-byte elements)")
        return part


@dataclasses.dataclass(frozen=True)
class WholePart:
    """A box's every element in the serving dtype, row-major, in ``<rank>.whole.bin``."""

    offset: int
    nbytes: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any, itemsize: int, numel: int, where: str) -> WholePart:
        part = cls(_int(d, "offset", where), _int(d, "nbytes", where), _int(d, "crc32c", where))
        if part.nbytes != numel * itemsize or part.offset % ALIGN or part.crc32c > 0xFFFFFFFF:
            raise CorruptCheckpointError(f"{where}: a whole copy of {part.nbytes} bytes is not its box's "
                                         f"{numel} elements of {itemsize} bytes")
        return part


@dataclasses.dataclass(frozen=True)
class Entry:
    """One box of a tensor the rank wrote (or referenced, unchanged) in this
    save: its element checksum now (``checksum``) and, when the rank held the
    box at the previous checkpoint, then (``before``) with the change
    (``delta``); a whole copy when the save wrote one."""

    fqn: str
    box: Region
    checksum: int
    before: int | None = None
    delta: DeltaPart | None = None
    whole: WholePart | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"fqn": self.fqn, "offsets": list(self.box.offsets), "lengths": list(self.box.lengths),
                             "checksum": hex64(self.checksum)}
        if self.delta is not None:
            d["before"] = hex64(self.before or 0)
            d["delta"] = self.delta.to_json()
        if self.whole is not None:
            d["whole"] = self.whole.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any, itemsize: int, where: str) -> Entry:
        fqn = _str(d, "fqn", where)
        offs, lens = d.get("offsets"), d.get("lengths")
        if not isinstance(offs, list) or not isinstance(lens, list) or len(offs) != len(lens) or len(offs) > 64 \
                or not all(type(x) is int and x >= 0 for x in offs + lens):
            raise CorruptCheckpointError(f"{where}: entry {fqn!r:.80} has no valid box")
        box = Region(tuple(offs), tuple(lens))
        at = f"{where}: {fqn} {box}"
        delta = DeltaPart.from_json(d["delta"], itemsize, box.numel, at) if "delta" in d else None
        whole = WholePart.from_json(d["whole"], itemsize, box.numel, at) if "whole" in d else None
        if delta is None and whole is None:
            raise CorruptCheckpointError(f"{at}: an entry with neither a delta nor a whole copy")
        before = parse_hex64(d.get("before"), at) if delta is not None else None
        return cls(fqn, box, parse_hex64(d.get("checksum"), at), before, delta, whole)


def _header(d: Any, where: str) -> tuple[str, str, Link | None, int | None]:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: not a bytecp serving document")
    if d.get("version") != VERSION:
        raise CorruptCheckpointError(f"{where}: serving format version {d.get('version')!r:.20} is not "
                                     f"{VERSION}, the one this bytecp reads; upgrade bytecp to use these deltas")
    dtype = serving_dtype_name(d.get("dtype")) if d.get("dtype") in ITEMSIZES else None
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: serving dtype {d.get('dtype')!r:.40} is not a floating dtype")
    step = d.get("step")
    if step is not None and type(step) is not int:
        raise CorruptCheckpointError(f"{where}: step {step!r:.40} is not an integer")
    return _str(d, "save_id", where), dtype, Link.from_json(d.get("previous"), where), step


def _load(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({str(e)[:120]})") from None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """``serving/<save_id>/serving.json``: the save carries deltas in ``dtype``
    relative to ``previous`` (None: none, every entry whole)."""

    save_id: str
    dtype: str
    world_size: int
    step: int | None
    previous: Link | None

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "save_id": self.save_id, "dtype": self.dtype,
                           "world_size": self.world_size, "step": self.step,
                           "previous": None if self.previous is None else self.previous.to_json()}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        d = _load(data, where)
        save_id, dtype, previous, step = _header(d, where)
        return cls(save_id, dtype, _int(d, "world_size", where, 1), step, previous)


@dataclasses.dataclass(frozen=True)
class RankEntries:
    """``serving/<save_id>/<rank>.json``: the rank's entries, relative to ``previous``."""

    save_id: str
    rank: int
    dtype: str
    step: int | None
    previous: Link | None
    entries: tuple[Entry, ...]
    #: sizes of ``<rank>.bin`` and ``<rank>.whole.bin`` (0: not written)
    delta_nbytes: int = 0
    whole_nbytes: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "save_id": self.save_id, "rank": self.rank,
                           "dtype": self.dtype, "step": self.step,
                           "previous": None if self.previous is None else self.previous.to_json(),
                           "delta_nbytes": self.delta_nbytes, "whole_nbytes": self.whole_nbytes,
                           "entries": [e.to_json() for e in self.entries]}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RankEntries:
        d = _load(data, where)
        save_id, dtype, previous, step = _header(d, where)
        raw = d.get("entries")
        if not isinstance(raw, list):
            raise CorruptCheckpointError(f"{where}: 'entries' is not a list")
        size = ITEMSIZES[dtype]
        out = cls(save_id, _int(d, "rank", where), dtype, step, previous,
                  tuple(Entry.from_json(e, size, where) for e in raw), _int(d, "delta_nbytes", where),
                  _int(d, "whole_nbytes", where))
        for e in out.entries:
            for part, total in ((e.delta, out.delta_nbytes), (e.whole, out.whole_nbytes)):
                if part is not None and part.offset + part.nbytes > total:
                    raise CorruptCheckpointError(f"{where}: {e.fqn} {e.box} ends at byte {part.offset + part.nbytes}"
                                                 f" of a {total}-byte file")
        return out


def volume(boxes: Sequence[Region]) -> int:
    """Elements of ``boxes`` together (their sum: boxes of a save never overlap)."""
    return sum(math.prod(b.lengths) for b in boxes)
