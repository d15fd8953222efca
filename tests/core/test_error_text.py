"""The text of an error every rank raises (:class:`bytecp.errors.DistributedCheckpointError`):
one line when every rank failed alike (a refusal all ranks decide: thousands of ranks, one
line), a line per distinct error otherwise, ranks in runs."""

from __future__ import annotations

from bytecp.errors import DistributedCheckpointError, rank_list


def test_ranks_failing_alike_make_one_line() -> None:
    e = DistributedCheckpointError("load/match", {r: "DataReshardError: the data order changed" for r in range(4)})
    assert str(e) == "load/match failed on rank(s) 0-3: DataReshardError: the data order changed"
    big = DistributedCheckpointError("save/write", {r: "StorageError: full" for r in range(1024) if r != 7})
    assert str(big) == "save/write failed on rank(s) 0-6, 8-1023: StorageError: full"
    assert big.failures[8] == "StorageError: full" and 7 not in big.failures


def test_different_errors_get_a_line_each_with_their_ranks() -> None:
    e = DistributedCheckpointError("save/plan", {2: "a", 0: "a", 1: "b"})
    assert str(e).splitlines() == ["save/plan failed on rank(s) 0, 1, 2:", "  ranks 0, 2: a", "  rank 1: b"]
    one = DistributedCheckpointError("load/read", {1: "CorruptCheckpointError: x"})
    assert str(one) == "load/read failed on rank(s) 1:\n  rank 1: CorruptCheckpointError: x"


def test_rank_list_runs() -> None:
    assert rank_list([0, 1, 2]) == "0, 1, 2"
    assert rank_list([0, 1, 2, 3, 9, 10, 11, 12, 13, 20]) == "0-3, 9-13, 20"
    assert rank_list([]) == ""
