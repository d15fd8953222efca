"""The bytes of one segment of a version-4 index part (docs/FORMAT.md
section 5.6, "Segment encoding"): flat little-endian 64-bit words, decoded
with a handful of NumPy operations.

Who calls it and when: every saving rank, at commit, through
:func:`bytecp.format.parts_build.build_part` (:func:`encode_rows`, one call
per segment of its part); every loading rank and the one-process tools
(inspect, verify, export), through :func:`bytecp.format.parts_read.read_parts`
(:func:`decode` then :func:`to_records`, one call per segment read, after
its crc32c). Directory pages and the index files of versions 1 to 3 stay
Parquet (:mod:`bytecp.format.index_check`).

Layout (``n`` rows, ``m`` tensor names, ``f`` file names, ``D`` dimensions
in all, ``S`` string bytes): the header ``[MAGIC, n, m, f, D, S]``, then
the columns ``name_id[n] file_id[n] ndim[n] byte_offset[n] nbytes[n]
crc32c[n] offsets[D] lengths[D]``, the string lengths ``[1 + m + f]`` (the
save id, the tensor names ascending, the file names), and the strings'
UTF-8 bytes zero-padded to a multiple of 8. Format version 5 writes
segments of encoding 2 (:data:`MAGIC_BLOCKS`): the header has a seventh
word, ``K``, and the ``K`` block checksums of the rows (32 bits each, a
row's after the previous rows', two to a word, zero-padded) follow
``lengths``; a row of ``nbytes`` over the index's ``block_bytes`` has
``ceil(nbytes / block_bytes)`` of them, any other none. The decoder checks every count
against the segment's real length before it looks at anything the counts
locate, so no crafted count makes it allocate or loop beyond the bytes read.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bytecp.errors import CorruptCheckpointError
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.format.tensor_table import TensorTable

__all__ = ["MAGIC", "MAGIC_BLOCKS", "HEADER_WORDS", "SegmentRows", "Kept", "Names", "encode", "encode_rows", "decode", "kept_rows",
           "records", "to_records"]

#: first word of a segment (the bytes "bcpSG4", then version 1: 0x00 0x01)
MAGIC = int.from_bytes(b"bcpSG4\x00\x01", "little")
#: first word of a segment of encoding 2, with block checksums (format version 5)
MAGIC_BLOCKS = int.from_bytes(b"bcpSG4\x00\x02", "little")
#: MAGIC, n, m, f, D, S (encoding 2: and K)
HEADER_WORDS = 6


@dataclasses.dataclass
class SegmentRows:
    """A decoded segment: its strings and its columns (views of the bytes read, never copies)."""

    save_id: str
    names: list[str]
    files: list[str]
    name_id: np.ndarray
    file_id: np.ndarray
    ndim: np.ndarray
    byte_offset: np.ndarray
    nbytes: np.ndarray
    crc32c: np.ndarray
    #: every row's offsets (lengths), row after row: ``ndim[i]`` values each
    offsets: np.ndarray
    lengths: np.ndarray
    #: with a :class:`Names` memo, what :func:`kept_rows` found of these names, shared by every segment
    #: of the same names
    checked: dict[Any, Any] | None = None
    #: encoding 2: every row's block checksums, row after row, and where each row's start (n + 1 values)
    blocks: np.ndarray | None = None
    block_at: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.name_id)

    @functools.cached_property
    def start(self) -> np.ndarray:
        """Where each row's dimensions begin in ``offsets`` and ``lengths``."""
        return np.cumsum(self.ndim) - self.ndim

    def dims_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The positions in ``offsets``/``lengths`` of the dimensions of ``rows``, row after row, and
        each one's dimension within its row."""
        nd = self.ndim[rows]
        dim = np.arange(int(nd.sum())) - np.repeat(np.cumsum(nd) - nd, nd)
        return np.repeat(self.start[rows], nd) + dim, dim

    def blocks_of(self, rows: np.ndarray) -> Sequence[bytes]:
        """Each of ``rows``' block checksums, packed (empty: none recorded), sliced out of one copy."""
        if self.blocks is None or self.block_at is None:
            return [b""] * len(rows)
        data = self.blocks.astype("<u4", copy=False).tobytes()
        return [data[4 * a : 4 * b] for a, b in zip(self.block_at[rows].tolist(), self.block_at[rows + 1].tolist(),
                                                       strict=True)]


class Names:
    """One reader's memo of the tensor-name lists of the segments it decodes
    (names' bytes and lengths -> the list, and what :func:`kept_rows` found
    of it): the segments of many ranks holding shards of the same tensors
    list the same names (simulated, 280M-chunk MoE at 16,384 ranks: 550
    segments of 74 distinct lists, 604,008 names of 139,296), each list
    then decoded and checked against ``metadata.json`` once."""

    def __init__(self) -> None:
        self.lists: dict[bytes, tuple[list[str], dict[Any, Any]]] = {}


def encode(save_id: str, names: Sequence[str], files: Sequence[str], name_id: np.ndarray, file_id: np.ndarray,
           ndim: np.ndarray, byte_offset: np.ndarray, nbytes: np.ndarray, crc: np.ndarray,
           offsets: np.ndarray, lengths: np.ndarray, blocks: np.ndarray | None = None) -> bytes:
    """The segment of these columns, as given (``names`` ascending, ids into
    ``names`` and ``files``, ``offsets``/``lengths`` flat; ``blocks``: the
    rows' block checksums, one row's after the other: encoding 2; None:
    encoding 1): no check here, so tests can craft damaged segments with it."""
    strings = [s.encode() for s in (save_id, *names, *files)]
    tail = b"".join(strings)
    n = len(name_id)
    head = [MAGIC, n, len(names), len(files), len(offsets), len(tail)]
    packed = np.zeros(0, np.int64)
    if blocks is not None:
        head = [MAGIC_BLOCKS, *head[1:], len(blocks)]
        b = np.asarray(blocks, "<u4")
        packed = np.concatenate([b, np.zeros(len(b) % 2, "<u4")]).view("<i8")
    words = np.concatenate([
        np.asarray(head, np.int64),
        *(np.asarray(c, np.int64).reshape(-1) for c in (name_id, file_id, ndim, byte_offset, nbytes, crc,
                                                        offsets, lengths)),
        packed,
        np.asarray([len(s) for s in strings], np.int64),
    ]).astype("<i8", copy=False)
    return words.tobytes() + tail + b"\0" * (-len(tail) % 8)


def encode_rows(save_id: str, names: Sequence[str], files: Sequence[str], fid: np.ndarray, file: np.ndarray,
                ndim: np.ndarray, byte_offset: np.ndarray, nbytes: np.ndarray, crc: np.ndarray,
                O: np.ndarray, L: np.ndarray, blocks: np.ndarray | None = None) -> bytes:  # noqa: E741, N803
    """(every rank, at commit) One segment of a rank's rows, in the order
    given: ``fid``/``file`` index the rank's ``names`` (sorted) and ``files``,
    ``O``/``L`` are padded to the most dimensions (the first ``ndim`` of each
    row count), ``blocks`` the rows' block checksums (encoding 2). Only the
    names and files these rows use are listed."""
    used_n, name_id = np.unique(fid, return_inverse=True)
    used_f, file_id = np.unique(file, return_inverse=True)
    mask = np.arange(O.shape[1])[None, :] < ndim[:, None]
    return encode(save_id, [names[i] for i in used_n.tolist()], [files[i] for i in used_f.tolist()],
                  name_id, file_id, ndim, byte_offset, nbytes, crc, O[mask], L[mask], blocks)


def decode(label: str, buf: bytes | bytearray | memoryview, rows: int, save_id: str, memo: Names | None = None,
           block_bytes: int | None = None) -> SegmentRows:
    """``buf`` (one segment, its crc32c already checked) decoded and checked
    as FORMAT.md §5.6 says a reader MUST: ``rows`` the directory's count,
    ``save_id`` the checkpoint's; tensor names a ``memo`` holds already are its
    list (checked when it was decoded); ``block_bytes``: the index's (format
    version 5: the segment is of encoding 2, its rows' block checksums
    checked against their sizes; None: encoding 1). Any failure is one line
    starting with ``label``."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{label}: {why}; the index is corrupt")

    size = len(buf)
    head = HEADER_WORDS + (block_bytes is not None)
    if size % 8 or size < 8 * HEADER_WORDS:
        raise bad(f"{size} bytes are not a segment (a header of {head} 64-bit words, then whole words)")
    words = np.frombuffer(buf, "<i8")
    magic = int(words[0])
    want = MAGIC if block_bytes is None else MAGIC_BLOCKS
    if magic != want:
        raise bad(f"its first word {magic:#018x} is not the segment magic {want:#018x}"
                  f"{' (this checkpoint format version records block checksums)' if magic == MAGIC else ''}")
    if size < 8 * head:
        raise bad(f"{size} bytes are not a segment (a header of {head} 64-bit words, then whole words)")
    n, m, f, dims, nstr, *more = words[1:head].tolist()
    nblocks = more[0] if more else 0
    if min(n, m, f, dims, nstr, nblocks) < 0:
        raise bad(f"its header declares a negative count (rows {n}, names {m}, files {f}, dims {dims}, "
                  f"string bytes {nstr}, block checksums {nblocks})")
    if n != rows:
        raise CorruptCheckpointError(f"{label} has {n} rows, the directory says {rows}")
    packed = -(-nblocks // 2)
    need = 8 * (head + 6 * n + 2 * dims + packed + 1 + m + f) + -(-nstr // 8) * 8  # Python ints: no overflow
    if need != size:
        raise bad(f"its header (rows {n}, names {m}, files {f}, dims {dims}, string bytes {nstr}"
                  f"{f', block checksums {nblocks}' if block_bytes is not None else ''}) makes it {need} "
                  f"bytes, not {size}{' (trailing bytes)' if need < size else ''}")
    at = head
    table = words[at : at + 6 * n].reshape(6, n)  # one row per column
    name_id, file_id, ndim, byte_offset, nbytes, crc = table
    at += 6 * n
    boxes = words[at : at + 2 * dims]
    offsets, lengths = boxes[:dims], boxes[dims:]
    at += 2 * dims
    blocks, block_at = _blocks(bad, words[at : at + packed], nblocks, nbytes, block_bytes)
    at += packed
    strlen = words[at : at + 1 + m + f]
    at += 1 + m + f
    # the common case in a few reductions; any failure is then located below
    lo, hi = (table.min(axis=1).tolist(), table.max(axis=1).tolist()) if n else ([0] * 6, [-1] * 6)
    if not (lo[0] >= 0 and hi[0] < m and lo[1] >= 0 and hi[1] < f and lo[2] >= 0 and hi[2] <= limits.MAX_NDIM
            and lo[3] >= 0 and lo[4] >= 0 and lo[5] >= 0 and hi[5] <= 0xFFFFFFFF and (not dims or boxes.min() >= 0)
            and int(ndim.sum()) == dims and strlen.min() >= 0 and strlen.max() <= nstr and int(strlen.sum()) == nstr):
        _locate(bad, name_id, file_id, ndim, byte_offset, nbytes, crc, offsets, lengths, strlen, m, f, dims, nstr)
    raw = memoryview(buf)[8 * at :]
    if any(raw[nstr:]):
        raise bad("the padding after its strings is not zero")
    ends = np.cumsum(strlen).tolist()
    sid, named = ends[0], ends[m]
    got = _strings(bad, raw[:sid], strlen[:1], 0)[0]
    # the names' bytes and lengths: a list seen before (a reader of a band reads the segments of many ranks
    # holding shards of the same tensors) is the same list, decoded and checked once
    key = bytes(raw[sid:named]) + strlen[1 : 1 + m].tobytes() if memo is not None else b""
    known = memo.lists.get(key) if memo is not None else None
    names = known[0] if known is not None else _strings(bad, raw[sid:named], strlen[1 : 1 + m], 1)
    files = _strings(bad, raw[named:nstr], strlen[1 + m :], 1 + m)
    if got != save_id:
        raise CorruptCheckpointError(f"{label} belongs to save {got[:40]!r}, not to this checkpoint's {save_id!r}; "
                                     "the index is corrupt")
    if known is None and m > 1 and not all(map(operator.lt, names, itertools.islice(names, 1, None))):
        i = next(k for k in range(1, m) if not names[k - 1] < names[k])
        raise bad(f"its tensor names are not strictly ascending ({names[i - 1]!r:.80} then {names[i]!r:.80})")
    if memo is not None and known is None:
        known = memo.lists[key] = (names, {})
    return SegmentRows(got, names, files, name_id, file_id, ndim, byte_offset, nbytes, crc, offsets, lengths,
                       None if known is None else known[1], blocks, block_at)


def _blocks(bad: Callable[[str], CorruptCheckpointError], packed: np.ndarray, count: int, nbytes: np.ndarray,
            block_bytes: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The block checksums (``count`` of them in the words ``packed``) and where
    each row's start, checked: one per block of each row over one block, none
    for the others, the padding zero. (``nbytes`` is not checked yet: a
    negative one counts none here and is refused by the column checks.)"""
    if block_bytes is None:
        return None, None
    per = np.where(nbytes > block_bytes, -(-nbytes // block_bytes), 0)  # each <= 2**63 / block_bytes
    if len(per) and int(per.max()) > count:
        raise bad(f"a row of {int(nbytes[int(per.argmax())])} bytes needs {int(per.max())} block checksums, "
                  f"the segment holds {count}")
    at = np.zeros(len(per) + 1, np.int64)
    np.cumsum(per, out=at[1:])  # each <= count, at most size/8 rows: no overflow
    if int(at[-1]) != count:
        raise bad(f"its rows' sizes make {int(at[-1])} block checksums (one per {block_bytes} bytes of a chunk "
                  f"over one block), its header says {count}")
    values = packed.view("<u4")
    if len(values) > count and values[count:].any():
        raise bad("the padding after its block checksums is not zero")
    return values[:count], at


def _strings(bad: Callable[[str], CorruptCheckpointError], raw: memoryview, strlen: np.ndarray, first: int,
             ) -> list[str]:
    """The strings of lengths ``strlen`` back to back in ``raw`` (their sum checked), each valid UTF-8
    (string ``first + k`` of the segment, for errors). ASCII bytes (the common case) are decoded
    once and sliced: a segment that a reader reads for a few rows lists a name per row, thousands,
    most of them of tensors it drops."""
    if not len(strlen):
        return []
    ends = np.cumsum(strlen)
    blob = bytes(raw[: int(ends[-1])])
    if blob.isascii():  # every string is then valid UTF-8, one character per byte
        text = blob.decode("ascii")
        return list(map(text.__getitem__, map(slice, (ends - strlen).tolist(), ends.tolist())))
    strings = []
    pos = 0
    for k, ln in enumerate(strlen.tolist()):
        try:
            strings.append(str(blob[pos : pos + ln], "utf-8"))
        except UnicodeDecodeError:
            raise bad(f"string {first + k} is not UTF-8") from None
        pos += ln
    return strings


def _locate(bad: Callable[[str], CorruptCheckpointError], name_id: np.ndarray, file_id: np.ndarray, ndim: np.ndarray,
            byte_offset: np.ndarray, nbytes: np.ndarray, crc: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
            strlen: np.ndarray, m: int, f: int, dims: int, nstr: int) -> None:
    """Raise ``bad`` naming the first of :func:`decode`'s column checks that fails."""
    def first(mask: np.ndarray) -> int | None:
        hit = np.flatnonzero(mask)
        return int(hit[0]) if len(hit) else None

    if (i := first((ndim < 0) | (ndim > limits.MAX_NDIM))) is not None:
        raise bad(f"row {i} has {int(ndim[i])} dimensions (0 to {limits.MAX_NDIM} allowed)")
    if int(ndim.sum()) != dims:  # each in 0..MAX_NDIM: the sum cannot overflow
        raise bad(f"its rows have {int(ndim.sum())} dimensions in all, its header says {dims}")
    if (i := first((name_id < 0) | (name_id >= m))) is not None:
        raise bad(f"row {i} names tensor {int(name_id[i])} of its {m}")
    if (i := first((file_id < 0) | (file_id >= f))) is not None:
        raise bad(f"row {i} names file {int(file_id[i])} of its {f}")
    if (i := first((byte_offset < 0) | (nbytes < 0) | (crc < 0) | (crc > 0xFFFFFFFF))) is not None:
        raise bad(f"row {i} has bytes {int(byte_offset[i])}+{int(nbytes[i])} and crc32c {int(crc[i])}")
    if (i := first((offsets < 0) | (lengths < 0))) is not None:
        raise bad(f"dimension {i} of its rows has offset {int(offsets[i])} and length {int(lengths[i])}")
    if (i := first((strlen < 0) | (strlen > nstr))) is not None:
        raise bad(f"string {i} has length {int(strlen[i])}, outside its {nstr} string bytes")
    if int(strlen.sum()) != nstr:  # each in 0..nstr, at most size/8 of them: no overflow
        raise bad(f"its string lengths add up to {int(strlen.sum())} bytes, its header says {nstr}")
    raise bad("its columns are malformed")  # unreachable: the checks above cover the fast path's


@dataclasses.dataclass
class Kept:
    """The rows of a decoded segment a reader keeps by name: their indices,
    each row's tensor (``names`` index) and its dtype and shape by name id."""

    rows: np.ndarray
    #: per name id of the segment, (fqn, dtype, shape) where a kept row names it, else None
    heads: list[tuple[str, str, tuple[int, ...]] | None]
    #: per name id, its row in ``metadata.json``'s tensor table (None: the tensors are a dict)
    table_rows: np.ndarray | None = None


def kept_rows(seg: SegmentRows, md: fmt.Metadata, label: str, fqns: set[str] | None) -> Kept:
    """The rows of tensors ``fqns`` (None: all), in segment order: a row
    naming a tensor ``metadata.json`` lacks is refused (any row, kept or
    not), each kept row's box checked as well formed
    (:func:`bytecp.format.limits.check_chunk_records`). Names are checked and
    filtered as columns (a reader of a few rows of a segment drops the
    others', thousands of names), dtypes and shapes looked up for the kept
    rows' tensors only."""
    names, tensors = seg.names, md.tensors
    m = len(names)
    table = tensors if isinstance(tensors, TensorTable) else None
    memo = seg.checked if seg.checked is not None else {}
    found = memo.get((id(md), id(fqns)))  # (both live as long as the reader's memo)
    if found is None:
        row = table.rows_of(names) if table is not None else None
        known = row >= 0 if row is not None else np.fromiter(map(tensors.__contains__, names), bool, m)
        wanted = np.ones(m, bool) if fqns is None else np.fromiter(map(fqns.__contains__, names), bool, m)
        heads: list[tuple[str, str, tuple[int, ...]] | None] = [None] * m
        rank = np.full(m, -1, np.int64)  # each looked-up tensor's number of dimensions (-1: a negative one, from a dict)
        found = memo[(id(md), id(fqns))] = (row, known, bool(known.all()), wanted, heads, rank)
    row, known, every, wanted, heads, rank = found
    if not every:  # refused if a row names it (any row, wanted or not)
        used = np.bincount(seg.name_id, minlength=m) > 0
        if len(k := np.flatnonzero(used & ~known)):
            raise CorruptCheckpointError(f"{label}: a row names tensor {names[int(k[0])]!r:.80}, which metadata.json "
                                         "lacks")
    keep = np.flatnonzero(wanted[seg.name_id]) if m else np.zeros(0, np.int64)
    for k in np.unique(seg.name_id[keep]).tolist():
        if heads[k] is not None:
            continue
        if row is not None and table is not None:
            i = int(row[k])
            dtype, shape = table.dtypes[int(table.dtype[i])], tuple(table.shape(i))
        else:
            info = tensors[names[k]]
            dtype, shape = info["dtype"], tuple(info["shape"])
        heads[k] = (names[k], dtype, shape)
        rank[k] = len(shape) if min(shape, default=0) >= 0 else -1
    kept = Kept(keep, heads, row)
    # decode checked every count, offset, length and byte range >= 0 and every ndim <= MAX_NDIM: what is
    # left of check_chunk_records is each row's ndim against its tensor's (and, from a dict, its shape)
    if len(bad := np.flatnonzero(rank[seg.name_id[keep]] != seg.ndim[keep])):
        limits.check_chunk_records(label, records(seg, kept, keep[bad[:1]]))
    return kept


def records(seg: SegmentRows, kept: Kept, rows: np.ndarray) -> list[fmt.ChunkRecord]:
    """Rows ``rows`` (of ``kept.rows``) as chunk records, in the order given."""
    start = seg.start[rows]
    heads, files = kept.heads, seg.files
    # (a few rows of many: their boxes sliced out; most of them: every box as one list)
    few = len(rows) * 8 < len(seg)
    offsets, lengths = (seg.offsets, seg.lengths) if few else (seg.offsets.tolist(), seg.lengths.tolist())
    out = []
    for blocks, nid, fid, s, nd, bo, nb, crc in zip(seg.blocks_of(rows), *(c.tolist() for c in (
            seg.name_id[rows], seg.file_id[rows], start, seg.ndim[rows], seg.byte_offset[rows], seg.nbytes[rows],
            seg.crc32c[rows])), strict=True):
        fqn, dtype, shape = heads[nid]  # (set for every kept row)
        o, n = offsets[s : s + nd], lengths[s : s + nd]
        out.append(fmt.chunk_record(fqn, dtype, shape, tuple(o.tolist() if few else o), tuple(n.tolist() if few else n),
                                   files[fid], bo, nb, crc, blocks))
    return out


def to_records(seg: SegmentRows, md: fmt.Metadata, label: str, fqns: set[str] | None) -> list[fmt.ChunkRecord]:
    """The rows of tensors ``fqns`` (None: all) as chunk records, in segment
    order, checked as :func:`kept_rows` says, one row at a time: for a
    segment of a few rows (a reader of a replicated expert set reads 2,000
    of them, 2.7 rows each), whose columns' fixed cost is more than theirs."""
    m, tensors = len(seg.names), md.tensors
    missing = [k for k, name in enumerate(seg.names) if name not in tensors]
    if missing:  # refused if a row names it (any row, wanted or not)
        used = np.bincount(seg.name_id, minlength=m) > 0
        for k in missing:
            if used[k]:
                raise CorruptCheckpointError(f"{label}: a row names tensor {seg.names[k]!r:.80}, which metadata.json "
                                             "lacks")
    wanted = np.asarray([fqns is None or name in fqns for name in seg.names], bool)
    keep = np.flatnonzero(wanted[seg.name_id]) if m else np.zeros(0, np.int64)
    if not len(keep):
        return []
    start = seg.start
    heads: list[tuple[str, str, tuple[int, ...]] | None] = [None] * m
    for k in np.unique(seg.name_id[keep]).tolist():  # the dtype and shape of the kept rows' tensors only
        info = tensors[seg.names[k]]
        heads[k] = (seg.names[k], info["dtype"], tuple(info["shape"]))
    offsets, lengths = seg.offsets.tolist(), seg.lengths.tolist()
    out = []
    for blocks, nid, fid, s, nd, bo, nb, crc in zip(seg.blocks_of(keep), *(c[keep].tolist() for c in (
            seg.name_id, seg.file_id, start, seg.ndim, seg.byte_offset, seg.nbytes, seg.crc32c)), strict=True):
        fqn, dtype, shape = heads[nid]  # (every kept row's is set above)
        out.append(fmt.chunk_record(fqn, dtype, shape, tuple(offsets[s : s + nd]), tuple(lengths[s : s + nd]),
                                   seg.files[fid], bo, nb, crc, blocks))
    limits.check_chunk_records(label, out)
    return out
