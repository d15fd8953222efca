"""Megatron-Core <-> transformers through the mapping specs of
``bytecp.adapters.megatron.hf``: a tiny GPTModel of each family (GPT-2,
Llama, Qwen2, Mixtral) saved at TP=2 and exported with ``bytecp export``
loads with ``from_pretrained`` into the real transformers class and gives
Megatron's logits; a transformers model's weights, written as a bytecp
checkpoint under Megatron's names, load into Megatron at TP=2 (and the
Mixtral one at EP=2) and give the transformers logits.

The spec round trips (convert then invert, bitwise) run without Megatron.
One pool of two spawned ranks serves every Megatron case (the CPU patches are
in ``megatron_cases``; the family models in ``megatron_hf_cases``).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

import bytecp
from bytecp.errors import ConfigError, StateMismatchError
from bytecp.interop.mapping import (
    convert_state_dict,
    fuse_interleaved_qkv,
    get_spec,
    invert_state_dict,
    split_interleaved_qkv,
)

FAMILIES = ["gpt2", "llama", "qwen2", "mixtral"]


def _megatron_state(family: str, layers: int = 2, hidden: int = 32, ffn: int = 64, heads: int = 4, groups: int = 2,
                    vocab: int = 128, experts: int = 4) -> dict[str, torch.Tensor]:
    """Random tensors under Megatron's checkpoint keys and shapes (layers stacked)."""
    g = torch.Generator().manual_seed(0)
    hd = hidden // heads
    groups = heads if family == "gpt2" else groups
    qkv = (heads + 2 * groups) * hd
    L = "decoder.layers."
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (vocab, hidden), "output_layer.weight": (vocab, hidden),
        L + "self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
        L + "self_attention.linear_qkv.weight": (layers, qkv, hidden),
        L + "self_attention.linear_proj.weight": (layers, hidden, heads * hd),
        L + "mlp.linear_fc1.layer_norm_weight": (layers, hidden), "decoder.final_layernorm.weight": (hidden,),
    }  # fmt: skip
    if family == "gpt2":
        shapes.update({
            "embedding.position_embeddings.weight": (8, hidden),
            L + "self_attention.linear_qkv.layer_norm_bias": (layers, hidden),
            L + "self_attention.linear_qkv.bias": (layers, qkv), L + "self_attention.linear_proj.bias": (layers, hidden),
            L + "mlp.linear_fc1.layer_norm_bias": (layers, hidden), L + "mlp.linear_fc1.weight": (layers, ffn, hidden),
            L + "mlp.linear_fc1.bias": (layers, ffn), L + "mlp.linear_fc2.weight": (layers, hidden, ffn),
            L + "mlp.linear_fc2.bias": (layers, hidden), "decoder.final_layernorm.bias": (hidden,),
        })  # fmt: skip
    elif family == "mixtral":
        shapes.update({
            L + "mlp.router.weight": (layers, experts, hidden),
            L + "mlp.experts.experts.linear_fc1.weight": (layers, experts, 2 * ffn, hidden),
            L + "mlp.experts.experts.linear_fc2.weight": (layers, experts, hidden, ffn),
        })  # fmt: skip
    else:
        shapes.update({L + "mlp.linear_fc1.weight": (layers, 2 * ffn, hidden),
                       L + "mlp.linear_fc2.weight": (layers, hidden, ffn)})
        if family == "qwen2":
            shapes[L + "self_attention.linear_qkv.bias"] = (layers, qkv)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_round_trip_is_bitwise(family: str) -> None:
    sd = _megatron_state(family)
    params = {"heads": 4, "groups": 4 if family == "gpt2" else 2, "vocab_size": 128}
    hf = convert_state_dict({**sd, "decoder.layers.mlp.linear_fc2._extra_state/shard_0_2": None}, get_spec(family),
                            **params)
    assert all("{layer}" not in k and "decoder" not in k for k in hf)
    back = invert_state_dict(hf, get_spec(family), **params)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_qkv_fuse_inverts_split_and_gate_up_order() -> None:
    t = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(8 * 4, 3)  # heads 4, groups 2, head_dim 4
    q, k, v = split_interleaved_qkv(t, heads=4, groups=2)
    assert q.shape == (16, 3) and k.shape == (8, 3)
    assert torch.equal(q[:4], t[:4]) and torch.equal(k[:4], t[8:12]) and torch.equal(q[8:12], t[16:20])
    assert torch.equal(fuse_interleaved_qkv(q, k, v, 4, 2), t)
    fc1 = {"decoder.layers.mlp.linear_fc1.weight": torch.arange(8.0).reshape(1, 4, 2)}
    spec = {"rules": [{"from": "decoder.layers.mlp.linear_fc1.weight", "split": "gate_up",
                       "to": ["l.{layer}.gate", "l.{layer}.up"]}]}
    out = convert_state_dict(fc1, spec)
    assert torch.equal(out["l.0.gate"], fc1["decoder.layers.mlp.linear_fc1.weight"][0, :2])


def test_spec_errors_name_the_problem() -> None:
    with pytest.raises(ConfigError, match="no mapping spec named 'gpt3'"):
        get_spec("gpt3")
    sd = _megatron_state("llama")
    sd["decoder.layers.self_attention.linear_proj.bias"] = torch.zeros(2, 32)
    with pytest.raises(StateMismatchError, match="linear_proj.bias"):
        convert_state_dict(sd, get_spec("llama"), heads=4, groups=2, vocab_size=128)
    hf = convert_state_dict(_megatron_state("llama"), get_spec("llama"), heads=4, groups=2, vocab_size=128)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(StateMismatchError, match="model.layers.1.mlp.up_proj.weight"):
        invert_state_dict(hf, get_spec("llama"), heads=4, groups=2, vocab_size=128)


def test_export_with_a_spec_needs_the_config_and_one_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from bytecp.interop.hf_export import export_hf

    sd = _megatron_state("qwen2")
    url = str(tmp_path / "ck")
    bytecp.save(url, {"model": sd})  # Megatron's names, saved by any job
    with pytest.raises(ConfigError, match="--spec qwen2 needs the Hugging Face config"):
        export_hf(url, str(tmp_path / "a"), spec="qwen2")
    cfg = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    with pytest.raises(ConfigError, match="drop --workers"):
        export_hf(url, str(tmp_path / "b"), spec="qwen2", config=cfg, workers=2)
    export_hf(url, str(tmp_path / "c"), spec="qwen2", config=cfg, dtype="bf16")
    got = load_file(str(tmp_path / "c" / "model.safetensors"))
    want = convert_state_dict(sd, get_spec("qwen2"), heads=4, groups=2, vocab_size=128)
    assert set(got) == set(want) and all(torch.equal(got[k], v.bfloat16()) for k, v in want.items())
    # streamed: each source tensor is read once, when its first target is written
    from bytecp.interop import mapped_export

    fetched: list[str] = []
    real = mapped_export.TensorReader.read

    def counting(self: Any, items: Any) -> Any:
        items = list(items)
        fetched.extend(it.fqn for it in items)
        return real(self, items)

    mp = pytest.MonkeyPatch()
    mp.setattr(mapped_export.TensorReader, "read", counting)
    try:
        export_hf(url, str(tmp_path / "e"), spec="qwen2", config=cfg, max_shard_size="20KB")
    finally:
        mp.undo()
    assert sorted(fetched) == sorted({f"model.{k}" for k in sd}), fetched  # each source once
    got = {k: v for f in sorted((tmp_path / "e").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    # a plain (not Megatron) checkpoint: no spec unless named
    export_hf(url, str(tmp_path / "d"), config=cfg)
    assert "decoder.layers.self_attention.linear_qkv.weight" in load_file(str(tmp_path / "d" / "model.safetensors"))


# ---------------------------------------------------------------- Megatron
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("megatron-core or transformers is not installed (make test installs them)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_cases as mc  # noqa: E402
import megatron_hf_cases as hc  # noqa: E402
from dist.pool import WorkerPool  # noqa: E402


@pytest.fixture(scope="module")
@spawns
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(2, env={"PYTHONWARNINGS": "ignore"})
    yield p
    p.close()


def _hf_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=mc.batch()[0]).logits


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_to_transformers_and_back_at_tp2(pool: WorkerPool, tmp_path: Path) -> None:
    import transformers
    from bytecp.adapters.megatron.hf import megatron_state_from_hf

    from bytecp.cli import main
    from bytecp.interop.hf_export import export_hf

    ref = pool.run(hc.save_families, str(tmp_path), FAMILIES, 2)[0]
    classes = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM, "mixtral": transformers.MixtralForCausalLM}
    for family in FAMILIES:
        out = tmp_path / f"{family}-hf"
        if family == "llama":  # the command line, spec detected from the saved hf_config
            assert main(["export", str(tmp_path / family), str(out), "--no-progress"]) == 0
        else:
            export_hf(str(tmp_path / family), str(out), spec=family)
        model = classes[family].from_pretrained(out)
        torch.testing.assert_close(_hf_logits(model), ref[family]["logits"], atol=1e-5, rtol=0,
                                   msg=lambda m, f=family: f"{f}: {m}")

    # Hugging Face weights -> a bytecp checkpoint under Megatron's names -> Megatron at TP=2
    urls, want = {}, {}
    for family in FAMILIES:
        cfg = ref[family]["hf_config"]
        torch.manual_seed(5)
        hf = classes[family](transformers.AutoConfig.for_model(**cfg))
        with torch.no_grad():
            for p in hf.parameters():  # norms too, so a dropped or swapped norm shows
                p.normal_(0, 0.2)
        want[family] = _hf_logits(hf)
        urls[family] = str(tmp_path / f"{family}-from-hf")
        bytecp.save(urls[family], {"model": megatron_state_from_hf(hf.state_dict(), family, cfg)})
    got = pool.run(hc.load_families, urls, 2)[0]
    # EP=2: each rank's experts only. strict=False because main's Megatron adapter
    # still matches the other ranks' (empty) expert extra states per rank; the
    # logits show every tensor arrived
    got["mixtral-ep2"] = pool.run(hc.load_family, urls["mixtral"], "mixtral", 1, 2, False)[0]
    for name, logits in got.items():
        torch.testing.assert_close(logits, want[name.split("-")[0]], atol=1e-5, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_hf_config_refuses_a_setting_the_family_cannot_express() -> None:
    from bytecp.adapters.megatron.hf import hf_config
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    with pytest.raises(ConfigError, match="normalization='RMSNorm'"):
        hf_config("llama", cfg, vocab_size=128, max_position_embeddings=8)
