"""Tied tensors and wrapper names on real gloo ranks, with a real GPT-2
(``transformers``; ``lm_head`` tied to ``wte``): FSDP2 and FSDP1 store the
tied tensor once, record the alias, and load it tied -- resharded, into
another framework, into one process -- under the plain names whatever wraps
the model (``torch.compile``, activation checkpointing, FSDP1's own
wrappers). Every comparison is bitwise against the full state torch reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.loading.opened import open_checkpoint, read_metadata
from bytecp.storage_api import open_storage

from . import tie_cases
from .cases import assert_same_state

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

HEAD, WTE = "lm_head.weight", "transformer.wte.weight"


def assert_stored_once(url: str, ref: dict[str, Any]) -> None:
    """The tied tensor is one stored tensor plus an alias; the stored bytes are
    the model's parameters once each plus the optimizer state."""
    storage = open_storage(url)
    md = read_metadata(storage)
    assert md.aliases == {f"model.{HEAD}": f"model.{WTE}"}
    assert not any("_orig_mod" in k or "_checkpoint_wrapped" in k or "_fsdp_wrapped" in k or HEAD in k
                   for k in md.tensors)
    want = {f"model.{k}" for k in ref["model"] if k != HEAD} | {f"optimizer.state.{k}" for k in ref["optim"]}
    assert set(md.tensors) - {"extra.step"} == want
    model_bytes = sum(v.numel() * v.element_size() for k, v in ref["model"].items() if k != HEAD)
    optim_bytes = sum(v.numel() * v.element_size() for v in ref["optim"].values())
    assert sum(c.nbytes for c in open_checkpoint(storage).all_rows()) == model_bytes + optim_bytes


def assert_matches_one_process(url: str, ref: dict[str, Any]) -> None:
    sd = bytecp.load_state_dict(url)
    assert sd["model"][HEAD] is sd["model"][WTE]
    for k, v in ref["model"].items():
        assert torch.equal(v, sd["model"][k]), k
    flat = {f"{p}.{k}": t for p, st in sd["optimizer"]["state"].items() for k, t in st.items()}
    for k, v in ref["optim"].items():
        assert torch.equal(v, flat[k]), k


@pytest.fixture(scope="module")
def fsdp2_saved(pools, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    """GPT-2 under FSDP2 on 2 ranks, saved through torch.compile's wrapper."""
    url = str(tmp_path_factory.mktemp("ties") / "fsdp2")
    ref = pools(2).run(tie_cases.save, "fsdp2", url, "compiled")[0]
    assert ref["tied"] and HEAD in ref["model"]  # torch's own full state has both names
    return url, ref


def test_fsdp2_tied_embedding_is_stored_once_and_loads_in_one_process(fsdp2_saved) -> None:
    url, ref = fsdp2_saved
    assert_stored_once(url, ref)
    assert_matches_one_process(url, ref)


def test_fsdp2_resumes_exactly_and_reshards_into_ddp_and_fsdp1(fsdp2_saved, pools) -> None:
    url, ref = fsdp2_saved
    # same job shape, plain (not compiled) model: the loss goes on exactly
    got = pools(2).run(tie_cases.load, "fsdp2", url, "", more_steps=2)[0]
    assert_same_state(ref, got, "fsdp2 2 -> fsdp2 2")
    assert got["tied"] and (got["missing"], got["unexpected"]) == ([], [])
    assert got["losses"] == pools(2).run(tie_cases.continuous, "fsdp2")[0]
    # another framework and world size
    got = pools(3).run(tie_cases.load, "ddp", url)[0]
    assert_same_state(ref, got, "fsdp2 2 -> ddp 3")
    assert got["tied"]
    got = pools(2).run(tie_cases.load, "fsdp1", url, "ckpt")[0]
    assert_same_state(ref, got, "fsdp2 2 -> fsdp1 2 (activation checkpointing)")
    assert got["tied"]


@pytest.mark.parametrize("variant", ["ckpt", "flat"])
def test_fsdp1_tied_embedding_is_stored_once_and_reshards(pools, tmp_path: Path, variant: str) -> None:
    """FSDP1 flattens a shared parameter once (use_orig_params True with
    activation checkpointing inside, and False): its other name is an alias."""
    url = str(tmp_path / "ck")
    ref = pools(2).run(tie_cases.save, "fsdp1", url, variant)[0]
    assert ref["tied"]
    assert_stored_once(url, ref)
    assert_matches_one_process(url, ref)
    got = pools(2).run(tie_cases.load, "fsdp2", url, "compiled")[0]
    assert_same_state(ref, got, f"fsdp1/{variant} 2 -> fsdp2 2 (compiled)")
    assert got["tied"] and (got["missing"], got["unexpected"]) == ([], [])
    got = pools(2).run(tie_cases.load, "fsdp1", url, variant, more_steps=2)[0]
    assert_same_state(ref, got, f"fsdp1/{variant} 2 -> fsdp1 2")
    assert got["losses"] == pools(2).run(tie_cases.continuous, "fsdp1", variant)[0]


def test_ties_that_differ_between_ranks_are_refused_everywhere(pools, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    for got in pools(2).run(tie_cases.disagreeing_ties, url):
        assert "'m.head'" in got["disagree"] and "rank(s) [1]" in got["disagree"], got["disagree"]
        assert got["uneven"] == repr([("only1.b", "only1.a")])
    assert not (tmp_path / "ck-disagree" / "metadata.json").exists()
    assert not list((tmp_path / "ck-disagree").rglob("*.bin"))
    sd = bytecp.load_state_dict(f"{url}-uneven")
    assert sd["only1"]["a"] is sd["only1"]["b"] and torch.equal(sd["only1"]["a"], sd["m"]["embed"] + 1)
