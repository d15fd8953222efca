"""The union of the ranks' tensor tables at a job's first save, merged as columns.

Called by the coordinator (:func:`bytecp.saving.union.described_union`) when
it builds a new union at a job's first save: the lowest rank of each distinct skeleton sends
its tensors' dtypes and shapes as a table (:func:`sent_table`, built on
that rank, with its names' hashes), and every tensor two ranks both
describe must have the same dtype and shape. A DeepSeek-V3-like state sends
63 tables of 6,188 tensors, of which 3,400 (the dense layers) every table
repeats: merged as dicts of dicts, name by name, they took 0.26 s and 31 MB
pickled; here the tables are matched by their names' hashes in NumPy, and
each name is touched once more only to compare it with the first of its hash.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bytecp.errors import ConfigError
from bytecp.format.chunk_batch import fqn_hashes
from bytecp.format.tensor_table import TensorTable, table_json

__all__ = ["sent_table", "union_tables", "elements_of"]


def _ragged(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The positions ``starts[i] .. starts[i] + lens[i] - 1`` of every ``i``, in order."""
    if not len(lens):
        return np.zeros(0, np.int64)
    ends = np.cumsum(lens)
    return np.repeat(starts - ends + lens, lens) + np.arange(int(ends[-1]), dtype=np.int64)


def sent_table(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """(a rank that sends its tensors at a job's first save) ``specs`` as a table
    (:func:`~bytecp.format.tensor_table.table_json`), its numbers as NumPy
    arrays, with its names' :func:`~bytecp.format.chunk_batch.fqn_hashes`
    (``hashes``: the coordinator matches tensors and looks names up by them)."""
    table = table_json(specs)
    return table | {"hashes": fqn_hashes(table["names"]), "dtype": np.asarray(table["dtype"], np.uint8 if len(
        table["dtypes"]) <= 256 else np.int64), "ndim": np.asarray(table["ndim"], np.uint8),
        "dims": np.asarray(table["dims"], np.int64)}


def union_tables(tables: Sequence[tuple[int, Mapping[str, Any]]]) -> tuple[TensorTable, np.ndarray]:
    """(coordinator, on the union's thread) The union of ``tables`` ((rank, its
    :func:`sent_table` or :func:`~bytecp.format.tensor_table.table_json`),
    the coordinator's first): the first's tensors in its order, then each
    next table's new ones in its order; and their names' hashes, in that
    order. Tensors are matched by their names' hashes (NumPy; no name is
    hashed or looked up here), then checked name by name. Raises
    :class:`ConfigError` naming the tensor and both ranks when two ranks
    give a tensor different dtypes or shapes."""
    code: dict[str, int] = {}
    cols: dict[str, list[np.ndarray]] = {"hash": [], "dtype": [], "ndim": [], "dims": [], "rank": []}
    for rank, t in tables:
        their = np.asarray([code.setdefault(d, len(code)) for d in t["dtypes"]], np.int64)
        cols["dtype"].append(their[np.asarray(t["dtype"], np.int64)] if len(their) else np.zeros(0, np.int64))
        cols["ndim"].append(np.asarray(t["ndim"], np.int64))
        cols["dims"].append(np.asarray(t["dims"], np.int64))
        cols["hash"].append(fqn_hashes(t["names"]) if t.get("hashes") is None else np.asarray(t["hashes"], np.uint64))
        cols["rank"].append(np.full(len(t["names"]), rank, np.int64))
    hashes, dtype, ndim, dims, ranks = (np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols.values())
    every = list(itertools.chain.from_iterable(t["names"] for _, t in tables))
    starts = np.cumsum(ndim) - ndim
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    keep = np.sort(first)  # each tensor where a table first names it: the union's rows, in order
    seen = first[inverse.reshape(-1)]
    again = np.flatnonzero(seen != np.arange(len(hashes)))  # every later mention, and its first
    _check(every, list(code), (dtype, ndim, dims, starts, ranks), again, seen[again])
    names = list(_pick(every, keep))
    dtypes = sorted(code)  # (listed sorted, as table_json lists them)
    recode = np.asarray([dtypes.index(d) for d in code], np.int64)
    union_dtype = recode[dtype[keep]] if len(recode) else dtype[keep]
    return TensorTable(names, dtypes, union_dtype.astype(np.uint8 if len(dtypes) <= 256 else np.int64),
                       ndim[keep].astype(np.uint8), dims[_ragged(starts[keep], ndim[keep])]), hashes[keep].astype(np.uint64)


def _pick(items: list[str], at: np.ndarray) -> Sequence[str]:
    """``items`` at positions ``at`` (gathered in C)."""
    if len(at) == 0:
        return []
    got = operator.itemgetter(*at.tolist())(items)
    return got if len(at) > 1 else [got]


def _check(names: list[str], dtypes: list[str], table: tuple[np.ndarray, ...], again: np.ndarray,
           first: np.ndarray) -> None:
    """Every later mention ``again`` of a tensor (in the tables' concatenated
    rows: dtype codes, ndim, dims, starts, ranks) the same name, dtype and
    shape as its first mention ``first``."""
    dtype, ndim, dims, starts, ranks = table
    if any(map(operator.ne, _pick(names, again), _pick(names, first))):  # (64-bit hashes of two names alike)
        k = next(k for k, (a, b) in enumerate(zip(_pick(names, again), _pick(names, first), strict=True)) if a != b)
        raise ConfigError(f"tensor names {names[int(first[k])]!r} and {names[int(again[k])]!r} collide in the "
                          "commit's 64-bit name hash; rename one")
    bad = (dtype[again] != dtype[first]) | (ndim[again] != ndim[first])
    alike = np.flatnonzero(~bad)
    lens = ndim[again[alike]]
    differ = dims[_ragged(starts[first[alike]], lens)] != dims[_ragged(starts[again[alike]], lens)]
    if differ.any():
        bad[alike[np.repeat(np.arange(len(alike)), lens)[differ]]] = True
    if not bad.any():
        return
    k = int(np.flatnonzero(bad)[0])
    i, j = int(first[k]), int(again[k])

    def said(x: int) -> str:
        return f"dtype {dtypes[int(dtype[x])]} shape {dims[int(starts[x]): int(starts[x]) + int(ndim[x])].tolist()}"

    raise ConfigError(f"tensor {names[i]!r}: rank {int(ranks[i])} has {said(i)} but rank {int(ranks[j])} has "
                      f"{said(j)}; every rank must describe the same global tensor")


def elements_of(table: TensorTable) -> int:
    """The elements of every tensor of ``table``, all together (exact)."""
    shaped = np.flatnonzero(table.ndim > 0)
    if not len(shaped):
        return len(table)
    with np.errstate(over="ignore"):
        approx = np.multiply.reduceat(table.dims.astype(np.float64), table.start[shaped])
    if float(approx.sum()) + len(table) < 2.0 ** 62:  # int64 products and their sum are exact below that
        return int(np.multiply.reduceat(table.dims, table.start[shaped]).sum()) + len(table) - len(shaped)
    return sum(math.prod(table.shape(i)) for i in range(len(table)))
