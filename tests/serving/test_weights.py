"""bytecp.iter_weights and follow with transformers and peft: the pairs load
into a fresh LlamaForCausalLM bitwise (names as transformers gives them, or
through a Megatron spec), changed_since yields only what changed, and a LoRA
follower reads only the adapters' bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.interop.mapping import convert_state_dict, get_spec
from tests.dist import peft_cases as cases
from tests.megatron.test_megatron_hf import _megatron_state

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 512, (2, 16), generator=g)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def test_iter_weights_loads_a_transformers_llama_bitwise_and_changed_since(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    run = str(tmp_path / "run")
    model = cases.base_model()
    model.model.embed_tokens.requires_grad_(False)  # frozen: referenced by the next checkpoints
    opt = cases.optimizer(model)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3)
    for step in (1, 2):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    fresh = LlamaForCausalLM(cases.llama_config())
    pairs = list(bytecp.iter_weights(f"{run}/step-2", names="hf"))
    assert [n for n, _ in pairs] == list(model.state_dict())  # transformers' own names and order
    fresh.load_state_dict(dict(pairs), strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    changed = dict(bytecp.iter_weights(f"{run}/step-2", changed_since=f"{run}/step-1"))
    assert set(changed) == set(model.state_dict()) - {"model.embed_tokens.weight"}
    half = dict(bytecp.iter_weights(f"{run}/step-2", dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))
    assert not list(bytecp.iter_weights(f"{run}/step-2", changed_since=f"{run}/step-2"))


def test_iter_weights_converts_a_megatron_layout_through_its_spec(tmp_path: Path) -> None:
    sd = _megatron_state("llama")
    url = str(tmp_path / "ck")
    bytecp.save(url, {"model": sd})
    cfg = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    got = dict(bytecp.iter_weights(url, names="hf", spec="llama", config=cfg))
    want = convert_state_dict(sd, get_spec("llama"), heads=4, groups=2, vocab_size=128)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    sd["decoder.final_layernorm.weight"] = sd["decoder.final_layernorm.weight"] + 1
    bytecp.save(str(tmp_path / "ck2"), {"model": sd})
    changed = dict(bytecp.iter_weights(str(tmp_path / "ck2"), names="hf", spec="llama", config=cfg,
                                       changed_since=url))
    assert list(changed) == ["model.norm.weight"]  # equal checksums: the rest is unchanged


def test_a_lora_follower_reads_only_the_adapters(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    run = str(tmp_path / "run")
    model = cases.lora(cases.base_model())
    opt = cases.optimizer(model)
    adapter_bytes = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=2)
    served = cases.lora(cases.base_model())
    with torch.no_grad():
        for p in served.parameters():
            p.zero_()
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    for step in (1, 2, 3):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
        up = next(gen)
        assert up.ok and up.step == step, up
        for k, v in model.state_dict().items():
            assert torch.equal(served.state_dict()[k], v), (step, k)
        if step > 1:
            assert up.bytes_read == adapter_bytes, (up.bytes_read, adapter_bytes)
            assert up.tensors_read == 8 and up.unchanged_by_reference == up.tensors_unchanged
    gen.close()


def test_iter_weights_scatter_triples_bring_an_engine_forward_bitwise(tmp_path: Path) -> None:
    """An engine holding bf16 weights (loaded from ``iter_weights(dtype=)``
    pairs) takes two steps at once from ``scatter=True`` triples: each
    changed tensor's changed elements, applied in place (a tensor none of
    whose bf16 values changed -- the norms' weights of 1.0 at lr 1e-6 -- is
    not yielded); then a dense step whose boxes the trainer wrote whole, as
    whole tensors copied in. After each, bitwise the trainer's weights cast
    to bf16."""
    from transformers import LlamaForCausalLM

    run = str(tmp_path / "run")
    model = cases.base_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=5, serving_dtype=torch.bfloat16)
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})
    bits = {1: {k: v.to(torch.bfloat16).view(torch.int16) for k, v in model.state_dict().items()}}
    engine = LlamaForCausalLM(cases.llama_config()).to(torch.bfloat16)
    engine.load_state_dict(dict(bytecp.iter_weights(f"{run}/step-1", names="hf", dtype="bf16")))
    for step in (2, 3):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    params = dict(engine.named_parameters())

    def apply(url: str, since: str) -> tuple[int, int]:
        """The engine takes ``url``'s changes since ``since`` in place: (tensors scattered, tensors copied whole)."""
        scattered = copied = 0
        yielded = set()
        with torch.no_grad():
            for name, positions, values in bytecp.iter_weights(url, changed_since=since, dtype=torch.bfloat16,
                                                               scatter=True):
                yielded.add(name)
                if positions is None:
                    params[name].copy_(values)
                    copied += 1
                else:
                    assert values.dtype == torch.bfloat16 and 0 < len(positions) == len(values) < params[name].numel()
                    params[name].view(-1)[positions] = values
                    scattered += 1
        now = {k: v.to(torch.bfloat16).view(torch.int16) for k, v in model.state_dict().items()}
        for k, v in now.items():
            assert torch.equal(engine.state_dict()[k].view(torch.int16), v), k
        old = bits[int(since.rsplit("-", 1)[1])]
        assert yielded == {k for k in now if not torch.equal(now[k], old[k])}, yielded  # what changed in bf16
        bits[int(url.rsplit("-", 1)[1])] = now
        return scattered, copied

    # two steps at lr 1e-6 (typical of RL): every weight but the norms' changed, each by its changed elements alone
    norms = [k for k in params if "norm" in k]
    assert norms and apply(f"{run}/step-3", f"{run}/step-1") == (len(params) - len(norms), 0)
    # a step at lr 1e-2 changes most elements: the trainer wrote those boxes whole, the engine copies them
    for g in opt.param_groups:
        g["lr"] = 1e-2
    _train(model, opt, 4)
    mgr.save(4, {"model": model, "optimizer": opt})
    scattered, copied = apply(f"{run}/step-4", f"{run}/step-3")
    assert copied > 0 and scattered + copied > len(params) - len(norms), (scattered, copied)
    with pytest.raises(bytecp.ConfigError, match="scatter=True"):
        next(bytecp.iter_weights(f"{run}/step-3", scatter=True))
