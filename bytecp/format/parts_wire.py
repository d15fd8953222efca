"""What a rank sends the coordinator about its version-4 index part, and
how the coordinator reads every rank's at once (docs/FORMAT.md section 5.6).

Every rank, at commit, lays out its part (:func:`bytecp.format.parts_build.
build_part`), whose :class:`PartEntries` it sends in the commit's gather as
:meth:`PartEntries.encode`'s bytes: little-endian 64-bit words, tensor names
as their 64-bit hashes (:func:`~bytecp.format.chunk_batch.fqn_hash`), so
that a rank's message is a few dozen words and nothing is unpickled per
rank. The coordinator decodes all of them together (:func:`decode_all`,
NumPy gathers over one buffer, the 0-dim values' file names an Arrow
column of their bytes) and maps the hashes back to the state's tensor names
(:class:`NameTable`). Nothing here is stored.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from bytecp.errors import ConfigError
from bytecp.format.chunk_batch import fqn_hash, fqn_hashes

__all__ = ["PartEntries", "Scalar", "Scalars", "EntryColumns", "NameTable", "decode_all"]

#: first word of an encoded PartEntries ("bcpPE4", version 1)
MAGIC = int.from_bytes(b"bcpPE4\x00\x01", "little")
_HEAD = 8


class Scalar(NamedTuple):
    """A 0-dim chunk: listed in the directory's scalar pages, not in a part
    (a tuple: a rank of Adam's state holds one ``step`` per parameter, made at every save)."""

    fqn: str
    file: str
    byte_offset: int
    nbytes: int
    crc: int


@dataclasses.dataclass
class PartEntries:
    """What a rank tells the coordinator about its part: its size, one entry
    per segment (columns: band segments, then wide segments), the names of
    the wide tensors with the wide segment holding their rows, and its 0-dim
    chunks. ``nbytes == 0``: it wrote no part."""

    rank: int
    nbytes: int = 0
    #: elements of every chunk this rank wrote, 0-dim ones included (the coordinator adds them up)
    elements: int = 0
    #: band segments: the bands [lo, hi] their rows meet
    lo: list[int] = dataclasses.field(default_factory=list)
    hi: list[int] = dataclasses.field(default_factory=list)
    #: band segments then wide segments: where they are in the part
    offset: list[int] = dataclasses.field(default_factory=list)
    size: list[int] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)
    crc: list[int] = dataclasses.field(default_factory=list)
    #: one per (wide tensor, wide segment holding rows of it), ascending: the
    #: tensor and the segment's index among the wide segments
    names: list[str] = dataclasses.field(default_factory=list)
    name_seg: list[int] = dataclasses.field(default_factory=list)
    scalars: list[Scalar] = dataclasses.field(default_factory=list)

    @property
    def wide_segments(self) -> int:
        return len(self.offset) - len(self.lo)

    def encode(self) -> bytes:
        """(every rank, at commit) The compact form sent in the gather."""
        files = [s.file.encode() for s in self.scalars]
        tail = b"".join(files)
        head = [MAGIC, self.rank, self.nbytes, self.elements, len(self.lo), self.wide_segments, len(self.names),
                len(self.scalars)]
        words = np.concatenate([
            np.asarray(head, np.int64), np.asarray(self.lo, np.int64), np.asarray(self.hi, np.int64),
            *(np.asarray(c, np.int64) for c in (self.offset, self.size, self.rows, self.crc)),
            np.fromiter((fqn_hash(n) for n in self.names), np.uint64, len(self.names)).view(np.int64),
            np.asarray(self.name_seg, np.int64),
            np.fromiter(map(fqn_hash, (s.fqn for s in self.scalars)), np.uint64, len(self.scalars)).view(np.int64),
            # (byte_offset, nbytes, crc) of each: the column of each field, one after the other
            np.asarray([s[2:] for s in self.scalars], np.int64).reshape(-1, 3).T.ravel(),
            np.asarray([len(f) for f in files], np.int64),
        ]).astype("<i8", copy=False)
        return words.tobytes() + tail + b"\0" * (-len(tail) % 8)


def _string_column(offsets: np.ndarray, data: np.ndarray) -> pa.Array:
    """An Arrow string column of the strings ``data[offsets[i]:offsets[i+1]]``
    (UTF-8 bytes), built from NumPy buffers (``pa.array`` of anything makes
    pyarrow import pandas: 0.35 s the first time in a process)."""
    if len(data) >= 1 << 31:
        raise ValueError("a string column of 2 GiB or more")
    return pa.Array.from_buffers(pa.string(), len(offsets) - 1, [
        None, pa.py_buffer(np.ascontiguousarray(offsets, np.int32)), pa.py_buffer(np.ascontiguousarray(data, np.uint8))])


def _rows_of(column: pa.Array, at: np.ndarray) -> pa.Array:
    """``column``'s rows ``at``, in that order (Arrow's take, the indices
    given as a buffer: ``pa.array`` would import pandas)."""
    at = np.ascontiguousarray(at, np.int64)
    return column.take(pa.Array.from_buffers(pa.int64(), len(at), [None, pa.py_buffer(at)]))


@dataclasses.dataclass
class Scalars:
    """Every rank's 0-dim chunks as columns (:func:`decode_all`)."""

    rank: np.ndarray
    #: the tensor name's hash (uint64)
    hash: np.ndarray
    #: the data file each is in (Arrow strings)
    file: pa.Array

    def files_at(self, at: np.ndarray) -> pa.Array:
        """The data files of the chunks ``at``, in that order."""
        return _rows_of(self.file, at)

    offset: np.ndarray
    nbytes: np.ndarray
    crc32c: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)


@dataclasses.dataclass
class EntryColumns:
    """Every rank's entries as flat columns (what :func:`decode_all` returns)."""

    #: per part: rank, size, elements; ranks ascending, parts with ``nbytes == 0`` dropped
    rank: np.ndarray
    nbytes: np.ndarray
    elements: int
    #: band entries
    band: dict[str, np.ndarray]
    #: wide entries, one per (tensor, segment): ``name`` = the tensor's hash, ``seg`` = the segment's
    #: position in ``segments`` (its columns are gathered a page at a time, not per entry)
    wide: dict[str, np.ndarray]
    #: every segment (band and wide): rank, offset, nbytes, rows, crc32c; ``named``: how many wide entries name it
    segments: dict[str, np.ndarray]
    #: 0-dim chunks
    scalars: Scalars


def _ramp(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] for the counts ``counts``."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def decode_all(blobs: Sequence[bytes]) -> EntryColumns:
    """(coordinator, at commit) Every rank's :meth:`PartEntries.encode`, decoded
    together. Raises :class:`ConfigError` naming the rank (or the position
    in the gather) whose message is malformed."""
    lens = np.fromiter((len(b) for b in blobs), np.int64, len(blobs))
    bad_len = np.flatnonzero((lens % 8 != 0) | (lens < 8 * _HEAD))
    if len(bad_len):
        raise ConfigError(f"the index part entries of the rank at position {int(bad_len[0])} of the commit's gather "
                          f"are malformed ({int(lens[bad_len[0]])} bytes)")
    buf = np.frombuffer(b"".join(blobs), "<i8")
    words = lens // 8
    start = np.cumsum(words) - words
    head = buf[start[:, None] + np.arange(_HEAD)] if len(blobs) else np.zeros((0, _HEAD), np.int64)
    rank, nbytes, elements, nb, nw, nn, ns = (head[:, k] for k in range(1, _HEAD))
    fixed = _HEAD + 2 * nb + 4 * (nb + nw) + 2 * nn + 5 * ns
    bad = (head[:, 0] != MAGIC) | (nb < 0) | (nw < 0) | (nn < 0) | (ns < 0) | (fixed > words) | (nbytes < 0)
    if bool(bad.any()):
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(f"rank {int(rank[i])} (position {i} of the commit's gather): its index part entries "
                          "are malformed")

    def col(at: np.ndarray, counts: np.ndarray) -> np.ndarray:
        return buf[np.repeat(start + at, counts) + _ramp(counts)]

    ns_ = nb + nw
    at = np.full(len(blobs), _HEAD, np.int64)
    band = {"lo": col(at, nb), "hi": col(at + nb, nb)}
    at = at + 2 * nb
    seg = {k: col(at + i * ns_, ns_) for i, k in enumerate(("offset", "nbytes", "rows", "crc32c"))}
    at = at + 4 * ns_
    whash, wseg = col(at, nn), col(at + nn, nn)
    at = at + 2 * nn
    seg_rank = np.repeat(rank, ns_)
    is_band = _ramp(ns_) < np.repeat(nb, ns_)
    band |= {k: v[is_band] for k, v in seg.items()} | {"rank": seg_rank[is_band]}
    name_rank = np.repeat(rank, nn)
    bad_seg = (wseg < 0) | (wseg >= np.repeat(nw, nn))
    if bool(bad_seg.any()):
        raise ConfigError(f"rank {int(name_rank[np.flatnonzero(bad_seg)[0]])}: its index part names a wide "
                          "segment it does not have")
    base = np.repeat(np.cumsum(nw) - nw, nn)  # each part's first wide segment, among all wide segments
    where_seg = np.flatnonzero(~is_band)[base + wseg]  # each wide entry's segment, among all segments
    wide = {"name": whash.view(np.uint64), "seg": where_seg}
    scalars = _scalars(buf, rank, ns, start + at, start + words)
    tail_ok = (ns > 0) | (words == fixed)
    if not bool(tail_ok.all()):
        i = int(np.flatnonzero(~tail_ok)[0])
        raise ConfigError(f"rank {int(rank[i])}: its index part entries are malformed (trailing bytes)")
    keep = np.flatnonzero(nbytes > 0)
    keep = keep[np.argsort(rank[keep], kind="stable")]  # ranks ascending, as the columns promise
    named = np.zeros(int(ns_.sum()), np.int64)
    np.add.at(named, where_seg, 1)
    segments = {"rank": seg_rank, **seg, "named": np.where(is_band, 1, named)}
    return EntryColumns(rank=rank[keep], nbytes=nbytes[keep], elements=int(elements.sum()), band=band, wide=wide,
                        segments=segments, scalars=scalars)


def _scalars(buf: np.ndarray, rank: np.ndarray, ns: np.ndarray, at: np.ndarray, end: np.ndarray) -> Scalars:
    """Every rank's 0-dim chunks (its ``ns`` entries: five columns from word
    ``at``, then the file names' bytes up to word ``end``), decoded together
    into columns, the file names an Arrow string column made of their bytes
    (no Python step per chunk: a MoE's 45,000 Adam steps took 0.05 s)."""
    hashes, offs, sizes, crcs, flen = (buf[np.repeat(at + k * ns, ns) + _ramp(ns)] for k in range(5))
    owner = np.repeat(np.arange(len(ns)), ns)
    if bool((flen < 0).any()):
        raise ConfigError(f"rank {int(rank[owner[np.flatnonzero(flen < 0)[0]]])}: its index part entries name "
                          "files malformed")
    total = np.zeros(len(ns), np.int64)
    np.add.at(total, owner, flen)
    room = (end - at - 5 * ns) * 8  # the bytes after the columns
    bad = (ns > 0) & ((total > room) | (-(-total // 8) * 8 != room))
    if bool(bad.any()):
        raise ConfigError(f"rank {int(rank[np.flatnonzero(bad)[0]])}: its index part entries name files malformed")
    before = np.cumsum(flen) - flen
    first = np.repeat(np.cumsum(ns) - ns, ns)  # each chunk's rank's first chunk, among all chunks
    where = (at + 5 * ns)[owner] * 8 + before - before[first]
    data = buf.view(np.uint8)[np.repeat(where - before, flen) + np.arange(int(flen.sum()), dtype=np.int64)]
    files = _string_column(np.concatenate([np.zeros(1, np.int64), np.cumsum(flen)]), data)
    try:
        files.validate(full=True)
    except pa.ArrowInvalid:  # (find whose: one chunk at a time)
        raw = memoryview(buf.view(np.uint8).data)
        for w, n, r in zip(where.tolist(), flen.tolist(), owner.tolist(), strict=True):
            try:
                str(raw[w: w + n], "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"rank {int(rank[r])}: its index part entries name a file that is not UTF-8") from e
        raise
    return Scalars(rank=rank[owner], hash=hashes.view(np.uint64), file=files, offset=offs,
                   nbytes=sizes, crc32c=crcs)


class NameTable:
    """(coordinator) The state's tensor names, by their 64-bit hashes: ids are
    positions in name order (Unicode code points), so sorting ids sorts names."""

    _last: tuple[bytes, NameTable] | None = None

    @classmethod
    def of(cls, names: Iterable[str], hashes: np.ndarray | None = None) -> NameTable:
        """The table of ``names`` (``hashes``: their :func:`fqn_hashes`, in
        their order, when the caller has them): the last commit's when its
        names were the same (the usual case: a job saves one state again and
        again), else a new one."""
        names = list(names)
        key = hashlib.blake2b("\0".join(names).encode(), digest_size=16).digest()
        last = cls._last
        if last is not None and last[0] == key:
            return last[1]
        table = cls(names, hashes)
        cls._last = (key, table)
        return table

    def __init__(self, names: Iterable[str], hashes: np.ndarray | None = None) -> None:
        if hashes is None:
            self.names = sorted(names)
            hashes = fqn_hashes(self.names)
        else:  # (the ranks hashed their own names: 181,580 hashes here took 0.08 s)
            given = list(names)
            at = sorted(range(len(given)), key=given.__getitem__)
            self.names = [given[i] for i in at]
            hashes = np.asarray(hashes, np.uint64)[np.asarray(at, np.int64)]
        self.order = np.argsort(hashes, kind="stable")
        self.sorted = hashes[self.order]
        dup = np.flatnonzero(self.sorted[1:] == self.sorted[:-1])
        if len(dup):
            a, b = self.names[self.order[dup[0]]], self.names[self.order[dup[0] + 1]]
            raise ConfigError(f"tensor names {a!r} and {b!r} collide in the commit's 64-bit name hash; rename one")

    @functools.cached_property
    def arrow(self) -> pa.Array:
        """The names as one Arrow string column (the directory's pages take theirs from it)."""
        joined = "".join(self.names)
        if joined.isascii():  # (a byte a character)
            lens = np.fromiter(map(len, self.names), np.int64, len(self.names))
            raw = joined.encode("ascii")
        else:
            encoded = [n.encode() for n in self.names]
            lens = np.fromiter(map(len, encoded), np.int64, len(encoded))
            raw = b"".join(encoded)
        return _string_column(np.concatenate([np.zeros(1, np.int64), np.cumsum(lens)]), np.frombuffer(raw, np.uint8))

    def strings(self, ids: np.ndarray) -> pa.Array:
        """The names of ``ids`` as an Arrow string column (the directory's pages' names)."""
        return _rows_of(self.arrow, ids)

    def ids(self, hashes: np.ndarray, rank_of: Callable[[int], int], what: str) -> np.ndarray:
        """The ids of ``hashes`` (hash ``i`` sent by rank ``rank_of(i)``);
        ConfigError naming a rank that sent the hash of no tensor of the state."""
        hashes = np.asarray(hashes, np.uint64)
        if not len(self.sorted):
            pos = np.zeros(len(hashes), np.int64)
            known = np.zeros(len(hashes), bool)
        else:
            pos = np.minimum(np.searchsorted(self.sorted, hashes), len(self.sorted) - 1)
            known = self.sorted[pos] == hashes
        if not bool(known.all()):
            raise ConfigError(f"rank {rank_of(int(np.flatnonzero(~known)[0]))}: its index part lists {what} of a tensor "
                              "missing from the state every rank described")
        return np.asarray(self.order[pos], np.int64)
