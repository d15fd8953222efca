"""Functions the DeepSpeed tests run on every rank of a spawned gloo pool.

DeepSpeed runs on the CPU accelerator (``DS_ACCELERATOR=cpu``, set in the
pool's environment); :func:`setup` skips the JIT build of its shared-memory
communication op (about 30 s, not needed on gloo) and adopts the pool's
process group. Every function returns full tensors (small) that the test
compares bitwise.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

import bytecp
from tests.dist import groups

STEPS_LR = 1e-2


def setup() -> None:
    """(every rank) DeepSpeed on the pool's gloo group, without its shm op build."""
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_SIZE", str(dist.get_world_size()))
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def make_engine(stage: int, seed: int, *, bf16: bool = False, fp16: bool = False, sgd: bool = False,
                warmup: int = 0, **zero: Any) -> Any:
    """A ZeRO engine over :func:`make_model` with torch AdamW (or a client SGD
    with momentum); ``warmup``: DeepSpeed's WarmupLR over that many steps;
    ``fp16``: a dynamic loss scaler starting at 2^24, which overflows (and
    skips) the first steps."""
    setup()
    import deepspeed

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, **zero},
        "bf16": {"enabled": bf16},
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }
    if fp16:
        # DeepSpeed's CPU accelerator asks oneDNN whether this CPU has fp16 kernels and refuses
        # fp16 when it has none; torch runs the fp16 ops regardless
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1, "loss_scale_window": 1000}
    if warmup:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": STEPS_LR,
                                                           "warmup_num_steps": warmup}}
    if stage == 3:  # the weights are partitioned, the biases kept whole (persistent) on every rank
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 20)
    model = make_model(seed)
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=STEPS_LR, momentum=0.9)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": STEPS_LR, "torch_adam": True}}
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def engine_counters(engine: Any) -> dict[str, Any]:
    """What DeepSpeed's own checkpoint restores beside the tensors."""
    sched = engine.lr_scheduler
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "lr": [g["lr"] for g in engine.optimizer.param_groups],
            "scheduler": sched.state_dict() if sched is not None else None}


def losses(engine: Any, steps: range) -> list[float]:
    """Train ``steps`` steps; each step's loss (the same on every rank only up to its batch)."""
    out = []
    dtype = next(engine.module.parameters()).dtype
    for s in steps:
        loss = engine(batch(s).to(dtype)).float().square().mean()
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def ds_engine_resume(url: str, stage: int) -> dict[str, Any]:
    """``{"model": engine}`` is the whole engine: a fresh engine resumes its
    steps, samples, scheduler and learning rate; the next losses equal the
    uninterrupted run's. ``exclude=["engine.lr_scheduler"]`` keeps the fresh
    engine's scheduler, ``exclude=["optimizer"]`` its optimizer."""
    engine = make_engine(stage, seed=0, warmup=10)
    losses(engine, range(3))
    saved = engine_counters(engine)
    saved_tensors = engine_snapshot(engine)
    bytecp.save(url, {"model": engine})
    uninterrupted = losses(engine, range(3, 5))
    resumed = make_engine(stage, seed=1, warmup=10)
    bytecp.load(url, {"model": resumed})
    loaded = engine_counters(resumed)
    loaded_tensors = engine_snapshot(resumed)
    after = losses(resumed, range(3, 5))
    kept = make_engine(stage, seed=1, warmup=10)
    fresh_lr = engine_counters(kept)
    bytecp.load(url, {"model": kept}, exclude=["engine.lr_scheduler"])
    partly = engine_counters(kept)
    no_opt = make_engine(stage, seed=2, warmup=10)
    bytecp.load(url, {"model": no_opt}, exclude=["optimizer"])
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "after": after,
            "saved_tensors": saved_tensors, "loaded_tensors": loaded_tensors, "fresh": fresh_lr,
            "partly": partly, "no_opt_state": not engine_has_state(no_opt),
            "no_opt_model": model_snapshot(no_opt)}


def scaler_state(engine: Any) -> dict[str, Any]:
    from bytecp.adapters.deepspeed.engine import SCALER_FIELDS

    scaler = engine.optimizer.loss_scaler
    return {f: float(getattr(scaler, f)) for f in SCALER_FIELDS if hasattr(scaler, f)}


def ds_fp16_roundtrip(url: str, stage: int, **zero: Any) -> dict[str, Any]:
    """fp16 with a dynamic loss scaler: the first steps overflow and are
    skipped; the resumed engine has the same fp16 weights, fp32 masters,
    moments, counters and scaler, and its next losses are the uninterrupted run's."""
    engine = make_engine(stage, seed=0, fp16=True, **zero)
    step = 0
    while not engine_has_state(engine) and step < 60:  # overflows (each halves the scale), then a step
        losses(engine, range(step, step + 1))
        step += 1
    losses(engine, range(step, step + 2))
    step += 2
    saved = {**engine_counters(engine), **scaler_state(engine)}
    saved_tensors = engine_snapshot(engine)
    bytecp.save(url, {"model": engine})
    uninterrupted = losses(engine, range(step, step + 2))
    other = make_engine(stage, seed=1, fp16=True, **zero)
    bytecp.load(url, {"model": other})
    loaded = {**engine_counters(other), **scaler_state(other)}
    loaded_tensors = engine_snapshot(other)
    return {"saved": saved, "loaded": loaded, "saved_tensors": saved_tensors, "loaded_tensors": loaded_tensors,
            "uninterrupted": uninterrupted, "after": losses(other, range(step, step + 2))}


def ds_fp16_load(url: str, stage: int) -> dict[str, torch.Tensor]:
    """A fresh fp16 engine at ZeRO ``stage`` loads the checkpoint; its state."""
    engine = make_engine(stage, seed=9, fp16=True)
    bytecp.load(url, {"model": engine})
    return engine_snapshot(engine)


def engine_has_state(engine: Any) -> bool:
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return any(bool(st) for st in inner.state.values())


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(2, 5, generator=g)


def train_engine(engine: Any, steps: range) -> None:
    for s in steps:
        x = batch(s).to(torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)
        engine.backward(engine(x).float().sum())
        engine.step()


def model_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Full model and fp32 masters of an engine (collective)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, torch.Tensor] = {}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
        for n, p in params:
            out[f"model.{n}"] = p.detach().clone()
    for n, p in params:
        out[f"master.{n}"] = (p.detach() if engine.zero_optimization_stage() == 0 else safe_get_full_fp32_param(p)).clone()
    return out


def engine_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Full model, fp32 master, Adam moments and step of an engine (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {k: v for k, v in model_snapshot(engine).items() if k.startswith("model.")}
    params = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 0:  # a plain torch optimizer over the module's parameters
        for n, p in params:
            out[f"master.{n}"] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{n}"] = engine.optimizer.state[p][k].clone()
            out["step"] = engine.optimizer.state[p]["step"].clone()
        return out
    for n, p in params:
        out[f"master.{n}"] = safe_get_full_fp32_param(p).clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = safe_get_full_optimizer_state(p, k).clone()
    inner = engine.optimizer.optimizer
    out["step"] = next(iter(inner.state.values()))["step"].clone()
    return out


def ds_save(url: str, stage: int, world_steps: int, form: str, bf16: bool = False) -> dict[str, torch.Tensor]:
    """Train a fresh engine ``world_steps`` steps, snapshot, save."""
    engine = make_engine(stage, seed=0, bf16=bf16)
    train_engine(engine, range(world_steps))
    snap = engine_snapshot(engine)
    state = {"model": engine} if form == "engine" else {"model": engine, "optimizer": engine.optimizer}
    bytecp.save(url, state)
    return snap


def ds_roundtrip(url: str, stage: int, bf16: bool = False, **zero: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                                    dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Same-size resume: (saved, loaded) snapshots, then the next step of the
    uninterrupted engine and of the resumed one."""
    engine = make_engine(stage, seed=0, bf16=bf16, **zero)
    train_engine(engine, range(2))
    saved = engine_snapshot(engine)
    bytecp.save(url, {"model": engine})
    train_engine(engine, range(2, 3))
    after = engine_snapshot(engine)
    other = make_engine(stage, seed=1, bf16=bf16, **zero)  # other weights, no optimizer state yet
    bytecp.load(url, {"model": other})
    loaded = engine_snapshot(other)
    train_engine(other, range(2, 3))
    return saved, loaded, after, engine_snapshot(other)


def ds_lazy(url: str, stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A lazy async save of ``{"model": engine}``: the next step waits for the
    copy (the process-wide pre-step hook catches the engine's inner torch
    optimizer); the checkpoint holds the state of the save, not of the step
    after it."""
    engine = make_engine(stage, seed=0)
    train_engine(engine, range(2))
    saved = engine_snapshot(engine)
    handle = bytecp.async_save(url, {"model": engine}, lazy=True)
    train_engine(engine, range(2, 3))
    handle.wait()
    other = make_engine(stage, seed=1)
    bytecp.load(url, {"model": other})
    return saved, engine_snapshot(other)


def ds_sgd_roundtrip(url: str, stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Another optimizer's state (SGD's ``momentum_buffer``), same size."""
    from deepspeed.utils import safe_get_full_optimizer_state

    def snap(engine: Any) -> dict[str, torch.Tensor]:
        return {n: safe_get_full_optimizer_state(p, "momentum_buffer").clone()
                for n, p in engine.module.named_parameters()}

    engine = make_engine(stage, seed=0, sgd=True)
    train_engine(engine, range(2))
    saved = snap(engine)
    bytecp.save(url, {"model": engine})
    other = make_engine(stage, seed=1, sgd=True)
    bytecp.load(url, {"model": other})
    return saved, snap(other)


def refuses_bad_mapping(url: str) -> list[str]:
    """Rank 1's map of a parameter points outside its partition: the save
    fails on every rank, naming the parameter and its group."""
    engine = make_engine(1, seed=0)
    if dist.get_rank() == 1:
        engine.module[0].bias._hp_mapping.hp_fragment_address.start = 10**6
    try:
        bytecp.save(url, {"model": engine})
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return [type(e).__name__, str(e)]
    return ["saved"]


def ds_load(url: str, stage: int, form: str, train_after: int = 0, save_to: str | None = None,
            exclude: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Load into a fresh engine (other seed); snapshot; optionally train and save again."""
    engine = make_engine(stage, seed=7)
    state = {"model": engine} if form == "engine" else {"model": engine, "optimizer": engine.optimizer}
    bytecp.load(url, state, exclude=exclude)
    loaded = engine_snapshot(engine)
    if not train_after:
        return loaded, None
    train_engine(engine, range(100, 100 + train_after))
    snap = engine_snapshot(engine)
    assert save_to is not None
    bytecp.save(save_to, state)
    return loaded, snap


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def torch_snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        out[f"model.{n}"] = _full(p.detach()).clone()
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = _full(st[k]).clone()
        out["step"] = st["step"].clone()
    return out


def fsdp2_load_train_save(url: str, save_to: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """FSDP2 on the pool: load a DeepSpeed checkpoint, one step, save."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed=3)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])  # no engine here
    loaded = torch_snapshot(model, opt)
    model(batch(200)).sum().backward()
    opt.step()
    snap = torch_snapshot(model, opt)
    bytecp.save(save_to, {"model": model, "optimizer": opt})
    return loaded, snap


def plain_load(url: str, save_to: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One plain process: load, one step, save."""
    model = make_model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])  # no engine here
    loaded = torch_snapshot(model, opt)
    model(batch(300)).sum().backward()
    opt.step()
    bytecp.save(save_to, {"model": model, "optimizer": opt})
    return loaded, torch_snapshot(model, opt)


def refuses(stage: int, url: str, bf16: bool, **zero: Any) -> list[str]:
    """Save with an unsupported setting; the error of this rank."""
    engine = make_engine(stage, seed=0, bf16=bf16, **zero)
    try:
        bytecp.save(url, {"model": engine})
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return [type(e).__name__, str(e)]
    return ["saved"]


# ------------------------------------------------ the adapter contract (bytecp.adapters.testing)
def contract_state(seed: int) -> dict[str, Any]:
    """A ZeRO-3 engine on this rank, one step trained, as ``{"model": engine}``."""
    engine = make_engine(3, seed=seed)
    train_engine(engine, range(1))
    return {"model": engine}


def contract_full(state: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The oracle: full tensors by DeepSpeed's own readers (``safe_get_full_*``)."""
    snap = engine_snapshot(state["model"])
    model = {k[len("model."):]: v for k, v in snap.items() if k.startswith("model.")}
    opt = {f"state.{k.partition('.')[2]}.{k.partition('.')[0]}": v for k, v in snap.items()
           if k.startswith(("exp_avg.", "exp_avg_sq."))}
    return {"model": model, "optimizer": opt}


def contract_unsupported() -> dict[str, Any]:
    return {"model": make_engine(0, seed=0, bf16=True)}


# -- pipeline parallelism -------------------------------------------------------------------
PIPE_WIDTH = 6


def pipe_layers() -> list[Any]:
    """The layers of the pipeline model: the same as :func:`pipe_plain`'s nn.Sequential."""
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(nn.Linear, PIPE_WIDTH, 8), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 8, 7),
            LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 7, 5), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 5, 3)]


def pipe_plain(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(PIPE_WIDTH, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(),
                         nn.Linear(5, 3))


def _pipe_loss(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def make_pipe_engine(stages: int, stage: int, seed: int, *, bf16: bool = False) -> Any:
    """A ``PipelineEngine`` over :func:`pipe_layers` in ``stages`` stages, ZeRO ``stage`` (0 or 1)."""
    setup()
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(seed)
    module = PipelineModule(layers=pipe_layers(), num_stages=stages, loss_fn=_pipe_loss, partition_method="uniform")
    cfg: dict[str, Any] = {
        "train_batch_size": 4 * (dist.get_world_size() // stages), "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": STEPS_LR, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()], config=cfg)
    return engine


def pipe_batches(step: int, dp_rank: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    while True:
        yield torch.randn(2, PIPE_WIDTH, generator=g), torch.zeros(2, 3)


def pipe_train(engine: Any, steps: range) -> list[float]:
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    out = []
    for s in steps:
        it = ((x.to(dtype), y) for x, y in pipe_batches(s, engine.grid.data_parallel_id))
        out.append(float(engine.train_batch(it)))
    return out


def pipe_save(url: str, stages: int, stage: int, bf16: bool = False) -> dict[str, Any]:
    engine = make_pipe_engine(stages, stage, seed=0, bf16=bf16)
    pipe_train(engine, range(2))
    bytecp.save(url, {"model": engine})
    return {"names": sorted(n for n, _ in engine.module.named_parameters())}


def pipe_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """This stage's parameters, fp32 masters and Adam moments, by the model's own names."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, torch.Tensor] = {}
    zero = engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled()
    for n, p in engine.module.named_parameters():
        out[f"model.{n}"] = p.detach().clone()
        if zero:
            out[f"master.{n}"] = safe_get_full_fp32_param(p).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{n}"] = safe_get_full_optimizer_state(p, k).clone()
        else:
            out[f"master.{n}"] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{n}"] = engine.optimizer.state[p][k].clone()
    return out


@groups.renewing("deepspeed-pipe")  # a grid of groups at every engine (tests/dist/groups.py)
def pipe_roundtrip(url: str, stages: int, stage: int, bf16: bool = False) -> dict[str, Any]:
    """Same-layout resume of a pipeline engine: state and the next losses."""
    engine = make_pipe_engine(stages, stage, seed=0, bf16=bf16)
    pipe_train(engine, range(2))
    saved = pipe_snapshot(engine)
    counters = engine.global_steps
    bytecp.save(url, {"model": engine})
    uninterrupted = pipe_train(engine, range(2, 4))
    other = make_pipe_engine(stages, stage, seed=1, bf16=bf16)
    bytecp.load(url, {"model": other})
    loaded = pipe_snapshot(other)
    return {"saved": saved, "loaded": loaded, "steps": (counters, other.global_steps),
            "uninterrupted": uninterrupted, "after": pipe_train(other, range(2, 4))}


@groups.renewing("deepspeed-pipe")  # a grid of groups at every engine (tests/dist/groups.py)
def pipe_load(url: str, stages: int, stage: int, bf16: bool = False) -> dict[str, torch.Tensor]:
    """A pipeline engine of ``stages`` stages (any number, 1 too) loads the checkpoint."""
    engine = make_pipe_engine(stages, stage, seed=5, bf16=bf16)
    bytecp.load(url, {"model": engine})
    return pipe_snapshot(engine)


def pipe_plain_load(url: str) -> dict[str, torch.Tensor]:
    """The same model without a pipeline or DeepSpeed, in one process: model and Adam state."""
    model = pipe_plain(seed=6)
    opt = torch.optim.AdamW(model.parameters(), lr=STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        out[f"model.{n}"] = p.detach().clone()
        out[f"master.{n}"] = p.detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = opt.state[p][k].clone()
    return out


def pipe_flat_engine_load(url: str, stage: int) -> dict[str, torch.Tensor]:
    """The same model without a pipeline, as a ZeRO engine at this data-parallel size."""
    setup()
    import deepspeed

    model = pipe_plain(seed=9)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": STEPS_LR, "torch_adam": True}},
           "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    bytecp.load(url, {"model": engine})
    return pipe_snapshot(engine)


# -- DeepSpeed-MoE ----------------------------------------------------------------------------
MOE_EXPERTS = 4


class MoENet(nn.Module):
    """A dense layer, a DeepSpeed-MoE layer of ``MOE_EXPERTS`` experts over ``ep`` ranks, a head."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.inp = nn.Linear(6, 8)
        expert = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.moe = MoE(hidden_size=8, expert=expert, num_experts=MOE_EXPERTS, ep_size=ep, k=1, min_capacity=1)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h).square().mean() + aux


def make_moe_engine(ep: int, stage: int, seed: int) -> Any:
    """An engine over :class:`MoENet`; each expert's weights seeded by its global index."""
    setup()
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(seed)
    model = MoENet(ep)
    world = dist.get_world_size()
    ep_rank = dist.get_rank() % ep  # DeepSpeed's expert groups: consecutive ranks (world 2, ep 2: ranks 0 and 1)
    local = model.moe.deepspeed_moe.experts.deepspeed_experts
    for i, e in enumerate(local):
        torch.manual_seed(seed * 100 + ep_rank * len(local) + i)
        for p in e.parameters():
            nn.init.normal_(p, std=0.3)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    opt = torch.optim.AdamW(groups, lr=STEPS_LR)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert world % ep == 0
    return engine


def moe_train(engine: Any, steps: range) -> list[float]:
    out = []
    for s in steps:
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        loss = engine(torch.randn(4, 6, generator=g))
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def _full_from_fragments(opt: Any, p: torch.Tensor, key: str) -> torch.Tensor:
    """A parameter's fp32 master (``key="fp32"``) or optimizer state, whole, from
    each rank's fragment (DeepSpeed 0.19's ``safe_get_full_optimizer_state``
    finds no state for expert parameters: their fragments are never linked)."""
    gi = next(i for i, g in enumerate(opt.bit16_groups) if any(q is p for q in g))
    flat = opt.single_partition_of_fp32_groups[gi]
    src = (flat if key == "fp32" else opt.optimizer.state[flat][key]).detach()
    full = torch.zeros(p.numel(), dtype=src.dtype)
    m: Any = getattr(p, "_hp_mapping", None)
    if m is not None:  # None: this rank's partition holds none of it
        lp, hp = m.lp_fragment_address, m.hp_fragment_address
        full[lp.start : lp.start + lp.numel] = src[hp.start : hp.start + hp.numel]
    dist.all_reduce(full, group=opt.real_dp_process_group[gi])
    return full.view(p.shape)


def moe_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Model, fp32 masters and moments of this rank's parameters, experts by global index."""
    moe = engine.module.moe
    ep = moe.ep_size
    nl = moe.num_local_experts
    ep_rank = dist.get_rank() % ep
    out: dict[str, torch.Tensor] = {}
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    for n, p in engine.module.named_parameters():
        if n.startswith(prefix):
            local, rest = n[len(prefix):].split(".", 1)
            n = f"{prefix}{ep_rank * nl + int(local)}.{rest}"
        out[f"model.{n}"] = p.detach().clone()
        out[f"master.{n}"] = _full_from_fragments(engine.optimizer, p, "fp32")
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = _full_from_fragments(engine.optimizer, p, k)
    return out


def moe_roundtrip(url: str, ep: int, stage: int) -> dict[str, Any]:
    engine = make_moe_engine(ep, stage, seed=0)
    moe_train(engine, range(2))
    saved = moe_snapshot(engine)
    bytecp.save(url, {"model": engine, "rng": bytecp.RNGState()})  # the gate draws random numbers (RTS)
    uninterrupted = moe_train(engine, range(2, 4))
    other = make_moe_engine(ep, stage, seed=1)
    bytecp.load(url, {"model": other, "rng": bytecp.RNGState()})
    loaded = moe_snapshot(other)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "after": moe_train(other, range(2, 4))}


def moe_load(url: str, ep: int, stage: int) -> dict[str, torch.Tensor]:
    engine = make_moe_engine(ep, stage, seed=3)
    bytecp.load(url, {"model": engine}, exclude=["rng"])
    return moe_snapshot(engine)




# -- AutoTP -----------------------------------------------------------------------------------
def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)


def make_tp_engine(tp: int, stage: int, seed: int, *, bf16: bool = False) -> Any:
    """A transformers Llama trained with AutoTP over ``tp`` ranks, ZeRO ``stage``."""
    setup()
    import deepspeed
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config())
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
        "tensor_parallel": {"autotp_size": tp},
        "optimizer": {"type": "AdamW", "params": {"lr": STEPS_LR, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def tp_train(engine: Any, steps: range) -> list[float]:
    """Every rank of a TP group takes the same batch (the data-parallel rank picks it)."""
    from deepspeed.utils import groups

    dp = groups.get_data_parallel_rank() if dist.get_world_size() > 1 else 0
    out = []
    for s in steps:
        g = torch.Generator().manual_seed(1000 * s + dp)
        ids = torch.randint(0, 128, (2, 9), generator=g)
        loss = engine(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def tp_local(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's shards: model, fp32 master, Adam moments (DeepSpeed's own readers)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, torch.Tensor] = {}
    zero = engine.zero_optimization_stage() > 0
    for n, p in engine.module.named_parameters():
        out[f"model.{n}"] = p.detach().clone()
        out[f"master.{n}"] = (safe_get_full_fp32_param(p) if zero else p.detach()).clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = (safe_get_full_optimizer_state(p, k) if zero else engine.optimizer.state[p][k]).clone()
    return out


def tp_pieces_of(engine: Any) -> dict[str, Any]:
    """name -> (full shape, [(full box, shard box)]) of each AutoTP shard of this rank."""
    from bytecp.adapters.deepspeed.tp import META, pieces, tp_rank

    out = {}
    for n, p in engine.module.named_parameters():
        got = pieces(p, tp_rank(), n) if getattr(p, META, None) else None
        if got is not None:
            out[n] = got
    return out


def check_against_full(local: dict[str, torch.Tensor], parts: dict[str, Any], full: dict[str, Any]) -> list[str]:
    """The keys of this rank's shards that differ from their boxes in the full checkpoint (one process's view)."""
    bad = []
    for key, t in local.items():
        kind, name = key.split(".", 1)
        whole = full["model"][name] if kind == "model" else (
            full["optimizer"]["state"][name]["fp32"] if kind == "master" and "fp32" in
            full["optimizer"]["state"][name] else full["model"][name] if kind == "master"
            else full["optimizer"]["state"][name][kind])
        if name in parts:
            for src, dest in parts[name][1]:
                if not torch.equal(whole[src.slices()].to(t.dtype), t[dest.slices()]):
                    bad.append(key)
        elif not torch.equal(whole.to(t.dtype), t):
            bad.append(key)
    return bad


def tp_roundtrip(url: str, tp: int, stage: int) -> dict[str, Any]:
    engine = make_tp_engine(tp, stage, seed=0)
    tp_train(engine, range(2))
    saved = tp_local(engine)
    bytecp.save(url, {"model": engine})
    uninterrupted = tp_train(engine, range(2, 4))
    other = make_tp_engine(tp, stage, seed=1)
    bytecp.load(url, {"model": other})
    loaded = tp_local(other)
    other.module.eval()  # the logits of the loaded model (the Hugging Face export must give them)
    with torch.no_grad():
        logits = other(input_ids=torch.arange(1, 9).view(1, 8)).logits.detach().clone()
    other.module.train()
    after = tp_train(other, range(2, 4))
    full = bytecp.load_state_dict(url)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "after": after,
            "against_full": check_against_full(saved, tp_pieces_of(engine), full),
            "sharded": sorted(tp_pieces_of(engine)), "logits": logits}


def tp_other_load(url: str, tp: int, stage: int) -> list[str]:
    """Another TP size loads the checkpoint: the keys of this rank's shards that differ from the full tensors."""
    engine = make_tp_engine(tp, stage, seed=4)  # (tp=1: no layer is sharded; the data-parallel size is the world)
    bytecp.load(url, {"model": engine})
    return check_against_full(tp_local(engine), tp_pieces_of(engine), bytecp.load_state_dict(url))


def tp_plain_load(url: str) -> list[str]:
    """One process, a plain transformers Llama and torch AdamW: what differs from the full tensors."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config())
    opt = torch.optim.AdamW(model.parameters(), lr=STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])
    full = bytecp.load_state_dict(url)
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), full["model"][n])]
    for n, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(opt.state[p][k], full["optimizer"]["state"][n][k]):
                bad.append(f"{k}.{n}")
    return bad


def tp_fsdp2_load(url: str) -> list[str]:
    """FSDP2 over 2 ranks (no DeepSpeed): a transformers Llama and torch AdamW load the
    AutoTP checkpoint; what differs from the full tensors (model and Adam moments)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(8)
    model = LlamaForCausalLM(llama_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=STEPS_LR)
    bytecp.load(url, {"model": model, "optimizer": opt}, exclude=["engine"])
    o = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd = get_model_state_dict(model, options=o)
    osd = get_optimizer_state_dict(model, opt, options=o)
    full = bytecp.load_state_dict(url)
    bad = [n for n, v in msd.items() if n in full["model"] and not torch.equal(v, full["model"][n])]
    for n, st in osd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(st[k], full["optimizer"]["state"][n][k]):
                bad.append(f"{k}.{n}")
    return bad + sorted(set(full["model"]) - set(msd))


# ------------------------------------------------------------------ the training data loader's position
class Ids(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is five features equal to ``i``: each batch says which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((5,), float(i))


def curriculum(clusters: str) -> dict[str, Any]:
    """DeepSpeed's curriculum learning over one cluster (every sample; no
    data-analysis files needed): its ``DeepSpeedDataSampler`` draws each
    global batch on rank 0 from the shuffled cluster (written under
    ``clusters``), reshuffling it when used up; 2 epochs."""
    metric = {"index_to_sample_path": "", "index_to_metric_path": "", "difficulty_type": "value",
              "clustering_type": "single_cluster", "min_difficulty": 1, "max_difficulty": 1,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 1}}
    return {"enabled": True, "seed": 1234, "data_sampling": {
        "enabled": True, "num_epochs": 2, "num_workers": 0,
        "curriculum_learning": {"enabled": True, "data_cluster_path": clusters, "curriculum_metrics": {"m": metric}}}}


def make_data_engine(mbs: int, gas: int, n: int = 144, clusters: str | None = None) -> Any:
    """A ZeRO-1 engine built with ``training_data``: DeepSpeed's own loader
    (``DistributedSampler`` over the data-parallel ranks, 2 workers; with
    ``clusters``, the curriculum sampler instead)."""
    setup()
    import deepspeed

    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]  # loader workers
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": 1}, "zero_force_ds_cpu_optimizer": False,
           "optimizer": {"type": "AdamW", "params": {"lr": STEPS_LR, "torch_adam": True}}}
    if clusters is not None:
        cfg["data_efficiency"] = curriculum(clusters)
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg, training_data=Ids(n))
    return engine


F = TypeVar("F", bound=Callable[..., Any])


def forked_loader_workers(fn: F) -> F:
    """``fn`` with its loader workers forked from the rank, as under
    ``torchrun`` (Linux's default). A pool's rank inherits the fork server's
    start method: without this, each ``iter`` of the loader starts a fork
    server of its own, and every worker unpickling the dataset imports torch
    and DeepSpeed anew (5-12 s here, per iteration). The rank's start method
    is restored after."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = multiprocessing.get_start_method(allow_none=True)
        multiprocessing.set_start_method("fork", force=True)
        try:
            return fn(*args, **kwargs)
        finally:
            multiprocessing.set_start_method(was, force=True)

    return run  # type: ignore[return-value]


def train_on(engine: Any, it: Any, steps: int | None = None) -> list[list[int]]:
    """Up to ``steps`` optimizer steps (else to the epoch's end) on batches
    from ``it``; each step's sample ids on this rank."""
    out: list[list[int]] = []
    while steps is None or len(out) < steps:
        ids: list[int] = []
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                x = next(it)
            except StopIteration:
                return out + ([ids] if ids else [])
            ids += [int(v) for v in x[:, 0]]
            engine.backward(engine(x).square().mean())
            engine.step()
        out.append(ids)
    return out


@forked_loader_workers
def ds_data_save(url: str, mbs: int, gas: int, steps: int, epoch: int, clusters: str | None = None,
                 after: int | None = None) -> dict[str, Any]:
    """Train ``steps`` steps of ``epoch``, save ``{"model": engine}``, train
    to the epoch's end (or ``after`` steps more)."""
    engine = make_data_engine(mbs, gas, clusters=clusters)
    if clusters is None:
        engine.training_dataloader.data_sampler.set_epoch(epoch)
    it = iter(engine.training_dataloader)
    before = train_on(engine, it, steps)
    bytecp.save(url, {"model": engine})
    if clusters is not None and dist.get_rank() == 0:  # the cluster files as they stand at the save (below)
        shutil.copytree(clusters, f"{clusters}.saved")
    dist.barrier()
    return {"before": before, "after": train_on(engine, it, after)}


def clusters_as_saved(clusters: str, to: str) -> None:
    """(rank 0) The curriculum's cluster files as they were at the save:
    DeepSpeed keeps them on disk, outside any checkpoint, and rewrites them
    when it reshuffles a cluster (as the saving run does after the save)."""
    if dist.get_rank() == 0:
        shutil.copytree(f"{clusters}.saved", to)
    dist.barrier()


@forked_loader_workers
def ds_data_load(url: str, mbs: int, gas: int, mode: str = "exact", early_iter: bool = False,
                 clusters: str | None = None, after: int | None = None, **kw: Any) -> dict[str, Any]:
    """A fresh engine loads (``early_iter``: its loader's iteration already
    begun) and trains to the epoch's end (or ``after`` steps); or the refusal it got."""
    import logging

    engine = make_data_engine(mbs, gas, clusters=clusters)
    loader = engine.training_dataloader
    it = iter(loader) if early_iter else None
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: logs.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("bytecp").addHandler(handler)
    try:
        bytecp.load(url, {"model": engine}, data_reshard=mode, **kw)
    except bytecp.BytecpError as e:
        return {"error": str(e)}
    finally:
        logging.getLogger("bytecp").removeHandler(handler)
    steps = train_on(engine, it if it is not None else iter(loader), after)
    epoch = getattr(loader.data_sampler, "epoch", None)
    return {"after": steps, "epoch": epoch, "steps": engine.global_steps, "logs": logs}


def ds_engine_save(url: str) -> None:
    """An engine of the same model built without ``training_data`` saves (no loader position)."""
    engine = make_engine(1, seed=0)
    losses(engine, range(2))
    bytecp.save(url, {"model": engine})
