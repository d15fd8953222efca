"""Functions the worker pools run on every rank: DTensor and FSDP2 states saved
again and again, their description kept between saves while their structure
is unchanged and made afresh when a tensor is resharded, every checkpoint
read back whole on rank 0 and compared with the full tensors torch reports
at its save (``full_tensor()``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp

from .cases import build, full_state, train


def _full(v: Any) -> Any:
    """(every rank) A DTensor's full tensor (a collective), a tensor's clone, a value as it is."""
    if hasattr(v, "full_tensor"):
        return v.full_tensor().clone()
    return v.clone() if isinstance(v, torch.Tensor) else v


def _reference(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """(every rank) The full model and optimizer tensors, named as bytecp names them."""
    names = {id(p): n for n, p in model.named_parameters()}
    ref: dict[str, Any] = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            ref[f"optim.state.{names[id(p)]}.{k}"] = _full(v)
    return ref


def _check(url: str, ref: dict[str, Any]) -> None:
    """(rank 0) The checkpoint holds exactly ``ref``'s tensors, bitwise."""
    got = bytecp.load_state_dict(url)
    flat: dict[str, Any] = {}

    def walk(v: Any, name: str) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{name}.{k}" if name else str(k))
        elif isinstance(v, torch.Tensor):
            flat[name] = v

    walk(got, "")
    assert set(flat) == set(ref), sorted(set(flat) ^ set(ref))
    for k, v in ref.items():
        assert flat[k].dtype == v.dtype and torch.equal(flat[k], v), k


def _save(mode: str, url: str, state: dict[str, Any]) -> None:
    if mode == "sync":
        bytecp.save(url, state)
    else:
        bytecp.async_save(url, state, lazy=mode == "lazy").wait()


def _reshard(model: nn.Module, opt: torch.optim.Optimizer, name: str, placements: list[Any]) -> None:
    """(every rank) Parameter ``name`` and its optimizer state laid out anew (new DTensors)."""
    old = getattr(model, name)
    new = nn.Parameter(old.detach().redistribute(old.device_mesh, placements))
    setattr(model, name, new)
    for g in opt.param_groups:
        g["params"] = [new if p is old else p for p in g["params"]]
    st = opt.state.pop(old)
    opt.state[new] = {k: v.redistribute(v.device_mesh, placements) if hasattr(v, "redistribute") else v
                      for k, v in st.items()}


def dtensor_resharded(root: str, mode: str) -> list[tuple[int, int]]:
    """(each of 2 ranks) A module of DTensor parameters (Shard(0) and
    Replicate) with Adam state: saved, saved again, resharded (Shard(0) ->
    Shard(1) -> Replicate), saved after each; -> (kept, described) growth
    of each save after the first."""
    from bytecp.adapters._watch import DESCRIBE_STATS
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    model.b = nn.Parameter(distribute_tensor(torch.randn(6), mesh, [Replicate()]))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step() -> None:
        (model.w * model.b).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    state = {"model": model, "optim": opt}
    counts: list[tuple[int, int]] = []
    for i, change in enumerate([None, None, [Shard(1)], None, [Replicate()], None]):
        if change is not None:
            _reshard(model, opt, "w", change)
        step()
        url = f"{root}/{mode}-{i}"
        ref = _reference(model, opt)
        before = (DESCRIBE_STATS.kept, DESCRIBE_STATS.described)
        _save(mode, url, state)
        counts.append((DESCRIBE_STATS.kept - before[0], DESCRIBE_STATS.described - before[1]))
        if dist.get_rank() == 0:
            _check(url, ref)
        dist.barrier()
    return counts[1:]


def fsdp2_saved_every_step(root: str, mode: str) -> list[tuple[int, int]]:
    """(each rank) The FSDP2 model of the distributed tests trained and saved
    four times; every checkpoint equals the full state torch reports; ->
    (kept, described) growth of each save after the first."""
    from bytecp.adapters._watch import DESCRIBE_STATS

    model, opt = build("fsdp2")
    counts: list[tuple[int, int]] = []
    for i in range(4):
        train(model, opt, i, 1)
        ref = full_state(model, opt)
        url = f"{root}/fsdp2-{mode}-{i}"
        before = (DESCRIBE_STATS.kept, DESCRIBE_STATS.described)
        _save(mode, url, {"model": model, "optim": opt})
        counts.append((DESCRIBE_STATS.kept - before[0], DESCRIBE_STATS.described - before[1]))
        if ref is not None:
            got = bytecp.load_state_dict(url)
            for k, v in ref["model"].items():
                assert torch.equal(got["model"][k], v), k
            for k, v in ref["optim"].items():
                p, name = k.rsplit(".", 1)
                assert torch.equal(got["optim"]["state"][p][name], v), k
        dist.barrier()
    return counts[1:]
