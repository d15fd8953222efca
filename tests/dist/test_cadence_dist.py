"""Wall-clock cadence across ranks: every rank saves the steps the
coordinator's clock picks, whatever the other ranks' clocks say."""

from __future__ import annotations

from pathlib import Path

import pytest

from bytecp.manager import list_checkpoints

from . import cadence_cases

pytestmark = pytest.mark.timeout(300)


def test_every_rank_saves_the_steps_the_coordinators_clock_picks(pools, tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    got = pools(2).run(cadence_cases.seconds_cadence, run, 1000.0, timeout=120)
    assert got[0] == got[1]  # one decision for every rank
    assert 2 <= len(got[0]) <= 8, got  # by rank 0's clock, not every step as rank 1's would have it
    assert [c.step for c in list_checkpoints(run)] == got[0]
