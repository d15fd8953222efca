"""Processes of the gc-racing-a-save test: a job saving incremental
checkpoints, and another process applying retention to the same run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import bytecp
from bytecp.errors import CorruptCheckpointError


def saver(run: str, steps: int, out: str) -> None:
    """Save ``steps`` checkpoints, each referencing the last committed one;
    a save whose base was removed first fails, and the next is written whole."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 8))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model[1].parameters(), lr=0.01)
    last: str | None = None
    failed, referenced, broken, states = 0, 0, 0, {}
    for step in range(1, steps + 1):
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
        url = f"{run}/step-{step}"
        try:
            md = bytecp.save(url, {"model": model}, step=step, base=last)
            referenced += bool(md.references)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
            last = url
        except CorruptCheckpointError:  # the base was removed before this save pinned it
            failed += 1
            last = None  # the next save is written whole
            continue
        broken += _broken(url)
    torch.save({"states": states, "failed": failed, "referenced": referenced, "broken": broken}, out)


def _broken(url: str) -> int:
    """1 if the checkpoint just committed is still committed but cannot be
    read (its references gone); retention may delete it whole meanwhile."""
    from bytecp.loading.opened import open_checkpoint

    try:
        open_checkpoint(url).check_sizes()
        return 0
    except CorruptCheckpointError:
        return int(os.path.exists(f"{url}/metadata.json"))
    except Exception:
        return 0  # deleted meanwhile: not a checkpoint any more


def collector(run: str, stop: str) -> None:
    """Retention over the run until ``stop`` exists, keeping no checkpoint it
    listed (only what the checkpoints committed meanwhile reference): every
    base the job is about to reference is doomed while the job saves."""
    from bytecp.catalog import list_checkpoints
    from bytecp.storage_api import open_storage
    from bytecp.tools.retention import retain

    root = open_storage(run)
    while not os.path.exists(stop):
        names = [c.name for c in list_checkpoints(run)]
        retain(root, [], names, lambda: [c.name for c in list_checkpoints(run)])
        time.sleep(0.005)


def run_both(run: str, steps: int, out: str) -> Any:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = str(Path(out).with_suffix(".stop"))
    gc = ctx.Process(target=collector, args=(run, stop))
    job = ctx.Process(target=saver, args=(run, steps, out))
    gc.start()
    job.start()
    job.join(240)
    Path(stop).touch()
    gc.join(60)
    for p in (job, gc):
        if p.is_alive():
            p.kill()
    return job.exitcode, gc.exitcode
