"""Wall-clock cadence across ranks: every rank saves the steps the
coordinator's clock picks, whatever the other ranks' clocks say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.manager import list_checkpoints
from tests.netport import free_ports

from . import cadence_cases
from .conftest import discard_pool

pytestmark = pytest.mark.timeout(300)


def test_every_rank_saves_the_steps_the_coordinators_clock_picks(pools, tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    got = pools(2).run(cadence_cases.seconds_cadence, run, 1000.0, timeout=120)
    assert got[0] == got[1]  # one decision for every rank
    assert 2 <= len(got[0]) <= 8, got  # by rank 0's clock, not every step as rank 1's would have it
    assert [c.step for c in list_checkpoints(run)] == got[0]


def test_managers_share_bytecps_groups_instead_of_making_one_each(pools, tmp_path: Path) -> None:
    """Every gloo group keeps a thread that wakes a hundred times a second: a
    process making manager after manager (a sweep, a notebook) must not pile them up."""
    got = pools(2).run(cadence_cases.groups_of_many_managers, str(tmp_path / "run"), 6, timeout=120)
    before, after = got[0]
    assert after - before <= 2, got  # at most the votes' group and the saves' group, once (6 before)


def test_saves_go_on_after_torch_distributed_is_made_again_in_the_process(pools, tmp_path: Path) -> None:
    """An in-process restart destroys the process groups and makes new ones:
    bytecp's own groups of the first world were destroyed with it ("Group ...
    is not registered" at the next async save before), new ones are made."""
    try:
        pools(2).run(cadence_cases.saves_across_an_in_process_restart, str(tmp_path), free_ports(2), timeout=120)
    finally:
        discard_pool(2)  # its world is not the one its ranks started with (caches of other cases may hold the old)
    for round_ in (0, 1, 2):
        for url in (tmp_path / f"async-{round_}", tmp_path / f"run-{round_}" / "step-1"):
            got = bytecp.load_state_dict(str(url))
            assert torch.equal(got["w"], torch.full((4,), float(10 * round_))), (url, got)


def test_saves_of_a_part_of_the_world_leave_the_worlds_next_groups_alike(pools, tmp_path: Path) -> None:
    """bytecp's own group over ``process_group=`` a part of the world is made by
    that part alone, without moving the world's count of groups on its ranks
    only: the job's next ``new_group`` hung before (rank 0's was named another
    name than rank 1's)."""
    try:
        got = pools(2).run(cadence_cases.saves_of_a_part_of_the_world, str(tmp_path), timeout=60)
    except BaseException:
        discard_pool(2)  # a rank may still wait in the store
        raise
    assert got == [2.0, 2.0]
    for url in (tmp_path / "sync", tmp_path / "async", tmp_path / "run" / "step-1"):
        assert torch.equal(bytecp.load_state_dict(str(url))["w"], torch.arange(6.0)), url
