"""``torch.save`` archives and bare pickles read without ``torch.load``:
the object tree, with every tensor a :class:`StoredTensor` naming where its
bytes lie in the file.

A ``torch.save`` file is a zip archive of stored (uncompressed) entries:
``<name>/data.pkl`` (the pickled object tree; each tensor's storage a
persistent id naming the entry ``<name>/data/<key>``), the storages, and a
few small records. :func:`read_torch_file` reads such an archive at a byte
range of a file (a DCP ``.distcp`` item, a DeepSpeed ``.pt`` file) with a
few small ranged reads -- the tail (end of central directory, zip64
records, central directory), the head (``data.pkl``), one local header per
storage -- and never reads a storage's bytes: a caller turns each
contiguous :class:`StoredTensor` into a row naming ``(file, data_offset,
nbytes)`` and reads only what it needs, or calls :func:`materialize` for a
tensor that is not contiguous.

Both the archive and the pickle are hostile input:

- the zip: every entry stored (never inflated), inside the byte range, at
  most :data:`MAX_ENTRIES` of them and a central directory of at most
  :data:`MAX_DIRECTORY_BYTES`; the pickle at most :data:`MAX_PICKLE_BYTES`;
- the pickle runs no code: :class:`RestrictedUnpickler` admits plain
  containers (dict, list, tuple, set, OrderedDict), ``torch.Size``, dtypes,
  layouts, ``torch.device``, bytes, ``_rebuild_tensor_v2`` and
  ``_rebuild_parameter`` (both replaced by a builder of
  :class:`StoredTensor`), storages as persistent ids -- plus the globals a
  caller names in ``allow`` for that call, never anything else;
- every tensor's shape, stride and offset within its storage's entry, at
  most :data:`~bytecp.format.limits.MAX_NDIM` dimensions; the tree at most
  :data:`MAX_OBJECTS` objects and :data:`~bytecp.format.limits.MAX_SKELETON_DEPTH` deep.

Every refusal is a one-line :class:`~bytecp.errors.CorruptCheckpointError`
naming the file (and the global, entry or tensor; a global: :class:`RefusedGlobal`).

Who calls what: the sources of :data:`bytecp.interop.SOURCES`, on the coordinator of a
load: :mod:`bytecp.interop.dcp` (:func:`restricted_loads` on DCP's ``.metadata``,
:func:`read_torch_file` on each tensor item), torch_dist (``common.pt``, its values) and DeepSpeed (``.pt`` files).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import io
import math
import pickle
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from bytecp.errors import CorruptCheckpointError
from bytecp.format import limits
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import SUPPORTED_DTYPES, dtype_name

__all__ = [
    "MAX_PICKLE_BYTES", "MAX_ENTRIES", "MAX_DIRECTORY_BYTES", "MAX_OBJECTS",
    "StoredTensor", "RefusedGlobal", "RestrictedUnpickler", "restricted_loads", "read_torch_file", "materialize",
]

#: the largest pickle unpickled (``data.pkl``, DCP's ``.metadata``)
MAX_PICKLE_BYTES = 1 << 30
#: the most entries a torch.save archive may have
MAX_ENTRIES = 1 << 20
#: the largest central directory read
MAX_DIRECTORY_BYTES = 128 << 20
#: the most containers and values an unpickled tree may hold
MAX_OBJECTS = 1 << 24
#: the first read at each end of an archive (most archives' directory and pickle fit)
_PROBE = 4096

#: ``torch.<Name>Storage`` -> the dtype its persistent id stores
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_STORAGE_DTYPES["UntypedStorage"] = torch.uint8
_DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES.values()}
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor of a ``torch.save`` archive, located in its file, not read."""

    #: bytecp dtype name (``"float32"``, ``"bfloat16"``)
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: elements into the storage
    storage_offset: int
    #: the storage's key (entry ``<name>/data/<key>``); tensors sharing a storage share it
    storage_key: str
    #: the file holding it (as the caller named it)
    file: str
    #: absolute byte offset in ``file`` of the element at index 0 (``storage_start + storage_offset * itemsize``)
    data_offset: int
    #: ``numel * itemsize``: the bytes at ``data_offset`` when :attr:`contiguous`
    nbytes: int
    #: absolute byte offset and size of the whole storage (for :func:`materialize`)
    storage_start: int
    storage_nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """Row-major and dense: its bytes are ``[data_offset, data_offset + nbytes)``."""
        want = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and st != want:
                return False
            want *= size
        return True


@dataclasses.dataclass(frozen=True)
class _Storage:
    """A storage's entry: its bytes at ``[start, start + nbytes)`` of the file."""

    key: str
    dtype: torch.dtype
    numel: int
    start: int  # absolute offset of its bytes
    nbytes: int


class RefusedGlobal(CorruptCheckpointError):
    """The pickle names a global no allowlist admits: only a full unpickler reads it."""


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the file is corrupt, was tampered with, or is not a plain "
                                  "torch.save of tensors and containers")


def _int(v: Any) -> bool:
    return type(v) is int


# ----------------------------------------------------------------- unpickling
def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """Protocol 2's spelling of ``bytes``: only the latin-1 text of bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode of something other than latin-1 text")
    return text.encode("latin1")


def _get_layout(name: Any) -> torch.layout:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"layout {name!r:.40}")
    return _LAYOUTS[name]


def _device(*args: Any) -> torch.device:
    if not all(isinstance(a, (str, int)) for a in args) or len(args) > 2:
        raise pickle.UnpicklingError("torch.device of something other than a name and an index")
    return torch.device(*args)


class _StorageType:
    """What ``torch.FloatStorage`` and the like stand for in a persistent id."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


_BASE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    ("builtins", "list"): list, ("builtins", "dict"): dict, ("builtins", "tuple"): tuple,
    ("__builtin__", "set"): set, ("__builtin__", "frozenset"): frozenset,  # protocol 2's spelling
    ("_codecs", "encode"): _codecs_encode,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): _device,
    ("torch.serialization", "_get_layout"): _get_layout,
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that admits only the module docstring's globals plus
    ``allow`` (``{"module.name": object}``: the object stands for that global).
    ``storages`` (an archive's): persistent id -> storage; None: a bare pickle,
    which may have none. Tensors come back as :class:`StoredTensor`."""

    def __init__(self, data: bytes, where: str, allow: Mapping[str, Any] = {}, *,  # noqa: B006 - never mutated
                 storages: Callable[[Any], _Storage] | None = None, file: str = "") -> None:
        super().__init__(io.BytesIO(data))
        self.where, self.file, self._storages = where, file, storages
        self._allow = dict(_BASE_GLOBALS)
        if storages is not None:
            self._allow[("torch._utils", "_rebuild_tensor_v2")] = self._rebuild_tensor
            self._allow[("torch._utils", "_rebuild_parameter")] = self._rebuild_parameter
            self._allow[("torch._utils", "_rebuild_parameter_with_state")] = self._rebuild_parameter
        for name, obj in allow.items():
            module, _, attr = name.rpartition(".")
            self._allow[(module, attr)] = obj

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allow[(module, name)]
        except KeyError:
            raise RefusedGlobal(
                f"{self.where}: the pickle names the global {module}.{name}, which bytecp never loads "
                "(unpickling it could run code); load the file with torch.load only if you trust it") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._storages is None:
            raise pickle.UnpicklingError(f"a persistent id {pid!r:.60} in a bare pickle")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and _int(pid[4])):
            raise pickle.UnpicklingError(f"the persistent id {pid!r:.80}")
        st = self._storages(pid[2])
        if st.nbytes != pid[4] * SUPPORTED_DTYPES[dtype_name(pid[1].dtype)].itemsize:
            raise pickle.UnpicklingError(f"storage {pid[2]!r} declares {pid[4]} {pid[1].dtype} elements "
                                         f"in an entry of {st.nbytes} bytes")
        return dataclasses.replace(st, dtype=pid[1].dtype, numel=pid[4])

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> StoredTensor:
        if not isinstance(storage, _Storage) or not _int(offset) or offset < 0:
            raise pickle.UnpicklingError("_rebuild_tensor_v2 without a storage and an offset")
        shape, strides = tuple(size) if isinstance(size, tuple) else (), tuple(stride) if isinstance(stride, tuple) else ()
        if (not isinstance(size, tuple) or not isinstance(stride, tuple) or len(shape) != len(strides) or len(shape) > limits.MAX_NDIM
                or not all(_int(n) and n >= 0 for n in (*shape, *strides))):
            raise pickle.UnpicklingError(f"a tensor of shape {size!r:.60} and stride {stride!r:.60}")
        name = dtype_name(storage.dtype)
        isz = SUPPORTED_DTYPES[name].itemsize
        if 0 not in shape and offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) >= storage.numel:
            raise pickle.UnpicklingError(f"a tensor of shape {list(shape)} (stride {list(strides)}, offset {offset}) "
                                         f"reaching past its storage {storage.key!r} of {storage.numel} elements")
        return StoredTensor(name, shape, strides, offset, storage.key, self.file, storage.start + offset * isz,
                            math.prod(shape) * isz, storage.start, storage.nbytes)

    @staticmethod
    def _rebuild_parameter(data: Any, *_: Any) -> Any:
        return data


_LEAVES = (int, float, str, bytes, bool, type(None), torch.dtype, torch.Size)


def _count(tree: Any, where: str, max_objects: int) -> None:
    """The tree holds at most ``max_objects`` values, at most MAX_SKELETON_DEPTH deep (no recursion;
    leaves counted with their container, never pushed: a 5,000-tensor ``.metadata`` holds 100,000)."""
    seen, stack = 1, [(tree, 0)]
    while stack:
        v, depth = stack.pop()
        kids: Any = [*v.keys(), *v.values()] if isinstance(v, dict) else v if isinstance(v, (list, tuple, set, frozenset)) \
            else vars(v).values() if hasattr(v, "__dict__") and not isinstance(v, type) else ()
        seen += len(kids)
        if seen > max_objects or (kids and depth >= limits.MAX_SKELETON_DEPTH):
            raise _bad(where, f"the pickle holds more than {max_objects} objects" if seen > max_objects else
                       f"the pickle holds containers nested deeper than {limits.MAX_SKELETON_DEPTH}")
        stack.extend((x, depth + 1) for x in kids if type(x) not in _LEAVES)


def restricted_loads(data: bytes, where: str, allow: Mapping[str, Any] = {}, *,  # noqa: B006 - never mutated
                     max_bytes: int = MAX_PICKLE_BYTES, max_objects: int = MAX_OBJECTS,
                     _storages: Callable[[Any], _Storage] | None = None, _file: str = "") -> Any:
    """(sources, coordinator) Unpickle ``data`` (a bare pickle: DCP's ``.metadata``)
    with :class:`RestrictedUnpickler` and ``allow``, within the budgets; any
    refusal or decoding failure is one line naming ``where``."""
    if len(data) > max_bytes:
        raise _bad(where, f"the pickle is {len(data)} bytes, over the {max_bytes} byte budget")
    try:
        tree = RestrictedUnpickler(data, where, allow, storages=_storages, file=_file).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to decode stored bytes is corruption
        raise _bad(where, f"the pickle does not decode ({type(e).__name__}: {str(e)[:160]})") from None
    _count(tree, where, max_objects)
    return tree


# ----------------------------------------------------------------- the zip
class _Ranged:
    """Ranged reads of ``[start, start + length)`` of a file, served from the
    head and tail buffers read first when they cover the range."""

    def __init__(self, storage: Storage, file: str, start: int, length: int, where: str) -> None:
        self.storage, self.file, self.start, self.length, self.where = storage, file, start, length, where
        self.bufs: list[tuple[int, bytes]] = []

    def read(self, off: int, n: int, what: str) -> bytes:
        """``n`` bytes at ``off`` (relative to the archive's start)."""
        if off < 0 or n < 0 or off + n > self.length:
            raise _bad(self.where, f"{what} lies at bytes [{off}, {off + n}), outside the archive's {self.length}")
        for b0, buf in self.bufs:
            if b0 <= off and off + n <= b0 + len(buf):
                return buf[off - b0:off - b0 + n]
        try:
            got = self.storage.read_bytes(self.file, self.start + off, n)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where} is missing") from None
        if len(got) != n:
            raise _bad(self.where, f"{what} is cut short ({len(got)} of {n} bytes): the file is truncated")
        return got

    def keep(self, off: int, n: int) -> None:
        n = min(n, self.length - off)
        self.bufs.append((off, self.read(off, n, "the archive")))


def _directory(r: _Ranged) -> tuple[int, int, int]:
    """(entries, directory offset, directory size) from the end records."""
    tail = r.bufs[-1][1]
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 and r.length > len(tail):
        r.keep(max(0, r.length - (1 << 16) - 22), (1 << 16) + 22)  # the longest comment
        tail = r.bufs[-1][1]
        pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or len(tail) - pos < 22:
        raise _bad(r.where, "has no zip end-of-central-directory record (not a torch.save archive, or truncated)")
    eocd = r.bufs[-1][0] + pos
    _, _, _, _, entries, size, offset, _ = struct.unpack("<IHHHHIIH", tail[pos:pos + 22])
    if entries == 0xFFFF or size == 0xFFFFFFFF or offset == 0xFFFFFFFF:  # zip64
        loc = r.read(eocd - 20, 20, "the zip64 locator")
        if loc[:4] != b"PK\x06\x07":
            raise _bad(r.where, "has no zip64 locator before its end record")
        (rec_off,) = struct.unpack("<Q", loc[8:16])
        rec = r.read(rec_off, 56, "the zip64 end record")
        if rec[:4] != b"PK\x06\x06":
            raise _bad(r.where, "has no zip64 end record where its locator points")
        entries, size, offset = struct.unpack("<QQQ", rec[32:56])
    if entries > MAX_ENTRIES or size > MAX_DIRECTORY_BYTES:
        raise _bad(r.where, f"declares {entries} zip entries in a {size} byte directory (budget: "
                            f"{MAX_ENTRIES} entries, {MAX_DIRECTORY_BYTES} bytes)")
    return entries, offset, size


def _zip64(extra: bytes, fields: list[int]) -> list[int]:
    """``fields`` with the 0xFFFFFFFF ones taken from the zip64 extra block, in order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack("<HH", extra[pos:pos + 4])
        if tag == 1:
            vals = extra[pos + 4:pos + 4 + n]
            out, k = [], 0
            for f in fields:
                if f == 0xFFFFFFFF and k + 8 <= len(vals):
                    out.append(struct.unpack("<Q", vals[k:k + 8])[0])
                    k += 8
                else:
                    out.append(f)
            return out
        pos += 4 + n
    return fields


def _entries(r: _Ranged) -> dict[str, tuple[int, int]]:
    """Entry name -> (offset of its local header, size), every entry stored."""
    count, offset, size = _directory(r)
    cd = r.read(offset, size, "the central directory")
    out: dict[str, tuple[int, int]] = {}
    pos = 0
    for _ in range(count):
        if cd[pos:pos + 4] != b"PK\x01\x02" or pos + 46 > len(cd):
            raise _bad(r.where, f"has a damaged central directory (entry {len(out)})")
        method, csize, usize, nlen, elen, clen, local = (
            struct.unpack("<H", cd[pos + 10:pos + 12])[0], *struct.unpack("<II", cd[pos + 20:pos + 28]),
            *struct.unpack("<HHH", cd[pos + 28:pos + 34]), struct.unpack("<I", cd[pos + 42:pos + 46])[0])
        try:
            name = cd[pos + 46:pos + 46 + nlen].decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(r.where, "names a zip entry in bytes that are not UTF-8") from None
        usize, csize, local = _zip64(cd[pos + 46 + nlen:pos + 46 + nlen + elen], [usize, csize, local])
        if method != 0 or csize != usize:
            raise _bad(r.where, f"holds the compressed zip entry {name!r:.80} (torch.save stores entries; "
                                "refusing to inflate it)")
        if local + 30 + usize > r.length:
            raise _bad(r.where, f"places zip entry {name!r:.80} ({usize} bytes) past the archive's end: truncated?")
        out[name] = (local, usize)
        pos += 46 + nlen + elen + clen
    return out


def _data_start(r: _Ranged, name: str, local: int, size: int) -> int:
    """Where the data of the entry whose local header is at ``local`` begins (relative)."""
    head = r.read(local, 30, f"the header of entry {name!r:.80}")
    if head[:4] != b"PK\x03\x04":
        raise _bad(r.where, f"has no local header for zip entry {name!r:.80} where its directory says")
    nlen, elen = struct.unpack("<HH", head[26:30])
    start = local + 30 + nlen + elen
    if start + size > r.length:
        raise _bad(r.where, f"places zip entry {name!r:.80} past the archive's end (truncated?)")
    return start


def read_torch_file(storage: Storage, file: str, *, start: int = 0, length: int | None = None,
                    allow: Mapping[str, Any] | Iterable[str] = (), where: str | None = None) -> Any:
    """(sources, coordinator) The object tree of the ``torch.save`` archive
    at bytes ``[start, start + length)`` of ``file`` (``length`` None: to the
    file's end), every tensor a :class:`StoredTensor` (absolute offsets in
    ``file``); ``allow``: extra globals, ``{"module.name": stand-in}`` or
    names imported as they are. ``where`` names it in errors."""
    where = where or f"{storage.url}/{file}" + (f" (bytes {start}+{length})" if start or length is not None else "")
    if length is None:
        try:
            length = storage.size(file) - start
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where} is missing") from None
    r = _Ranged(storage, file, start, length, where)
    if length < 22:
        raise _bad(where, f"has {length} bytes, too few for a torch.save archive")
    r.keep(0, _PROBE)
    if length > _PROBE:
        r.keep(length - _PROBE, _PROBE)
    entries = _entries(r)
    pkls = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise _bad(where, f"has {len(pkls)} <name>/data.pkl entries (want 1: a torch.save archive)")
    prefix = pkls[0][: -len("data.pkl")]
    local, size = entries[pkls[0]]
    if size > MAX_PICKLE_BYTES:
        raise _bad(where, f"has a {size} byte data.pkl, over the {MAX_PICKLE_BYTES} byte budget")
    data = r.read(_data_start(r, pkls[0], local, size), size, "data.pkl")

    def storage_of(key: str) -> _Storage:
        name = f"{prefix}data/{key}"
        if name not in entries:
            raise pickle.UnpicklingError(f"storage {key!r:.40} has no entry {name!r:.80}")
        off, n = entries[name]
        return _Storage(key, torch.uint8, n, start + _data_start(r, name, off, n), n)

    if not isinstance(allow, Mapping):
        allow = {name: _import(name) for name in allow}
    return restricted_loads(data, where, allow, _storages=functools.lru_cache(maxsize=None)(storage_of), _file=file)


def _import(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def materialize(storage: Storage, t: StoredTensor) -> torch.Tensor:
    """(callers, for a tensor that is not :attr:`~StoredTensor.contiguous`)
    The tensor itself: its storage's bytes read, viewed with its stride, copied dense."""
    dtype = SUPPORTED_DTYPES[t.dtype]
    raw = bytearray(storage.read_bytes(t.file, t.storage_start, t.storage_nbytes))
    if len(raw) != t.storage_nbytes:
        raise _bad(f"{storage.url}/{t.file}", f"storage {t.storage_key!r} is cut short: the file is truncated")
    flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.as_strided(t.shape, t.stride, t.storage_offset).clone()
