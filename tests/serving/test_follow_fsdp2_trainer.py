"""bytecp.follow beside a real training job: a transformers Llama trained
under FSDP2 on 2 spawned gloo ranks, checkpointed every step through
CheckpointManager, followed by one process (this one, no torch.distributed)
while it trains: after each update the follower's weights equal the
trainer's gathered weights of that step, bitwise; a step passed over is
counted in ``skipped`` (after its first update the follower stalls until
the trainer ends, then takes the newest in one update); the last step is
always reached."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from tests.dist.conftest import pools  # noqa: F401 - the session's spawned gloo pools, shared with tests/dist

from . import fsdp2_trainer_cases as cases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 3


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal only when bitwise equal (NaN and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_follower_tracks_an_fsdp2_llama_trainer_bitwise(pools: Any, tmp_path: Path) -> None:  # noqa: F811
    from transformers import LlamaForCausalLM

    run, refs = str(tmp_path / "run"), tmp_path / "refs"
    refs.mkdir()
    pool = pools(2)
    result: dict[str, Any] = {}
    stop = threading.Event()

    def trainer() -> None:
        try:
            result["names"] = pool.run(cases.train, run, str(refs), STEPS, 0.3, timeout=240)[0]
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            result["error"] = e
            stop.set()  # the follower stops waiting for steps that will not come

    torch.manual_seed(1)  # weights unlike the trainer's: every tensor must come from the checkpoints
    served = LlamaForCausalLM(cases.llama_config())
    before = {k: v.clone() for k, v in served.state_dict().items()}
    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    taken: list[int] = []
    passed_over: list[int] = []
    held = 0
    deadline = time.monotonic() + 240
    for up in bytecp.follow(run, {"model": served}, poll_s=0.05, stop=stop, on_error="raise", idle_timeout_s=180):
        assert up.ok and up.step is not None and up.held == f"{run}/step-{up.step}", up
        assert up.step > held and up.skipped == up.step - held - 1, (held, up)  # passed-over steps are counted
        passed_over += range(held + 1, up.step)
        want = torch.load(refs / f"step-{up.step}.pt", weights_only=True)
        got = served.state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(_bytes(got[k]), _bytes(v)), (up.step, k)
        if not taken:  # the first update reads every tensor of the state
            assert up.tensors_read == len(want), up
        taken.append(up.step)
        held = up.step
        if len(taken) == 1:  # fall behind: the trainer commits the rest meanwhile, the next update skips to the newest
            t.join(timeout=240)
        if held == STEPS or time.monotonic() > deadline or "error" in result:
            stop.set()
            break
    t.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert sorted(result["names"]) == sorted(before)  # the trainer saved the names the follower holds
    assert taken and taken[-1] == STEPS, (taken, passed_over)  # the last step is reached
    assert sorted(taken + passed_over) == list(range(1, STEPS + 1)), (taken, passed_over)
    if taken[0] <= STEPS - 2:  # (the usual case) behind by two or more: one update straight to the newest
        assert taken == [taken[0], STEPS] and passed_over == list(range(taken[0] + 1, STEPS)), (taken, passed_over)
    final = torch.load(refs / f"step-{STEPS}.pt", weights_only=True)
    assert all(torch.equal(served.state_dict()[k], v) for k, v in final.items())
    assert any(not torch.equal(before[k], v) for k, v in final.items())
    assert not list(Path(run).glob("*/pins/*"))  # the follower unpinned what it read
