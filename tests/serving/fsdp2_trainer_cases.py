"""What the FSDP2 trainer of test_follow_fsdp2_trainer runs on every gloo
rank: a tiny transformers Llama under FSDP2, AdamW, one CheckpointManager
save per step; before each save rank 0 writes the gathered full weights of
that step to ``<refs>/step-<n>.pt`` (renamed into place, so a follower that
sees the step's checkpoint finds its reference whole)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import bytecp


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def train(run: str, refs: str, steps: int = 3, pause_s: float = 0.0) -> list[str]:
    """Train ``steps`` steps under FSDP2 x world (every decoder layer and the
    root sharded), saving each through CheckpointManager; returns the
    names of the model's tensors (the keys of every reference)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = llama_config()
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=100)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    names: list[str] = []
    for step in range(1, steps + 1):
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.state_dict().items()}  # a collective: every rank gathers
        names = sorted(full)
        if dist.get_rank() == 0:
            tmp = os.path.join(refs, f".step-{step}.pt.tmp")
            torch.save(full, tmp)
            os.replace(tmp, os.path.join(refs, f"step-{step}.pt"))
        dist.barrier()
        mgr.save(step, {"model": model, "optimizer": opt})
        if pause_s:
            time.sleep(pause_s)
    return names


def _wait(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def train_gated(run: str, refs: str, steps: int, lr: float, full_every: int) -> list[str]:
    """As :func:`train` with serving deltas (``serving_dtype=torch.bfloat16``,
    the serving copy whole every ``full_every``-th save) and AdamW at ``lr``;
    each step starts once the test writes ``<refs>/go-<step>`` (the test
    paces the run: a follower behind, a delta damaged before it is read)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = llama_config()
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=100, serving_dtype=torch.bfloat16,
                                   full_every=full_every)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    names: list[str] = []
    for step in range(1, steps + 1):
        _wait(os.path.join(refs, f"go-{step}"))
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.state_dict().items()}  # a collective: every rank gathers
        names = sorted(full)
        if dist.get_rank() == 0:
            tmp = os.path.join(refs, f".step-{step}.pt.tmp")
            torch.save(full, tmp)
            os.replace(tmp, os.path.join(refs, f"step-{step}.pt"))
        dist.barrier()
        mgr.save(step, {"model": model, "optimizer": opt})
    return names
