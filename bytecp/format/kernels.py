"""The compiled kernels of serving deltas (``bytecp/format/_kernels.c``), when this install has them.

A follower applying serving deltas pays per changed element: decoding its
position, reading the value it replaces, the element checksum's weight and
sum, and writing the new value. In NumPy each of those is a pass of its own
(about 55 ns an element on the benchmark host, the replaced values read in
one pass and written in another); ``bytecp.format._kernels`` decodes in one
loop and reads, sums and writes in a second, each element's memory asked
for ahead, without the GIL: about 2.7 + 4.5 ns an element where the weights
are in the cache, 11-12 ns where they come from memory (elements far apart
each bring a cache line of their own); ``apply_deltas`` does both for every
box of an apply thread in one call. It is built at install time where a C compiler is
(pyproject.toml's ``ext-modules``, optional); where it is not, or when it
fails the check below, :func:`compiled` is None and
:mod:`bytecp.format.serving_elements` runs the NumPy code, which computes the
same values (and writes the same bits).

Loaded at the first call of :func:`compiled`. The module is used only when
its ABI number is this file's and it agrees with the NumPy reference on a
self-check (positions, sums and writes of every element size, a position
outside its box refused): a stale or broken build warns once and is not
used. ``BYTECP_KERNELS=0`` turns it off; ``1`` requires it (a missing or
failing build is then a :class:`ConfigError`).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np

from bytecp.format.extensions import Extension, first

__all__ = ["compiled", "engine", "ABI", "load"]

log = logging.getLogger("bytecp.format.kernels")

#: the interface this Python expects of ``bytecp.format._kernels`` (its ``ABI``)
ABI = 3
_EXTENSION = Extension("bytecp.format._kernels", ABI, "BYTECP_KERNELS", "kernels", "serving deltas run in NumPy",
                       "NumPy kernels only", log)


def _self_check(k: Any) -> str | None:
    """Why ``k`` cannot be used (None: it agrees with the NumPy reference)."""
    from bytecp.format import serving_elements as wire

    rng = np.random.default_rng(7)
    pos = np.unique(rng.integers(0, 1 << 40, 300, dtype=np.int64))
    raw = wire.encode_positions(pos)
    out = np.empty(len(pos), dtype=np.int64)
    if k.decode_positions(raw, len(pos), 1 << 40, out) != 0 or not np.array_equal(out, pos):
        return "decode_positions differs from the NumPy decoder"
    damaged = {1: (raw + b"\x01", len(pos), 1 << 40), 2: (b"\x80" * 9 + b"\x01", 1, 1 << 40),
               3: (b"\x05\x00\x01", 3, 100), 4: (raw, len(pos), int(pos[-1]))}
    for code, (buf, count, numel) in damaged.items():
        if k.decode_positions(buf, count, numel, np.empty(count, dtype=np.int64)) != code:
            return f"decode_positions does not refuse damaged positions as the NumPy decoder does (case {code})"
    for size in (1, 2, 4, 8):
        bits = wire.bits_dtype(size)
        held = rng.integers(0, np.iinfo(bits).max, 1000, dtype=bits, endpoint=True)
        q = np.unique(rng.integers(0, 1000, 200, dtype=np.int64))
        new = rng.integers(0, np.iinfo(bits).max, len(q), dtype=bits, endpoint=True)
        g = q * 3 + 11
        want = wire.change_sum_reference(g, new, held[q])
        ref = held.copy()
        ref[q] = new
        swapped, old = held.copy(), np.empty(len(q), dtype=bits)
        if k.change_sum(g, new, held[q], size) != want or k.swap_change_sum(swapped, q, new, g, 0, size, old) != want \
                or k.swap_change_sum(held.copy(), q, new, None, 5, size, old) != \
                wire.change_sum_reference(q + 5, new, held[q]):
            return f"the element checksum differs from the NumPy one ({size}-byte elements)"
        if not np.array_equal(swapped, ref) or not np.array_equal(old, held[q]):
            return f"the in-place change differs from NumPy's ({size}-byte elements)"
        k.scatter(swapped, q, old, size)
        if not np.array_equal(swapped, held):
            return f"scatter differs from NumPy's ({size}-byte elements)"
        journal: list[Any] = []
        k.swap_change_sum(swapped, q, new, None, 0, size, old, journal, "tag")
        if len(journal) != 1 or journal[0][0] != "tag" or journal[0][1] is not swapped or journal[0][3] is not old:
            return "swap_change_sum does not record its change in the journal"
        far = np.append(q, len(held)).astype(np.int64)
        try:
            k.swap_change_sum(swapped, far, np.append(new, new[:1]), None, 0, size, np.empty(len(far), bits))
        except IndexError:
            pass
        else:
            return "swap_change_sum accepts a position outside its tensor"
        if not np.array_equal(swapped, ref):
            return "swap_change_sum writes before it refuses a position outside its tensor"
        why = _check_batch(k, wire, held, q, new, size)
        if why is not None:
            return why
    return None


def _check_batch(k: Any, wire: Any, held: np.ndarray, q: np.ndarray, new: np.ndarray, size: int) -> str | None:
    """``apply_deltas`` against NumPy: two steps of a box at element 100 of a
    tensor (each decoded, summed, written, recorded), and a box whose first
    step is damaged (nothing of it written, its second step not taken)."""
    bits = held.dtype
    box = 600
    q2 = q[q < box][::2]
    steps = [(q[q < box], new[q < box]), (q2, (new[q < box][::2] ^ 1).astype(bits))]
    live, ref = held.copy(), held.copy()
    want = []
    for p, v in steps:
        want.append(wire.change_sum_reference(p + 100 + 7, v, ref[p + 100]))
        ref[p + 100] = v
    recs: list[Any] = []
    jobs = [(live, v.tobytes() + wire.encode_positions(p), len(p), box, size, 100, 7, np.empty(len(p), np.int64),
             np.empty(len(p), bits), recs, "t", 0) for p, v in steps]
    other, other_recs = held.copy(), list[Any]()
    p, v = steps[0]
    jobs += [(other, v.tobytes() + b"\x80" * 9 + b"\x01", len(p), box, size, 0, 0, np.empty(len(p), np.int64),
              np.empty(len(p), bits), other_recs, "u", 1)] + [(other, *jobs[1][1:9], other_recs, "u", 1)]
    got = k.apply_deltas(jobs)
    if [c for c, _ in got] != [0, 0, 1, 6] or [t for _, t in got[:2]] != want:
        return f"apply_deltas differs from the NumPy kernels ({size}-byte elements)"
    if not np.array_equal(live, ref) or not np.array_equal(other, held) or other_recs or len(recs) != 2 \
            or recs[0][1] is not live or not np.array_equal(recs[1][3], steps[0][1][::2]):
        return f"apply_deltas writes or records otherwise than the NumPy kernels ({size}-byte elements)"
    for _tag, h, pos, old in reversed(recs):
        k.scatter(h, pos, old, size)
    return None if np.array_equal(live, held) else f"apply_deltas' records do not undo it ({size}-byte elements)"


def load() -> ModuleType | None:
    """``bytecp.format._kernels`` when it is built, current and agrees (see the module's docstring); else None."""
    return _EXTENSION.load(lambda k: _self_check(k))


_LOADED: list[ModuleType | None] = []


def compiled() -> ModuleType | None:
    """The kernels to use (None: NumPy's), loaded and checked at the first call."""
    return first(_LOADED, load)


def engine() -> str:
    """Which kernels serving deltas run on: ``"c"`` or ``"numpy"``."""
    return "numpy" if compiled() is None else "c"
