"""A Lightning job's train loader across a world-size change, on spawned gloo
ranks: torchdata's ``StatefulDataLoader`` with the ``DistributedSampler``
Lightning gives each rank, saved mid-epoch by 2 DDP ranks through bytecp's
strategy and resumed on 1: every global step after the resume trains on the
samples the uninterrupted 2-rank run trained on at that step (global batch
8 on both). Lightning alone would restore rank 0's per-rank count into the
single rank and train on half the epoch again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .test_lightning import record, spawn

pytestmark = [pytest.mark.spawn, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_fit_loop_continues_the_epoch_on_another_number_of_ranks(tmp_path: Path, warm: Any) -> None:
    a, b = tmp_path / "train", tmp_path / "resume"
    a.mkdir()
    b.mkdir()
    common = {"every": 3, "top_k": -1, "strategy": "ddp"}
    spawn(2, [{**common, "tag": "ids", "ids": 4, "ckpt_dir": str(a / "run"), "out": str(a), "max_steps": 6}], a,
          warm=warm)
    spawn(1, [{**common, "tag": "ids", "ids": 8, "ckpt_dir": str(b / "run"), "out": str(b), "ref": str(a),
               "resume": str(a / "run" / "step=3.ckpt"), "resume_step": 3, "max_steps": 6}], b, warm=warm)
    full = [record(a, "ids", r)["ids"] for r in range(2)]
    want = {k: sorted(full[0][k] + full[1][k]) for k in full[0]}
    got = record(b, "ids")["ids"]
    assert sorted(got) == ["3", "4", "5"], got
    assert {k: sorted(v) for k, v in got.items()} == {k: want[k] for k in ("3", "4", "5")}
    seen = [i for k in ("0", "1", "2") for i in want[k]] + [i for v in got.values() for i in v]
    assert sorted(seen) == list(range(48))
