"""Saves whose adapter's replica hints are wrong or missing for some boxes
(2 ranks, each holding every tensor whole): each box is written once and
the checkpoint loads bitwise (bytecp/plan/exchange.py, planner.plan_save)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import hint_cases
from .test_layouts import _stored_once

pytestmark = pytest.mark.timeout(200)


@pytest.mark.parametrize(("framework", "coordinated"), [("selfish", 0), ("halfhint", 1)])
def test_replicas_the_hints_miss_are_written_once(pools: Any, tmp_path: Path, framework: str,
                                                   coordinated: int) -> None:
    url = str(tmp_path / framework)
    out = pools(2).run(hint_cases.save_then_load, framework, url)
    assert all(o["same"] for o in out), out
    # every own-hinted copy merges (equal fingerprints); vectors without a hint: the coordinator dedups
    assert [o["coordinated"] for o in out] == [coordinated] * 2
    _stored_once(url)


def test_a_large_replica_set_is_written_once_as_runs(pools: Any, tmp_path: Path) -> None:
    """24 tensors every rank holds under one hint: each rank writes one run of
    them (bytecp/plan/runs.py), without the coordinator; the checkpoint loads bitwise."""
    url = str(tmp_path / "runs")
    out = pools(2).run(hint_cases.large_set_save_then_load, url)
    assert all(o["same"] and o["runs"] for o in out), out
    assert [o["coordinated"] for o in out] == [0, 0]
    _stored_once(url)
