"""A save's description kept between saves on real gloo ranks: DTensors
resharded between saves and FSDP2 saved at every step, each checkpoint
compared bitwise with the full tensors torch reports at its save."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import describe_cases

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("mode", ["sync", "lazy"])
def test_resharded_dtensor_is_described_afresh(pools, tmp_path: Path, mode: str) -> None:
    counts = pools(2).run(describe_cases.dtensor_resharded, str(tmp_path), mode, timeout=300)
    # saves 1..5 after the first: kept, resharded (afresh), kept, resharded (afresh), kept -- on every rank
    want = [(1, 0), (0, 1), (1, 0), (0, 1), (1, 0)]
    assert counts == [want, want]


@pytest.mark.parametrize("mode", ["sync", "eager", "lazy"])
def test_fsdp2_saved_at_every_step_keeps_its_description(pools, tmp_path: Path, mode: str) -> None:
    counts = pools(2).run(describe_cases.fsdp2_saved_every_step, str(tmp_path), mode, timeout=300)
    assert counts == [[(1, 0)] * 3, [(1, 0)] * 3]
