"""``metadata.json``'s tensors as columns (format version 4, docs/FORMAT.md §6.2).

Versions 1-3 list every tensor as an object ``{fqn: {"dtype", "shape"}}``;
for a DeepSeek-V3-like state of 181,580 tensors that is 15 MB of JSON which
every loading rank turned into 181,580 dicts and lists (about 80 MB). Version 4
writes four arrays -- the names, the distinct dtypes, each tensor's dtype
index and its shape's dimensions one after the other, with each shape's
length -- and a reader keeps them as a :class:`TensorTable`: a read-only
mapping with the same interface (``md.tensors[fqn]`` gives ``{"dtype": ...,
"shape": [...]}``), built on first use per tensor.

Written by :meth:`bytecp.format.metadata.Metadata.to_bytes`
(:func:`table_json`), read by :meth:`~bytecp.format.metadata.Metadata.from_bytes`
(:meth:`TensorTable.from_json`, which checks every value before anything is
trusted: one line naming the tensor at fault).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from bytecp.errors import CorruptCheckpointError
from bytecp.tree.dtype_names import ITEMSIZES

__all__ = ["TensorTable", "table_json", "spec_of", "MAX_NDIM"]

#: the most dimensions a tensor may have (bytecp.format.limits.MAX_NDIM; torch's own limit is 25 for most ops)
MAX_NDIM = 64
#: rows whose dtype and shape a table keeps once asked for (a rank's load of a MoE's tens of thousands)
SPECS_KEPT = 1 << 15


def table_json(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """(coordinator, at commit) The version-4 form of ``specs``, in their order
    (the state's: exports and serving list tensors in it)."""
    if isinstance(specs, TensorTable):
        return specs.to_json()
    names = list(specs)
    dtypes = sorted({specs[n]["dtype"] for n in names})
    code = {d: i for i, d in enumerate(dtypes)}
    shapes = [specs[n]["shape"] for n in names]
    return {"names": names, "dtypes": dtypes, "dtype": [code[specs[n]["dtype"]] for n in names],
            "ndim": [len(s) for s in shapes], "dims": [d for s in shapes for d in s]}


class TensorTable(Mapping[str, dict[str, Any]]):
    """Every stored tensor's dtype and shape, by FQN, as columns."""

    def __init__(self, names: list[str], dtypes: list[str], dtype: np.ndarray, ndim: np.ndarray,
                 dims: np.ndarray) -> None:
        self.names = names
        self.dtypes = dtypes
        self.dtype = dtype
        self.ndim = ndim
        self.dims = dims
        self._numbered = False
        #: row -> (dtype, shape) of the first :data:`SPECS_KEPT` rows asked for: a load asks each of its
        #: tensors' several times (its rows, its plan, its targets), and reading a row out of the arrays
        #: costs microseconds; a reader of every row of a huge table (``verify``, the coordinator's
        #: checks) keeps no more than that many (about 8 MB)
        self._specs: dict[int, tuple[str, tuple[int, ...]]] = {}
        #: answers computed from the table by its readers (it never changes): the commit's checks keep
        #: their columns of its names and shapes here, made once for the saves that share the table
        self.memo: dict[Any, Any] = {}

    @classmethod
    def of(cls, specs: Mapping[str, Mapping[str, Any]]) -> TensorTable:
        """``specs`` (``{fqn: {"dtype", "shape"}}``, checked by their maker) as a table, in their order."""
        t = table_json(specs)
        return cls(t["names"], t["dtypes"], np.asarray(t["dtype"], np.uint8 if len(t["dtypes"]) <= 256 else np.int64),
                   np.asarray(t["ndim"], np.uint8), np.asarray(t["dims"], np.int64))

    @functools.cached_property
    def _row(self) -> dict[str, Any]:
        """fqn -> its row; until a row is asked for, fqn -> the table's own
        string (enough for ``in`` and :meth:`shared`: a reader that checks
        names but looks none up keeps no int per tensor, 5.8 MB for 181,580
        tensors). Made on first use (a commit that only writes the table's
        text makes none)."""
        return dict(zip(self.names, self.names, strict=True))

    @functools.cached_property
    def start(self) -> np.ndarray:
        """Where each tensor's dimensions begin in ``dims`` (made on first use)."""
        return np.cumsum(self.ndim, dtype=np.int64) - self.ndim

    @classmethod
    def from_json(cls, d: Any, where: str) -> TensorTable:
        """Parse and check the version-4 ``tensors`` member."""

        def bad(what: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: metadata.json {what}; the checkpoint is corrupt or was "
                                          "tampered with")

        if not isinstance(d, dict) or set(d) != {"names", "dtypes", "dtype", "ndim", "dims"} or not all(
                type(v) is list for v in d.values()):
            raise bad("has a tensors table without exactly the arrays names, dtypes, dtype, ndim and dims")
        names, dtypes = d["names"], d["dtypes"]
        n = len(names)
        if len(d["dtype"]) != n or len(d["ndim"]) != n:
            raise bad(f"lists {n} tensor names but {len(d['dtype'])} dtypes and {len(d['ndim'])} shapes")
        if not set(map(type, names)) <= {str}:
            k = next(k for k, name in enumerate(names) if type(name) is not str)
            raise bad(f"names tensor {k} {names[k]!r:.80}, not a string")
        for t in dtypes:
            if type(t) is not str or t not in ITEMSIZES:
                raise bad(f"lists the unknown dtype {t!r:.40}")
        ints = [_ints(d[k], k, bad) for k in ("dtype", "ndim", "dims")]
        dtype, ndim, dims = ints
        wrong = np.flatnonzero((dtype < 0) | (dtype >= len(dtypes)) | (ndim < 0) | (ndim > MAX_NDIM))
        if len(wrong):
            i = int(wrong[0])
            raise bad(f"gives tensor {names[i]!r:.80} dtype number {int(dtype[i])} of {len(dtypes)} and "
                      f"{int(ndim[i])} dimensions (want at most {MAX_NDIM})")
        if int(ndim.sum()) != len(dims):
            raise bad(f"gives its tensors {int(ndim.sum())} dimensions in all but lists {len(dims)}")
        if len(dims) and int(dims.min()) < 0:
            k = int(np.flatnonzero(dims < 0)[0])
            i = int(np.searchsorted(np.cumsum(ndim), k, side="right"))
            raise bad(f"gives tensor {names[i]!r:.80} a negative dimension {int(dims[k])}")
        # (checked: a tensor has at most MAX_NDIM dimensions, a dtype number below len(dtypes))
        table = cls(names, dtypes, dtype.astype(np.uint8) if len(dtypes) <= 256 else dtype, ndim.astype(np.uint8),
                    dims)
        if len(table._row) != n:
            seen: set[str] = set()
            dup = next(x for x in names if x in seen or seen.add(x))  # type: ignore[func-returns-value]
            raise bad(f"lists tensor {dup!r:.80} twice")
        return table

    def shared(self, fqn: str) -> str:
        """This table's own string equal to ``fqn`` (``fqn`` itself if none):
        the skeleton's leaves keep it rather than a copy."""
        own = self._row.get(fqn)
        return fqn if own is None else own if type(own) is str else self.names[own]

    def _rows(self) -> dict[str, int]:
        """fqn -> row (numbered in place on first use)."""
        if not self._numbered:
            row = self._row
            for i, n in enumerate(self.names):
                row[n] = i
            self._numbered = True
        return self._row

    def rows_of(self, names: list[str]) -> np.ndarray:
        """Each name's row in the table, -1 where it has none."""
        row = self._rows()
        return np.fromiter((row.get(n, -1) for n in names), np.int64, len(names))

    def to_json(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "dtype": self.dtype.tolist(),
                "ndim": self.ndim.tolist(), "dims": self.dims.tolist()}

    def _spec(self, i: int) -> tuple[str, tuple[int, ...]]:
        specs = self._specs
        got = specs.get(i)
        if got is None:
            a = int(self.start[i])
            got = (self.dtypes[int(self.dtype[i])], tuple(self.dims[a: a + int(self.ndim[i])].tolist()))
            if len(specs) < SPECS_KEPT:
                specs[i] = got
        return got

    def spec(self, fqn: str) -> tuple[str, tuple[int, ...]]:
        """``fqn``'s dtype and shape (``KeyError`` if the table lacks it), without the
        dict and list of ``self[fqn]``: a load asks it several times per row it reads."""
        return self._spec(self._rows()[fqn])

    def shape(self, i: int) -> list[int]:
        return list(self._spec(i)[1])

    def __getitem__(self, fqn: str) -> dict[str, Any]:
        dtype, shape = self._spec(self._rows()[fqn])
        return {"dtype": dtype, "shape": list(shape)}

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._row

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def empty_count(self) -> int:
        """How many tensors have no element (a dimension of 0); counted once (the index's
        row budget and a whole-tensor load's index read both ask)."""
        got = self.memo.get("empty_count")
        if got is None:
            shaped = np.flatnonzero(self.ndim > 0)
            zeros = np.add.reduceat((self.dims == 0).astype(np.int64), self.start[shaped]) if len(shaped) else shaped
            got = self.memo["empty_count"] = int((zeros > 0).sum())
        return int(got)

    def first_over(self, budget: int) -> int | None:
        """The first tensor (in table order) at which the tensors' bytes so far
        exceed ``budget``, or None (their total fits)."""
        numel = np.ones(len(self.names))
        shaped = np.flatnonzero(self.ndim > 0)
        if len(shaped):  # float products: no overflow (a crafted shape gives inf), exact below 2**53
            with np.errstate(over="ignore"):
                numel[shaped] = np.multiply.reduceat(self.dims.astype(np.float64), self.start[shaped])
        approx = numel * np.asarray([ITEMSIZES[t] for t in self.dtypes], np.float64)[self.dtype]
        if float(approx.sum()) < budget * (1 - 1e-9):
            return None
        total = 0
        for i in range(len(self.names)):  # exactly, up to where the estimate says
            total += math.prod(self.shape(i)) * ITEMSIZES[self.dtypes[int(self.dtype[i])]]
            if total > budget:
                return i
        return None


def spec_of(tensors: Mapping[str, Mapping[str, Any]], fqn: str) -> tuple[str, tuple[int, ...]]:
    """``fqn``'s dtype and shape in ``metadata.json``'s tensors (a table or a
    dict, versions 1-3); ``KeyError`` if it lacks ``fqn``."""
    if isinstance(tensors, TensorTable):
        return tensors.spec(fqn)
    info = tensors[fqn]
    return info["dtype"], tuple(info["shape"])


def _ints(values: list[Any], what: str, bad: Any) -> np.ndarray:
    if not set(map(type, values)) <= {int}:  # (not bool, not float: the type exactly)
        k = next(k for k, v in enumerate(values) if type(v) is not int)
        raise bad(f"has {values[k]!r:.40} in the tensors' {what}, not an integer")
    try:
        return np.asarray(values, np.int64)
    except OverflowError as e:
        raise bad(f"has an integer out of range in the tensors' {what}") from e
