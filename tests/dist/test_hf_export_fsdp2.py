"""A tiny GPT-2 trained under FSDP2 on 2 gloo ranks, saved by bytecp,
exported to the Hugging Face layout and loaded by ``from_pretrained`` in this
process: weights and logits bitwise equal to the trained model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bytecp.cli import main as cli

from . import hf_cases

pytestmark = pytest.mark.timeout(600)


def test_fsdp2_trained_gpt2_loads_with_from_pretrained(pools, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    url, out = str(tmp_path / "ck"), tmp_path / "hf"
    ref_sd = pools(2).run(hf_cases.train_fsdp2_gpt2, url, timeout=300)[0]
    assert cli(["export", url, str(out), "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    loaded = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ref = GPT2LMHeadModel(hf_cases.gpt2_config()).eval()
    ref.load_state_dict(ref_sd)
    assert set(ref_sd) == set(loaded.state_dict())
    for k, v in ref_sd.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    x = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref(x).logits)
