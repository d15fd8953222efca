"""Mapping specs between Megatron-Core GPTModel checkpoints and real
``transformers`` classes, and the Hugging Face config of a Megatron model.

- :data:`GPT2` -> ``GPT2LMHeadModel`` (learned positions, LayerNorm, GELU;
  ``Conv1D`` weights transposed, ``c_attn`` = plain ``[q; k; v]``);
- :data:`LLAMA` -> ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, GQA);
- :data:`QWEN2` -> ``Qwen2ForCausalLM`` (Llama plus q/k/v biases);
- :data:`MIXTRAL` -> ``MixtralForCausalLM`` (transformers 5's stacked
  experts: Megatron's ``experts.experts.linear_fc1`` of shape
  ``(layers, experts, 2*ffn, hidden)`` is ``gate_up_proj`` per layer as is).

Data, applied by :func:`bytecp.interop.mapping.convert_state_dict` (Megatron ->
transformers, ``bytecp export --spec NAME``) and
:func:`bytecp.interop.mapping.invert_state_dict` (transformers -> Megatron, see
:func:`megatron_state_from_hf`). Parameters: :func:`spec_params` of the
Hugging Face config. :func:`hf_config` writes that config from Megatron's
``TransformerConfig``; save it with the checkpoint
(``metadata={"hf_config": ...}``) and ``bytecp export`` finds the spec and
the config by itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.interop.mapped_export import spec_params

__all__ = ["GPT2", "LLAMA", "QWEN2", "MIXTRAL", "hf_config", "megatron_state_from_hf", "megatron_extra_states"]

_L = "decoder.layers."
_ATT = _L + "self_attention."
_H = "model.layers.{layer}."

_EMBED_OUT = [
    {"from": "decoder.final_layernorm.weight", "to": "model.norm.weight"},
    # a tied output layer is not in the checkpoint: the embedding unties into it
    {"from": "output_layer.weight", "fallback": "embedding.word_embeddings.weight", "to": "lm_head.weight",
     "rows": "vocab_size"},
]
_LLAMA_ATTENTION = [
    {"from": "embedding.word_embeddings.weight", "to": "model.embed_tokens.weight", "rows": "vocab_size"},
    {"from": _ATT + "linear_qkv.layer_norm_weight", "to": _H + "input_layernorm.weight"},
    {"from": _ATT + "linear_qkv.weight", "split": "qkv",
     "to": [_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"]},
    {"from": _ATT + "linear_proj.weight", "to": _H + "self_attn.o_proj.weight"},
    {"from": _L + "mlp.linear_fc1.layer_norm_weight", "to": _H + "post_attention_layernorm.weight"},
]
_SWIGLU = [
    {"from": _L + "mlp.linear_fc1.weight", "split": "gate_up",
     "to": [_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"]},
    {"from": _L + "mlp.linear_fc2.weight", "to": _H + "mlp.down_proj.weight"},
]
_IGNORE = ["*_extra_state*"]
_REVERSE_IGNORE = ["*.rotary_emb.inv_freq", "*.attn.bias", "*.attn.masked_bias"]

LLAMA: dict[str, Any] = {
    "rules": _LLAMA_ATTENTION + _SWIGLU + _EMBED_OUT, "ignore": _IGNORE, "reverse_ignore": _REVERSE_IGNORE,
}
QWEN2: dict[str, Any] = {
    "rules": _LLAMA_ATTENTION + [
        {"from": _ATT + "linear_qkv.bias", "split": "qkv",
         "to": [_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"]},
    ] + _SWIGLU + _EMBED_OUT,
    "ignore": _IGNORE, "reverse_ignore": _REVERSE_IGNORE,
}
MIXTRAL: dict[str, Any] = {
    "rules": _LLAMA_ATTENTION + [
        {"from": _L + "mlp.router.weight", "to": _H + "mlp.gate.weight"},
        {"from": _L + "mlp.experts.experts.linear_fc1.weight", "to": _H + "mlp.experts.gate_up_proj"},
        {"from": _L + "mlp.experts.experts.linear_fc2.weight", "to": _H + "mlp.experts.down_proj"},
    ] + _EMBED_OUT,
    "ignore": _IGNORE, "reverse_ignore": _REVERSE_IGNORE,
}
_G = "transformer.h.{layer}."
GPT2: dict[str, Any] = {
    "rules": [
        {"from": "embedding.word_embeddings.weight", "to": "transformer.wte.weight", "rows": "vocab_size"},
        {"from": "embedding.position_embeddings.weight", "to": "transformer.wpe.weight"},
        {"from": _ATT + "linear_qkv.layer_norm_weight", "to": _G + "ln_1.weight"},
        {"from": _ATT + "linear_qkv.layer_norm_bias", "to": _G + "ln_1.bias"},
        {"from": _ATT + "linear_qkv.weight", "split": "qkv", "concat": True, "transpose": True,
         "to": _G + "attn.c_attn.weight"},
        {"from": _ATT + "linear_qkv.bias", "split": "qkv", "concat": True, "to": _G + "attn.c_attn.bias"},
        {"from": _ATT + "linear_proj.weight", "transpose": True, "to": _G + "attn.c_proj.weight"},
        {"from": _ATT + "linear_proj.bias", "to": _G + "attn.c_proj.bias"},
        {"from": _L + "mlp.linear_fc1.layer_norm_weight", "to": _G + "ln_2.weight"},
        {"from": _L + "mlp.linear_fc1.layer_norm_bias", "to": _G + "ln_2.bias"},
        {"from": _L + "mlp.linear_fc1.weight", "transpose": True, "to": _G + "mlp.c_fc.weight"},
        {"from": _L + "mlp.linear_fc1.bias", "to": _G + "mlp.c_fc.bias"},
        {"from": _L + "mlp.linear_fc2.weight", "transpose": True, "to": _G + "mlp.c_proj.weight"},
        {"from": _L + "mlp.linear_fc2.bias", "to": _G + "mlp.c_proj.bias"},
        {"from": "decoder.final_layernorm.weight", "to": "transformer.ln_f.weight"},
        {"from": "decoder.final_layernorm.bias", "to": "transformer.ln_f.bias"},
        {"from": "output_layer.weight", "fallback": "embedding.word_embeddings.weight", "to": "lm_head.weight",
         "rows": "vocab_size"},
    ],
    "ignore": _IGNORE, "reverse_ignore": _REVERSE_IGNORE,
}
for _spec in (LLAMA, QWEN2, MIXTRAL, GPT2):  # a Megatron checkpoint with this model_type's config converts by default
    _spec["source_framework"] = "megatron"

_ARCH = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "mixtral": "MixtralForCausalLM"}  # fmt: skip


def _need(cfg: Any, family: str, setting: str, want: Any) -> None:
    got = getattr(cfg, setting)
    if got != want:
        raise ConfigError(f"a {family} model needs TransformerConfig {setting}={want!r}, this one has {got!r}")


def hf_config(family: str, config: Any, *, vocab_size: int, max_position_embeddings: int,
              tie_word_embeddings: bool = False, rotary_base: float = 10000.0) -> dict[str, Any]:
    """The ``config.json`` (a dict) of the transformers model that computes
    what a Megatron GPTModel of ``config`` (a ``TransformerConfig``) computes.
    ``vocab_size``: the real vocabulary (padding rows are dropped);
    ``rotary_base``: the GPTModel's ``rotary_base``. Refuses settings the
    family cannot express, naming the setting."""
    if family not in _ARCH:
        raise ConfigError(f"no Hugging Face family {family!r}; known: {', '.join(_ARCH)}")
    heads = int(config.num_attention_heads)
    common = {"architectures": [_ARCH[family]], "model_type": family, "vocab_size": int(vocab_size),
              "tie_word_embeddings": bool(tie_word_embeddings), "dtype": "float32"}
    if family == "gpt2":
        _need(config, family, "normalization", "LayerNorm")
        _need(config, family, "gated_linear_unit", False)
        fused_gelu = bool(config.bias_activation_fusion and config.add_bias_linear)
        return {**common, "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": heads,
                "n_inner": config.ffn_hidden_size, "n_positions": max_position_embeddings,
                "activation_function": "gelu_new" if fused_gelu else "gelu",
                "layer_norm_epsilon": config.layernorm_epsilon, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}
    _need(config, family, "normalization", "RMSNorm")
    _need(config, family, "gated_linear_unit", True)
    _need(config, family, "add_bias_linear", False)
    _need(config, family, "add_qkv_bias", family == "qwen2")
    out = {**common, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
           "num_attention_heads": heads, "num_key_value_heads": int(config.num_query_groups or heads),
           "head_dim": int(config.kv_channels or config.hidden_size // heads),
           "intermediate_size": config.ffn_hidden_size, "max_position_embeddings": max_position_embeddings,
           "rms_norm_eps": config.layernorm_epsilon, "hidden_act": "silu",
           "rope_parameters": {"rope_type": "default", "rope_theta": float(rotary_base)},
           "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None}
    if family == "mixtral":
        out.update(num_local_experts=int(config.num_moe_experts), num_experts_per_tok=int(config.moe_router_topk),
                   intermediate_size=int(config.moe_ffn_hidden_size or config.ffn_hidden_size),
                   sliding_window=None, output_router_logits=False)
    return out


def megatron_state_from_hf(hf_state: Mapping[str, torch.Tensor], family: str,
                           config: Mapping[str, Any]) -> dict[str, torch.Tensor | None]:
    """A Hugging Face model's state dict (``model.state_dict()`` or its
    safetensors) as full Megatron tensors under Megatron's checkpoint keys
    (layers stacked). Save it with ``bytecp.save(url, {"model": sd})`` (one
    process) and ``bytecp.load(url, {"model": gpt_model})`` loads it into a
    Megatron model at any TP/PP/EP: the Megatron adapter reshards it. The
    empty ``_extra_state`` entries Megatron checkpoints are included
    (:func:`megatron_extra_states`), so that load is strict."""
    from bytecp.interop.mapping import get_spec, invert_state_dict

    state = invert_state_dict(hf_state, get_spec(family), **spec_params(config))
    return {**state, **megatron_extra_states(state)}


_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def megatron_extra_states(state: Mapping[str, torch.Tensor]) -> dict[str, None]:
    """The (empty) ``_extra_state`` entries Megatron's local layer spec
    checkpoints beside the linear layers of ``state`` (Megatron keys, layers
    stacked: ``<module>._extra_state/shard_<layer>_<layers>``, experts
    ``shard_<layer>.<expert>_<layers>.<experts>``), so a checkpoint written
    from Hugging Face weights loads strictly."""
    out: dict[str, None] = {}
    for key, t in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf != "weight" or not key.startswith(_L) or module.rpartition(".")[2] not in _LINEARS:
            continue
        layers = t.shape[0]
        experts = t.shape[1] if ".experts.experts." in key else 0
        for i in range(layers):
            for e in range(experts) if experts else [None]:
                shard = f"{i}_{layers}" if e is None else f"{i}.{e}_{layers}.{experts}"
                out[f"{module}._extra_state/shard_{shard}"] = None
    return out
