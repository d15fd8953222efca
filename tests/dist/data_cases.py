"""Functions the worker pools run on every rank: a torchdata
``StatefulDataLoader`` with a distributed sampler saved with ``bytecp.save``
(or the manager) beside a module, loaded by another number of ranks; and a
tiny FSDP2 training job resumed on another number of ranks. Each returns
the sample ids its rank drew, so the test process rebuilds every global step."""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import bytecp
from bytecp.manager import CheckpointManager

N = 144


def loader(batch: int, *, workers: int = 0, sampler: str = "DistributedSampler", epoch: int = 0,
           data: Any = None) -> StatefulDataLoader:
    """This rank's loader over ``data`` (default: the ids 0..N-1)."""
    if workers:  # the pool's ranks are daemonic processes; a loader's workers are their children
        multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    data = list(range(N)) if data is None else data
    cls = StatefulDistributedSampler if sampler == "StatefulDistributedSampler" else DistributedSampler
    s = cls(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=11)
    s.set_epoch(epoch)
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw.update(prefetch_factor=2, multiprocessing_context="fork")
    return StatefulDataLoader(data, batch_size=batch, sampler=s, **kw)


def _ids(batch: Any) -> list[int]:
    return [int(x) for x in batch]


def save_stream(url: str, batch: int, steps: int, *, workers: int = 0, sampler: str = "DistributedSampler",
                epoch: int = 0, run: str | None = None) -> dict[str, Any]:
    """Draw ``steps`` batches, save (``run``: through a manager), draw the rest of the epoch."""
    dl = loader(batch, workers=workers, sampler=sampler, epoch=epoch)
    it = iter(dl)
    before = [_ids(next(it)) for _ in range(steps)]
    torch.manual_seed(0)
    state = {"model": nn.Linear(3, 2), "extra": {"step": steps, "dataloader": dl}, "rng": bytecp.RNGState()}
    if run is None:
        bytecp.save(url, state)
    else:
        CheckpointManager(run, every_n_steps=1).save(steps, state)
    return {"before": before, "after": [_ids(b) for b in it]}


def save_steps(run: str, batch: int, steps: tuple[int, ...]) -> None:
    """A manager saves the loader (and a module) after each of ``steps``."""
    dl = loader(batch)
    it = iter(dl)
    torch.manual_seed(0)
    state = {"model": nn.Linear(3, 2), "extra": {"step": 0, "dataloader": dl}, "rng": bytecp.RNGState()}
    mgr, done = CheckpointManager(run, every_n_steps=1), 0
    for step in steps:
        for _ in range(step - done):
            next(it)
        done = step
        state["extra"]["step"] = step  # type: ignore[index]
        mgr.save(step, state)


def load_stream(url: str, batch: int, *, workers: int = 0, sampler: str = "DistributedSampler",
                mode: str | None = None, run: str | None = None) -> dict[str, Any]:
    """Load into a fresh loader (and module), then draw the rest of the epoch;
    a refused load reports its error and whether anything of the state changed."""
    dl = loader(batch, workers=workers, sampler=sampler)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.zero_()
    extra: dict[str, Any] = {"step": 0, "dataloader": dl}
    state = {"model": model, "extra": extra, "rng": bytecp.RNGState()}
    kw = {} if mode is None else {"data_reshard": mode}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if run is None:
                bytecp.load(url, state, **kw)
            else:
                CheckpointManager(run, **kw).restore(state)
        except bytecp.BytecpError as e:
            return {"error": str(e), "type": type(e).__name__, "step": extra["step"],
                    "untouched": bool(model.weight.eq(0).all()), "epoch": dl.sampler.epoch}
    return {"after": [_ids(b) for b in dl], "step": extra["step"], "epoch": dl.sampler.epoch,
            "warnings": [str(w.message) for w in caught if "set_vital" not in str(w.message)]}


# ---------------------------------------------------------------- a real FSDP2 training job


class _Data(torch.utils.data.Dataset):
    """Fixed inputs and targets of a regression task, by index."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 3, generator=g) + 0.1 * torch.randn(n, 3, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def _fsdp2_job() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train(model: nn.Module, opt: torch.optim.Optimizer, it: Any, steps: int) -> tuple[list[float], list[list[int]]]:
    """``steps`` optimizer steps (fewer where the epoch ends first); -> the
    global mean loss and this rank's sample ids of each."""
    losses, ids = [], []
    for _ in range(steps):
        got = torch.tensor([1.0])
        try:
            idx, x, y = next(it)
        except StopIteration:
            got.zero_()
        dist.all_reduce(got, op=dist.ReduceOp.MIN)  # every rank stops together
        if not got.item():
            break
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        ids.append(_ids(idx))
    return losses, ids


def fsdp2_train(run: str, global_batch: int, save_at: int, until: int, *, resume: bool = False,
                mode: str | None = None) -> dict[str, Any]:
    """Train an FSDP2 model on ``global_batch`` samples per step with a
    ``StatefulDataLoader``; a fresh job saves at ``save_at`` (the manager)
    and goes on to ``until``; ``resume=True`` restores the latest checkpoint
    first (any world size) and trains to ``until``."""
    model, opt = _fsdp2_job()
    dl = loader(global_batch // dist.get_world_size(), data=_Data())
    state = {"model": model, "optimizer": opt, "extra": {"step": 0, "dataloader": dl}}
    mgr = CheckpointManager(run, every_n_steps=save_at, **({} if mode is None else {"data_reshard": mode}))
    start = mgr.restore(state) if resume else None
    step = 0 if start is None else start
    it = iter(dl)
    first, ids1 = _train(model, opt, it, save_at - step if not resume else 0)
    step += len(first)
    if not resume:
        state["extra"]["step"] = step
        mgr.save(step, state)
    rest, ids2 = _train(model, opt, it, until - step)
    return {"start": step if resume else 0, "losses": first + rest, "ids": ids1 + ids2}


def fsdp2_train_as_before(run: str, global_batch: int, save_at: int, until: int) -> dict[str, Any]:
    """The resume as it was before positions resharded: no resharder known,
    so ``data_reshard="approximate"`` restores saved rank ``r % W``'s loader state."""
    from bytecp.data import registry

    kept = dict(registry._RESHARDERS)
    registry._RESHARDERS.clear()
    try:
        return fsdp2_train(run, global_batch, save_at, until, resume=True, mode="approximate")
    finally:
        registry._RESHARDERS.update(kept)
