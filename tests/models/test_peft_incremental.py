"""Incremental checkpoints of fine-tunes with the real peft, in one process:
a LoRA's checkpoints after the first are about its adapters and their
optimizer state, the newest loads bitwise after retention removed the older
ones, an adapter-only checkpoint loads onto a base from Hugging Face
weights, and a frozen embedding is written once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import peft_cases as cases
from tests.dist.peft_cases import assert_same

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)


def test_lora_checkpoints_hold_the_adapters_and_load_bitwise(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    res = cases.lora_run(run)
    w = res["written"]
    assert w[1] > res["total"]  # the first is full
    for step in (2, 3, 4):  # then the adapters and their optimizer state only
        assert w[step] <= res["budget"] < res["total"] / 5, (step, w[step], res["budget"], res["total"])
    assert sorted(p.name for p in Path(run).iterdir() if (p / "metadata.json").exists()) == ["step-3", "step-4"]
    got = cases.load_newest(run)
    assert got["step"] == 4
    assert_same(got["state"], res["state"])


def test_adapter_only_checkpoint_loads_onto_a_base_from_hugging_face_weights(tmp_path: Path) -> None:
    hf = tmp_path / "base"
    cases.base_model().save_pretrained(str(hf))
    res = cases.adapter_only(str(tmp_path / "adapter"), str(hf))
    assert res["equal"] and res["framework"] == "plain"
    assert all("lora_" in t for t in res["tensors"]) and len(res["tensors"]) == 8
    assert_same(res["adapters"], res["trained"])


def test_full_fine_tune_with_a_frozen_embedding_writes_it_once(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    res = cases.frozen_embedding_run(run)
    assert res["refs"][3] == ["step-1"]  # the embedding stays in the first checkpoint
    for step in (2, 3):
        assert res["written"][step] <= res["written"][1] - res["embedding_bytes"], res["written"]
    got = cases.load_frozen_embedding(run)
    assert got["step"] == 3
    assert_same(got["state"], res["state"])
