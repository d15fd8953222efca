"""Functions the worker pools run on every rank for tests/dist/test_ties.py: a real
``transformers`` GPT-2 (tied ``lm_head``/``wte``) under FSDP2, FSDP1 and DDP,
wrapped by ``torch.compile`` or activation checkpointing, saved and loaded
through bytecp; the full state as torch reports it is the oracle."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp

from .cases import full_state


def gpt2(seed: int, tied: bool = True) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=997, n_positions=32,
                                  tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg).eval()  # eval: no dropout, exact resumes


def _checkpointed(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPT2Block))
    return model


def build(framework: str, seed: int, variant: str = "") -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """``(module to train, module to checkpoint, optimizer)``: the checkpointed
    one is ``torch.compile``'d (never run) with ``variant`` "compiled";
    "ckpt" applies activation checkpointing to the blocks before wrapping;
    FSDP1 "flat" turns use_orig_params off."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = gpt2(seed)
    if "ckpt" in variant:
        model = _checkpointed(model)
    if framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root holds the tied embedding
    elif framework == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                     use_orig_params="flat" not in variant)
    elif framework == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, torch.compile(model) if "compiled" in variant else model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> list[float]:
    losses = []
    for step in range(start, start + n):
        x = torch.randint(0, 997, (2, 16), generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def _tied(model: nn.Module) -> bool:
    """Whether the live model's head and embedding are still one tensor
    (a parameter, or under FSDP1 without use_orig_params one view of its shard)."""
    mods = dict(model.named_modules())
    (head,) = [m for n, m in mods.items() if n.endswith("lm_head")]
    (wte,) = [m for n, m in mods.items() if n.endswith("wte")]
    return head.weight is wte.weight


def save(framework: str, url: str, variant: str = "", steps: int = 2) -> dict[str, Any] | None:
    model, wrapped, opt = build(framework, seed=0, variant=variant)
    train(model, opt, 0, steps)
    bytecp.save(url, {"model": wrapped, "optimizer": opt, "extra": {"step": steps}})
    out = full_state(model, opt)
    if out is not None:
        out["tied"] = _tied(model)
    return out


def load(framework: str, url: str, variant: str = "", more_steps: int = 0) -> dict[str, Any] | None:
    model, wrapped, opt = build(framework, seed=123, variant=variant)
    extra = {"step": -1}
    res = bytecp.load(url, {"model": wrapped, "optimizer": opt, "extra": extra})  # strict
    out = full_state(model, opt)
    losses = train(model, opt, extra["step"], more_steps) if more_steps else []
    if out is not None:
        out.update(losses=losses, tied=_tied(model), missing=res.missing_keys, unexpected=res.unexpected_keys)
    return out


def continuous(framework: str, variant: str = "", steps: int = 2, more_steps: int = 2) -> list[float]:
    model, _, opt = build(framework, seed=0, variant=variant)
    train(model, opt, 0, steps)
    return train(model, opt, steps, more_steps)


def disagreeing_ties(url: str) -> dict[str, str]:
    """Rank 1's state ties two tensors rank 0 holds apart: the save is refused
    on every rank, nothing commits. A tie only rank 1 has (its own keys) is saved."""
    rank = dist.get_rank()
    w = torch.arange(12.0).view(3, 4)
    out: dict[str, str] = {}
    state = {"m": {"embed": w, "head": w if rank == 1 else w.clone()}}
    try:
        bytecp.save(f"{url}-disagree", state)
        out["disagree"] = "saved"
    except bytecp.DistributedCheckpointError as e:
        out["disagree"] = str(e)
    v = w + 1
    state = {"m": {"embed": w}, **({"only1": {"a": v, "b": v}} if rank == 1 else {})}
    md = bytecp.save(f"{url}-uneven", state)
    out["uneven"] = repr(sorted(md.aliases.items()))
    return out
