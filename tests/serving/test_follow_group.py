"""bytecp.follow in a process group (2 spawned gloo ranks, FSDP2 x2 and
TP=2): after each update every rank's shards equal the trainer's full
tensors at that step, bitwise; a read failing on one rank fails the update
on every rank and none swaps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from tests.dist.pool import WorkerPool

from . import group_cases as cases

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(2)
    yield p
    p.close()


def _check(got: list[dict[str, Any]], want: dict[str, torch.Tensor]) -> None:
    """Every rank's shards are the slices of the trainer's full tensors, bitwise."""
    for g in got:
        assert set(g["shards"]) == set(want)
        for n, (offsets, local) in g["shards"].items():
            sl = tuple(slice(o, o + n_) for o, n_ in zip(offsets, local.shape, strict=True))
            assert local.dtype == want[n].dtype and torch.equal(local, want[n][sl]), (g["rank"], n)


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_a_group_follows_each_step_bitwise_and_fails_together(pool: WorkerPool, tmp_path: Path,
                                                              layout: str) -> None:
    run = str(tmp_path / "run")
    trainer = cases.model(seed=0)
    opt = torch.optim.Adam(trainer.parameters(), lr=0.01)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3)
    pool.run(cases.start, run, layout, timeout=120)
    held: dict[str, torch.Tensor] = {}
    # steps 1, 2 taken; 3 fails on rank 1 (none swaps); 4 taken straight from 2
    for step in range(1, 5):
        trainer(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, {"model": trainer, "optimizer": opt})
        want = {f"{k}": v.clone() for k, v in trainer.state_dict().items()}
        if step == 3:  # rank 1's read fails: every rank reports it, no rank swaps
            pool.run(cases.arm_failure, 1, timeout=60)
            got = pool.run(cases.take, timeout=120)
            for g in got:
                assert g["up"]["error"] and "rank 1" in g["up"]["error"] and "injected" in g["up"]["error"], g["up"]
                assert g["up"]["held"] == f"{run}/step-2"
            _check(got, held)  # step 2, whole, on both ranks
            continue
        got = pool.run(cases.take, timeout=120)
        assert all(g["up"]["error"] is None and g["up"]["step"] == step for g in got), [g["up"] for g in got]
        total = sum(t.nbytes for t in want.values())
        if layout == "fsdp2":  # each rank read its own boxes only: together, the model's bytes once
            assert sum(g["up"]["bytes_read"] for g in got) == total
        else:  # row-wise shards are read as ranges spanning their rows; a replicated bias by both
            assert all(total / 3 < g["up"]["bytes_read"] < total for g in got), [g["up"] for g in got]
        _check(got, want)
        held = want
    assert held
