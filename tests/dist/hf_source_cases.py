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


def load_on_ranks(kind: str, path: str, layout: str, zero_redundancy: bool | None = None) -> tuple[dict[str, torch.Tensor] | None, int]:
    """(every rank) Build ``kind`` under ``layout`` (fsdp2, ddp), load the
    Hugging Face directory ``path`` with bytecp; rank 0 returns the full
    weights; every rank the bytes it read from storage."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import bytecp
    from bytecp.recorder import recording

    model = build(kind, seed=1 + dist.get_rank())
    if layout == "fsdp2-tp":  # 1 x 2: tensor parallel inside, FSDP2 over the (size-1) data-parallel dim
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh2 = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        for block in model.model.layers:
            parallelize_module(block, mesh2["tp"], plan)
            fully_shard(block, mesh=mesh2["dp"])
        fully_shard(model, mesh=mesh2["dp"])
        target: torch.nn.Module = model
    elif layout == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        layers = model.transformer.h if kind == "gpt2" else model.model.layers
        for block in layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        target = model
    else:
        target = torch.nn.parallel.DistributedDataParallel(model)
    with recording() as reports:
        bytecp.load(path, {"model": target}, zero_redundancy=zero_redundancy)
    (rep,) = [r for r in reports if r.operation == "load"]
    read = sum(s.nbytes for s in rep.spans if s.phase == "read")
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in model.state_dict().items()}
    if kind != "llama":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return (full if dist.get_rank() == 0 else None), read
