"""What one ``bytecp.async_save(..., lazy=True)`` call costs the training
thread, against the copy floor.

    python -m benchmarks.lazy_call [--mb 45] [--layers L | --moe N] [--saves 40] [--json out.json]

One process, local disk, a small GPT (benchmarks/model.py, plain, Adam state)
of about ``--mb`` MB of tensors (``--layers``: that many blocks, 48 tensors
each with Adam's, the hidden size still sized by ``--mb``), or with
``--moe N`` a MoE-like GPT of about N small tensors (benchmarks/moe_model.py:
64 experts a block; ``--mb`` unused), prewarmed (:func:`bytecp.prewarm`). Each
round is what a training loop does: the save call (timed: ``lazy call``),
one forward/backward and ``optimizer.step()`` (which waits in bytecp's
pre-step hook until the background copy is done: ``hook wait``), then
``handle.wait()`` so the next round starts with no save in flight. The
same rounds through ``CheckpointManager(async_save=True, lazy=True)``
(``maybe_save``, incremental against the previous step, retention) give the
manager's lazy call, and with ``lazy=False`` the eager call (the copy
included) for reference, rounds with no save at all, and rounds that make
the floor's copy (below) in the call's place. Rounds take the kinds in
turn, so load on a shared machine hits them alike. Each mode's
``training_step`` is the forward/backward and ``optimizer.step()`` right
after the call, while the save's background part runs beside it: against
the rounds with no save, what the background costs the training thread (a
cyclic collection the background sets off holds the GIL: with tens of
thousands of tensors, one over the whole heap stopped training for 0.25-0.3
s a save until the background ran with the heap frozen).

The floor is the copy itself: the same tensors' bytes copied into a
prewarmed host buffer with one ``torch._foreach_copy_`` (one thread, as a
lazy save's background copy; and with torch's intra-op threads, as an eager
one), twice: back to back after the rounds (``floor_ms_*``: source and
buffer stay in the CPU's caches), and in rounds of its own in the call's
place (``floor_in_loop_*``: right after a training step, which leaves the
caches full of other bytes and the training thread's OpenMP workers
spinning for milliseconds; each after a round whose save wrote in the
background, as the eager round's is), the one the eager call is read
against (``eager_call_vs_floor_in_loop_*``). A lazy call does not copy at
all, so the floor is the scale it is read against: the call costs what
describing the state, hooking the optimizers and starting the background
thread cost.

Figures: minimum, median and 10th/90th percentiles over the ``--saves``
rounds of each mode after its ``--warmup`` rounds, in milliseconds: the wall time of the call, the CPU time
the training thread spent in it (``time.thread_time``; steadier than the
wall time on a loaded machine, but blind to waiting for the GIL), and the
number of cyclic garbage collections the training thread ran inside the
timed calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import bytecp
from benchmarks import moe_model
from benchmarks.model import GPTConfig, config_for_gb, forward_backward, state_bytes
from benchmarks.model import build as build_model

__all__ = ["main", "run"]


class _GcCounter:
    """Collections the training thread runs while ``active`` (gc callbacks run on the collecting thread)."""

    def __init__(self) -> None:
        self.active = False
        self.count = 0
        self.thread = threading.get_ident()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and self.active and threading.get_ident() == self.thread:
            self.count += 1


def _tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach() for t in model.state_dict().values()]
    out += [v for st in optim.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _floor_buffer(src: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of one prewarmed host buffer holding ``src``'s bytes, shaped as ``src``."""
    total = sum(t.numel() * t.element_size() for t in src)
    buf = torch.zeros(total, dtype=torch.uint8)
    dst, pos = [], 0
    for t in src:
        n = t.numel() * t.element_size()
        dst.append(buf[pos:pos + n].view(t.dtype).view(t.shape))
        pos += n
    return dst


def _floor_copy(dst: list[torch.Tensor], src: list[torch.Tensor], threads: int) -> float:
    """Seconds of one foreach copy of ``src`` into ``dst`` on ``threads`` of torch's threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)


def floor_ms(src: list[torch.Tensor], threads: int, repeats: int = 30) -> float:
    """Median ms to copy ``src`` into a prewarmed buffer of the same bytes
    with one foreach copy, copies back to back (the hot-loop floor: source
    and buffer stay in the CPU's caches between copies)."""
    dst = _floor_buffer(src)
    return statistics.median(_floor_copy(dst, src, threads) for _ in range(repeats)) * 1e3


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10) if len(xs) >= 10 else [xs[0]] * 9
    return {"min_ms": xs[0] * 1e3, "median_ms": statistics.median(xs) * 1e3, "p10_ms": q[0] * 1e3,
            "p90_ms": q[-1] * 1e3}


def _model(mb: float, layers: int | None, moe: int | None) -> tuple[Any, Any, Any, Callable[[int], None]]:
    """(config, model, optimizer, one forward/backward by seed) of the shape asked for."""
    if moe is not None:
        mcfg = moe_model.config_for_tensors(moe)
        mmodel, moptim = moe_model.build(mcfg)
        return mcfg, mmodel, moptim, lambda seed: moe_model.forward_backward(mmodel, mcfg, seed=seed)
    cfg = config_for_gb(mb / 1000)
    if layers is not None:
        scale = cfg.layers / layers  # the same bytes in more (or fewer) blocks
        cfg = GPTConfig(layers=layers, hidden=max(64, round(cfg.hidden * scale ** 0.5 / 64) * 64), vocab=cfg.vocab)
    model, optim = build_model(cfg, "plain")
    return cfg, model, optim, lambda seed: forward_backward(model, cfg, seed=seed)


def run(mb: float, saves: int, root: str, layers: int | None = None, moe: int | None = None,
        warmup: int = 3) -> dict[str, Any]:
    cfg, model, optim, step = _model(mb, layers, moe)
    state = {"model": model, "optim": optim}
    src = _tensors(model, optim)
    prewarm_s = bytecp.prewarm(state)
    counter = _GcCounter()
    gc.callbacks.append(counter)
    threads = torch.get_num_threads()
    # the copy alone, timed where the call is; each floor round after an (unrecorded) round of the manager's
    # lazy save, as the eager round is: its background write leaves the caches as it leaves them for the call.
    # The four kinds before keep their predecessors (lazy after no save, the manager after lazy, ...)
    floors = tuple(f"floor {t}" for t in sorted({1, threads}))
    again = "manager lazy, unrecorded"
    modes = ("lazy", "manager lazy", "eager", "none", *(m for f in floors for m in (again, f)))
    floor_dst = _floor_buffer(src)
    calls: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    steps: dict[str, list[float]] = {m: [] for m in modes}
    mgr = bytecp.CheckpointManager(f"{root}/run", every_n_steps=1, keep_last=2, async_save=True, lazy=True)
    hook: list[float] = []
    collections = {m: 0 for m in modes}
    try:
        for i in range(len(modes) * (warmup + saves)):
            mode = modes[i % len(modes)]
            seen = counter.count
            counter.active = True
            c0, t0 = time.thread_time(), time.perf_counter()
            if mode in ("manager lazy", again):
                mgr.maybe_save(i, state)
            elif mode in floors:
                copied = _floor_copy(floor_dst, src, int(mode.split()[1]))
            elif mode != "none":
                h = bytecp.async_save(f"{root}/{mode}-{i % 4}", state, lazy=mode == "lazy", overwrite=True, step=i)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if mode in floors:
                dt = copied  # (without setting torch's threads around it)
            counter.active = False
            t_step = time.perf_counter()
            step(i)
            t1 = time.perf_counter()
            optim.step()  # a lazy save's hook waits here for the copy
            step_s = time.perf_counter() - t1
            train_s = time.perf_counter() - t_step
            optim.zero_grad(set_to_none=True)
            if mode in ("manager lazy", again):
                mgr.wait()
            elif mode != "none" and mode not in floors:
                h.wait()
            if i >= warmup * len(modes) and mode != again:  # the first rounds warm caches up
                calls[mode].append(dt)
                cpu[mode].append(dc)
                steps[mode].append(train_s)
                collections[mode] += counter.count - seen
                if mode == "lazy":
                    hook.append(step_s)
    finally:
        gc.callbacks.remove(counter)
    n = len(calls["lazy"])
    named = {m.replace(" ", "_"): m for m in ("lazy", "manager lazy", "eager")}
    in_loop = {int(f.split()[1]): statistics.median(calls[f]) for f in floors}
    eager = statistics.median(calls["eager"])
    return {
        "model": dataclasses.asdict(cfg),
        "state_mb": state_bytes(model, optim) / 1e6,
        "tensors": len(src),
        "prewarm_s": prewarm_s,
        "saves_each": n,
        **{f"{k}_call": _summary(calls[m]) for k, m in named.items()},
        **{f"{k}_call_thread_cpu": _summary(cpu[m]) for k, m in named.items()},
        "lazy_step_with_hook": _summary(hook),
        # forward/backward + optimizer.step() right after the call, the save's background beside it
        # (the training thread's time: a collection the background sets off holds the GIL), and with no save
        **{f"{k}_training_step": _summary(steps[m]) for k, m in {**named, "no_save": "none"}.items()},
        "gc_per_call": {k: collections[m] / max(1, len(calls[m])) for k, m in named.items()},
        "floor_ms_1_thread": floor_ms(src, 1),
        f"floor_ms_{threads}_threads": floor_ms(src, threads),
        # the same copy at the call's place in a round (after the last round's step): the floor of the eager call
        **{f"floor_in_loop_{t}_thread{'s' if t > 1 else ''}": _summary(calls[f"floor {t}"]) for t in in_loop},
        **{f"eager_call_vs_floor_in_loop_{t}_thread{'s' if t > 1 else ''}": eager / v for t, v in in_loop.items()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=45.0, help="state size (parameters + Adam state), MB")
    ap.add_argument("--layers", type=int, default=None, help="GPT blocks (48 tensors each with Adam's)")
    ap.add_argument("--moe", type=int, default=None, metavar="N", help="a MoE-like GPT of about N tensors instead")
    ap.add_argument("--saves", type=int, default=40, help="saves of each mode, measured")
    ap.add_argument("--warmup", type=int, default=3, help="saves of each mode first, not measured")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        out = run(args.mb, args.saves, root, layers=args.layers, moe=args.moe, warmup=args.warmup)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
