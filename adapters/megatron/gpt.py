"""The mapping spec from a Megatron-Core GPTModel checkpoint (local or TE
layer spec, learned or no position embeddings, untied or tied output layer)
to a plain PyTorch GPT with Hugging Face GPT-J-style names:

``wte``, ``wpe``, ``h.<i>.ln_1``, ``h.<i>.attn.{q,k,v,out}_proj``, ``h.<i>.ln_2``,
``h.<i>.mlp.fc_in``/``fc_out``, ``ln_f``, ``lm_head``.

Data, not code: :func:`bytecp.interop.mapping.convert_state_dict` applies it.
Parameters: ``heads`` (attention heads), ``groups`` (query groups, default
``heads``), ``vocab_size`` (rows kept of the padded embedding and output
layer). Usage::

    sd = bytecp.load_state_dict(url)["model"]
    plain = convert_state_dict(sd, MEGATRON_GPT_TO_PLAIN, heads=32, vocab_size=50257)
    model.load_state_dict(plain)

A gated (SwiGLU) MLP's fc1 holds [gate; up]: map it with a ``split`` the
target model understands, or keep it fused as here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEGATRON_GPT_TO_PLAIN"]

_L = "decoder.layers."

MEGATRON_GPT_TO_PLAIN: dict[str, Any] = {
    "rules": [
        {"from": "embedding.word_embeddings.weight", "to": "wte.weight", "rows": "vocab_size"},
        {"from": "embedding.position_embeddings.weight", "to": "wpe.weight"},
        {"from": _L + "self_attention.linear_qkv.layer_norm_weight", "to": "h.{layer}.ln_1.weight"},
        {"from": _L + "self_attention.linear_qkv.layer_norm_bias", "to": "h.{layer}.ln_1.bias"},
        {"from": _L + "self_attention.linear_qkv.weight", "split": "qkv",
         "to": ["h.{layer}.attn.q_proj.weight", "h.{layer}.attn.k_proj.weight", "h.{layer}.attn.v_proj.weight"]},
        {"from": _L + "self_attention.linear_qkv.bias", "split": "qkv",
         "to": ["h.{layer}.attn.q_proj.bias", "h.{layer}.attn.k_proj.bias", "h.{layer}.attn.v_proj.bias"]},
        {"from": _L + "self_attention.linear_proj.weight", "to": "h.{layer}.attn.out_proj.weight"},
        {"from": _L + "self_attention.linear_proj.bias", "to": "h.{layer}.attn.out_proj.bias"},
        {"from": _L + "mlp.linear_fc1.layer_norm_weight", "to": "h.{layer}.ln_2.weight"},
        {"from": _L + "mlp.linear_fc1.layer_norm_bias", "to": "h.{layer}.ln_2.bias"},
        {"from": _L + "mlp.linear_fc1.weight", "to": "h.{layer}.mlp.fc_in.weight"},
        {"from": _L + "mlp.linear_fc1.bias", "to": "h.{layer}.mlp.fc_in.bias"},
        {"from": _L + "mlp.linear_fc2.weight", "to": "h.{layer}.mlp.fc_out.weight"},
        {"from": _L + "mlp.linear_fc2.bias", "to": "h.{layer}.mlp.fc_out.bias"},
        {"from": "decoder.final_layernorm.weight", "to": "ln_f.weight"},
        {"from": "decoder.final_layernorm.bias", "to": "ln_f.bias"},
        # a tied output layer is not in the checkpoint: the embedding unties into it
        {"from": "output_layer.weight", "fallback": "embedding.word_embeddings.weight",
         "to": "lm_head.weight", "rows": "vocab_size"},
    ],
    "ignore": ["*_extra_state*"],
}
