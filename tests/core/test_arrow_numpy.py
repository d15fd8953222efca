"""bytecp.format.arrow_numpy: the readers' NumPy arrays of Arrow columns
equal what ``to_numpy`` gives, sliced and chunked columns included, and a
null or a wrong type is refused (the readers then name the page at fault)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from bytecp.format import arrow_numpy


def test_numbers_match_to_numpy_across_chunks_and_slices() -> None:
    for t in (pa.int64(), pa.uint32(), pa.int8(), pa.float32()):
        a = pa.array([3, 1, 4, 1, 5, 9, 2, 6], t)
        col = pa.chunked_array([a.slice(1, 3), a.slice(5, 3), a.slice(0, 0)])
        got = arrow_numpy.numbers(col)
        assert got.dtype == np.dtype(t.to_pandas_dtype()) and got.tolist() == col.to_pylist()
        assert arrow_numpy.numbers(a.slice(2, 4)).tolist() == [4, 1, 5, 9]
        assert arrow_numpy.numbers(pa.chunked_array([], t)).tolist() == []


def test_strings_plain_and_dictionary() -> None:
    names = ["model.b", "model.a", "model.b", "", "opt.é"]
    plain = pa.chunked_array([pa.array(names[:2]), pa.array(names[2:])])
    coded = pa.array(names).dictionary_encode().slice(1, 4)
    assert arrow_numpy.strings(plain).tolist() == names
    assert arrow_numpy.strings(coded).tolist() == names[1:]
    assert arrow_numpy.indices(coded.indices).tolist() == coded.indices.to_pylist()
    assert arrow_numpy.strings(pa.chunked_array([], pa.string())).tolist() == []


def test_nulls_and_wrong_types_are_refused() -> None:
    with pytest.raises(ValueError, match="nulls"):
        arrow_numpy.numbers(pa.array([1, None], pa.int64()))
    with pytest.raises(ValueError, match="nulls"):
        arrow_numpy.strings(pa.array(["a", None]))
    with pytest.raises(TypeError, match="bool"):
        arrow_numpy.numbers(pa.array([True]))
    with pytest.raises(TypeError, match="int64"):
        arrow_numpy.strings(pa.array([1]))
