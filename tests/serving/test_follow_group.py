"""bytecp.follow in a process group (2 spawned gloo ranks, FSDP2 x2 and
TP=2): after each update every rank's shards equal the trainer's full
tensors at that step, bitwise; a read failing on one rank fails the update
on every rank and none swaps."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

import bytecp
from bytecp.catalog import list_checkpoints
from tests.dist.pool import WorkerPool

from . import group_cases as cases

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))  # keeper processes, as its tests start them
from keepers import TOKEN, spawn_keeper  # noqa: E402

from tests.netport import free_ports  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
@spawns
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


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "unpinned"])
def test_a_group_takes_a_checkpoint_retired_after_its_open(pool: WorkerPool, tmp_path: Path, pin: bool) -> None:
    """The coordinator opened step 1; before the ranks read it, a commit of step 2 retires it
    (``keep_last=1``, its ``metadata.json`` moved aside). ``pinned``: the follower's pin keeps
    its data and index files, and every rank takes step 1 (none reads ``metadata.json``: the
    coordinator's opened checkpoint came with the decision), then step 2. ``unpinned``
    (``pin=False``, as a pin the retention takes for dead): its index files go too, the update
    fails on every rank alike, the coordinator finds step 1 retired for a newer one, and every
    rank takes step 2 -- no error, bitwise."""
    run = str(tmp_path / "run")
    trainer = cases.model(seed=0)
    bytecp.CheckpointManager(run, every_n_steps=1, keep_last=1).save(1, {"model": trainer})
    at_one = {k: v.clone() for k, v in trainer.state_dict().items()}
    pool.run(cases.start, run, "fsdp2", None, None, None, pin, timeout=120)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)
    want = {k: v.clone() for k, v in trainer.state_dict().items()}
    pool.run(cases.arm_race, run, want, 2, timeout=60)
    if pin:
        got = pool.run(cases.take, timeout=120)
        assert all(g["up"]["error"] is None and g["up"]["step"] == 1 for g in got), [g["up"] for g in got]
        assert not Path(run, "step-1", "metadata.json").exists()
        _check(got, at_one)
    got = pool.run(cases.take, timeout=120)
    assert all(g["up"]["error"] is None and g["up"]["step"] == 2 for g in got), [g["up"] for g in got]
    assert not Path(run, "step-1", "metadata.json").exists()
    _check(got, want)


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


@pytest.mark.spawn
def test_a_group_follows_the_memory_tier(pool: WorkerPool, tmp_path: Path) -> None:
    """FSDP2 x2 given ``memory_url``: each memory step (a keeper process, the
    trainer saving every step to memory, every second drained) bitwise on
    both ranks, from the memory tier; the drained copies are never reread."""
    from bytecp.storage._keeper_wire import request

    ports = {"h0": free_ports(1)[0]}
    keeper = spawn_keeper("h0", ports, tmp_path, replicas=1)
    (hello, _) = request(("127.0.0.1", ports["h0"]), {"op": "hello", "token": TOKEN})
    try:
        opts = {"keepers": f"h0=127.0.0.1:{ports['h0']}", "host": "h0", "token": TOKEN}
        run, mem = str(tmp_path / "run"), f"keeper://job/{tmp_path.name}"
        trainer = cases.model(seed=0)
        opt = torch.optim.Adam(trainer.parameters(), lr=0.01)
        mgr = bytecp.CheckpointManager(run, every_n_steps=2, keep_last=3, memory_url=mem, memory_every_n_steps=1,
                                       memory_storage_options=opts)
        pool.run(cases.start, run, "fsdp2", mem, opts, timeout=120)
        for step in range(1, 5):
            trainer(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.maybe_save(step, {"model": trainer, "optimizer": opt})
            mgr.wait()
            got = pool.run(cases.take, timeout=120)
            assert all(g["up"]["error"] is None and g["up"]["step"] == step and g["up"]["tier"] == "memory"
                       for g in got), [g["up"] for g in got]
            _check(got, {k: v.clone() for k, v in trainer.state_dict().items()})
            if step == 2:  # drained before step 3: the next update must still be step 3, from memory
                deadline = time.time() + 60
                while not any(c.step == 2 for c in list_checkpoints(run)):
                    assert time.time() < deadline, "step 2 never drained"
                    time.sleep(0.05)
    finally:
        keeper.kill()
        keeper.wait()
        shutil.rmtree(hello["root"], ignore_errors=True)


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_a_bf16_group_applies_the_deltas_of_its_own_boxes(pool: WorkerPool, tmp_path: Path, layout: str) -> None:
    """A one-process trainer writing bf16 serving deltas, followed by FSDP2 x2
    and TP=2 groups holding bf16 shards: each rank applies the deltas of its
    own boxes (pieces of the trainer's whole tensors; TP's replicated bias
    counted once in the checksums), every step bitwise; a damaged delta is
    read whole by both ranks alike."""
    import json

    from bytecp.format import serving_wire as wire

    run = str(tmp_path / "run")
    trainer = cases.model(seed=0)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-6)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=10, serving_dtype=torch.bfloat16)
    pool.run(cases.start, run, layout, None, None, torch.bfloat16, timeout=120)
    for step in range(1, 5):
        trainer(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, {"model": trainer, "optimizer": opt})
        want = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
        if step == 3:  # the largest delta damaged: both ranks read that tensor whole instead
            ck = Path(run) / "step-3"
            sid = json.loads((ck / "metadata.json").read_text())["save_id"]
            ents = wire.RankEntries.from_bytes((ck / "serving" / sid / "0.json").read_bytes(), "t")
            e = max(ents.entries, key=lambda e: e.delta.count if e.delta else 0)
            assert e.delta is not None
            pool.run(cases.damage, str(ck / "serving" / sid / "0.bin"), e.delta.offset + 1, 0, timeout=60)
        got = pool.run(cases.take, timeout=120)
        ups = [g["up"] for g in got]
        assert all(u["error"] is None and u["step"] == step for u in ups), ups
        if step == 1:
            assert all(u["tensors_by_delta"] == u["tensors_read"] == 4 and u["delta_steps"] == 0 for u in ups), ups
        elif step == 3:
            assert all(u["tensors_by_delta"] == u["tensors_read"] - 1 and any(e.fqn in x for x in u["fallbacks"])
                       for u in ups), ups
        else:
            assert all(u["tensors_by_delta"] == u["tensors_read"] and u["tensors_read"] + u["tensors_unchanged"] == 4
                       and u["delta_steps"] == 1 and not u["fallbacks"] for u in ups), ups
        _check(got, want)
