"""Functions the DeepSpeed-source tests run on every rank of a spawned gloo
pool: DeepSpeed's own ``save_checkpoint`` writes the source, a fresh engine
at another ZeRO stage or data-parallel size loads it through ``bytecp.load``.
The engine helpers are the DeepSpeed adapter tests' (``tests/zero/ds_cases``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import bytecp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zero"))

import ds_cases as dc  # noqa: E402


def ds_write(root: str, stage: int, bf16: bool = False) -> dict[str, Any]:
    """(every rank) Train 2 steps, ``engine.save_checkpoint(root)``; the
    engine's full tensors, its counters and the next 2 steps' losses."""
    engine = dc.make_engine(stage, seed=0, bf16=bf16, warmup=10)
    dc.losses(engine, range(2))
    snap = dc.engine_snapshot(engine)
    counters = dc.engine_counters(engine)
    engine.save_checkpoint(root)
    return {"snap": snap, "counters": counters, "after": dc.losses(engine, range(2, 4))}


def ds_read(url: str, stage: int) -> dict[str, Any]:
    """(every rank) A fresh engine at ZeRO ``stage`` (other seed) loads the
    DeepSpeed checkpoint with ``bytecp.load``; its full tensors, counters
    and the next 2 steps' losses."""
    engine = dc.make_engine(stage, seed=5, warmup=10)
    bytecp.load(url, {"model": engine})
    snap = dc.engine_snapshot(engine)
    counters = dc.engine_counters(engine)
    return {"snap": snap, "counters": counters, "after": dc.losses(engine, range(2, 4))}


def plain_step(url: str) -> dict[str, torch.Tensor]:
    """(one process, no torch.distributed) A plain module and torch AdamW load it, then one step."""
    model = dc.make_model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=dc.STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])
    return dc.torch_snapshot(model, opt)


def fsdp2_read(url: str) -> dict[str, torch.Tensor]:
    """(every rank) FSDP2 over the plain module with torch AdamW loads the
    DeepSpeed checkpoint; the full tensors (DTensors gathered)."""
    from torch.distributed.fsdp import fully_shard

    model = dc.make_model(seed=4)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=dc.STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])
    return dc.torch_snapshot(model, opt)


#: (a fresh interpreter) a plain module's model-only load; prints whether FSDP or DTensor was imported
FRESH_MODEL_LOAD = """
import sys, torch, bytecp
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
bytecp.load(sys.argv[1], {"model": model}, exclude=["optimizer", "engine"])
torch.save(model.state_dict(), sys.argv[2])
print(sorted(m for m in ("torch.distributed.fsdp", "torch.distributed.tensor") if m in sys.modules))
"""


def ds_write_frozen(root: str) -> dict[str, torch.Tensor]:
    """(every rank) ZeRO-3 with the first layer's weight frozen (DeepSpeed saves it as
    ``frozen_param_fragments``, a partition per rank): one step, ``save_checkpoint``;
    every parameter's full value (masters of the trained ones)."""
    import deepspeed

    dc.setup()
    model = dc.make_model(seed=0)
    model[0].weight.requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": dc.STEPS_LR, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    dc.losses(engine, range(1))
    engine.save_checkpoint(root)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
