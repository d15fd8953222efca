"""Milestones and wall-clock cadence of CheckpointManager: ``keep_every_n_steps``
checkpoints survive retention whole (no incremental base) and load
bitwise; ``every_n_seconds`` saves when that much time has passed, whatever
the step. (The two-rank agreement on the coordinator's clock is in
tests/dist/test_restore_fallback.py's pool: :func:`test_every_rank_saves_the_steps_the_coordinators_clock_picks`.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecp
from bytecp.format import metadata as fmt
from bytecp.manager import CheckpointManager, list_checkpoints


def test_milestones_survive_retention_whole_and_load_bitwise(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # frozen: incremental saves reference it
    mgr = CheckpointManager(run, every_n_steps=1, keep_last=2, keep_every_n_steps=4)
    states = {}
    for step in range(1, 11):
        with torch.no_grad():
            model[1].weight.add_(0.5)
        mgr.maybe_save(step, {"model": model})
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert [c.step for c in list_checkpoints(run)] == [4, 8, 9, 10]
    for step in (4, 8):  # whole: they reference no other checkpoint
        md = json.loads((Path(run) / f"step-{step}" / fmt.METADATA_FILE).read_text())
        assert not md.get("references"), md.get("references")
    assert json.loads((Path(run) / "step-9" / fmt.METADATA_FILE).read_text()).get("references")  # (incremental)
    for step in (4, 8, 9, 10):
        sd = bytecp.load_state_dict(f"{run}/step-{step}")
        for k, v in states[step].items():
            assert torch.equal(sd["model"][k], v), (step, k)


def test_every_n_seconds_saves_when_the_time_has_passed(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    model = nn.Linear(2, 2)
    mgr = CheckpointManager(run, every_n_steps=10**6, every_n_seconds=0.25, keep_last=None)
    calls: list[tuple[int, float, float, bool]] = []  # step, call start, call end, saved
    for step in range(1, 15):
        time.sleep(0.1)
        t0 = time.monotonic()
        did = bool(mgr.maybe_save(step, {"model": model}))
        calls.append((step, t0, time.monotonic(), did))
    saved = [c[0] for c in calls if c[3]]
    assert len(saved) >= 2, saved
    # the interval counts from a save's start (inside its call): a save is due only once 0.25 s
    # have passed since the previous one started, and every call that long after it saves (the
    # bounds below hold whatever a loaded machine makes of a step or a save)
    last: tuple[int, float, float, bool] | None = None
    for c in calls:
        if last is not None:
            if c[3]:
                assert c[2] - last[1] >= 0.25, (saved, c, last)
            else:
                assert c[1] - last[2] < 0.25, (saved, c, last)
        if c[3]:
            last = c
    assert [ck.step for ck in list_checkpoints(run)] == saved


def test_bad_cadence_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(bytecp.ConfigError, match="every_n_seconds"):
        CheckpointManager(str(tmp_path), every_n_seconds=0)
    with pytest.raises(bytecp.ConfigError, match="keep_every_n_steps"):
        CheckpointManager(str(tmp_path), keep_every_n_steps=0)
