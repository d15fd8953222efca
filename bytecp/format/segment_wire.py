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
UTF-8 bytes zero-padded to a multiple of 8. The decoder checks every count
against the segment's real length before it looks at anything the counts
locate, so no crafted count makes it allocate or loop beyond the bytes read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from bytecp.errors import CorruptCheckpointError
from bytecp.format import limits
from bytecp.format import metadata as fmt

__all__ = ["MAGIC", "HEADER_WORDS", "SegmentRows", "encode", "encode_rows", "decode", "to_records"]

#: first word of a segment (the bytes "bcpSG4", then version 1: 0x00 0x01)
MAGIC = int.from_bytes(b"bcpSG4\x00\x01", "little")
#: MAGIC, n, m, f, D, S
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

    def __len__(self) -> int:
        return len(self.name_id)


def encode(save_id: str, names: Sequence[str], files: Sequence[str], name_id: np.ndarray, file_id: np.ndarray,
           ndim: np.ndarray, byte_offset: np.ndarray, nbytes: np.ndarray, crc: np.ndarray,
           offsets: np.ndarray, lengths: np.ndarray) -> bytes:
    """The segment of these columns, as given (``names`` ascending, ids into
    ``names`` and ``files``, ``offsets``/``lengths`` flat): no check here, so
    tests can craft damaged segments with it."""
    strings = [s.encode() for s in (save_id, *names, *files)]
    tail = b"".join(strings)
    n = len(name_id)
    head = [MAGIC, n, len(names), len(files), len(offsets), len(tail)]
    words = np.concatenate([
        np.asarray(head, np.int64),
        *(np.asarray(c, np.int64).reshape(-1) for c in (name_id, file_id, ndim, byte_offset, nbytes, crc,
                                                        offsets, lengths)),
        np.asarray([len(s) for s in strings], np.int64),
    ]).astype("<i8", copy=False)
    return words.tobytes() + tail + b"\0" * (-len(tail) % 8)


def encode_rows(save_id: str, names: Sequence[str], files: Sequence[str], fid: np.ndarray, file: np.ndarray,
                ndim: np.ndarray, byte_offset: np.ndarray, nbytes: np.ndarray, crc: np.ndarray,
                O: np.ndarray, L: np.ndarray) -> bytes:  # noqa: E741, N803
    """(every rank, at commit) One segment of a rank's rows, in the order
    given: ``fid``/``file`` index the rank's ``names`` (sorted) and ``files``,
    ``O``/``L`` are padded to the most dimensions (the first ``ndim`` of each
    row count). Only the names and files these rows use are listed."""
    used_n, name_id = np.unique(fid, return_inverse=True)
    used_f, file_id = np.unique(file, return_inverse=True)
    mask = np.arange(O.shape[1])[None, :] < ndim[:, None]
    return encode(save_id, [names[i] for i in used_n.tolist()], [files[i] for i in used_f.tolist()],
                  name_id, file_id, ndim, byte_offset, nbytes, crc, O[mask], L[mask])


def decode(label: str, buf: bytes | bytearray | memoryview, rows: int, save_id: str) -> SegmentRows:
    """``buf`` (one segment, its crc32c already checked) decoded and checked
    as FORMAT.md §5.6 says a reader MUST: ``rows`` the directory's count,
    ``save_id`` the checkpoint's. Any failure is one line starting with ``label``."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{label}: {why}; the index is corrupt")

    size = len(buf)
    if size % 8 or size < 8 * HEADER_WORDS:
        raise bad(f"{size} bytes are not a segment (a header of {HEADER_WORDS} 64-bit words, then whole words)")
    words = np.frombuffer(buf, "<i8")
    magic, n, m, f, dims, nstr = words[:HEADER_WORDS].tolist()
    if magic != MAGIC:
        raise bad(f"its first word {magic:#018x} is not the segment magic {MAGIC:#018x}")
    if min(n, m, f, dims, nstr) < 0:
        raise bad(f"its header declares a negative count (rows {n}, names {m}, files {f}, dims {dims}, "
                  f"string bytes {nstr})")
    if n != rows:
        raise CorruptCheckpointError(f"{label} has {n} rows, the directory says {rows}")
    need = 8 * (HEADER_WORDS + 6 * n + 2 * dims + 1 + m + f) + -(-nstr // 8) * 8  # Python ints: no overflow
    if need != size:
        raise bad(f"its header (rows {n}, names {m}, files {f}, dims {dims}, string bytes {nstr}) makes it {need} "
                  f"bytes, not {size}{' (trailing bytes)' if need < size else ''}")
    at = HEADER_WORDS
    table = words[at : at + 6 * n].reshape(6, n)  # one row per column
    name_id, file_id, ndim, byte_offset, nbytes, crc = table
    at += 6 * n
    boxes = words[at : at + 2 * dims]
    offsets, lengths = boxes[:dims], boxes[dims:]
    at += 2 * dims
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
    strings = []
    pos = 0
    for k, ln in enumerate(strlen.tolist()):
        try:
            strings.append(str(raw[pos : pos + ln], "utf-8"))
        except UnicodeDecodeError:
            raise bad(f"string {k} is not UTF-8") from None
        pos += ln
    got, names, files = strings[0], strings[1 : 1 + m], strings[1 + m :]
    if got != save_id:
        raise CorruptCheckpointError(f"{label} belongs to save {got[:40]!r}, not to this checkpoint's {save_id!r}; "
                                     "the index is corrupt")
    if (i := next((k for k in range(1, m) if not names[k - 1] < names[k]), None)) is not None:
        raise bad(f"its tensor names are not strictly ascending ({names[i - 1]!r:.80} then {names[i]!r:.80})")
    return SegmentRows(got, names, files, name_id, file_id, ndim, byte_offset, nbytes, crc, offsets, lengths)


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


def to_records(seg: SegmentRows, md: fmt.Metadata, label: str, fqns: set[str] | None) -> list[fmt.ChunkRecord]:
    """The rows of tensors ``fqns`` (None: all) as chunk records, in segment
    order: a row naming a tensor ``metadata.json`` lacks is refused (any row,
    kept or not), each kept row's box checked as well formed
    (:func:`bytecp.format.limits.check_chunk_records`). Records are built for
    the kept rows only."""
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
    start = np.cumsum(seg.ndim) - seg.ndim
    heads: list[tuple[str, str, tuple[int, ...]] | None] = [None] * m
    for k in np.unique(seg.name_id[keep]).tolist():  # the dtype and shape of the kept rows' tensors only
        info = tensors[seg.names[k]]
        heads[k] = (seg.names[k], info["dtype"], tuple(info["shape"]))
    offsets, lengths = seg.offsets.tolist(), seg.lengths.tolist()
    out = []
    for nid, fid, s, nd, bo, nb, crc in zip(*(c[keep].tolist() for c in (
            seg.name_id, seg.file_id, start, seg.ndim, seg.byte_offset, seg.nbytes, seg.crc32c)), strict=True):
        fqn, dtype, shape = heads[nid]  # (every kept row's is set above)
        out.append(fmt.ChunkRecord(fqn, dtype, shape, tuple(offsets[s : s + nd]), tuple(lengths[s : s + nd]),
                                   seg.files[fid], bo, nb, crc))
    limits.check_chunk_records(label, out)
    return out
