"""Functions the worker pools run on every rank for tests/dist/test_restore_fallback.py:
CheckpointManager saves and a restore that falls back past a damaged checkpoint."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bytecp.manager import CheckpointManager


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step, "extra": {"step": step}}


def save(run: str, steps: list[int]) -> None:
    mgr = CheckpointManager(run, every_n_steps=1, keep_last=None)
    for step in steps:
        mgr.save(step, state(step))


def restore(run: str, fallback: bool = True) -> dict[str, Any]:
    mgr = CheckpointManager(run, every_n_steps=1, keep_last=None)
    assert dist.is_initialized()
    got = {"w": torch.zeros(4096), "extra": {"step": -1}}
    try:
        step = mgr.restore(got, fallback=fallback)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"step": step, "same": torch.equal(got["w"], state(step)["w"]) if step is not None else None,
            "extra": got["extra"], "skipped": [u for u, _ in mgr.skipped]}
