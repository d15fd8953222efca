"""NumPy arrays of decoded Arrow columns, without pyarrow's pandas shim.

``Array.to_numpy`` imports pandas the first time it runs in a process
(0.35 s on the 2-core machine, more on a cold disk), which every rank's
first load would pay. The index readers (:mod:`bytecp.format.parts_read`,
:mod:`bytecp.format.index_read`) call these on the columns
:func:`bytecp.format.index_check.decode_table` returned, which has
refused nulls; a null or a type these do not read raises ``ValueError``
or ``TypeError``, which the readers turn into a corrupt-index error.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["indices", "numbers", "strings"]


def numbers(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer or floating column (no nulls) as one NumPy array: a view
    of its buffer when it is one chunk, a copy when it is several."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    dtype = _dtype(col.type)
    views = [_view(c, dtype) for c in chunks]
    if len(views) == 1:
        return views[0]
    return np.concatenate(views) if views else np.zeros(0, dtype)


def indices(ix: pa.Array) -> np.ndarray:
    """A dictionary array's indices (no nulls) as a view of their buffer."""
    return _view(ix, _dtype(ix.type))


def strings(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A string column, plain or dictionary-encoded (no nulls), as a NumPy
    array of ``str`` (each dictionary value decoded once)."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = []
    for c in chunks:
        if c.null_count:
            raise ValueError(f"a string column with {c.null_count} nulls")
        if pa.types.is_dictionary(c.type):
            parts.append(_objects(c.dictionary.to_pylist())[indices(c.indices)])
        elif pa.types.is_string(c.type) or pa.types.is_large_string(c.type):
            parts.append(_objects(c.to_pylist()))
        else:
            raise TypeError(f"a column of type {c.type} where strings belong")
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, object)


def _objects(values: list[str]) -> np.ndarray:
    out = np.empty(len(values), object)
    out[:] = values
    return out


def _dtype(t: pa.DataType) -> np.dtype:
    if pa.types.is_integer(t):
        return np.dtype(f"{'int' if pa.types.is_signed_integer(t) else 'uint'}{t.bit_width}")
    if pa.types.is_floating(t):
        return np.dtype(f"float{t.bit_width}")
    raise TypeError(f"a column of type {t} where numbers belong")


def _view(a: pa.Array, dtype: np.dtype) -> np.ndarray:
    if a.null_count:
        raise ValueError(f"a column of {a.type} with {a.null_count} nulls")
    if not len(a):
        return np.zeros(0, dtype)
    values: np.ndarray = np.frombuffer(a.buffers()[1], dtype=dtype)
    return values[a.offset: a.offset + len(a)]
