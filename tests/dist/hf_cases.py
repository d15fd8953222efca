"""Functions the distributed export test runs on every gloo rank: a tiny
GPT-2 from transformers trained under FSDP2, saved with bytecp."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import bytecp


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=1000, bos_token_id=0, eos_token_id=0)


def train_fsdp2_gpt2(url: str, steps: int = 2) -> dict[str, torch.Tensor] | None:
    """Train ``steps`` steps under FSDP2 (every block and the root sharded),
    save model, optimizer and config; rank 0 returns the full trained weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = gpt2_config()
    model = GPT2LMHeadModel(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    bytecp.save(url, {"model": model, "optimizer": opt, "hf_config": cfg.to_dict()}, step=steps)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in full.items()} if dist.get_rank() == 0 else None
