"""Serving deltas beside a real full fine-tune: a transformers Llama trained
with AdamW under FSDP2 on 2 spawned gloo ranks, saving serving deltas in
bf16 every step (``CheckpointManager(serving_dtype=torch.bfloat16)``), and
followed live by this process (no torch.distributed) holding bf16 weights
(``bytecp.follow(..., dtype=torch.bfloat16)``). After every update the
follower's weights equal, bit for bit, the trainer's fp32 weights of that
step cast to bf16: step by step by deltas, behind by three steps (the chain
applied), a second follower starting mid-run (the last whole serving copy
and the deltas after it), a damaged delta and a missing rank's entries (the
tensors read whole instead, reported), then by deltas again."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.format import serving_wire as wire
from tests.dist.conftest import pools  # noqa: F401 - the session's spawned gloo pools, shared with tests/dist

from . import fsdp2_trainer_cases as cases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 10
BF16 = torch.bfloat16


def _by_deltas(up: Any, n: int) -> bool:
    """Every tensor taken by deltas: changed by them or unchanged, none read whole."""
    return up.tensors_read == up.tensors_by_delta and up.tensors_by_delta + up.tensors_unchanged == n \
        and up.tensors_by_delta > 0


def _check(model: Any, refs: Path, step: int) -> None:
    want = torch.load(refs / f"step-{step}.pt", weights_only=True)
    got = model.state_dict()
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert got[k].dtype == BF16 and torch.equal(got[k].view(torch.int16), v.to(BF16).view(torch.int16)), (step, k)


def test_bf16_followers_of_an_fsdp2_llama_fine_tune_by_deltas_bitwise(pools: Any, tmp_path: Path) -> None:  # noqa: F811
    from transformers import LlamaForCausalLM

    run, refs = tmp_path / "run", tmp_path / "refs"
    refs.mkdir()
    pool = pools(2)
    result: dict[str, Any] = {}

    def trainer() -> None:
        try:
            result["names"] = pool.run(cases.train_gated, str(run), str(refs), STEPS, 1e-6, 4, timeout=360)[0]
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            result["error"] = e

    def go(*steps: int) -> None:
        for s in steps:
            (refs / f"go-{s}").touch()
        deadline = time.monotonic() + 120
        while not (run / f"step-{steps[-1]}" / "metadata.json").exists():
            assert "error" not in result, result["error"]
            assert time.monotonic() < deadline, f"step {steps[-1]} never committed"
            time.sleep(0.02)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    torch.manual_seed(1)  # weights unlike the trainer's: every tensor comes from the checkpoints
    served = LlamaForCausalLM(cases.llama_config()).to(BF16)
    n = len(served.state_dict())
    f = bytecp.follow(str(run), {"model": served}, poll_s=0.02, dtype=BF16, on_error="raise")
    try:
        go(1)
        up = next(f)  # nothing held: the whole serving copy of step 1
        assert up.step == 1 and _by_deltas(up, n) and not up.fallbacks, up
        _check(served, refs, 1)
        bf16_bytes = sum(v.numel() * 2 for v in served.state_dict().values())
        go(2)
        up = next(f)
        assert up.step == 2 and _by_deltas(up, n) and up.delta_steps == 1 and not up.fallbacks, up
        assert up.bytes_read < 0.25 * bf16_bytes, (up.bytes_read, bf16_bytes)
        _check(served, refs, 2)
        go(3, 4, 5)  # behind by three: the chain 3, 4, 5 costs less than step 5's whole copy
        up = next(f)
        assert up.step == 5 and up.skipped == 2 and up.delta_steps == 3 and _by_deltas(up, n), up
        _check(served, refs, 5)
        go(6)
        late = LlamaForCausalLM(cases.llama_config()).to(BF16)  # a follower starting mid-run
        g = bytecp.follow(str(run), {"model": late}, poll_s=0.02, dtype=BF16, on_error="raise")
        up = next(g)
        assert up.step == 6 and _by_deltas(up, n) and up.delta_steps == 1 and not up.fallbacks, up
        _check(late, refs, 6)
        g.close()
        up = next(f)
        assert up.step == 6 and up.delta_steps == 1 and _by_deltas(up, n), up
        _check(served, refs, 6)
        go(7)  # a byte of rank 1's deltas flipped before the follower reads them
        ck = run / "step-7"
        sid = json.loads((ck / "metadata.json").read_text())["save_id"]
        ents = wire.RankEntries.from_bytes((ck / "serving" / sid / "1.json").read_bytes(), "t")
        e = max(ents.entries, key=lambda e: e.delta.count if e.delta else 0)
        assert e.delta is not None and e.delta.count
        path = ck / "serving" / sid / "1.bin"
        data = bytearray(path.read_bytes())
        data[e.delta.offset + e.delta.nbytes // 2] ^= 0x5A
        path.write_bytes(bytes(data))
        up = next(f)
        assert up.step == 7 and 0 < up.tensors_by_delta < up.tensors_read, up
        assert any(e.fqn in x and "crc32c" in x and "1.bin" in x for x in up.fallbacks), up.fallbacks
        _check(served, refs, 7)
        go(8)  # rank 0's entries gone: every tensor has a box of rank 0 (FSDP2 shards each along dim 0)
        sid = json.loads((run / "step-8" / "metadata.json").read_text())["save_id"]
        (run / "step-8" / "serving" / sid / "0.json").unlink()
        up = next(f)
        assert up.step == 8 and up.tensors_by_delta == 0 and any("0.json" in x for x in up.fallbacks), up
        _check(served, refs, 8)
        go(9, 10)  # by deltas again, relative to step 8 held whole
        up = next(f)
        assert up.step == 10 and up.delta_steps == 2 and _by_deltas(up, n) and not up.fallbacks, up
        _check(served, refs, 10)
    finally:
        f.close()
        for s in range(1, STEPS + 1):  # a trainer still waiting is let through
            (refs / f"go-{s}").touch()
        t.join(timeout=240)
    assert "error" not in result, result.get("error")
    assert sorted(result["names"]) == sorted(served.state_dict())
    assert not list(run.glob("*/pins/*"))
