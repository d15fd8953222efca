"""The per-element half of the serving-delta format (FORMAT.md §13): where
a box's elements lie in a tensor, their positions' encoding (LEB128 gaps),
the element checksum, and the in-place writes a follower makes with them.

Split from :mod:`bytecp.format.serving_wire` (the files and their
documents), which re-exports every name here. The NumPy code is the
definition (``*_reference``); :mod:`bytecp.format.kernels` supplies the
compiled kernels when this install has them, checked against it. Called by
the writer (:mod:`bytecp.saving.serving`: encodes positions, sums boxes)
and the readers (:mod:`bytecp.serving.delta_apply`, ``iter_weights``:
decode, sum, change in place, put back).

The *element checksum* of a box is ``sum(w(i) * b_i) mod 2**64`` over its
elements, ``b_i`` the element's bits as an unsigned integer, ``i`` its
row-major linear index in the whole tensor and ``w(i)`` the ``(i+1)``-th
output of SplitMix64 seeded with 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from bytecp.errors import CorruptCheckpointError
from bytecp.format import kernels
from bytecp.tree.regions import Region, row_major_strides

__all__ = [
    "bits_dtype", "position_problem", "relocate", "run_start", "element_weights", "change_sum", "change_sum_reference", "swap_bits",
    "scatter_bits", "box_checksum", "encode_positions", "decode_positions", "decode_positions_reference",
]

_M64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
#: elements per piece of a whole box's checksum: small enough to stay in cache
_PIECE = 1 << 15


def bits_dtype(nbytes: int) -> np.dtype[Any]:
    """The unsigned integer type whose values are an element's bits."""
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[nbytes])


# -- positions ----------------------------------------------------------------
def _is_run(src: Region, dst: Region) -> bool:
    """Whether ``src`` lies in ``dst`` as one contiguous run of ``dst``'s row-major order."""
    if not dst.contains(src):
        return False
    d = next((k for k, n in enumerate(src.lengths) if n > 1), src.ndim)
    return all(src.lengths[k] == dst.lengths[k] for k in range(d + 1, src.ndim))


@functools.lru_cache(maxsize=4096)
def run_start(src: Region, dst: Region) -> int | None:
    """Where box ``src`` starts in box ``dst``'s row-major order when it lies
    there as one contiguous run (a position ``p`` of ``src`` is then ``p +``
    that in ``dst``); None when it does not. Cached: a follower asks it of
    the same boxes at every update."""
    if src.ndim == 0 or not _is_run(src, dst):
        return None
    return sum((o - b) * s for o, b, s in zip(src.offsets, dst.offsets, row_major_strides(dst.lengths), strict=True))


def relocate(p: np.ndarray, src: Region, dst: Region) -> tuple[np.ndarray | None, np.ndarray]:
    """Row-major positions ``p`` (int64) inside box ``src`` as positions inside
    box ``dst`` (both boxes of one tensor's global index space): ``(mask,
    q)``, ``mask`` saying which of ``p`` lie in ``dst`` (None: all of them)
    and ``q`` their positions there. ``dst = full_region(shape)`` gives the
    tensor's linear index."""
    if src.ndim == 0:
        return None, np.zeros(len(p), dtype=np.int64)
    start = run_start(src, dst)
    if start is not None:
        return None, (p + start if start else p)
    sstrides, dstrides = row_major_strides(src.lengths), row_major_strides(dst.lengths)
    q = np.zeros(len(p), dtype=np.int64)
    mask: np.ndarray | None = None
    for d in range(src.ndim):
        c = (p // sstrides[d]) % src.lengths[d] + (src.offsets[d] - dst.offsets[d])
        inside = (c >= 0) & (c < dst.lengths[d])
        mask = inside if mask is None else mask & inside
        q += c * dstrides[d]
    assert mask is not None
    if bool(mask.all()):
        return None, q
    return mask, q[mask]


# -- the element checksum -----------------------------------------------------
def element_weights(i: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``w(i)``: the ``(i+1)``-th output of SplitMix64 seeded with 0, for linear
    indices ``i`` (into ``out``, a uint64 array as long, when given)."""
    z = np.add(i, 1, out=out, dtype=np.uint64, casting="unsafe")
    t = np.empty_like(z)
    z *= _GAMMA
    np.right_shift(z, np.uint64(30), out=t)
    z ^= t
    z *= _MIX1
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= _MIX2
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t
    return z


def change_sum(g: np.ndarray, new: np.ndarray, old: np.ndarray) -> int:
    """``sum(w(g) * (new - old)) mod 2**64``: how the element checksum of a box
    moves when the elements at linear indices ``g`` (int64) go from bits
    ``old`` to ``new`` (one unsigned integer type); the compiled kernel when
    there is one (:mod:`bytecp.format.kernels`), else :func:`change_sum_reference`."""
    bits = bits_dtype(new.dtype.itemsize)  # as unsigned integers: a signed view sign-extends in NumPy
    new, old = _c(new, bits), _c(old, bits)
    k = kernels.compiled()
    if k is not None and len(g):
        return int(k.change_sum(_c(g, np.int64), new, old, bits.itemsize))
    return change_sum_reference(g, new, old)


def swap_bits(live: np.ndarray, q: np.ndarray, new: np.ndarray, g: np.ndarray | None, g_add: int = 0,
              journal: list[Any] | None = None, tag: Any = None) -> tuple[int, np.ndarray]:
    """Write ``new`` at positions ``q`` of ``live`` (flat, the elements' bits)
    in place: ``(change, old)``, the :func:`change_sum` of the change at
    linear indices ``g`` (None: ``q + g_add``) and the values replaced
    (``scatter_bits(live, q, old)`` puts them back). Every position is checked
    before anything is written. With a ``journal``, ``(tag, live, q, old)``
    is appended to it no later than the writes are made (in the same
    compiled call, or before the one NumPy assignment), so an interruption
    never leaves a write without its record. One pass over the elements'
    memory, by the compiled kernel when there is one."""
    k = kernels.compiled()
    if live.dtype.kind != "u":  # the bits as unsigned integers (a signed view sign-extends in NumPy's sums)
        live = live.view(bits_dtype(live.dtype.itemsize))
    q = _c(q, np.int64)
    new = _c(new, live.dtype)
    if k is not None and len(q) and live.flags.c_contiguous and live.flags.writeable:
        old = np.empty(len(q), dtype=live.dtype)
        change = k.swap_change_sum(live, q, new, None if g is None else _c(g, np.int64), g_add,
                                   live.dtype.itemsize, old, journal, tag)
        return int(change), old
    old = np.take(live, q)  # (raises before anything is written for a position outside)
    if journal is not None:
        journal.append((tag, live, q, old))
    live[q] = new
    return change_sum_reference(q + g_add if g is None else g, new, old), old


def scatter_bits(dst: np.ndarray, pos: np.ndarray, new: np.ndarray) -> None:
    """``dst[pos] = new`` (``dst`` flat, the elements' bits; every position
    checked before anything is written), by the compiled kernel when there is one."""
    k = kernels.compiled()
    if k is not None and len(pos) and dst.flags.c_contiguous and dst.flags.writeable:
        k.scatter(dst, _c(pos, np.int64), _c(new, dst.dtype), dst.dtype.itemsize)
    else:
        dst[pos] = new


def _c(a: np.ndarray, dtype: Any) -> np.ndarray:
    """``a`` contiguous in ``dtype``: a view where the bits are the same (an
    integer type of the same size), else converted."""
    a, want = np.ascontiguousarray(a), np.dtype(dtype)
    if a.dtype == want:
        return a
    if a.dtype.itemsize == want.itemsize and a.dtype.kind in "iu" and want.kind in "iu":
        return a.view(want)
    return a.astype(want)


def change_sum_reference(g: np.ndarray, new: np.ndarray, old: np.ndarray) -> int:
    """:func:`change_sum` in NumPy: the definition the compiled kernel is checked against."""
    total = 0
    w = np.empty(min(len(g), _PIECE), dtype=np.uint64)
    d = np.empty(min(len(g), _PIECE), dtype=np.uint64)
    for a in range(0, len(g), _PIECE):
        n = min(_PIECE, len(g) - a)
        ww, dd = element_weights(g[a:a + n], w[:n]), d[:n]
        np.subtract(new[a:a + n], old[a:a + n], out=dd, dtype=np.uint64, casting="unsafe")
        ww *= dd
        total += int(ww.sum(dtype=np.uint64))
    return total & _M64


def box_checksum(bits: np.ndarray, box: Region, shape: Sequence[int]) -> int:
    """The element checksum of box ``box`` of a tensor of ``shape`` whose
    elements' bits are ``bits`` (the box's, flat, row-major)."""
    full = Region((0,) * len(shape), tuple(shape))
    total = 0
    for a in range(0, box.numel, _PIECE):
        p = np.arange(a, min(box.numel, a + _PIECE), dtype=np.int64)
        _, g = relocate(p, box, full)
        total += int((element_weights(g) * bits[a:a + _PIECE].astype(np.uint64)).sum(dtype=np.uint64))
    return total & _M64


# -- position encoding: gaps as unsigned LEB128 ------------------------------
def encode_positions(p: np.ndarray) -> bytes:
    """Strictly increasing positions (int64) as the gaps between them (the
    first: the first position), each an unsigned LEB128 varint."""
    if len(p) == 0:
        return b""
    g = np.empty(len(p), dtype=np.int64)
    g[0] = p[0]
    np.subtract(p[1:], p[:-1], out=g[1:])
    top = int(g.max())
    if top < 1 << 7:  # every gap in one byte
        return g.astype(np.uint8).tobytes()
    if top < 1 << 14:  # in one or two bytes (the usual case): the low 7 bits with the high bit, then the rest
        isbig = g >= 1 << 7
        big = np.flatnonzero(isbig)
        shift = np.cumsum(isbig)  # each two-byte gap moves those after it one byte on
        at = np.arange(len(g), dtype=np.int64) + shift - isbig
        out = np.empty(len(g) + len(big), dtype=np.uint8)
        out[at] = (g & 0x7F).astype(np.uint8)
        out[at[big]] |= 0x80
        out[at[big] + 1] = (g[big] >> 7).astype(np.uint8)
        return out.tobytes()
    gu = g.astype(np.uint64)
    nb = np.ones(len(gu), dtype=np.int64)
    for k in range(1, 10):
        more = gu >= np.uint64(1 << (7 * k))
        if not more.any():
            break
        nb += more
    starts = np.cumsum(nb) - nb
    out = np.zeros(int(nb.sum()), dtype=np.uint8)
    for k in range(int(nb.max())):
        m = nb > k
        byte = (gu[m] >> np.uint64(7 * k)) & np.uint64(0x7F)
        byte |= np.where(nb[m] > k + 1, np.uint64(0x80), np.uint64(0))
        out[starts[m] + k] = byte.astype(np.uint8)
    return out.tobytes()


def decode_positions(buf: Any, count: int, numel: int, where: str) -> np.ndarray:
    """The ``count`` positions ``encode_positions`` wrote into ``buf``, each
    checked: strictly increasing, below ``numel``; the bytes used exactly."""
    b = np.frombuffer(buf, dtype=np.uint8)
    if count == 0:
        if len(b):
            raise CorruptCheckpointError(f"{where}: {len(b)} position bytes for no changed element")
        return np.zeros(0, dtype=np.int64)
    k = kernels.compiled()
    if k is not None:
        out = np.empty(count, dtype=np.int64)
        code = k.decode_positions(b, count, numel, out)
        if code == 0:
            return out
        raise CorruptCheckpointError(f"{where}: {position_problem(code, count, numel)}")
    return decode_positions_reference(b, count, numel, where)


def position_problem(code: int, count: int, numel: int) -> str:
    """What a decoder's failure ``code`` (1 to 4, as ``bytecp/format/_kernels.c``
    numbers them; the NumPy decoder words its own the same) says of ``count``
    positions in a box of ``numel`` elements."""
    return {
        1: f"the position bytes do not hold {count} values",
        2: "a position gap is longer than 9 bytes",
        3: f"positions are not strictly increasing inside the box's {numel} elements",
    }.get(code, f"a position lies outside its box of {numel} elements")


def decode_positions_reference(b: np.ndarray, count: int, numel: int, where: str) -> np.ndarray:
    """:func:`decode_positions` in NumPy (``b``: the bytes, ``count`` > 0):
    the definition the compiled kernel is checked against."""
    cont = np.flatnonzero(b >= 0x80)  # continuation bytes
    if len(cont) == 0 and len(b) == count:  # every gap in one byte
        return _checked(b.astype(np.int64), count, numel, where)
    if len(b) == count + len(cont) and len(cont) and cont[-1] < len(b) - 1 and not bool((b[cont + 1] >= 0x80).any()):
        # every gap in one or two bytes (the usual case): each value's last byte, the k-th two-byte
        # value's low 7 bits folded in (it is value cont[k] - k); gathers only, no boolean mask
        two = b[np.flatnonzero(b < 0x80)].astype(np.int64)
        at = cont - np.arange(len(cont))
        two[at] = (two[at] << 7) | (b[cont] & 0x7F)
        return _checked(two, count, numel, where)
    ends = np.flatnonzero(b < 0x80)
    if len(ends) != count or ends[-1] != len(b) - 1:
        raise CorruptCheckpointError(f"{where}: the position bytes hold {len(ends)} values, not {count}")
    g = b[ends].astype(np.uint64)  # each value's last byte: all of it for the one-byte ones
    lens = np.diff(ends, prepend=-1)
    multi = np.flatnonzero(lens > 1)  # the few longer ones, rebuilt from their bytes
    if len(multi):
        longest = int(lens[multi].max())
        if longest > 9:
            raise CorruptCheckpointError(f"{where}: {position_problem(2, count, numel)}")
        starts = ends[multi] - lens[multi] + 1
        val = np.zeros(len(multi), dtype=np.uint64)
        for k in range(longest):
            m = np.flatnonzero(lens[multi] > k)
            val[m] |= (b[starts[m] + k].astype(np.uint64) & np.uint64(0x7F)) << np.uint64(7 * k)
        g[multi] = val
    return _checked(g, count, numel, where)


def _checked(g: np.ndarray, count: int, numel: int, where: str) -> np.ndarray:
    """Positions from their gaps ``g``, checked: strictly increasing, below ``numel``."""
    if int(g.max()) >= numel or (count > 1 and int(g[1:].min()) < 1):
        raise CorruptCheckpointError(f"{where}: {position_problem(3, count, numel)}")
    pos = np.cumsum(g, dtype=np.int64) if g.dtype != np.int64 else np.cumsum(g)
    # gaps >= 1 and < numel: below 2**32 elements the sum cannot wrap, so the last position bounds them all
    if int(pos[-1]) >= numel or (numel > 1 << 32 and not bool((pos[1:] > pos[:-1]).all())):
        raise CorruptCheckpointError(f"{where}: {position_problem(4, count, numel)}")
    return pos
