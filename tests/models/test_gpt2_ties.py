"""A real Hugging Face GPT-2 (``transformers``; its ``lm_head`` is tied to the
token embedding) in one process: the tied tensor is stored once, loads tied
into a tied model and into both names of an untied one, and a compiled model
saves and loads under the plain names, optimizer state included. The
2-process FSDP1/FSDP2 runs are in tests/dist/test_ties.py."""

from __future__ import annotations

import copy
import math
import uuid
from typing import Any

import pytest
import torch

import bytecp
from bytecp.loading.opened import open_checkpoint, read_metadata
from bytecp.storage_api import open_storage

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

WTE, HEAD = "transformer.wte.weight", "lm_head.weight"


def gpt2(seed: int, tied: bool = True) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=997, n_positions=32,
                                  tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg).eval()


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 997, (2, 16), generator=torch.Generator().manual_seed(step))


def train(model: Any, opt: torch.optim.Optimizer, start: int, n: int) -> list[float]:
    losses = []
    for step in range(start, start + n):
        x = tokens(step)
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def trained(seed: int = 0, tied: bool = True) -> tuple[Any, torch.optim.Optimizer]:
    model = gpt2(seed, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 0, 2)
    return model, opt


def mem_url() -> str:
    return f"memory://bytecp-tests/{uuid.uuid4().hex}"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def same_optimizer(model: Any, opt: Any, other: Any, other_opt: Any) -> None:
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(other_opt.state[q][key], opt.state[p][key]), key


@pytest.fixture(scope="module")
def saved() -> tuple[str, Any, Any]:
    model, opt = trained()
    assert model.lm_head.weight is model.transformer.wte.weight
    url = mem_url()
    bytecp.save(url, {"model": model, "optimizer": opt, "extra": {"step": 2}})
    return url, model, opt


def test_tied_embedding_is_stored_once(saved: tuple[str, Any, Any]) -> None:
    url, model, opt = saved
    storage = open_storage(url)
    md = read_metadata(storage)
    assert md.aliases == {f"model.{HEAD}": f"model.{WTE}"}
    assert f"model.{HEAD}" not in md.tensors and not any(HEAD in k for k in md.tensors)
    chunks = open_checkpoint(storage).all_rows()
    assert len(chunks) == len(md.tensors)  # one chunk per stored tensor, none for the alias
    params = sum(nbytes(p) for p in model.parameters())  # each parameter once
    optim = sum(nbytes(v) for st in opt.state.values() for v in st.values())
    assert sum(c.nbytes for c in chunks) == params + optim

    # an untied GPT-2 of the same shapes stores the head and its optimizer state too
    untied, uopt = trained(tied=False)
    url2 = mem_url()
    md2 = bytecp.save(url2, {"model": untied, "optimizer": uopt})
    assert md2.aliases == {}
    untied_bytes = sum(c.nbytes for c in open_checkpoint(open_storage(url2)).all_rows())
    wte = nbytes(model.transformer.wte.weight)
    assert untied_bytes - sum(c.nbytes for c in chunks) == wte + 2 * wte + 4  # weight, exp_avg, exp_avg_sq, step


def test_load_into_a_tied_model_keeps_the_tie_and_resumes_exactly(saved: tuple[str, Any, Any]) -> None:
    url, model, opt = saved
    fresh = gpt2(seed=5)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    extra = {"step": -1}
    res = bytecp.load(url, {"model": fresh, "optimizer": fopt, "extra": extra})  # strict
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    same_state(model.state_dict(), fresh.state_dict())
    same_optimizer(model, opt, fresh, fopt)
    with torch.no_grad():
        assert torch.equal(model(tokens(9)).logits, fresh(tokens(9)).logits)
    # training goes on exactly as it would have (a copy of the saved model continues)
    cont = copy.deepcopy(model)
    copt = torch.optim.AdamW(cont.parameters(), lr=1e-3)
    copt.load_state_dict(opt.state_dict())
    assert train(fresh, fopt, extra["step"], 2) == train(cont, copt, 2, 2)


def test_load_into_an_untied_model_fills_both_names(saved: tuple[str, Any, Any]) -> None:
    url, model, _ = saved
    untied = gpt2(seed=6, tied=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    res = bytecp.load(url, {"model": untied}, strict=False)  # the optimizer is not loaded here
    assert res.missing_keys == [] and not [k for k in res.unexpected_keys if k.startswith("model.")]
    assert torch.equal(untied.lm_head.weight, model.transformer.wte.weight)
    same_state(model.state_dict(), untied.state_dict())


def test_load_state_dict_returns_the_alias_as_the_same_tensor(saved: tuple[str, Any, Any]) -> None:
    url, model, _ = saved
    sd = bytecp.load_state_dict(url)
    assert sd["model"][HEAD] is sd["model"][WTE]
    assert list(sd["model"]) == list(model.state_dict())
    plain = gpt2(seed=7)
    plain.load_state_dict(sd["model"])  # strict, as an evaluation job would
    assert set(sd["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        assert torch.equal(plain(tokens(3)).logits, model(tokens(3)).logits)


def test_untied_checkpoint_with_equal_copies_loads_into_a_tied_model() -> None:
    """Both names stored (a checkpoint without aliases, as every v1 one is):
    the tied model gets the data once, nothing is missing or unexpected."""
    src = gpt2(seed=8, tied=False)
    with torch.no_grad():
        src.lm_head.weight.copy_(src.transformer.wte.weight)
    url = mem_url()
    md = bytecp.save(url, {"model": src})
    assert md.aliases == {} and f"model.{HEAD}" in md.tensors
    tied = gpt2(seed=9)
    res = bytecp.load(url, {"model": tied})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    same_state(src.state_dict(), tied.state_dict())


@pytest.mark.parametrize("direction", ["compiled save -> plain load", "plain save -> compiled load"])
def test_compiled_gpt2_uses_the_plain_names(direction: str) -> None:
    model, opt = trained(seed=10)
    compiled = torch.compile(model)  # never run: wrapping is what changes the names
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    url = mem_url()
    md = bytecp.save(url, {"model": compiled if direction.startswith("compiled") else model, "optimizer": opt})
    assert not any("_orig_mod" in k for k in [*md.tensors, *md.aliases])
    assert f"optimizer.state.{WTE}.exp_avg" in md.tensors
    fresh = gpt2(seed=11)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    target = fresh if direction.startswith("compiled") else torch.compile(fresh)
    res = bytecp.load(url, {"model": target, "optimizer": fopt})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    same_state(model.state_dict(), fresh.state_dict())
    same_optimizer(model, opt, fresh, fopt)
    assert math.isfinite(train(fresh, fopt, 2, 1)[0])
