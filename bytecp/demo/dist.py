"""The distributed half of ``bytecp demo``, also a torchrun example.

    torchrun --nproc_per_node 2 -m bytecp.demo.dist --ckpt /tmp/run --phase train
    torchrun --nproc_per_node 3 -m bytecp.demo.dist --ckpt /tmp/run --phase resume

``train``: FSDP2 on a CPU device mesh (gloo), 4 steps, an asynchronous
checkpoint at step 2 taken while training goes on, a synchronous one at 4.
``resume``: any other number of processes loads the latest committed
checkpoint (resharding on load), checks it bitwise against the full state
recorded at save time, and trains on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import bytecp

from ..manager import CheckpointManager, list_checkpoints
from .model import TinyGPT, say, train_steps

__all__ = ["main", "run_distributed_demo"]


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True)
    out: dict[str, Any] = {f"model.{k}": v for k, v in get_model_state_dict(model, options=o).items()}
    osd: Any = get_optimizer_state_dict(model, opt, options=o)
    out.update({f"optim.{p}.{k}": v for p, st in osd["state"].items() for k, v in st.items()})
    return out


def _rank0(msg: str) -> None:
    if dist.get_rank() == 0:
        say(msg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="run directory (any URL bytecp takes)")
    ap.add_argument("--phase", choices=["train", "resume"], required=True)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mgr = CheckpointManager(args.ckpt, every_n_steps=2, keep_last=2)
    if args.phase == "train":
        model, opt = _build(seed=0)
        state: dict[str, Any] = {"model": model, "optimizer": opt, "extra": {"step": 0}}
        train_steps(model, opt, 0, 2)
        state["extra"]["step"] = 2
        t0 = time.perf_counter()
        handle = bytecp.async_save(mgr.url_for(2), state, step=2)
        blocked = time.perf_counter() - t0
        losses = train_steps(model, opt, 2, 2)  # runs while step-2 is written
        handle.wait()
        _rank0(f"[{world} ranks] async save of step 2 blocked training {blocked * 1000:.1f} ms; "
               f"steps 3-4 loss {losses[-1]:.3f}")
        state["extra"]["step"] = 4
        full = _full(model, opt)
        mgr.save(4, state)
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(args.ckpt, "expected-step-4.pt"))
        _rank0(f"[{world} ranks] saved {mgr.url_for(4)} (FSDP2, {world} shards per tensor)")
    else:
        model, opt = _build(seed=99)
        extra: dict[str, Any] = {"step": -1}
        restored = mgr.restore({"model": model, "optimizer": opt, "extra": extra})
        full = _full(model, opt)
        want = torch.load(os.path.join(args.ckpt, "expected-step-4.pt"), weights_only=True)
        bad = [k for k, v in want.items() if not torch.equal(v, full[k])]
        if bad:
            raise SystemExit(f"demo: {len(bad)} tensors differ after resharded load, e.g. {bad[:3]}")
        losses = train_steps(model, opt, extra["step"], 2)
        _rank0(f"[{world} ranks] resumed step {restored} resharded, all {len(want)} tensors bitwise "
               f"equal; trained on, loss {losses[-1]:.3f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _torchrun(n: int, ckpt: str, phase: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "bytecp.demo.dist", "--ckpt", ckpt, "--phase", phase]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env, timeout=600)


def run_distributed_demo(out: str, world_size: int) -> None:
    """``bytecp demo``'s second half: torchrun with W ranks, then W+1 and 1."""
    ckpt = os.path.join(out, "fsdp2-run")
    say(f"torchrun: FSDP2 training on {world_size} processes (gloo)")
    _torchrun(world_size, ckpt, "train")
    say(f"torchrun: resume on {world_size + 1} processes (load-time resharding)")
    _torchrun(world_size + 1, ckpt, "resume")
    latest = CheckpointManager(ckpt).latest()
    assert latest is not None
    sd = bytecp.load_state_dict(latest.url)
    model = TinyGPT()
    model.load_state_dict(sd["model"])
    say(f"one process, no torch.distributed: load_state_dict({latest.url}) -> {len(sd['model'])} tensors, "
         f"plain model evaluates: {json.dumps(round(float(model(torch.zeros(1, 4, dtype=torch.long)).sum()), 4))}")
    for c in list_checkpoints(ckpt):
        say(f"committed: {c.name}  step={c.step}  {c.created}")


if __name__ == "__main__":
    sys.exit(main())
