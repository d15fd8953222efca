"""Correctness on the GPU (``pytest -m gpu``; skipped without one): plain,
DDP and FSDP2 models on a CUDA device, the job's default group NCCL (world
1), saved with ``save``, eager ``async_save`` and lazy ``async_save`` while
training goes on; each checkpoint loaded back onto the GPU, and into CPU
processes at world 2 (FSDP2 on gloo: resharded), compared bitwise with the
full state torch reports for the GPU job at the call.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawning import spawns
from torch import nn

import bytecp
from bytecp.saving import handles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU-resident models need a GPU"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def nccl() -> Iterator[None]:
    """This process as the training job's world of 1 on NCCL."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file:///tmp/bytecp-nccl-{uuid.uuid4().hex}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", 0))
    yield
    handles._groups.clear()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
@spawns
def cpu_world_2() -> Iterator[Any]:
    """Two CPU processes on gloo (the resharding side)."""
    from dist.pool import WorkerPool

    pool = WorkerPool(2, env={"CUDA_VISIBLE_DEVICES": ""})
    yield pool
    pool.close()


def build(framework: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from dist.cases import Net

    torch.manual_seed(seed)
    model: nn.Module = Net().cuda()
    if framework == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    elif framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (1,))
        for m in (model.l1, model.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> None:
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(1000 * step)
        x = torch.randint(0, 37, (6, 5), generator=g)
        y = (x * 7 + 3) % 5
        nn.functional.cross_entropy(model(x.cuda()).flatten(0, 1), y.cuda().flatten()).backward()
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full state torch reports, on the host (the reference)."""
    from dist.cases import full_state as torch_full_state

    ref = torch_full_state(model, opt)
    assert ref is not None
    torch.cuda.synchronize()
    return {"model": {k: v.detach().cpu() for k, v in ref["model"].items()},
            "optim": {k: v.detach().cpu() for k, v in ref["optim"].items()}, "groups": ref["groups"]}


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model, "optimizer": opt, "extra": {"step": step}, "rng": bytecp.RNGState()}


@pytest.mark.parametrize("framework", ["plain", "ddp", "fsdp2"])
def test_gpu_checkpoints_load_back_and_reshard_on_cpu_bitwise(framework: str, nccl: None, cpu_world_2: Any,
                                                             tmp_path: Path) -> None:
    from dist.cases import assert_same_state, load_case

    model, opt = build(framework)
    train(model, opt, 0, 2)
    refs: dict[str, dict[str, Any]] = {}
    url = str(tmp_path / "sync")
    refs[url] = full_state(model, opt)
    bytecp.save(url, state_of(model, opt, 2), step=2)
    for step, lazy in ((3, False), (4, True)):
        train(model, opt, step - 1, 1)
        url = str(tmp_path / ("lazy" if lazy else "eager"))
        refs[url] = full_state(model, opt)
        h = bytecp.async_save(url, state_of(model, opt, step), lazy=lazy, step=step)
        train(model, opt, step, 2)  # training goes on while the save runs (lazy: its hook waits)
        h.wait(120)
    for url, ref in refs.items():
        back, back_opt = build(framework, seed=7)
        train(back, back_opt, 50, 1)  # the optimizer holds state: the load fills it in place
        bytecp.load(url, state_of(back, back_opt, -1))
        assert_same_state(ref, full_state(back, back_opt), f"{framework} {Path(url).name} back on the GPU")
        got = cpu_world_2.run(load_case, "fsdp2", url)[0]
        assert_same_state(ref, got, f"{framework} {Path(url).name} into FSDP2 on 2 CPU ranks")
