"""The multi-process golden cases (gloo ranks spawned by torch.multiprocessing),
for make_golden.py: two ranks of plain shards, DDP, FSDP1, FSDP2, and the
version-4 index parts of two ranks."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from golden_encoding import encode, pattern
from torch import nn

import bytecp
from bytecp.tree.regions import Region
from bytecp.tree.state import Shard, TensorLeaf


def _two_rank_state(rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the 2-rank save holds (views of the full tensors)."""
    full = _two_rank_full()
    flat = full["sharded_flat"].reshape(-1)
    cut = 13  # rank 0 holds elements [0, 13), rank 1 [13, 30): an FSDP1-style flat shard
    lo, hi = (0, cut) if rank == 0 else (cut, flat.numel())
    rows = full["sharded_rows"]
    torch.manual_seed(100 + rank)
    np.random.seed(100 + rank)
    random.seed(100 + rank)
    return {
        "replicated": full["replicated"].clone(),  # the same on both ranks: stored once
        "sharded_flat": TensorLeaf.from_flat((6, 5), torch.float32, lo, flat[lo:hi].clone()),
        "sharded_rows": TensorLeaf(
            (4, 3),
            torch.int32,
            [Shard(Region((2 * rank, 0), (2, 3)), rows[2 * rank : 2 * rank + 2].clone())],
        ),
        "extra": {"step": 11, "rng": bytecp.RNGState()},
    }


def _two_rank_full() -> dict[str, torch.Tensor]:
    return {
        "replicated": pattern((3, 7), torch.float16, 23),
        "sharded_flat": pattern((6, 5), torch.float32, 29),
        "sharded_rows": pattern((4, 3), torch.int32, 31),
    }


def _two_rank_worker(rank: int, workdir: str, init_file: str) -> None:
    import torch.distributed as dist

    os.chdir(workdir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        bytecp.save("checkpoint", _two_rank_state(rank), step=11, metadata={"ranks": 2})
    finally:
        dist.destroy_process_group()


def case_two_ranks(url: str) -> tuple[Any, dict[str, Any]]:
    """Two processes (gloo): a replicated tensor, a flat-range shard, a row shard, per-rank RNG."""
    import tempfile

    import torch.multiprocessing as mp

    assert url == "checkpoint"
    with tempfile.TemporaryDirectory() as td:
        mp.spawn(
            _two_rank_worker, args=(os.getcwd(), os.path.join(td, "init")), nprocs=2, join=True
        )
    rng = []
    for r in (0, 1):
        _two_rank_state(r)
        rng.append(bytecp.RNGState().state_dict())
    expected = {**_two_rank_full(), "extra": {"step": 11, "rng": rng[0]}}
    return expected, {
        "framework": "plain",
        "world_size": 2,
        "step": 11,
        "user_metadata": {"ranks": 2},
        "per_rank": {"extra.rng": {"0": encode(rng[0]), "1": encode(rng[1])}},
    }


class Tiny(nn.Module):
    """A model whose tensors do not split evenly over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 3)
        self.norm = nn.LayerNorm(3)
        self.l2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(torch.relu(self.l1(x))))


def _wrap(framework: str, model: nn.Module) -> nn.Module:
    if framework == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if framework == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # an FSDP2 DTensor
    return (full() if full is not None else t).detach().clone()


def _fsdp1_full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full parameters and optimizer state of an FSDP1 (use_orig_params) model,
    assembled from every rank's flat shards with torch's own bookkeeping."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    with FSDP.summon_full_params(model, writeback=False):
        params = {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}
    mine = []
    for prefix, m in model.named_modules():
        if not isinstance(m, FSDP) or m._handle is None:
            continue
        fp = m._handle.flat_param
        base = clean_tensor_name(prefix)
        for i, info in enumerate(fp._shard_param_infos):
            p = fp._params[i]
            if info.in_shard and p in opt.state:
                fqn = clean_tensor_name(f"{base}.{fp._fqns[i]}" if base else fp._fqns[i])
                st = {k: v.clone() for k, v in opt.state[p].items()}
                mine.append((fqn, tuple(fp._shapes[i]), info.intra_param_start_idx, st))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for lst in every:
        for fqn, shape, start, st in lst:
            entry = state.setdefault(fqn, {})
            for k, v in st.items():
                if v.dim() == 0:
                    entry[k] = v
                    continue
                flat = entry.setdefault(k, torch.zeros(shape, dtype=v.dtype)).view(-1)
                flat[start : start + v.numel()] = v
    return params, state


def _framework_worker(rank: int, framework: str, workdir: str, init_file: str) -> None:
    import torch.distributed as dist

    os.chdir(workdir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(5)
        model = _wrap(framework, Tiny())
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        x = torch.linspace(-2.0, 2.0, 20).reshape(4, 5) + rank
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        bytecp.save("checkpoint", {"model": model, "optimizer": opt, "extra": {"step": 1}}, step=1)
        # the oracle: full tensors as torch itself holds them
        if framework == "fsdp1":
            params, ostate = _fsdp1_full_state(model, opt)
            names = None
        else:
            inner = model.module if framework == "ddp" else model
            params = {n: _full(p) for n, p in inner.named_parameters()}
            names = {id(p): n for n, p in inner.named_parameters()}
            ostate = {
                names[id(p)]: {k: _full(v) for k, v in st.items()} for p, st in opt.state.items()
            }
        if framework == "fsdp1":
            from torch.distributed.fsdp._common_utils import clean_tensor_name

            order = [clean_tensor_name(n) for n, _ in model.named_parameters()]
        else:
            order = [names[id(p)] for g in opt.param_groups for p in g["params"]]  # type: ignore[index]
        groups = []
        for g in opt.param_groups:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = order[: len(g["params"])]
            order = order[len(g["params"]) :]
            groups.append(g2)
        if rank == 0:
            torch.save({"params": params, "state": ostate, "groups": groups}, "oracle.pt")
    finally:
        dist.destroy_process_group()


def _framework_case(framework: str) -> Callable[[str], tuple[Any, dict[str, Any]]]:
    def case(url: str) -> tuple[Any, dict[str, Any]]:
        import tempfile

        import torch.multiprocessing as mp

        assert url == "checkpoint"
        with tempfile.TemporaryDirectory() as td:
            mp.spawn(
                _framework_worker,
                args=(framework, os.getcwd(), os.path.join(td, "init")),
                nprocs=2,
                join=True,
            )
        oracle = torch.load("oracle.pt", weights_only=True)
        os.remove("oracle.pt")
        expected = {
            "model": oracle["params"],
            "optimizer": {"state": oracle["state"], "param_groups": oracle["groups"]},
            "extra": {"step": 1},
        }
        md = json.loads(Path("checkpoint/metadata.json").read_text())
        return expected, {
            "framework": framework,
            "world_size": 2,
            "step": 1,
            "user_metadata": {},
            "parallelism": md["parallelism"],
        }

    case.__doc__ = f"A 2-rank {framework} save (gloo): model and AdamW state after one step."
    return case


def _parts_full() -> dict[str, torch.Tensor]:
    return {
        "lin": pattern((1024,), torch.int16, 47),
        "grid": pattern((256, 4), torch.int32, 53),
        "tail": pattern((1000, 3), torch.float32, 59),
        "rep": pattern((3, 5), torch.float16, 61),
        "s": torch.tensor(-1.25, dtype=torch.float64),
        "e": torch.empty(0, 3, dtype=torch.bfloat16),
    }


#: rank -> tensor -> the boxes that rank holds ((offsets, lengths))
_PARTS_BOXES: dict[int, dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {
    0: {"lin": [((0,), (4,)), ((8,), (4,))], "grid": [((0, 0), (2, 4))], "tail": [((0, 0), (998, 3))]},
    1: {"lin": [((4,), (4,)), ((12,), (1012,))], "grid": [((2, 0), (254, 4))], "tail": [((998, 0), (2, 3))]},
}


def _parts_state(rank: int) -> dict[str, Any]:
    full = _parts_full()
    state: dict[str, Any] = {}
    for fqn, boxes in _PARTS_BOXES[rank].items():
        t = full[fqn]
        shards = [Shard(Region(o, n), t[tuple(slice(a, a + b) for a, b in zip(o, n, strict=True))].clone())
                  for o, n in boxes]
        state[fqn] = TensorLeaf(tuple(t.shape), t.dtype, shards)
    # replicated on both ranks (stored once), a 0-dim and an empty tensor
    state.update(rep=full["rep"].clone(), s=full["s"].clone(), e=full["e"].clone(), extra={"step": 4})
    return state


def _parts_worker(rank: int, workdir: str, init_file: str) -> None:
    import torch.distributed as dist

    os.chdir(workdir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        bytecp.save("checkpoint", _parts_state(rank), step=4)
    finally:
        dist.destroy_process_group()


def case_parts(url: str) -> tuple[Any, dict[str, Any]]:
    """Format version 4: two ranks (gloo), each writing its own index part;
    rows banded by linear position (small boxes of lin, grid and tail, the
    last at the end of the bands, a 0-dim tensor) and wide (the rest, the
    replicated tensor), an empty tensor with no rows."""
    import tempfile

    import torch.multiprocessing as mp

    assert url == "checkpoint"
    with tempfile.TemporaryDirectory() as td:
        mp.spawn(_parts_worker, args=(os.getcwd(), os.path.join(td, "init")), nprocs=2, join=True)
    md = json.loads(Path(url, "metadata.json").read_text())
    index = md["index"]
    assert index["layout"] == "parts" and index["parts"]["rank"] == [0, 1], index
    assert index["band_pages"]["lo"] == [0] and index["band_pages"]["hi"] == [1023], index
    expected = {**{k: v.clone() for k, v in _parts_full().items()}, "extra": {"step": 4}}
    return expected, {"framework": "plain", "world_size": 2, "step": 4, "user_metadata": {}}
