"""The coordinator's table of tensor names (:class:`NameTable`): hashes as
every rank computes them, and reused while the state's names stay the same."""

from __future__ import annotations

import numpy as np
import pytest

from bytecp.errors import ConfigError
from bytecp.format.chunk_batch import fqn_hash
from bytecp.format.parts_wire import NameTable


def test_ids_follow_name_order_and_the_ranks_hashes() -> None:
    names = [f"model.layers.{i}.w" for i in range(50)] + ["b", "a", "é"]
    table = NameTable.of(names)
    hashes = np.asarray([fqn_hash(n) for n in names], np.uint64)
    ids = table.ids(hashes, lambda i: 0, "rows")
    assert [table.names[i] for i in ids] == names and table.names == sorted(names)
    with pytest.raises(ConfigError, match="rank 7: its index part lists rows of a tensor missing"):
        table.ids(np.asarray([fqn_hash("nope")], np.uint64), lambda i: 7, "rows")


def test_the_last_table_is_reused_only_for_the_same_names() -> None:
    a = NameTable.of(["x", "y"])
    assert NameTable.of(iter(["x", "y"])) is a
    b = NameTable.of(["x", "y", "z"])
    assert b is not a and b.names == ["x", "y", "z"]
    assert NameTable.of(["x", "y"]) is not b


def test_a_table_of_names_hashed_by_the_ranks_is_the_same() -> None:
    names = [f"model.layers.{i}.w" for i in range(50)] + ["b", "a", "é"]
    given = NameTable(names, np.asarray([fqn_hash(n) for n in names], np.uint64))
    plain = NameTable(names)
    assert given.names == plain.names and given.sorted.tolist() == plain.sorted.tolist()
    assert given.order.tolist() == plain.order.tolist()


def test_the_names_of_ids_as_an_arrow_column() -> None:
    for names in (["b", "a", "model.layers.0.w", ""], ["é", "a", "日本"], []):
        table = NameTable(names)
        ids = np.asarray([i for i in (2, 0, 0, 1) if i < len(names)], np.int64)
        got = table.strings(ids)
        got.validate(full=True)
        assert got.to_pylist() == [table.names[i] for i in ids]
