"""Incremental checkpoints of a LoRA fine-tune with the real peft under FSDP2
on 2 gloo ranks: checkpoints after the first hold the adapters and their
optimizer state only, the newest loads bitwise after retention removed the
older ones, and the adapters saved alone (a dict of DTensors outside their
module) load onto a base from Hugging Face weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import peft_cases as cases
from .peft_cases import assert_same

pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_fsdp2_lora_incremental_checkpoints(pools, tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    res = pools(2).run(cases.lora_run, run, 3, True, timeout=300)[0]
    w = res["written"]
    assert w[1] > res["total"]
    for step in (2, 3):
        assert w[step] <= res["budget"] < res["total"] / 5, (step, w[step], res["budget"], res["total"])
    got = pools(2).run(cases.load_newest, run, True, timeout=300)
    for g in got:
        assert g["step"] == 3
        assert_same(g["state"], res["state"])


def test_fsdp2_adapter_dtensors_outside_their_module(pools, tmp_path: Path) -> None:
    hf = tmp_path / "base"
    cases.base_model().save_pretrained(str(hf))
    for res in pools(2).run(cases.adapter_only, str(tmp_path / "adapter"), str(hf), True, timeout=300):
        assert res["equal"] and res["framework"] == "fsdp2" and len(res["tensors"]) == 8
        assert_same(res["adapters"], res["trained"])


def test_fsdp2_full_fine_tune_with_a_frozen_embedding_writes_it_once(pools, tmp_path: Path) -> None:
    """With the manager's asynchronous saves (snapshots of the cached share)."""
    run = str(tmp_path / "run")
    res = pools(2).run(cases.frozen_embedding_run, run, 3, True, True, timeout=300)[0]
    assert res["refs"][3] == ["step-1"]
    for step in (2, 3):
        assert res["written"][step] <= res["written"][1] - res["embedding_bytes"], res["written"]
    for got in pools(2).run(cases.load_frozen_embedding, run, True, timeout=300):
        assert got["step"] == 3
        assert_same(got["state"], res["state"])
