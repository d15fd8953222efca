"""benchmarks/every_step (``make gpu-check``'s checkpoint-every-step loop) run
here on the CPU at a tiny size: the keeper it starts, the manager saving to
memory at every step and draining to disk every few, the loops and their
figures, and the last checkpoint read back bitwise. On a host without CUDA
the benchmark itself says it skipped, and why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import every_step

pytestmark = pytest.mark.timeout(600)


@pytest.mark.spawn  # the memory tier's keeper servers
def test_the_loop_checkpoints_every_step_to_memory_and_drains_to_disk(tmp_path: Path) -> None:
    out = every_step.run(2e5, batch=2, seq=32, steps=4, disk_every=3, rounds=1, root=tmp_path, device="cpu")
    assert out["params"] >= 2e5 and out["state_bytes"] > 12 * out["params"]
    assert out["failed_saves"] == 0
    assert out["last_checkpoint_bitwise"] is True
    assert out["memory_checkpoints_kept"] == [out["last_step"]]  # memory_keep_last=1, a save at every step
    assert out["disk_checkpoints_kept"] and all(s % 3 == 0 for s in out["disk_checkpoints_kept"])
    assert len(out["step_with_s"]) == 3 and math.isfinite(out["added_fraction"])
    assert out["target"]["goal"] == every_step.GOAL and isinstance(out["target"]["met"], bool)
    memory = out["save_phases_s"]["memory"]  # where each memory-tier save of the loop spent its time
    assert memory["saves"] == 4, out["save_phases_s"]
    assert {"stage", "plan", "write", "commit"} <= set(memory) and memory["duration"] >= memory["write"] > 0
    assert out["pinning"]["arena_mapping_hits"] > 0  # saves copy into arenas the keeper lends them back
    assert out["keeper_arenas"]["adopted"] >= 4 and out["keeper_arenas"]["free"] >= 1


def test_config_holds_at_least_the_parameters_asked_for() -> None:
    for n in (1e5, 2.5e8, 1e9, 1.2e9):
        cfg = every_step.config_for_params(n, 1024)
        assert n <= cfg.params < 1.3 * n + 2e6, (n, cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the benchmark for real")
def test_without_cuda_the_benchmark_says_it_skipped(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    assert every_step.main(["--json", str(path), "--dir", str(tmp_path / "d")]) == 0
    assert json.loads(path.read_text())["skipped"].startswith("no CUDA device")
