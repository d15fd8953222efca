"""Which files a failed save keeps, decided on each rank from the error
alone (``bytecp.saving.schedule``): a rank other than the coordinator keeps
its data files when the coordinator is among the ranks that did not answer
(it may still commit them), and removes them otherwise. The chaos run meets
these outcomes by chance; these cases meet each of them every time."""

from __future__ import annotations

import types

import pytest

from bytecp.errors import DistributedCheckpointError
from bytecp.saving.schedule import _broke_a_collective, _keep_for_silent_coordinator


def _pipeline(rank: int) -> types.SimpleNamespace:
    ctx = types.SimpleNamespace(rank=rank, coordinator=0, is_coordinator=rank == 0)
    return types.SimpleNamespace(ctx=ctx, storage=types.SimpleNamespace(url="/ck/step-3"))


def _broken(failures: dict[int, str]) -> DistributedCheckpointError:
    e = DistributedCheckpointError("save/write", failures)
    e.broken_group = True  # type: ignore[attr-defined]  # what DistContext sets on a missed deadline
    return e


def test_a_rank_keeps_its_files_when_the_coordinator_did_not_answer() -> None:
    e = _broken({0: "did not answer: stuck or stopped"})
    assert _keep_for_silent_coordinator(e, _pipeline(1))  # type: ignore[arg-type]
    assert any("keeps its data files at /ck/step-3" in n and "bytecp gc" in n for n in e.__notes__)


def test_the_coordinator_named_deeper_in_the_chain_counts_too() -> None:
    inner = DistributedCheckpointError("save/write", {0: "did not answer"})
    try:
        try:
            raise inner
        except DistributedCheckpointError as cause:
            raise _broken({1: "timed out"}) from cause
    except DistributedCheckpointError as e:
        assert _keep_for_silent_coordinator(e, _pipeline(2))  # type: ignore[arg-type]


@pytest.mark.parametrize("rank,failures,broken", [
    (1, {2: "did not answer"}, True),    # another rank was lost: the save cannot commit
    (0, {1: "did not answer"}, True),    # the coordinator itself removes its files
    (1, {0: "did not answer"}, False),   # an error in this rank's own step, no collective broke
])
def test_otherwise_the_files_go(rank: int, failures: dict[int, str], broken: bool) -> None:
    e = _broken(failures) if broken else DistributedCheckpointError("save/write", failures)
    assert _broke_a_collective(e) is broken
    assert not _keep_for_silent_coordinator(e, _pipeline(rank))  # type: ignore[arg-type]
    assert not getattr(e, "__notes__", [])
