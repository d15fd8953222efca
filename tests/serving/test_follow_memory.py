"""bytecp.follow with the memory tier: a follower takes each new checkpoint
from whichever tier has it first (a real keeper process, a trainer's
CheckpointManager saving to memory every step and draining every third),
reads each save once across tiers, falls back to storage when a memory
checkpoint vanishes mid-read, and goes on from storage when the keeper dies."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.storage._keeper_wire import request
from bytecp.storage.keeper import KeeperStorage
from torch import nn

import bytecp
from bytecp.catalog import list_checkpoints
from bytecp.serving import follow as follow_mod
from bytecp.serving.cli import watch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))  # keeper processes, as its tests start them
from keepers import TOKEN, spawn_keeper  # noqa: E402

from tests.netport import free_ports  # noqa: E402

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(300)]


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model[0].requires_grad_(False)  # frozen: unchanged across tiers, told by checksums
    return model, torch.optim.Adam(model[2].parameters(), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _bitwise(a: nn.Module, b: dict[str, torch.Tensor] | nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict() if isinstance(b, nn.Module) else b
    return set(sa) == set(sb) and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)


def _wait_for_storage(run: str, step: int) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        if any(c.step == step for c in list_checkpoints(run)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never drained to {run}")


@contextlib.contextmanager
def _keeper(tmp_path: Path) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A real keeper process (host h0, one replica) and the storage options
    that reach it; killed at the end, its root removed (a killed keeper frees nothing)."""
    ports = {"h0": free_ports(1)[0]}
    keeper = spawn_keeper("h0", ports, tmp_path, replicas=1)
    (hello, _) = request(("127.0.0.1", ports["h0"]), {"op": "hello", "token": TOKEN})
    try:
        yield keeper, {"keepers": f"h0=127.0.0.1:{ports['h0']}", "host": "h0", "token": TOKEN}
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
        shutil.rmtree(hello["root"], ignore_errors=True)


def test_follower_takes_each_step_from_the_first_tier_and_survives_the_keeper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _keeper(tmp_path) as (keeper, opts):
        run, mem = str(tmp_path / "run"), f"keeper://job/{tmp_path.name}"
        model, opt = _model()
        state = {"model": model, "optimizer": opt}
        mgr = bytecp.CheckpointManager(run, every_n_steps=3, keep_last=3, memory_url=mem, memory_every_n_steps=1,
                                       memory_storage_options=opts, memory_keep_last=2)
        served, _ = _model(seed=7)
        gen = bytecp.follow(run, {"model": served}, poll_s=0.01, memory_url=mem, memory_storage_options=opts)
        ups = []
        for step in range(1, 6):
            _step(model, opt)
            mgr.maybe_save(step, state)
            up = next(gen)
            ups.append(up)
            assert up.ok and up.step == step and up.tier == "memory" and up.url == f"{mem}/step-{step}", up
            assert _bitwise(served, model), step
            if step > 1:  # memory saves are whole: the frozen layer is proven unchanged by its checksums
                assert up.tensors_read == 2 and up.tensors_unchanged == 2 and up.unchanged_by_reference == 0, up
            if step == 3:  # drained: storage's step-3 is the same save, never read again (the next yield is step 4)
                mgr.wait()
                _wait_for_storage(run, 3)
        assert [u.skipped for u in ups] == [0] * 5
        # `bytecp follow RUN --memory-url ...`: the newest of both tiers, memory's step 5
        recs = list(watch(run, poll_s=0.01, idle_timeout_s=0.05, memory_url=mem, memory_storage_options=opts))
        assert [(r["step"], r["tier"]) for r in recs] == [(5, "memory")], recs

        # step 6 goes to memory and is drained; the keeper evicts it while the follower reads it
        before = {k: v.clone() for k, v in served.state_dict().items()}
        _step(model, opt)
        mgr.maybe_save(6, state)
        mgr.wait()
        _wait_for_storage(run, 6)
        real_stage = follow_mod.stage

        def evicting_stage(*args: Any, **kw: Any) -> Any:
            monkeypatch.setattr(follow_mod, "stage", real_stage)
            KeeperStorage(f"{mem}/step-6", **opts).delete_prefix("data")
            return real_stage(*args, **kw)

        monkeypatch.setattr(follow_mod, "stage", evicting_stage)
        up = next(gen)
        assert not up.ok and up.step == 6 and up.tier == "memory" and up.held == f"{mem}/step-5", up
        assert _bitwise(served, before)  # the previous weights, whole
        up = next(gen)  # the next poll: storage's copy
        assert up.ok and up.step == 6 and up.tier == "storage" and up.url == f"{run}/step-6", up
        assert up.tensors_read == 2 and _bitwise(served, model)

        # the keeper dies: the follower goes on from storage
        keeper.kill()
        keeper.wait()
        _step(model, opt)
        bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3).save(7, state)
        up = next(gen)
        assert up.ok and up.step == 7 and up.tier == "storage" and up.skipped == 0, up
        assert up.tensors_read == 2 and _bitwise(served, model)
        gen.close()


def test_a_bf16_follower_applies_serving_deltas_from_the_memory_tier(tmp_path: Path) -> None:
    """A full fine-tune saving to memory every step with serving deltas
    (``serving_dtype=torch.bfloat16``), draining every third step: a bf16
    follower of both tiers takes each step from memory by applying its
    deltas, and holds, bit for bit, the trainer's weights cast to bf16."""
    with _keeper(tmp_path) as (_, opts):
        run, mem = str(tmp_path / "run"), f"keeper://job/{tmp_path.name}"
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        state = {"model": model, "optimizer": opt}
        mgr = bytecp.CheckpointManager(run, every_n_steps=3, keep_last=3, memory_url=mem, memory_every_n_steps=1,
                                       memory_storage_options=opts, memory_keep_last=3,
                                       serving_dtype=torch.bfloat16)
        served = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(torch.bfloat16)
        gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=torch.bfloat16, on_error="raise",
                            memory_url=mem, memory_storage_options=opts)
        whole = 0
        for step in range(1, 6):
            _step(model, opt)
            mgr.maybe_save(step, state)
            up = next(gen)
            assert up.ok and up.step == step and up.tier == "memory" and not up.fallbacks, up
            want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
            assert _bitwise(served, want), step
            if step == 1:  # the first save's whole bf16 copy
                whole = up.bytes_read
            else:  # each later step by its own deltas, a fraction of those bytes
                assert up.delta_steps == 1 and up.tensors_by_delta == up.tensors_read > 0, up
                assert up.bytes_read < whole / 2, (up.bytes_read, whole)
        mgr.wait()
        gen.close()
