"""Tensors that share memory are stored once, as aliases, and load tied or untied;
wrapper prefixes never reach the checkpoint's names (one process, no transformers:
tests/models/test_gpt2_ties.py does the same with a real GPT-2)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecp
from bytecp.errors import ConfigError
from bytecp.loading.opened import open_checkpoint, read_metadata
from bytecp.storage_api import open_storage
from bytecp.tree.state import flatten_tree, merge_aliases

from .helpers import same_bits, tensor_specs


def mem_url() -> str:
    return f"memory://bytecp-tests/{uuid.uuid4().hex}"


def stored(url: str) -> tuple[dict[str, str], dict[str, int]]:
    """(aliases, bytes stored per tensor) as the checkpoint records them."""
    storage = open_storage(url)
    md = read_metadata(storage)
    per: dict[str, int] = {}
    for c in open_checkpoint(storage).all_rows():
        per[c.fqn] = per.get(c.fqn, 0) + c.nbytes
    return md.aliases, per


# ----------------------------------------------------------------- what is an alias
def test_same_object_and_same_memory_are_aliases_partial_overlaps_are_not() -> None:
    buf = torch.arange(40, dtype=torch.float32)
    m = buf.view(5, 8)
    state = {
        "a": buf,
        "same_object": buf,
        "same_memory": buf[:],  # another tensor object, exactly the same elements
        "reshaped": m,  # same memory, other shape: a different tensor
        "head": buf[:10],  # a part of the buffer
        "overlap": buf[5:15],  # overlaps "head"
        "transposed": m.t(),  # same elements, other strides
        "as_int": buf.view(torch.int32),  # same bytes, other dtype
        "empty": buf[:0],
        "empty2": buf[:0],  # empty tensors are never aliases by memory
    }
    flat = flatten_tree(state)
    assert flat.aliases == {"same_object": "a", "same_memory": "a"}
    assert set(flat.tensors) == set(state) - set(flat.aliases)


def test_aliases_are_stored_once_and_load_tied_or_untied() -> None:
    w = torch.randn(64, 16)
    state = {"model": {"embed": w, "head": w, "bias": torch.randn(16)}, "ema": {"embed": w}}
    url = mem_url()
    md = bytecp.save(url, state)
    assert md.aliases == {"model.head": "model.embed", "ema.embed": "model.embed"}
    aliases, per = stored(url)
    assert aliases == md.aliases
    assert per == {"model.embed": w.numel() * 4, "model.bias": 64}  # the tied tensor once
    meta = json.loads(open_storage(url).read_bytes("metadata.json"))
    assert meta["aliases"] == md.aliases and "model.head" not in tensor_specs(meta)

    # one process: an alias is the very tensor of its stored name
    sd = bytecp.load_state_dict(url)
    assert sd["model"]["head"] is sd["model"]["embed"] and sd["ema"]["embed"] is sd["model"]["embed"]
    assert same_bits(sd["model"]["embed"], w)

    # untied target: every name gets the data
    untied = {"model": {"embed": torch.zeros(64, 16), "head": torch.zeros(64, 16), "bias": torch.zeros(16)},
              "ema": {"embed": torch.zeros(64, 16)}}
    res = bytecp.load(url, untied)
    assert res.missing_keys == [] and res.unexpected_keys == []
    for t in (untied["model"]["embed"], untied["model"]["head"], untied["ema"]["embed"]):
        assert same_bits(t, w)

    # tied target: filled once, never reported missing or unexpected
    z = torch.zeros(64, 16)
    tied = {"model": {"embed": z, "head": z, "bias": torch.zeros(16)}, "ema": {"embed": torch.zeros(64, 16)}}
    res = bytecp.load(url, tied)
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert same_bits(z, w) and same_bits(tied["ema"]["embed"], w)


def test_a_tied_target_takes_its_first_stored_name_and_covers_the_others() -> None:
    """A checkpoint without aliases (both names stored, here with different
    data) into a tied target: the group is filled once, from the first name the
    checkpoint has; nothing is missing or unexpected."""
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    url = mem_url()
    bytecp.save(url, {"m": {"embed": a, "head": b}})
    z = torch.zeros(8, 4)
    res = bytecp.load(url, {"m": {"embed": z, "head": z}})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert same_bits(z, a)
    # the tied target's first name is absent from the checkpoint: its other name fills it
    url2 = mem_url()
    bytecp.save(url2, {"m": {"head": b}})
    z2 = torch.zeros(8, 4)
    res = bytecp.load(url2, {"m": {"embed": z2, "head": z2}})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert same_bits(z2, b)


def test_an_alias_the_target_lacks_is_unexpected_and_a_lacking_group_is_missing() -> None:
    w = torch.randn(4, 4)
    url = mem_url()
    bytecp.save(url, {"m": {"embed": w, "head": w}})
    with pytest.raises(bytecp.StateMismatchError, match="'m.head'"):
        bytecp.load(url, {"m": {"embed": torch.zeros(4, 4)}})
    res = bytecp.load(url, {"m": {"embed": torch.zeros(4, 4)}}, strict=False)
    assert res.unexpected_keys == ["m.head"] and res.missing_keys == []
    z = torch.zeros(4, 4)
    res = bytecp.load(url, {"m": {"other": z, "other2": z}}, strict=False)
    assert res.missing_keys == ["m.other", "m.other2"]


def test_a_shape_mismatch_through_an_alias_names_both_names() -> None:
    w = torch.randn(4, 4)
    url = mem_url()
    bytecp.save(url, {"m": {"embed": w, "head": w}})
    with pytest.raises(bytecp.StateMismatchError, match=r"m\.head \(stored as m\.embed\).*\[4, 4\].*\[5, 4\]"):
        bytecp.load(url, {"m": {"embed": torch.zeros(4, 4), "head": torch.zeros(5, 4)}})


@pytest.mark.parametrize("how", ["eager", "lazy", "batched"])
def test_async_saves_keep_aliases(how: str) -> None:
    w = torch.randn(300, 7)
    url = mem_url()
    h = bytecp.async_save(url, {"embed": w, "head": w, "b": torch.randn(3)}, lazy=how == "lazy",
                          memory_budget_bytes=4096 if how == "batched" else None)
    md = h.wait()
    assert md.aliases == {"head": "embed"}
    sd = bytecp.load_state_dict(url)
    assert sd["head"] is sd["embed"] and same_bits(sd["embed"], w)


def test_ranks_that_disagree_on_a_tie_are_refused_at_commit() -> None:
    """(merge_aliases, the coordinator's check; the 2-rank run is in tests/dist/test_ties.py)"""
    assert merge_aliases({"b": "a"}, [(1, {"b": "a", "d": "c"})], {"a", "c"}, 0) == {"b": "a", "d": "c"}
    with pytest.raises(ConfigError, match=r"\['b'\].*rank\(s\) \[1\]"):
        merge_aliases({}, [(1, {"b": "a"})], {"a", "b"}, 0)
    with pytest.raises(ConfigError, match=r"\['b'\].*rank\(s\) \[0\]"):
        merge_aliases({"b": "a"}, [(1, {})], {"a", "b"}, 0)


# ----------------------------------------------------------------- modules: ties and names
class Tied(nn.Module):
    """A tied embedding and a layer used twice (a module registered under two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.block = nn.Linear(8, 8)
        self.again = self.block
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.module = nn.LayerNorm(8)  # a user's submodule named like DDP's attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.module(self.again(self.block(self.embed(x)))))


def trained(model: nn.Module, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randint(0, 50, (4, 6))
    for _ in range(2):
        model(x).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_tied_module_saves_once_and_names_optimizer_state_by_the_first_name() -> None:
    model, opt = trained(Tied())
    url = mem_url()
    md = bytecp.save(url, {"model": model, "optimizer": opt})
    assert md.aliases == {"model.again.weight": "model.block.weight", "model.again.bias": "model.block.bias",
                          "model.head.weight": "model.embed.weight"}
    assert "model.module.weight" in md.tensors  # not a wrapper: the name stays
    assert {k.split(".state.")[1].rsplit(".", 1)[0] for k in md.tensors if k.startswith("optimizer.state.")} == {
        "embed.weight", "block.weight", "block.bias", "module.weight", "module.bias"}
    _, per = stored(url)
    unique = {t.data_ptr(): t.numel() * 4 for t in model.state_dict().values()}
    assert sum(v for k, v in per.items() if k.startswith("model.")) == sum(unique.values())

    fresh, fopt = trained(Tied(), seed=1)
    res = bytecp.load(url, {"model": fresh, "optimizer": fopt})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert fresh.head.weight is fresh.embed.weight and fresh.again is fresh.block
    for k, v in model.state_dict().items():
        assert same_bits(fresh.state_dict()[k], v), k
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(fopt.state[q][key], opt.state[p][key])


def checkpoint_wrapped(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    return model


WRAPS = {
    "plain": lambda m: m,
    "DataParallel": lambda m: nn.DataParallel(m),
    "compiled": lambda m: torch.compile(m),
    "activation checkpointing": checkpoint_wrapped,
    "all three": lambda m: nn.DataParallel(torch.compile(checkpoint_wrapped(m))),
}


@pytest.mark.parametrize("save_as", list(WRAPS))
@pytest.mark.parametrize("load_as", ["plain", "all three"])
def test_wrapper_prefixes_never_reach_the_checkpoint(save_as: str, load_as: str) -> None:
    model, opt = trained(Tied())
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    saving = WRAPS[save_as](model)
    url = mem_url()
    md = bytecp.save(url, {"model": saving, "optimizer": opt})
    assert sorted(md.tensors) == sorted(
        [f"model.{k}" for k in ref if not k.startswith(("again.", "head."))]
        + [f"optimizer.state.{p}.{s}" for p in ("embed.weight", "block.weight", "block.bias", "module.weight",
                                                 "module.bias") for s in ("step", "exp_avg", "exp_avg_sq")])
    assert not any(w in k for k in [*md.tensors, *md.aliases]
                   for w in ("_orig_mod", "_checkpoint_wrapped_module", "module.module"))
    fresh, fopt = trained(Tied(), seed=1)
    loading = WRAPS[load_as](fresh)
    res = bytecp.load(url, {"model": loading, "optimizer": fopt})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    for k, v in ref.items():
        assert same_bits(fresh.state_dict()[k], v), k
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert same_bits(fopt.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def test_compiled_model_state_dict_has_orig_mod_keys() -> None:
    """The premise of the test above: torch.compile's wrapper prefixes its keys."""
    compiled = torch.compile(Tied())
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    wrapped = checkpoint_wrapped(Tied())
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())


def test_names_that_collide_once_cleaned_are_refused() -> None:
    from bytecp.adapters._names import ModuleNames

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.compile(nn.Linear(2, 2))

        def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            sd = super().state_dict(*args, **kwargs)
            sd["inner.weight"] = sd["inner._orig_mod.weight"]
            return sd

    with pytest.raises(ConfigError, match="'inner._orig_mod.weight' and 'inner.weight'|'inner.weight' and"):
        ModuleNames(Odd()).state_dict()


def test_wrapper_hops_declared_per_instance_are_asked_each_time() -> None:
    """Which module classes are wrappers is remembered per class, except for
    classes declaring ``_fqn_modifiers``: their hops may differ per instance."""
    from bytecp.adapters._names import ModuleNames

    class Hidden(nn.Module):
        def __init__(self, hop: str) -> None:
            super().__init__()
            self.hop = hop
            self.add_module(hop, nn.Linear(2, 2))

        def _fqn_modifiers(self) -> dict[str, str]:
            return {"hidden": self.hop}

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Hidden("x"), Hidden("y")

    assert sorted(ModuleNames(Outer()).state_dict()[0]) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    plain = nn.Sequential(nn.Linear(2, 2))
    names = ModuleNames(plain)
    assert names.clean("0.weight") == "0.weight" and sorted(names.state_dict()[0]) == ["0.bias", "0.weight"]


def test_format_records_aliases_that_a_reader_must_resolve(tmp_path: Path) -> None:
    """metadata.json: an alias is a tensor leaf of the skeleton named in
    "aliases", absent from "tensors"; a reader that ignored "aliases" would
    find a skeleton leaf naming no stored tensor and refuse the checkpoint."""
    w = torch.randn(3, 3)
    url = str(tmp_path / "ck")
    bytecp.save(url, {"embed": w, "head": w})
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert meta["aliases"] == {"head": "embed"}
    sk = meta["skeleton"]
    assert dict(zip(sk["k"], sk["v"], strict=True))["head"] == "T" and "head" not in tensor_specs(meta)
    meta["aliases"] = {}
    (tmp_path / "ck" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(bytecp.CorruptCheckpointError, match="skeleton names tensor 'head'"):
        bytecp.load_state_dict(url)
    meta["aliases"] = {"head": "nothing"}
    (tmp_path / "ck" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(bytecp.CorruptCheckpointError, match="aliases tensor 'head' to 'nothing'"):
        bytecp.load_state_dict(url)


def test_v1_golden_without_aliases_loads_into_a_tied_model() -> None:
    """A checkpoint written before aliases existed (format v1: every name
    stored) loads into a model whose tensors are tied: each tie is filled once,
    from its first name, and no name is missing or unexpected."""
    url = str(Path(__file__).resolve().parents[1] / "golden" / "v1" / "plain" / "checkpoint")
    saved = bytecp.load_state_dict(url)["model"]  # checked against expected.json by tests/golden
    assert not read_metadata(open_storage(url)).aliases
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model[1].bias = model[1].weight  # a tied parameter
    model[1].running_var = model[1].running_mean  # and a tied buffer
    res = bytecp.load(url, {"model": model}, strict=False)
    assert res.missing_keys == []
    assert not [k for k in res.unexpected_keys if k.startswith("model.")]
    assert model[1].bias is model[1].weight and model[1].running_var is model[1].running_mean
    for name in ("0.weight", "0.bias", "1.weight", "1.running_mean", "1.num_batches_tracked"):
        assert same_bits(model.state_dict()[name], saved[name]), name


def test_inspect_lists_aliases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bytecp.cli import main as cli

    w = torch.randn(3, 3)
    bytecp.save(str(tmp_path / "ck"), {"embed": w, "head": w})
    assert cli(["inspect", "--json", str(tmp_path / "ck")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["aliases"] == {"head": "embed"} and list(info["tensors"]) == ["embed"]
