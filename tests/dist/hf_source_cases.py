"""Tiny transformers models built from configs (no hub), shared by the
Hugging Face source tests (one process and spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["llama_config", "gpt2_config", "build", "save", "reference"]


def llama_config(tied: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=256)


def build(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``kind``: llama, llama-tied, llama-base (LlamaModel), gpt2."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, LlamaModel

    torch.manual_seed(seed)
    if kind == "gpt2":
        model: torch.nn.Module = GPT2LMHeadModel(gpt2_config())
    elif kind == "llama-base":
        model = LlamaModel(llama_config(False))
    else:
        model = LlamaForCausalLM(llama_config(kind == "llama-tied"))
    return model.to(dtype)


def save(kind: str, out: Path, *, sharded: bool, dtype: torch.dtype = torch.float32) -> Path:
    """A model of ``kind`` saved with ``save_pretrained`` (sharded: several files and an index)."""
    model = build(kind, seed=0, dtype=dtype)
    model.save_pretrained(str(out), max_shard_size="40KB" if sharded else "5GB")
    return out


def reference(kind: str, path: Path) -> dict[str, torch.Tensor]:
    """``from_pretrained``'s weights of the directory."""
    from transformers import AutoModel, GPT2LMHeadModel, LlamaForCausalLM

    cls = {"gpt2": GPT2LMHeadModel, "llama-base": AutoModel}.get(kind, LlamaForCausalLM)
    return {k: v.detach().clone() for k, v in cls.from_pretrained(str(path)).state_dict().items()}
