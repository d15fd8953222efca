"""Functions the 4-rank pool runs for the DTensor layout matrix
(tests/dist/test_layouts.py): a tiny torchtitan-style transformer laid out
with torch's own ``parallelize_module`` and ``fully_shard`` on a
``DeviceMesh`` -- FSDP2 x TP with SequenceParallel norms or with the norms
left out of the TP plan, TP alone, HSDP, HSDP x TP, pipeline stages that
keep the full model's names -- trained two steps, saved, and loaded into
other layouts. The oracle is every tensor in full, as the DTensors
themselves report it (``full_tensor``), gathered over pipeline stages."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp

VOCAB = 37  # prime: no shard count divides it
HIDDEN = 16
HEADS = 4
LAYERS = 2

#: layout name -> what it builds (the matrix in docs/saving-and-loading.md, "DTensor layouts", lists the same)
LAYOUTS = {
    "fsdp_tp_sp": "FSDP2 x TP, dp=2 x tp=2, SequenceParallel norms, vocabulary-parallel embedding and output",
    "fsdp_tp_norms_out": "FSDP2 x TP, dp=2 x tp=2, norms and embeddings outside the TP plan (FSDP over dp only)",
    "tp": "TP only, tp=4, SequenceParallel norms",
    "hsdp": "HSDP, replicate=2 x shard=2",
    "hsdp_tp": "HSDP x TP, replicate=2 x shard=1 x tp=2, norms outside the TP plan",
    "pp_fsdp": "pipeline stages pp=2 x FSDP2 dp=2 (stage 0: embedding, layer 0; stage 1: layer 1, norm, output)",
    "fsdp": "FSDP2 alone, dp=4",
    "fsdp_groups": "FSDP2 over two process groups of 2 ranks, each its own mesh (ranks 0 and 1 hold the same boxes)",
    "fsdp_tp_1x4": "FSDP2 x TP, dp=1 x tp=4, SequenceParallel norms",
    "pp_fsdp_other": "pipeline stages pp=2 x FSDP2 dp=2, another split (stage 0: embedding, layers 0-1)",
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, HIDDEN // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.w2 = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(HIDDEN)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    """torchtitan's shape in small: a stage drops the parts it does not run
    (``None``, or a missing key of ``layers``) and keeps the full model's names."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.LayerNorm(HIDDEN)
        self.output: nn.Module | None = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _tp_plan(model: Model, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for i in model.layers:
        p = f"layers.{i}"
        lin = {f"{p}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        lin[f"{p}.feed_forward.w1"] = ColwiseParallel()
        if sequence_parallel:
            lin[f"{p}.attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
            lin[f"{p}.feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
            for n, m in ((f"{p}.attention", 1), (f"{p}.feed_forward", 1)):
                plan[n] = PrepareModuleInput(input_layouts=(Shard(m),), desired_input_layouts=(Replicate(),))
            plan[f"{p}.attn_norm"] = SequenceParallel()
            plan[f"{p}.ffn_norm"] = SequenceParallel()
        else:
            lin[f"{p}.attention.wo"] = RowwiseParallel()
            lin[f"{p}.feed_forward.w2"] = RowwiseParallel()
        plan.update(lin)
    if sequence_parallel:
        if model.tok_embeddings is not None:
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if model.norm is not None:
            plan["norm"] = SequenceParallel()
        if model.output is not None:
            plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


#: the device meshes and groups the layouts were built on, made once a rank: a pool's
#: ranks serve the whole session, and every gloo group keeps a thread that wakes a
#: hundred times a second (each test built five meshes anew before: 140 groups a rank)
_MESHES: dict[Any, Any] = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """(every rank, collectively the first time) The device mesh of ``shape`` and ``names``."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names, dist.get_world_size())
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _parity_groups(world: int) -> list[Any]:
    """(every rank, collectively the first time) One group of the even ranks, one of the odd."""
    key = ("parity", world)
    if key not in _MESHES:
        _MESHES[key] = [dist.new_group(list(range(i, world, 2))) for i in range(2)]
    return _MESHES[key]


def build(layout: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """(every rank) The model under ``layout``, an AdamW over it, and this
    rank's pipeline stage (0 without pipelining)."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = Model()
    world = dist.get_world_size() if layout != "plain" else 1
    stage = 0
    if layout in ("fsdp_tp_sp", "fsdp_tp_norms_out", "fsdp_tp_1x4"):
        dp = 1 if layout == "fsdp_tp_1x4" else 2
        mesh = _mesh((dp, world // dp), ("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan(model, layout != "fsdp_tp_norms_out"))
        _shard(model, mesh["dp"])
    elif layout == "tp":
        mesh = _mesh((world,), ("tp",))
        parallelize_module(model, mesh, _tp_plan(model, True))
    elif layout == "hsdp":
        _shard(model, _mesh((2, world // 2), ("replicate", "shard")))
    elif layout == "hsdp_tp":
        mesh = _mesh((2, 1, world // 2), ("replicate", "shard", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan(model, False))
        _shard(model, mesh["replicate", "shard"])
    elif layout == "fsdp":
        _shard(model, _mesh((world,), ("dp",)))
    elif layout == "fsdp_groups":
        from torch.distributed.device_mesh import DeviceMesh

        # one group per parity, each a mesh of its own (no root spans the world):
        # ranks 0 and 1 hold the same boxes and no hint can say so
        groups = _parity_groups(world)
        _shard(model, DeviceMesh.from_group(groups[dist.get_rank() % 2], "cpu", mesh_dim_names=("dp",)))
    elif layout in ("pp_fsdp", "pp_fsdp_other"):
        mesh = _mesh((2, world // 2), ("pp", "dp"))
        stage = int(mesh.get_coordinate()[0])  # type: ignore[index]
        first = {"pp_fsdp": 1, "pp_fsdp_other": 2}[layout]  # layers of stage 0
        if stage == 0:
            model.norm = model.output = None
            for i in range(first, LAYERS):
                del model.layers[str(i)]
        else:
            model.tok_embeddings = None
            for i in range(first):
                del model.layers[str(i)]
        _shard(model, mesh["dp"])
    elif layout != "plain":
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    return model, opt, stage


def _shard(model: Model, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model: nn.Module, opt: torch.optim.Optimizer, stage: int, steps: int = 2) -> None:
    """A few steps so the optimizer holds state (a pipeline stage trains its
    part alone on a stand-in input: the layout is what is under test)."""
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step)  # every rank alike: TP peers must see the same batch
        if getattr(model, "tok_embeddings", None) is not None:
            x: torch.Tensor = torch.randint(0, VOCAB, (2, 8), generator=g)
        else:
            x = torch.randn(2, 8, HIDDEN, generator=g)
        out = model(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        (out.float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """(every rank) Every model and optimizer tensor in full by FQN, merged
    over pipeline stages; rank 0 returns it."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    msd = {k: full(v) for k, v in model.state_dict().items()}
    optim: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                optim[f"{name}.{k}"] = full(v)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    mine = {"model": msd, "optim": optim, "groups": groups}
    if not dist.is_initialized():
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    out: dict[str, Any] = {"model": {}, "optim": {}, "groups": groups}
    for part in every:
        out["model"].update(part["model"])
        out["optim"].update(part["optim"])
    return out


def _build(layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    if layout.startswith("titan"):
        from . import titan_cases

        return titan_cases.build(layout, seed)
    return build(layout, seed)


def _train(layout: str, model: nn.Module, opt: torch.optim.Optimizer, stage: int) -> None:
    if layout.startswith("titan"):
        from . import titan_cases

        titan_cases.train(model, opt, stage)
    else:
        train(model, opt, stage)


def save_then_load(layout: str, url: str, loads: list[str]) -> dict[str, Any] | None:
    """(every rank) Save ``layout`` trained 2 steps to ``url`` (a sync save
    to ``url + "-sync"`` first, then an async one to ``url``), then load it
    into each layout of ``loads`` (a fresh model each, other initial
    values). Rank 0 returns the saved state in full, each load's and the
    seconds each took."""
    from bytecp.adapters._dtensor import dtensor_replicas

    model, opt, stage = _build(layout, seed=0)
    _train(layout, model, opt, stage)
    block = next(iter(model.layers.values()))
    norm = getattr(block, "attn_norm", None) or block.attention_norm
    norm = norm.weight
    hint = dtensor_replicas(norm) if hasattr(norm, "device_mesh") else None  # type: ignore[arg-type]
    state = {"model": model, "optimizer": opt, "extra": {"step": 2}}
    from bytecp.plan.exchange import PLAN_STATS

    coordinated = PLAN_STATS.coordinated
    t0 = time.perf_counter()
    bytecp.save(url + "-sync", state)
    saved = time.perf_counter() - t0
    coordinated = PLAN_STATS.coordinated - coordinated  # 1: the first save gathered boxes
    # the checkpoint loaded below: an async save of the same state, which
    # reuses the plan just made and copies this rank's cached share alone
    bytecp.async_save(url, state).wait()
    ref = full_state(model, opt)
    got: dict[str, Any] = {}
    took: dict[str, float] = {"save": saved}
    for to in loads:
        m2, o2, _ = _build(to, seed=123)
        extra: dict[str, Any] = {"step": -1}
        t0 = time.perf_counter()
        # a pipeline stage takes its own names only
        bytecp.load(url, {"model": m2, "optimizer": o2, "extra": extra}, strict=not to.startswith("pp"))
        took[to] = time.perf_counter() - t0
        st = full_state(m2, o2)
        if st is not None:
            st["step"] = extra["step"]
            got[to] = st
    return None if ref is None else {"ref": ref, "got": got, "took": took,
                                     "norm_replicas": None if hint is None else list(hint.ranks),
                                     "coordinated": coordinated}


def save_error(layout: str, url: str) -> str:
    """(every rank) Save a model one of whose parameters holds partial sums
    (``Partial`` where the layout has ``Replicate``); the error text, or "no error"."""
    from torch.distributed.tensor import DTensor, Partial

    model, opt, _ = build(layout, seed=0)
    norm = model.layers["0"].attn_norm
    w = norm.weight
    placements = [Partial() if p.is_replicate() else p for p in w.placements]
    norm.weight = nn.Parameter(DTensor.from_local(w.to_local().detach().clone(), w.device_mesh, placements,
                                                     run_check=False, shape=w.shape, stride=w.stride()))
    try:
        bytecp.save(url, {"model": model})
    except bytecp.DistributedCheckpointError as e:
        return str(e)
    return "no error"
