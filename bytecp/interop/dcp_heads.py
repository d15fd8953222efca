"""DCP tensor chunks located inside their ``torch.save`` archives from the
archives' two ends: two small ranged reads per chunk, batched per
``.distcp`` file (two requests per 4,096 chunks), and the pickle of each
distinct chunk layout decoded once.

Every tensor item ``dcp.save`` writes is a ``torch.save`` archive laid out
the same way: streamed zip records -- ``<name>/data.pkl``, a few small
records (``.format_version``, ``.storage_alignment``, ``byteorder``), the
storage ``<name>/data/<key>``, each followed by a data descriptor holding
its size -- then two small records and the central directory. So the
first few hundred bytes of an item (its *head*) say where the storage's
bytes begin and, in ``data.pkl``, the chunk's dtype, shape and stride; the
bytes after the storage (its *tail*, about 900) hold the central directory.
:func:`bytecp.interop.torch_zip.read_torch_file`, by contrast, takes two to
four requests and a pickle per chunk: at 5,000 chunks the open took longer
than ``dcp.load`` of the whole checkpoint.

What is checked, item by item:

- the head walked record by record: each local header's signature, every
  record stored (never compressed), each streamed record's size from the
  first data descriptor whose sizes equal its distance;
- its ``data.pkl`` through the same restricted unpickler, once per distinct
  pickle (the chunks of same-shaped tensors share one): the tensor it names
  must be the chunk ``.metadata`` declares, dense, at the storage's start;
- the tail parsed as the central directory (the archive's authoritative
  record, as ``torch.load`` reads it): ``data.pkl`` first with the size the
  head gave, the storage at the local header the head walked to, with the
  chunk's size; the end records where the item ends;
- each file's first item also read the full way, and the whole file read
  so if the two disagree.

Any item the heads and tails do not settle (a head too short, another
layout, a mismatch of any kind) is read the full way, which raises the
one-line errors of :mod:`bytecp.interop.dcp_items` (truncated, damaged,
not dense, ``serialization_format=SAFETENSORS``).

Who calls what: :func:`bytecp.interop.dcp.read_dcp_dir` (the coordinator of
a load) calls :func:`locate_chunks` once with every tensor chunk of the
checkpoint; it falls back on :func:`bytecp.interop.dcp_items.locate_chunks`.
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.interop import dcp_items, torch_zip
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import SUPPORTED_DTYPES

__all__ = ["HEAD_BYTES", "MAX_TAIL", "BATCH", "Chunk", "locate_chunks", "head_layout", "tail_ok"]

#: the bytes read at the start of each item (``dcp.save``'s heads take about 700)
HEAD_BYTES = 1024
#: the most bytes read after a storage's data (data descriptor, the last records, the central directory:
#: about 900 bytes in ``dcp.save``'s archives)
MAX_TAIL = 8192
#: heads and tails read (and held) at once per file
BATCH = 4096
_MIN_TAIL = 22  # the end-of-central-directory record
_LOCAL = b"PK\x03\x04"
_HEADER = struct.Struct("<4sHHHHHIIIHH")
_DESCRIPTOR = b"PK\x07\x08"

#: (key, dtype name, global shape, chunk offsets, chunk sizes, (file, item offset, item length))
Chunk = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], dcp_items.Item]
#: a decoded ``data.pkl``: (dtype, shape, contiguous, offset of the chunk's first byte in its storage, nbytes)
_Layout = tuple[str, tuple[int, ...], bool, int, int]


def _sized(head: bytes, data: int) -> int | None:
    """The size of a record written with a data descriptor (flag bit 3: sizes
    after the data) whose data begins at ``data``: the first descriptor after
    it whose sizes equal its distance; None when the head holds none."""
    at = head.find(_DESCRIPTOR, data)
    while at >= 0 and at + 16 <= len(head):
        csize, usize = struct.unpack_from("<II", head, at + 8)
        if csize == usize == at - data:
            return at - data
        at = head.find(_DESCRIPTOR, at + 1)
    return None


def head_layout(head: bytes, length: int) -> tuple[bytes, str, int, int] | None:
    """(here; tests) The head of an archive of ``length`` bytes walked record
    by record up to its first storage: (``data.pkl``'s bytes, the storage's
    key, where its local header and where its bytes begin, relative to the
    archive); None when the head does not settle it. The sizes are checked
    against the archive's central directory apart (:func:`tail_ok`)."""
    pos, pkl, prefix = 0, None, b""
    while pos + 30 <= len(head):
        sig, _, flags, method, _, _, _, csize, usize, nlen, elen = _HEADER.unpack_from(head, pos)
        data = pos + 30 + nlen + elen
        if sig != _LOCAL or method != 0 or data > len(head):
            return None
        name = head[pos + 30:pos + 30 + nlen]
        if pkl is not None and name.startswith(prefix + b"data/"):
            try:
                return (pkl, name[len(prefix) + 5:].decode("ascii"), pos, data) if data < length else None
            except UnicodeDecodeError:
                return None
        if pkl is None and (not name.endswith(b"/data.pkl") or name.count(b"/") != 1):
            return None  # the first record is <name>/data.pkl
        if pkl is not None and (b"/data/" in name or not name.startswith(prefix)):
            return None
        if flags & 8:  # streamed (dcp.save): the sizes follow the data
            n = _sized(head, data)
            if n is None:
                return None
            nxt = data + n + 16
        elif csize == usize and usize != 0xFFFFFFFF and data + usize <= len(head):
            n, nxt = usize, data + usize
        else:
            return None
        if pkl is None:
            pkl, prefix = head[data:data + n], name[:-len(b"data.pkl")]
        pos = nxt
    return None


def tail_ok(storage: Storage, c: Chunk, tail_at: int, tail: bytes, pkl: int, local: int, key: str) -> bool:
    """(here; tests) Whether the archive of chunk ``c``, whose last bytes
    (from ``tail_at``, relative: right after the storage's data) are
    ``tail``, has a central directory placing ``data.pkl`` (``pkl`` bytes)
    first and the storage ``key`` at ``local`` with the chunk's size: the
    archive's own record of its layout, checked without a further request."""
    file, start, length = c[5]
    r = torch_zip._Ranged(storage, file, start, length, f"{storage.url}/{file} (tensor {c[0]!r})")
    r.bufs = [(tail_at, tail)]
    try:
        entries = torch_zip._entries(r)
    except CorruptCheckpointError:
        return False
    pkls = [n for n, e in entries.items() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1 or entries[pkls[0]] != (0, pkl):
        return False
    want = math.prod(c[4]) * SUPPORTED_DTYPES[c[1]].itemsize
    return entries.get(f"{pkls[0][:-len('data.pkl')]}data/{key}") == (local, want)


class _Pickles:
    """``data.pkl`` -> its tensor's layout, each distinct pickle decoded once."""

    def __init__(self) -> None:
        self.seen: dict[tuple[bytes, str, int], _Layout | None] = {}

    def layout(self, pkl: bytes, key: str, nbytes: int, where: str) -> _Layout | None:
        k = (pkl, key, nbytes)
        if k not in self.seen:
            def storage_of(pid: Any) -> Any:
                if pid != key:
                    raise ValueError(f"a second storage {pid!r:.40}")
                return torch_zip._Storage(key, SUPPORTED_DTYPES["uint8"], nbytes, 0, nbytes)
            try:
                t = torch_zip.restricted_loads(pkl, where, _storages=storage_of, max_objects=1024)
            except Exception:  # noqa: BLE001 - the full read names what is wrong
                t = None
            self.seen[k] = (t.dtype, t.shape, t.contiguous, t.data_offset, t.nbytes) \
                if isinstance(t, torch_zip.StoredTensor) else None
        return self.seen[k]


#: what the heads say of one chunk: (row, data.pkl's size, the storage's local header, its key)
_Found = tuple[fmt.ChunkRecord, int, int, str]


def _fast(storage: Storage, pickles: _Pickles, c: Chunk, head: bytes) -> _Found | None:
    """Chunk ``c``'s row from its item's head, its central directory still to
    be checked (:func:`tail_ok`); None: read it the full way."""
    key, dtype, shape, offsets, lengths, (file, start, length) = c
    got = head_layout(head, length)
    nbytes = math.prod(lengths) * SUPPORTED_DTYPES[dtype].itemsize
    if got is None or got[3] + nbytes + _MIN_TAIL > length or length - got[3] - nbytes > MAX_TAIL:
        return None
    pkl, skey, local, data = got
    lay = pickles.layout(pkl, skey, nbytes, f"{storage.url}/{file} (tensor {key!r})")
    if lay is None or lay[0] != dtype or lay[1] != lengths or not lay[2] or lay[3] != 0 or lay[4] != nbytes:
        return None
    return fmt.ChunkRecord(key, dtype, shape, offsets, lengths, file, start + data, nbytes, 0), len(pkl), local, skey


def _batch(storage: Storage, file: str, batch: list[Chunk], pickles: _Pickles) -> list[fmt.ChunkRecord | None]:
    """The rows of one batch of a file's chunks: their heads in one request,
    then their tails in one; None where only the full read settles it."""
    heads = [bytearray(min(HEAD_BYTES, c[5][2])) for c in batch]
    storage.read_ranges(file, [(c[5][1], memoryview(h)) for c, h in zip(batch, heads, strict=True)])
    found = [_fast(storage, pickles, c, bytes(h)) for c, h in zip(batch, heads, strict=True)]
    todo = [(c, f, f[0].byte_offset + f[0].nbytes) for c, f in zip(batch, found, strict=True) if f is not None]
    tails = [bytearray(c[5][1] + c[5][2] - at) for c, _, at in todo]
    storage.read_ranges(file, [(at, memoryview(t)) for (_, _, at), t in zip(todo, tails, strict=True)])
    ok = {id(f) for (c, f, at), t in zip(todo, tails, strict=True)
          if tail_ok(storage, c, at - c[5][1], bytes(t), f[1], f[2], f[3])}
    return [f[0] if f is not None and id(f) in ok else None for f in found]


def _file(storage: Storage, file: str, chunks: list[Chunk]) -> list[fmt.ChunkRecord]:
    """The rows of one file's chunks (sorted by offset), in batches; the
    first also read the full way, and the whole file so if they differ."""
    chunks.sort(key=lambda c: c[5][1])
    first = dcp_items.locate_chunks(storage, chunks[:1])[0]
    pickles = _Pickles()
    out: list[fmt.ChunkRecord] = []
    for b in range(0, len(chunks), BATCH):
        batch = chunks[b:b + BATCH]
        rows = _batch(storage, file, batch, pickles)
        if b == 0:
            if rows[0] not in (None, first):
                return dcp_items.locate_chunks(storage, chunks)
            rows[0] = first
        out.extend(r if r is not None else dcp_items.locate_chunks(storage, [c])[0]
                   for c, r in zip(batch, rows, strict=True))
    return out


def locate_chunks(storage: Storage, chunks: Sequence[Chunk]) -> list[fmt.ChunkRecord]:
    """(coordinator) One row per chunk, in the order given, its bytes found
    from its item's head and tail (module docstring); files in parallel."""
    by_file: dict[str, list[Chunk]] = defaultdict(list)
    for c in chunks:
        by_file[c[5][0]].append(c)
    if len(by_file) <= 1:
        found = [_file(storage, f, cs) for f, cs in by_file.items()]
    else:
        with ThreadPoolExecutor(min(8, len(by_file)), thread_name_prefix="bytecp-dcp") as pool:
            found = list(pool.map(lambda fc: _file(storage, *fc), by_file.items()))
    rows = {(r.fqn, r.offsets): r for rs in found for r in rs}
    return [rows[(c[0], c[3])] for c in chunks]
