"""Retention, gc and references over a run of simulated many-rank checkpoints
(benchmarks/scale_retention.py at a small world): every step runs the real
code, and the run's end state is checked (it asserts nothing about speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import scale_jobs as jobs
from benchmarks.scale_retention import measure


@pytest.mark.parametrize("model", ["llama", "moe"])
def test_retention_and_gc_over_a_run_of_many_rank_checkpoints(tmp_path: Path, model: str) -> None:
    job = jobs.llama_job(256) if model == "llama" else jobs.moe_job(64, ep=32)  # EP 32 x DP 2
    got = measure(job, tmp_path)
    files = job.world  # a data file per rank
    assert got["live_files"] == files // 2  # step-3 references half of step-2's
    assert got["retired_files_left"] == files // 2 + 1  # those, and base.json
    assert got["gc_removed"] == got["files_per_checkpoint"]  # the killed save's every file, nothing else
    assert not (tmp_path / "run").exists()
