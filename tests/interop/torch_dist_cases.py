"""Functions the Megatron worker pool runs on every rank for the torch_dist
source tests: a tiny GPT (``tests/megatron/megatron_cases``) saved by
Megatron-Core's own ``dist_checkpointing.save`` with the torch_dist
strategy, laid out as Megatron-LM lays out a run (``iter_0000100/`` and
``latest_checkpointed_iteration.txt``; the state dict of Megatron-LM's
``generate_state_dict``: ``model``, ``optimizer``, ``iteration``, ``args``,
``rng_state``), then loaded by bytecp at another layout.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import megatron_cases as mc  # noqa: E402
from megatron_cases import _STATE, CpuDeviceMode  # noqa: E402

import bytecp  # noqa: E402

ITERATION = 100
FOLDER = f"iter_{ITERATION:07d}"


def _rng_state() -> Any:
    """Megatron-LM's per-rank RNG state: a ShardedObject per (PP, TP) rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"random_rng_state": [1, 2, 3], "np_rng_state": "n", "torch_rng_state": torch.get_rng_state()}]
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    return ShardedObject("rng_state", state, (ps.get_pipeline_model_parallel_world_size(),
                                              ps.get_tensor_model_parallel_world_size()), (pp, tp),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def megatron_save(run: str, *, optimizer: str | None = "fully_reshardable", **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build (and train two steps with the distributed optimizer),
    save with ``dist_checkpointing.save`` (torch_dist) into ``run/iter_0000100``
    as Megatron-LM does; report the full tensors saved."""
    mc.build(**{"dist_opt": optimizer is not None, **build_kw})
    if optimizer is not None:
        mc.train_step(1)
        mc.train_step(2)
    ref: dict[str, Any] = {"model": mc.full_model_state()}
    if optimizer is not None:
        ref["optim"] = mc.full_optimizer_state()
    _write(run, optimizer, build_kw.get("tp", 1))
    return ref


def megatron_save_moe(run: str, ep: int = 2) -> dict[str, Any]:
    """(all ranks) The MoE GPT (4 experts, top-2) at EP=``ep`` with the
    distributed optimizer (a chain: dense and expert), two steps, saved as
    :func:`megatron_save` saves."""
    import moe_cases

    moe_cases.build(1, ep)
    moe_cases.train_step(1)
    moe_cases.train_step(2)
    ref = {"model": mc.full_model_state(), "optim": moe_cases.full_optimizer_state()}
    _write(run, "fully_reshardable", 1)
    return ref


def bytecp_load_moe(url: str, ep: int, optimizer: bool) -> dict[str, Any]:
    """(all ranks) The MoE GPT at EP=``ep`` with other weights, loaded from ``url``."""
    import moe_cases

    moe_cases.build(1, ep, seed=99, dist_opt=optimizer)
    before = mc.full_model_state()
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"]), "iteration": 0}
    if optimizer:
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():
        res = bytecp.load(url, state, strict=False)
    out: dict[str, Any] = {"before": before, "model": mc.full_model_state(), "iteration": state["iteration"],
                           "missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys)}
    if optimizer:
        out["optim"] = moe_cases.full_optimizer_state()
    return out


def _write(run: str, optimizer: str | None, tp: int) -> None:
    """(all ranks) Megatron-LM's state dict of the built model (and optimizer),
    saved by ``dist_checkpointing.save`` (torch_dist) into ``run/iter_0000100``."""
    from megatron.core import dist_checkpointing

    model_sd = _STATE["model"].sharded_state_dict()
    sd: dict[str, Any] = {
        "args": argparse.Namespace(tensor_model_parallel_size=tp, lr=0.01),
        "checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd,
        "rng_state": [_rng_state()], "num_floating_point_operations_so_far": 0,
    }
    if optimizer is not None:
        with CpuDeviceMode():
            sd["optimizer"] = _STATE["optimizer"].sharded_state_dict(
                model_sd, metadata={"distrib_optim_sharding_type": optimizer})
    folder = os.path.join(run, FOLDER)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    # Megatron's writer starts helper processes, which a daemonic pool worker
    # may not: the pool's workers pass for ordinary processes while it saves
    config = mp.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        with CpuDeviceMode():
            dist_checkpointing.save(sd, folder, ("torch_dist", 1),
                                    content_metadata={"distrib_optim_sharding_type": optimizer} if optimizer else None)
    finally:
        if daemon is not None:
            config["daemon"] = daemon
    dist.barrier()
    if dist.get_rank() == 0:
        Path(run, "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def bytecp_load(url: str, *, optimizer: bool = False, **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build with other weights (and a fresh distributed
    optimizer), load ``url`` with bytecp, report the full tensors."""
    mc.build(**{"dist_opt": optimizer, "seed": 99, **build_kw})
    before = mc.full_model_state()
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"]), "iteration": 0}
    if optimizer:
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():  # Megatron-LM's other values (args, rng_state) are not asked for
        res = bytecp.load(url, state, strict=False)
    out: dict[str, Any] = {"before": before, "model": mc.full_model_state(), "iteration": state["iteration"],
                           "missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys)}
    if optimizer:
        out["optim"] = mc.full_optimizer_state()
    return out


def bytecp_save(url: str, *, optimizer: bool = False, **build_kw: Any) -> None:
    """(all ranks, exploration) bytecp's own save of the same model."""
    mc.build(**{"dist_opt": optimizer, **build_kw})
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"])}
    if optimizer:
        mc.train_step(1)
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():
        bytecp.save(url, state)


def timed_loads(url: str, repeat: int = 3, **build_kw: Any) -> dict[str, list[float]]:
    """(all ranks) Seconds per load of ``url`` into the model: bytecp, then
    ``dist_checkpointing.load`` (torch_dist), each ``repeat`` times."""
    from megatron.core import dist_checkpointing

    mc.build(**{"seed": 99, **build_kw})
    model = _STATE["model"]
    out: dict[str, list[float]] = {"bytecp": [], "megatron": []}
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        bytecp.load(url, {"model": model})
        dist.barrier()
        out["bytecp"].append(time.perf_counter() - t)
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, url)
        model.load_state_dict(loaded["model"], strict=False)
        dist.barrier()
        out["megatron"].append(time.perf_counter() - t)
    return out
