"""The union of the ranks' tensor tables at a commit, merged as columns.

Called by the coordinator's commit (:func:`bytecp.saving.commit.described_union`)
when it builds a new union: the lowest rank of each distinct skeleton sends
its tensors' dtypes and shapes as a table (:func:`sent_table`, built on
that rank, with its names' hashes), and every tensor two ranks both describe must have the
same dtype and shape. A DeepSeek-V3-like state sends 63 tables of 6,188
tensors, of which 3,400 (the dense layers) every table repeats: merged as
dicts of dicts they took 0.26 s and 31 MB pickled; here each table costs one
dict lookup per name and a few NumPy operations.
"""

from __future__ import annotations

import itertools
import math
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


class _Columns:
    """The union so far, in columns sized for every table's rows at once
    (the union is at most that long): rows are appended, never moved."""

    def __init__(self, rows: int, dims: int) -> None:
        self.n = 0
        self.n_dims = 0
        self.dtype = np.zeros(rows, np.int64)
        self.ndim = np.zeros(rows, np.int64)
        self.start = np.zeros(rows, np.int64)
        self.rank = np.zeros(rows, np.int64)
        self.dims = np.zeros(dims, np.int64)

    def add(self, dtype: np.ndarray, ndim: np.ndarray, dims: np.ndarray, rank: int) -> None:
        n, m = self.n, self.n + len(dtype)
        self.dtype[n:m], self.ndim[n:m], self.rank[n:m] = dtype, ndim, rank
        self.start[n:m] = self.n_dims + np.cumsum(ndim) - ndim
        self.dims[self.n_dims: self.n_dims + len(dims)] = dims
        self.n, self.n_dims = m, self.n_dims + len(dims)


def sent_table(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """(a rank that sends its tensors at commit) ``specs`` as a table
    (:func:`~bytecp.format.tensor_table.table_json`) with its names'
    :func:`~bytecp.format.chunk_batch.fqn_hashes` (``hashes``: the
    coordinator's directory looks names up by them)."""
    table = table_json(specs)
    return table | {"hashes": fqn_hashes(table["names"])}


def union_tables(tables: Sequence[tuple[int, Mapping[str, Any]]]) -> tuple[TensorTable, np.ndarray]:
    """(coordinator, at commit) The union of ``tables`` ((rank, its
    :func:`sent_table` or :func:`~bytecp.format.tensor_table.table_json`),
    the coordinator's first): the first's tensors in its order, then each
    next table's new ones in its order; and their names' hashes, in that
    order. Raises :class:`ConfigError` naming the tensor and both ranks
    when two ranks give a tensor different dtypes or shapes."""
    names: list[str] = []
    row: dict[str, int] = {}
    code: dict[str, int] = {}
    hashes: list[np.ndarray] = [np.zeros(0, np.uint64)]
    cols = _Columns(sum(len(t["names"]) for _, t in tables), sum(len(t["dims"]) for _, t in tables))
    for rank, t in tables:
        their = np.asarray([code.setdefault(d, len(code)) for d in t["dtypes"]], np.int64)
        dtype = their[np.asarray(t["dtype"], np.int64)] if len(their) else np.zeros(0, np.int64)
        ndim, dims = np.asarray(t["ndim"], np.int64), np.asarray(t["dims"], np.int64)
        tn = t["names"]
        rows = np.fromiter(map(row.get, tn, itertools.repeat(-1)), np.int64, len(tn))
        starts = np.cumsum(ndim) - ndim
        old = np.flatnonzero(rows >= 0)
        if len(old):
            _check(names, list(code), cols, rows[old], old, (dtype, ndim, dims, starts), rank)
        new = np.flatnonzero(rows < 0)
        if len(new):
            add = [tn[i] for i in new.tolist()]
            row.update(zip(add, range(len(names), len(names) + len(add)), strict=True))
            names += add
            hashes.append(fqn_hashes(add) if t.get("hashes") is None else np.asarray(t["hashes"], np.uint64)[new])
            cols.add(dtype[new], ndim[new], dims[_ragged(starts[new], ndim[new])], rank)
    dtypes = sorted(code)  # (listed sorted, as table_json lists them)
    recode = np.asarray([dtypes.index(d) for d in code], np.int64)
    dtype = recode[cols.dtype[:cols.n]] if len(recode) else cols.dtype[:cols.n]
    return TensorTable(names, dtypes, dtype.astype(np.uint8 if len(dtypes) <= 256 else np.int64),
                       cols.ndim[:cols.n].astype(np.uint8), cols.dims[:cols.n_dims].copy(), rows=row), \
        np.concatenate(hashes)


def _check(names: list[str], dtypes: list[str], union: _Columns, at: np.ndarray, old: np.ndarray,
           table: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], rank: int) -> None:
    """Every tensor of rank ``rank``'s ``table`` (dtype codes, ndim, dims,
    starts) at rows ``old`` (the union's rows ``at``) the same dtype and
    shape as the union holds."""
    dtype, ndim, dims, starts = table
    bad = (union.dtype[at] != dtype[old]) | (union.ndim[at] != ndim[old])
    alike = np.flatnonzero(~bad)
    lens = ndim[old[alike]]
    differ = union.dims[_ragged(union.start[at[alike]], lens)] != dims[_ragged(starts[old[alike]], lens)]
    if differ.any():
        bad[alike[np.repeat(np.arange(len(alike)), lens)[differ]]] = True
    if not bad.any():
        return
    k = int(np.flatnonzero(bad)[0])
    i, j = int(at[k]), int(old[k])
    theirs = dims[int(starts[j]): int(starts[j]) + int(ndim[j])].tolist()
    ours = union.dims[int(union.start[i]): int(union.start[i]) + int(union.ndim[i])].tolist()
    raise ConfigError(
        f"tensor {names[i]!r}: rank {int(union.rank[i])} has dtype {dtypes[int(union.dtype[i])]} shape {ours} "
        f"but rank {rank} has dtype {dtypes[int(dtype[j])]} shape {theirs}; every rank must describe the same "
        "global tensor"
    )


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
