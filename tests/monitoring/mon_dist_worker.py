"""One rank of the monitored multi-process test (run by test_mon_distributed.py).

Arguments: rank, world size, rendezvous port, checkpoint URL, collector address.
Saves a model on every rank with monitoring on, loads it back into a fresh
one, checks the values, and flushes its reports before exiting.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import bytecp
from bytecp.recorder import resolve_monitor


def main(rank: int, world: int, port: int, url: str, monitor: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)  # 8 MiB: split across both ranks' writes
    dist.barrier()  # ranks start the save together (interpreters start at different speeds)
    bytecp.save(url, {"model": model, "extra": {"step": 7}}, step=7, monitor=monitor)
    fresh = torch.nn.Linear(1024, 2048)
    bytecp.load(url, {"model": fresh, "extra": {"step": 0}}, monitor=monitor)
    assert torch.equal(fresh.weight, model.weight)
    push = resolve_monitor(monitor)
    assert push is not None and push.flush(30)  # type: ignore[attr-defined]
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
