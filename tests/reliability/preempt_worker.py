"""One rank of a training job that saves on SIGTERM (tests/reliability/test_preemption.py).

Trains a tiny DDP model step after step (slowly: the test signals it mid-run);
CheckpointManager(save_on_signal=True) never saves on schedule here. When the
manager exits after its pre-emption save, rank 0 writes the state it saved
(expected.pt) for the test to compare bitwise."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bytecp.manager import CheckpointManager


def main(run: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "extra": {"step": 0}}
    mgr = CheckpointManager(run, every_n_steps=10**6, save_on_signal=True)
    torch.manual_seed(1 + rank)
    for step in range(1, 10**6):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state["extra"]["step"] = step
        print(f"step {step}", flush=True)
        time.sleep(0.05)
        try:
            mgr.maybe_save(step, state)
        except SystemExit:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(run, "expected.pt"))
            print(f"saved step {step}", flush=True)
            raise


if __name__ == "__main__":
    main(sys.argv[1])
