"""Functions the worker pools run on every rank: build a model under a
framework, train, save, load, and report full tensors as torch itself sees
them (``get_model_state_dict``/``get_optimizer_state_dict`` with
``full_state_dict=True``), the oracle the tests compare bytecp against."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp


class Net(nn.Module):
    """Shapes that do not divide evenly: a prime vocabulary, a 1-row tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 11)
        self.row = nn.Parameter(torch.randn(1, 11))
        self.l1 = nn.Linear(11, 13)
        self.l2 = nn.Linear(13, 7)
        self.norm = nn.LayerNorm(7)
        self.out = nn.Linear(7, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.row
        x = torch.relu(self.l1(x))
        return self.out(self.norm(self.l2(x)))


def assert_same_state(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    """(test process) Every model and optimizer tensor of ``got`` equals ``ref``'s bitwise."""
    assert set(ref["model"]) == set(got["model"]), what
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), f"{what}: model {k}"
    assert set(ref["optim"]) == set(got["optim"]), f"{what}: optimizer keys"
    for k, v in ref["optim"].items():
        assert torch.equal(v, got["optim"][k]), f"{what}: optimizer {k}"
    assert ref["groups"] == got["groups"], f"{what}: param groups"


def build(framework: str, seed: int = 0, variant: str = "") -> tuple[nn.Module, torch.optim.Optimizer]:
    """``framework`` in ddp, fsdp1, fsdp2, plain; ``variant`` selects options
    (fsdp1: ``orig``/``flat``, ``hybrid``; fsdp2: ``hsdp``)."""
    torch.manual_seed(seed)
    model = Net()
    world = dist.get_world_size()
    if framework == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if variant == "hsdp" and world % 2 == 0:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for m in (model.l1, model.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif framework == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD
        kwargs: dict[str, Any] = {}
        if "hybrid" in variant and world % 2 == 0:
            from torch.distributed.device_mesh import init_device_mesh

            strategy = ShardingStrategy.HYBRID_SHARD
            kwargs["device_mesh"] = init_device_mesh("cpu", (2, world // 2))
        if "grad_op" in variant:
            strategy = ShardingStrategy.SHARD_GRAD_OP
        model = FSDP(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params="flat" not in variant,
            sharding_strategy=strategy,
            **kwargs,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(0, 37, (6, 5), generator=g)
    return x, (x * 7 + 3) % 5


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> list[float]:
    losses = []
    for step in range(start, start + n):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Full model and optimizer state by FQN, as torch reports it (rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    # (cpu_offload=True segfaults for FSDP1 on CPU in this torch; the full
    # state is small here, so every rank gathers it)
    o = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd = get_model_state_dict(model, options=o)
    if _fsdp1_orig(model):
        optim, groups = _fsdp1_orig_optim(model, opt)
    else:
        osd = get_optimizer_state_dict(model, opt, options=o)
        optim = {f"{p}.{k}": v.clone() for p, st in osd["state"].items() for k, v in st.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    if dist.get_rank() != 0:
        return None
    return {"model": {k: v.clone() for k, v in msd.items()}, "optim": optim, "groups": groups}


def _fsdp1_orig(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP) and bool(model._use_orig_params)


def _fsdp1_orig_optim(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[Any]]:
    """Full optimizer state of an FSDP1 use_orig_params model, assembled from
    every rank's 1-D shards (torch's own full optimizer state dict refuses
    models where a rank holds no elements of a parameter, as Adam then keeps
    no state for it there)."""
    import math

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    mine = []
    for prefix, m in model.named_modules():
        if not isinstance(m, FSDP) or m._handle is None:
            continue
        fp = m._handle.flat_param
        base = clean_tensor_name(prefix)
        for i, info in enumerate(fp._shard_param_infos):
            p = fp._params[i]
            if not info.in_shard or p not in opt.state:
                continue
            fqn = clean_tensor_name(f"{base}.{fp._fqns[i]}" if base else fp._fqns[i])
            st = {k: v.clone() for k, v in opt.state[p].items()}
            mine.append((fqn, tuple(fp._shapes[i]), info.intra_param_start_idx, st))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    full: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for lst in every:
        for fqn, shape, start, st in lst:
            for k, v in st.items():
                key = f"{fqn}.{k}"
                if v.dim() == 0:
                    full[key] = v
                    continue
                t = full.setdefault(key, torch.zeros(math.prod(shape), dtype=v.dtype))
                t[start : start + v.numel()] = v
                shapes[key] = shape
    for key, shape in shapes.items():
        full[key] = full[key].reshape(shape)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return full, groups


def save_case(framework: str, url: str, variant: str = "", steps: int = 2) -> dict[str, Any] | None:
    model, opt = build(framework, seed=0, variant=variant)
    train(model, opt, 0, steps)
    state = {"model": model, "optimizer": opt, "extra": {"step": steps}, "rng": bytecp.RNGState()}
    bytecp.save(url, state, step=steps)
    return full_state(model, opt)


def load_case(
    framework: str, url: str, variant: str = "", more_steps: int = 0, pretrain: bool = False
) -> dict[str, Any] | None:
    model, opt = build(framework, seed=123, variant=variant)
    if pretrain:  # the optimizer already holds state: the load fills it in place
        train(model, opt, 50, 1)
    extra: dict[str, Any] = {"step": -1}
    state = {"model": model, "optimizer": opt, "extra": extra, "rng": bytecp.RNGState()}
    bytecp.load(url, state)
    out = full_state(model, opt)
    losses = train(model, opt, extra["step"], more_steps) if more_steps else []
    if out is not None:
        out["step"] = extra["step"]
        out["losses"] = losses
    return out


def continuous_case(framework: str, variant: str = "", steps: int = 2, more_steps: int = 3) -> list[float]:
    model, opt = build(framework, seed=0, variant=variant)
    train(model, opt, 0, steps)
    return train(model, opt, steps, more_steps)


def fixed_loss(model: nn.Module) -> float:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 37, (32, 5), generator=g)
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), ((x * 7 + 3) % 5).flatten())
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def resume_decreases(framework: str, url: str, variant: str = "", more_steps: int = 6) -> tuple[float, float]:
    model, opt = build(framework, seed=123, variant=variant)
    extra: dict[str, Any] = {"step": -1}
    bytecp.load(url, {"model": model, "optimizer": opt, "extra": extra, "rng": bytecp.RNGState()})
    before = fixed_loss(model)
    train(model, opt, extra["step"], more_steps)
    return before, fixed_loss(model)


def failing_save(url: str, fault: str, kind: str = "ERROR") -> tuple[str, float]:
    """Save with a fault injected on one rank; return the error text and seconds to fail."""
    import time

    model, opt = build("fsdp2", seed=0)
    os.environ[f"BYTECP_FAULT_{kind}"] = fault
    t0 = time.perf_counter()
    try:
        bytecp.save(url, {"model": model, "optimizer": opt})
    except bytecp.DistributedCheckpointError as e:
        return str(e), time.perf_counter() - t0
    finally:
        os.environ.pop(f"BYTECP_FAULT_{kind}", None)
    return "no error", time.perf_counter() - t0


def failing_load(url: str, fault: str) -> tuple[str, float]:
    import time

    model, opt = build("fsdp2", seed=5)
    os.environ["BYTECP_FAULT_ERROR"] = fault
    t0 = time.perf_counter()
    try:
        bytecp.load(url, {"model": model, "optimizer": opt}, strict=False)
    except bytecp.DistributedCheckpointError as e:
        return str(e), time.perf_counter() - t0
    finally:
        os.environ.pop("BYTECP_FAULT_ERROR", None)
    return "no error", time.perf_counter() - t0


def mismatched_load(url: str) -> str:
    class Wider(Net):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(11, 17)

    model = nn.parallel.DistributedDataParallel(Wider())
    try:
        bytecp.load(url, {"model": model}, strict=False)
    except bytecp.DistributedCheckpointError as e:
        return str(e)
    return "no error"


def plan_cache_stats(url: str, uneven: bool = False) -> list[tuple[int, int]]:
    """(collectives, bytes sent) of three saves of one model; ``uneven``: each
    rank also holds a tensor the other lacks, so the replica hints of plain
    tensors ("every rank holds it") do not hold and the coordinator plans."""
    from bytecp import dist as bdist
    from bytecp.plan import exchange as plan_exchange

    plan_exchange.PLAN_CACHE.clear()
    model, opt = build("ddp", seed=0)
    train(model, opt, 0, 1)
    out = []
    orig = bdist.DistContext.__init__

    captured: list[Any] = []

    def spy(self: Any, *a: Any, **k: Any) -> None:
        orig(self, *a, **k)
        self.count_bytes = True
        captured.append(self)

    bdist.DistContext.__init__ = spy  # type: ignore[method-assign]
    try:
        for i in range(3):
            captured.clear()
            extra = {f"only{dist.get_rank()}": torch.zeros(3)} if uneven else {}
            bytecp.save(f"{url}-{i}", {"model": model, "optimizer": opt, "extra": extra})
            s = captured[0].stats
            out.append((s.calls, s.bytes_sent))
    finally:
        bdist.DistContext.__init__ = orig  # type: ignore[method-assign]
    return out


def async_case(framework: str, url: str, lazy: bool, variant: str = "") -> dict[str, Any] | None:
    """async_save while training (with its own collectives) goes on; returns
    the full state at the moment of the call."""
    model, opt = build(framework, seed=0, variant=variant)
    train(model, opt, 0, 2)
    ref = full_state(model, opt)
    state = {"model": model, "optimizer": opt, "extra": {"step": 2}, "rng": bytecp.RNGState()}
    h = bytecp.async_save(url, state, lazy=lazy, step=2)
    train(model, opt, 2, 3)
    h.wait(timeout=120)
    return ref


def zero_redundancy_load(framework: str, url: str, zero: bool) -> tuple[dict[str, Any] | None, int, int]:
    """Load with or without zero-redundancy; return the full state (rank 0),
    the bytes this rank read from storage and the bytes it broadcast."""
    from bytecp.recorder import recording

    model, opt = build(framework, seed=123)
    with recording() as reports:
        bytecp.load(url, {"model": model, "optimizer": opt}, strict=False, zero_redundancy=zero)
    (rep,) = [r for r in reports if r.operation == "load"]
    read = sum(s.nbytes for s in rep.spans if s.phase == "read")
    exchanged = sum(s.nbytes for s in rep.spans if s.phase == "exchange")
    return full_state(model, opt), read, exchanged


def uneven_objects(url: str) -> Any:
    """Ranks whose state trees differ: values only some ranks hold are saved too."""
    r = dist.get_rank()
    extra: dict[str, Any] = {"common": 1, f"only{r}": {"value": r, "t": torch.full((3,), float(r))}}
    if r == 1:
        extra["blob"] = (1, 2)
    bytecp.save(url, {"extra": extra})
    dist.barrier()
    return bytecp.load_state_dict(url) if r == 0 else None


def uneven_incremental(run: str) -> Any:
    """Ranks whose trees differ (each holds a tensor only it has), saved
    twice, the second referencing the first: the unchanged tensor of the rank
    whose tree is not the coordinator's is referenced too, not dropped."""
    r = dist.get_rank()
    state = {"extra": {f"only{r}": torch.arange(6.0) + 10 * r, "moving": torch.zeros(4)}}
    bytecp.save(f"{run}/step-1", state, step=1)
    state["extra"]["moving"].add_(1.0)
    md = bytecp.save(f"{run}/step-2", state, step=2, base=f"{run}/step-1")
    dist.barrier()
    return (sorted(md.references), bytecp.load_state_dict(f"{run}/step-2")) if r == 0 else None


def replicated_incremental(run: str) -> Any:
    """A replicated tensor large enough that the ranks split it (each writes
    a box inside the shard it holds), unchanged between two saves, the second
    referencing the first: each rank's box is referenced, not written again."""
    r = dist.get_rank()
    state = {"model": {"big": torch.arange(2 << 20, dtype=torch.float32), "moving": torch.zeros(4)}}
    first = bytecp.save(f"{run}/step-1", state, step=1)
    state["model"]["moving"].add_(1.0)
    md = bytecp.save(f"{run}/step-2", state, step=2, base=f"{run}/step-1")
    dist.barrier()
    if r:
        return None
    own = {f: n for f, n in md.data_files.items() if not f.startswith("../")}
    return sorted(first.data_files.values()), sorted(md.references), own, bytecp.load_state_dict(f"{run}/step-2")


def state_changes_on_one_rank_between_async_saves(url: str) -> list[Any]:
    """Eager async saves of a replicated tensor (split between the ranks);
    from the second save on, rank 1 also holds a tensor of its own, so its
    plan fingerprint changes while rank 0's cached plan (and its snapshot of
    only its share) still holds. Every save must commit and load bitwise."""
    from bytecp.plan import exchange as plan_exchange

    plan_exchange.PLAN_CACHE.clear()
    r = dist.get_rank()
    x = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB: split between the 2 ranks
    state: dict[str, Any] = {"model": {"x": x}, "extra": {}}
    out = []
    for step in range(4):
        if step == 1 and r == 1:
            state["extra"]["y"] = torch.ones(3)
        x.add_(1.0)
        bytecp.async_save(f"{url}-{step}", state).wait()
        dist.barrier()
        if r == 0:
            sd = bytecp.load_state_dict(f"{url}-{step}")
            out.append((torch.equal(sd["model"]["x"], x), sorted(sd["extra"])))
    return out


def rank_local_tensor_moves_between_async_saves(url: str) -> list[Any]:
    """Eager async saves of a 10 MiB tensor every rank holds (split between
    them) while a tensor of one rank's own moves: on rank 0 at the first
    save, rank 1 at the second, nowhere after. The ranks' cached shares then
    come from different earlier plans; every save must still commit and load
    bitwise (never two ranks writing the same rows, never rows nobody copied)."""
    from bytecp.plan import exchange as plan_exchange

    plan_exchange.PLAN_CACHE.clear()
    r = dist.get_rank()
    w = torch.arange(10 * (1 << 18), dtype=torch.float32).reshape(10, 1 << 18)
    out = []
    for step, owner in enumerate([0, 1, None, None, None]):
        state: dict[str, Any] = {"w": w, "extra": {"x": torch.full((1 << 20,), float(step))} if r == owner else {}}
        w.add_(1.0)
        bytecp.async_save(f"{url}-{step}", state).wait()
        dist.barrier()
        if r == 0:
            sd = bytecp.load_state_dict(f"{url}-{step}")
            out.append((torch.equal(sd["w"], w), sorted(sd["extra"])))
    return out


def bad_state_on_one_rank(url: str) -> tuple[str, float]:
    """Rank 1's state is invalid (two entries map to one key): every rank must
    raise at once instead of waiting in a collective."""
    import time

    state: dict[str, Any] = {"a.b": torch.zeros(2), "a": {"b": torch.zeros(2)}} if dist.get_rank() == 1 else {
        "a": {"b": torch.zeros(2)}}
    t0 = time.perf_counter()
    try:
        bytecp.save(url, state)
    except bytecp.DistributedCheckpointError as e:
        return str(e), time.perf_counter() - t0
    return "no error", time.perf_counter() - t0


def cache_on_one_rank_only(url: str) -> list[float]:
    """Rank 0 forgets its cached plans between two saves; both still agree."""
    from bytecp.plan import exchange as plan_exchange

    model, opt = build("fsdp2", seed=0)
    bytecp.save(f"{url}-a", {"model": model, "optimizer": opt})
    if dist.get_rank() == 0:
        plan_exchange.PLAN_CACHE.clear()
    bytecp.save(f"{url}-b", {"model": model, "optimizer": opt})
    return [float(v.to_local().sum()) for v in model.state_dict().values()][:1]


def mixed_dtype_zero_redundancy(url: str) -> bool:
    state = {"a": torch.arange(3, dtype=torch.bfloat16), "b": torch.arange(4, dtype=torch.float32),
             "c": torch.ones(1, dtype=torch.float32), "d": torch.arange(5, dtype=torch.int16)}
    bytecp.save(url, state)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    bytecp.load(url, fresh, zero_redundancy=True)
    return all(torch.equal(fresh[k], state[k]) for k in state)


def fsdp1_ignored_modules(url: str, world_to: int | None = None) -> dict[str, torch.Tensor] | None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0 if world_to is None else 9)
    net = Net()
    model = FSDP(net, device_id=torch.device("cpu"), ignored_modules=[net.out], use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if world_to is None:
        train(model, opt, 0, 2)
        # FSDP leaves ignored modules unsynchronized; like a user wrapping them
        # in DDP, make the replicas agree (bytecp writes replicas once)
        with torch.no_grad():
            for p in net.out.parameters():
                dist.broadcast(p.data, 0)
                for v in opt.state[p].values():
                    dist.broadcast(v, 0)
        bytecp.save(url, {"model": model, "optimizer": opt})
    else:
        bytecp.load(url, {"model": model, "optimizer": opt})
    return {k: v.detach().clone() for k, v in net.out.state_dict().items()} | {
        f"exp_avg.{i}": opt.state[p]["exp_avg"].clone() for i, p in enumerate(net.out.parameters())}


def rank() -> int:
    return dist.get_rank()


def env(name: str) -> str | None:
    return os.environ.get(name)


def replica_checks(url: str) -> dict[str, str]:
    """Saves the generic path must refuse: replicas whose shapes differ, and
    (verify_replicas) replicas whose contents differ; each error text, seen on
    this rank, by case."""
    rank = dist.get_rank()
    out: dict[str, str] = {}

    def attempt(name: str, state: dict[str, Any], **kw: Any) -> None:
        try:
            bytecp.save(f"{url}-{name}", state, **kw)
            out[name] = "saved"
        except bytecp.DistributedCheckpointError as e:
            out[name] = str(e)

    # a tensor-parallel shard taken for a replica: same key, other shape
    attempt("shape", {"model": {"embed": torch.zeros(64 + 64 * rank, 8)}})
    # same shape, other contents (a TP shard of a [128, 8] tensor, or diverged DDP weights)
    attempt("contents", {"model": {"embed": torch.full((64, 8), float(rank))}}, verify_replicas=True)
    def attempt_async(name: str, state: dict[str, Any], **kw: Any) -> None:
        try:
            bytecp.async_save(f"{url}-{name}", state, **kw).wait(timeout=60)
            out[name] = "saved"
        except bytecp.DistributedCheckpointError as e:
            out[name] = str(e)

    model, opt = build("ddp", seed=0)
    train(model, opt, 0, 1)
    # eager async saves sum what they copy: a first save (every held box
    # copied), then one with the plan cached (this rank's share copied, the
    # other boxes summed from the live tensors)
    attempt_async("ddp-async-first", {"model": model, "optimizer": opt}, verify_replicas=True)
    if rank == 1:
        with torch.no_grad():
            model.module.l1.weight.add_(1e-3)  # DDP ranks that diverged
    attempt("ddp", {"model": model, "optimizer": opt}, verify_replicas=True)
    attempt("ddp-unchecked", {"model": model, "optimizer": opt}, verify_replicas=False)
    attempt_async("ddp-async", {"model": model, "optimizer": opt}, verify_replicas=True)
    attempt_async("ddp-async-uncached", {"model": model}, verify_replicas=True)
    attempt_async("ddp-lazy", {"model": model, "optimizer": opt}, verify_replicas=True, lazy=True)
    return out


def saves_follow_changed_tensors(url: str) -> list[dict[str, Any] | None]:
    """FSDP2 saves (eager, then eager and lazy) of states whose tensors
    changed identity (the optimizer's state tensors replaced by
    ``load_state_dict``) or shape (same FQNs, wider layers) since the last
    save: cached DTensor boxes and plans must never describe the old
    tensors. Returns the full state at each call (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    refs = []
    model, opt = build("fsdp2", seed=0)
    train(model, opt, 0, 2)
    refs.append(full_state(model, opt))
    bytecp.async_save(f"{url}-0", {"model": model, "optimizer": opt}).wait(timeout=60)
    opt.load_state_dict(opt.state_dict())  # new state tensors, same values
    train(model, opt, 2, 1)
    refs.append(full_state(model, opt))
    bytecp.async_save(f"{url}-1", {"model": model, "optimizer": opt}).wait(timeout=60)
    torch.manual_seed(1)
    wide = Net()
    wide.l1, wide.l2 = nn.Linear(11, 29), nn.Linear(29, 7)  # same names, other shapes
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in (wide.l1, wide.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(wide, mesh=mesh)
    wopt = torch.optim.AdamW(wide.parameters(), lr=0.01)
    train(wide, wopt, 0, 1)
    refs.append(full_state(wide, wopt))
    bytecp.async_save(f"{url}-2", {"model": wide, "optimizer": wopt}).wait(timeout=60)
    h = bytecp.async_save(f"{url}-3", {"model": wide, "optimizer": wopt}, lazy=True)
    refs.append(full_state(wide, wopt))  # collectives on the training group meanwhile
    train(wide, wopt, 1, 1)
    h.wait(timeout=60)
    return refs
