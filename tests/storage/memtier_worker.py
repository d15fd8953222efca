"""A rank of the kill-a-host test (and of benchmarks/memory_tier.py): one
process of a gloo job whose host is named by ``BYTECP_KEEPER_HOST``.

``python memtier_worker.py train RUN OUT STEPS SIZE`` trains STEPS steps with a
memory tier (memory every 2 steps, storage every 4), writes its state after
the last one to OUT, prints one JSON line of timings, then keeps running
(mid-run) until killed. ``... restore RUN OUT 0 SIZE`` restores, writes the
restored state to OUT and prints the step, the tier and the seconds taken.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import bytecp


def build(size: int, rank: int, seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(size, size), nn.ReLU(), nn.Linear(size, 8))
    torch.manual_seed(seed * 100 + rank)
    local = nn.Linear(size, size)  # this rank's own shard: on its host (and its peer) only
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    local_opt = torch.optim.AdamW(local.parameters(), lr=0.01)
    return {"model": model, "optim": opt, "local": bytecp.PerRankState(local),
            "local_optim": bytecp.PerRankState(local_opt)}


def train_step(state: dict[str, object], step: int, size: int) -> None:
    model, opt, local = state["model"], state["optim"], state["local"].obj  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, size, generator=g)
    (model(x).pow(2).mean() + local(x).pow(2).mean()).backward()  # type: ignore[operator]
    for o in (opt, state["local_optim"].obj):  # type: ignore[attr-defined]
        o.step()
        o.zero_grad()


def flat(state: dict[str, object]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}  # type: ignore[attr-defined]
    out.update({f"local.{k}": v for k, v in state["local"].state_dict().items()})  # type: ignore[attr-defined]
    for name in ("optim", "local_optim"):
        for i, st in state[name].state_dict()["state"].items():  # type: ignore[attr-defined]
            out.update({f"{name}.{i}.{k}": v for k, v in st.items()})
    return {k: v.clone() for k, v in out.items()}


def manager(run: str) -> bytecp.CheckpointManager:
    return bytecp.CheckpointManager(run, every_n_steps=4, memory_url="keeper://job/run",
                                    memory_every_n_steps=2, async_save=True, keep_last=2)


def main() -> None:
    mode, run, out, steps, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = manager(run)
    if mode == "train":
        state = build(size, rank, seed=0)
        blocked = []
        for s in range(1, steps + 1):
            train_step(state, s, size)
            t0 = time.perf_counter()
            if mgr.maybe_save(s, state):
                blocked.append(time.perf_counter() - t0)
        mgr.wait()
        torch.save(flat(state), out)
        stats = bytecp.storage_api.open_storage("keeper://job/run").keeper_stats()  # type: ignore[attr-defined]
        print(json.dumps({"rank": rank, "blocked_s": blocked,
                          "replication_s": {k: v for s in stats for k, v in s["replication_s"].items()}}), flush=True)
        while True:  # mid-run: the test kills this host
            time.sleep(1)
    state = build(size, rank, seed=1)
    t0 = time.perf_counter()
    step = mgr.restore(state)
    seconds = time.perf_counter() - t0
    torch.save(flat(state), out)
    print(json.dumps({"rank": rank, "step": step, "tier": mgr.restored_from, "seconds": seconds}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
