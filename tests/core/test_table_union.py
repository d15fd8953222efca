"""The coordinator's union of the ranks' tensor tables (bytecp/format/table_union.py):
the tensors the ranks describe, merged as columns, the same as merging them
name by name; a tensor two ranks describe differently is refused, naming both."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import numpy as np
import pytest

from bytecp.errors import ConfigError
from bytecp.format.chunk_batch import fqn_hashes
from bytecp.format.table_union import elements_of, sent_table, union_tables
from bytecp.format.tensor_table import TensorTable, table_json

DTYPES = ["float32", "bfloat16", "int64", "float8_e4m3fn", "bool"]


def _specs(rng: random.Random, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"dtype": rng.choice(DTYPES), "shape": [rng.choice([0, 1, 3, 7]) for _ in range(rng.randint(0, 3))]}
            for n in names}


def _by_name(tables: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The union as the commit built it before: a dict, name by name."""
    out: dict[str, dict[str, Any]] = {}
    for specs in tables:
        for fqn, spec in specs.items():
            assert out.setdefault(fqn, spec) == spec
    return out


def test_the_union_of_tables_is_the_union_of_their_tensors() -> None:
    rng = random.Random(3)
    for _ in range(200):
        pool = [f"layers.{i}.w" for i in range(rng.randint(0, 30))]
        whole = _specs(rng, pool)
        tables = []
        for _ in range(rng.randint(1, 6)):  # each rank: some of the tensors, in its own order
            mine = rng.sample(pool, rng.randint(0, len(pool)))
            tables.append({n: whole[n] for n in mine})
        sent = [(r, sent_table(t) if r % 2 else table_json(t)) for r, t in enumerate(tables)]  # (hashes: sent or not)
        got, hashes = union_tables(sent)
        want = _by_name(tables)
        assert hashes.tolist() == fqn_hashes(list(want)).tolist()
        assert list(got) == list(want) and {n: got[n] for n in got} == want
        assert got.dtypes == sorted(got.dtypes) and set(got.dtypes) == {s["dtype"] for s in want.values()}
        assert table_json(got) == table_json(want)  # (what metadata.json holds: the same columns)
        assert TensorTable.from_json(table_json(got), "x").to_json() == table_json(got)
        assert elements_of(got) == sum(math.prod(s["shape"]) for s in want.values())


@pytest.mark.parametrize(("theirs", "said"), [
    ({"dtype": "bfloat16", "shape": [4, 2]}, "dtype bfloat16 shape [4, 2]"),
    ({"dtype": "float32", "shape": [4, 3]}, "dtype float32 shape [4, 3]"),
    ({"dtype": "float32", "shape": [8]}, "dtype float32 shape [8]"),
    ({"dtype": "float32", "shape": []}, "dtype float32 shape []"),
])
def test_a_tensor_described_differently_is_refused_naming_both_ranks(theirs: dict[str, Any], said: str) -> None:
    w = {"dtype": "float32", "shape": [4, 2]}
    tables = [(0, table_json({"a": {"dtype": "int64", "shape": [1]}})),
              (3, table_json({"b": {"dtype": "float32", "shape": [2]}, "w": w})),  # first to describe w
              (5, table_json({"w": w, "b": {"dtype": "float32", "shape": [2]}})),
              (9, table_json({"c": {"dtype": "float32", "shape": []}, "w": theirs}))]
    with pytest.raises(ConfigError, match=re.escape(
            f"tensor 'w': rank 3 has dtype float32 shape [4, 2] but rank 9 has {said}; every rank must describe "
            "the same global tensor")):
        union_tables(tables)


def test_elements_are_exact_past_what_int64_holds() -> None:
    specs = {"huge": {"dtype": "float32", "shape": [2 ** 40, 2 ** 30]}, "s": {"dtype": "float32", "shape": []},
             "none": {"dtype": "float32", "shape": [5, 0]}, "v": {"dtype": "float32", "shape": [3]}}
    got = union_tables([(0, table_json(specs))])[0]
    assert elements_of(got) == 2 ** 70 + 1 + 0 + 3
    assert elements_of(union_tables([(0, table_json({"s": specs["s"]}))])[0]) == 1
    assert elements_of(union_tables([(0, table_json({}))])[0]) == 0 and len(union_tables([])[0]) == 0


def test_two_names_of_one_hash_are_refused() -> None:
    a = table_json({"a": {"dtype": "float32", "shape": [1]}}) | {"hashes": np.asarray([7], np.uint64)}
    b = table_json({"b": {"dtype": "float32", "shape": [1]}}) | {"hashes": np.asarray([7], np.uint64)}
    with pytest.raises(ConfigError, match="tensor names 'a' and 'b' collide in the commit's 64-bit name hash"):
        union_tables([(0, a), (1, b)])
