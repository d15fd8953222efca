"""``make gpu-check`` where CI runs it (no GPU): it says so and exits 0; its
targets and table read a report as the GPU run writes it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import table, targets

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check would run the whole check")
@pytest.mark.spawn
@pytest.mark.bench
def test_make_gpu_check_without_cuda_says_so_and_exits_0(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "tools/gpu-check.sh", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    assert json.loads((tmp_path / "gpu-check.json").read_text())["skipped"].startswith("no CUDA device")


def test_targets_and_table_of_a_report() -> None:
    bench = {"torch": "2.11", "state_bytes": 4.34e9, "params": 310e6, "d2h_floor_s": 0.080,
             "bytecp_eager_block_s": 0.086, "dcp_async_block_s": 2.7, "bytecp_lazy_call_s": 0.011,
             "added_bytecp_lazy_s": 0.12, "added_dcp_async_s": 3.2, "bytecp_load_s": 0.4, "read_floor_s": 0.2,
             "errors": {}}
    from benchmarks.gpu import ratios

    bench["ratios"] = ratios(bench)
    got = {t["target"]: t for t in targets(bench)}
    assert got["eager async blocking vs pinned D2H floor"]["met"] is True  # 1.075 <= 1.1
    assert got["lazy call blocking (ms)"]["met"] is False and got["lazy call blocking (ms)"]["value"] == 11.0
    assert got["training time added per checkpoint, lazy vs DCP pinned async"]["value"] == pytest.approx(0.0375, abs=1e-3)
    assert got["load into the GPU model vs the read floor (speed)"]["met"] is False  # 0.5 < 0.8
    report = {"gpu": "H200", "date": "2026-11-26", "bench": bench, "targets": targets(bench),
              "tests": [{"name": "a::b", "outcome": "failed", "message": "boom"},
                        {"name": "a::c", "outcome": "passed", "message": ""}]}
    text = table(report)
    assert "CUDA tests: 1 passed of 2" in text and "failed: a::b boom" in text
    assert "| async save: blocking (eager copy / DCP call + staging) | 0.086 s | 2.700 s | 0.03x |" in text
    assert "| one training step | - | - |  |" in text  # not measured: a dash, never a made-up figure


def test_the_every_step_loop_in_targets_and_table() -> None:
    from benchmarks.every_step import summary

    loops = {"without": {"step_s": [1.0, 1.02, 0.98], "call_s": [0.0] * 3, "optimizer_s": [0.01] * 3},
             "with": {"step_s": [1.005, 1.025, 0.985], "call_s": [0.004, 0.005, 0.006], "optimizer_s": [0.012] * 3}}
    every = {"params": 1.21e9, "state_bytes": 16.9e9, "batch": 32, "seq": 1024, "disk_every": 50,
             "last_checkpoint_bitwise": True, "failed_saves": 0, **summary(loops)}
    got = {t["target"]: t for t in targets({}, every)}
    row = got["training time added per step, a checkpoint every step to the memory tier (%)"]
    assert row["value"] == pytest.approx(0.5, abs=1e-3) and row["met"] is True
    text = table({"gpu": "H200", "date": "2026-12-01", "bench": {}, "every_step": every, "tests": [],
                  "targets": targets({}, every)})
    assert "Checkpoint at every step (1.21B parameters, 16.9 GB of state, batch 32 x 1024)" in text
    assert "+5.0 ms a step (+0.50%)" in text and "last checkpoint bitwise: True" in text
    skipped = table({"gpu": "H200", "date": "2026-12-01", "bench": {}, "tests": [], "targets": targets({}, None),
                     "every_step": {"skipped": "/dev/shm has 8.0 GB free"}})
    assert "Checkpoint at every step: skipped (/dev/shm has 8.0 GB free)" in skipped
    assert got["lazy call blocking (ms)"]["value"] is None  # not measured: no figure
