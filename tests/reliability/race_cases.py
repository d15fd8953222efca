"""Processes of the gc-racing-a-save test: a job saving incremental
checkpoints, and another process applying retention to the same run."""

from __future__ import annotations

import os
import random
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
    except Exception:  # any failure of a checkpoint still committed is a broken one
        return int(os.path.exists(f"{url}/metadata.json"))  # (deleted meanwhile: not a checkpoint any more)


class _Slow:
    """A storage whose every call first waits a random 0-2 ms (storage
    latency): retention's steps spread out, so saves sometimes pin their
    base before retention looks at the pins, and sometimes after."""

    def __init__(self, inner: Any, rng: random.Random) -> None:
        self._inner, self._rng = inner, rng
        self.url = inner.url

    def child(self, name: str) -> _Slow:
        return _Slow(self._inner.child(name), self._rng)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self._rng.uniform(0, 0.002))
            return attr(*args, **kwargs)

        return slow


def collector(run: str, stop: str, seed: int = 0) -> None:
    """Retention over the run until ``stop`` exists, keeping no checkpoint it
    listed (only what the checkpoints committed meanwhile reference): every
    base the job is about to reference is doomed while the job saves."""
    from bytecp.catalog import list_checkpoints
    from bytecp.storage_api import open_storage
    from bytecp.tools.retention import retain

    rng = random.Random(seed)
    root = _Slow(open_storage(run), rng)
    while not os.path.exists(stop):
        names = [c.name for c in list_checkpoints(run)]
        retain(root, [], names, lambda: [c.name for c in list_checkpoints(run)])  # type: ignore[arg-type]
        time.sleep(rng.uniform(0, 0.03))


def run_both(run: str, steps: int, out: str, seed: int = 0) -> Any:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = str(Path(out).with_suffix(".stop"))
    gc = ctx.Process(target=collector, args=(run, stop, seed))
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
