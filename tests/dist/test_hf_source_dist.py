"""Hugging Face directories loaded by bytecp on 2 gloo ranks: FSDP2 and FSDP2 x TP (each
rank reads only the byte ranges of its own shards) and DDP (every rank
whole, or each half with zero-redundancy loading), bitwise equal to
``from_pretrained``'s weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from . import hf_source_cases as hf

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("kind,layout,zero", [
    ("llama", "fsdp2", None), ("gpt2", "fsdp2", None), ("llama", "fsdp2-tp", None), ("llama-tied", "ddp", True), ("llama", "ddp", False),
])
def test_hf_dir_loads_on_two_ranks(pools, tmp_path: Path, kind: str, layout: str, zero: bool | None) -> None:
    path = hf.save(kind, tmp_path / kind, sharded=True)
    ref = hf.reference(kind, path)
    from safetensors.torch import load_file

    stored = sum(v.nbytes for f in path.glob("*.safetensors") for v in load_file(str(f)).values())
    results = pools(2).run(hf.load_on_ranks, kind, str(path), layout, zero, timeout=300)
    full, _ = results[0]
    assert set(full) == set(ref)
    for k, v in ref.items():
        assert torch.equal(full[k], v), k
    reads = [r for _, r in results]
    if layout == "ddp" and not zero:
        assert reads == [stored, stored]  # each rank reads the whole model
    elif layout == "fsdp2-tp":  # TP shards the projections; the rest (norms, embeddings) every rank reads whole
        assert sum(reads) > stored and max(reads) < stored, reads
    else:
        assert sum(reads) == stored and max(reads) < 0.6 * stored, reads  # each rank only its share
