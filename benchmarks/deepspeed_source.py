"""``python -m benchmarks.deepspeed_source``: DeepSpeed's own checkpoints
loaded by bytecp as a source, against DeepSpeed's own loaders on the same
work, in one run on one machine.

Phase 1, two gloo ranks (CPU accelerator): an MLP (``hidden``, ``layers``
blocks of ``Linear(h, 4h), ReLU, Linear(4h, h)``; fp32, torch AdamW) trains
one step at ZeRO-3 and at ZeRO-2; ``engine.save_checkpoint`` writes each.
``ds_to_universal`` converts both (timed: it is part of DeepSpeed's path).

Phase 2, one process, no torch.distributed, the ZeRO-3 checkpoint, both
libraries imported and the files in the page cache (the target module and
optimizer made outside the timer):

- the fp32 masters: ``load_state_dict(url, exclude=["optimizer", "engine"])``
  against ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``: the
  same work; ``load_state_dict`` of every tensor (masters, Adam moments and
  step: three times the bytes) is reported beside it;
- the model only into an ``nn.Sequential`` (``bytecp.load`` with
  ``exclude=["optimizer", "engine"]``) against ``zero_to_fp32`` plus the
  module's ``load_state_dict``;
- the model and a torch ``AdamW``'s state (``bytecp.load`` of
  ``{"model", "optimizer"}``) against ``ds_to_universal`` plus the universal
  load into a one-rank engine (phase 3): DeepSpeed's only way to the moments
  outside the saving layout;
- a fresh interpreter that imports its library and writes the masters with
  ``torch.save`` (the ``zero_to_fp32`` script's job), each way, both
  byte-compiled (a first run untimed; not with ``--quick``).

Phase 3, one rank: a ZeRO-3 engine loads the ZeRO-3 checkpoint of two
(``bytecp.load``) and the universal folder (``engine.load_checkpoint`` with
``load_universal``; DeepSpeed 0.19.8 finds no model-states file when a
ZeRO-1 or 2 engine loads a ZeRO-3 one's universal folder, nor when a ZeRO-3
engine loads a ZeRO-1 or 2 one's: bytecp loads both). Phase 4, two ranks: a
ZeRO-1 engine loads the ZeRO-2 checkpoint, the same two ways (another
stage). Each library's first load into its engine is a warm-up, untimed.

Every bytecp load is checked bitwise against DeepSpeed's (phase 2: the
``zero_to_fp32`` masters and bytecp's own full read; phases 3 and 4: the
engines' full masters and moments). Phase 2 reports the median of
``--repeat`` runs, the cases alternated every repeat; phases 3 and 4 one run between barriers, the slowest
rank. Prints a Markdown table; ``--out`` writes JSON.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.deepspeed_bench import ENV, _spawn, leave, rank_setup, to_universal
from benchmarks.harness import ratio_table

__all__ = ["TAG", "QUICK", "FULL", "ROWS", "make_module", "write_rank", "engine_rank", "one_process", "fresh_process",
           "run", "report", "main"]

TAG = "global_step1"
#: the smoke test's size (about 1.5 MB of state) and the reported one (about 300 MB)
QUICK = {"hidden": 64, "layers": 2}
FULL = {"hidden": 1024, "layers": 3}


def make_module(size: dict[str, int]) -> Any:
    """The benchmark's MLP, seed 0."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    h = size["hidden"]
    layers: list[nn.Module] = []
    for _ in range(size["layers"]):
        layers += [nn.Linear(h, 4 * h), nn.ReLU(), nn.Linear(4 * h, h)]
    return nn.Sequential(*layers)


def _engine(size: dict[str, int], stage: int, universal: bool = False) -> Any:
    import deepspeed

    comm: Any = importlib.import_module("deepspeed.comm.torch")
    comm.build_shm_op = lambda: None  # gloo needs no shm op
    deepspeed.init_distributed(dist_backend="gloo")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "checkpoint": {"load_universal": universal},
    }
    engine, *_ = deepspeed.initialize(model=make_module(size), config=cfg)
    return engine


def _full_state(engine: Any) -> dict[str, Any]:
    """(every rank) The engine's full fp32 masters and Adam moments, by parameter name."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                     safe_get_full_optimizer_state(p, "exp_avg_sq"))
    return out


def write_rank(rank: int, world: int, port: int, size: dict[str, Any], root: str, phase: int, out: Any) -> None:
    """(phase 1, each of 2 ranks) Train one step at ZeRO-3 and ZeRO-2; save each with DeepSpeed."""
    _, _case = rank_setup(rank, world, port)
    import torch
    import torch.distributed as dist

    try:
        nbytes = 0
        for stage in (3, 2):
            engine = _engine(size, stage)
            x = torch.randn(2, size["hidden"], generator=torch.Generator().manual_seed(rank))
            engine.backward(engine(x).square().mean())
            engine.step()
            engine.save_checkpoint(str(Path(root) / f"z{stage}"), tag=TAG)
            nbytes = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()) * 12
            del engine
        if rank == 0:
            out.put(("ok", nbytes, {}))
        leave(out)
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def engine_rank(rank: int, world: int, port: int, size: dict[str, Any], root: str, phase: int, out: Any) -> None:
    """(phase 3 on one rank: the ZeRO-3 checkpoint of 2 ranks; phase 4 on two: ZeRO-2 into ZeRO-1)
    bytecp against ``engine.load_checkpoint`` of the universal folder, each into a fresh
    engine, compared bitwise."""
    results, case = rank_setup(rank, world, port, label=f"phase {phase}: ")
    import torch
    import torch.distributed as dist

    import bytecp

    src, stage = ("z3", 3) if phase == 3 else ("z2", 1)
    r = Path(root) / src
    try:
        ds = _engine(size, stage, universal=True)
        ds.load_checkpoint(str(r), tag=TAG + "_universal")  # each library's first load warms it up, untimed
        case("DeepSpeed universal load", lambda: ds.load_checkpoint(str(r), tag=TAG + "_universal"))
        want = _full_state(ds)
        engine = _engine(size, stage)
        bytecp.load(str(r / TAG), {"model": engine})
        case("bytecp load", lambda: bytecp.load(str(r / TAG), {"model": engine}))
        got = _full_state(engine)
        same = all(torch.equal(a, b) for n in want for a, b in zip(want[n], got[n], strict=True))
        results["bitwise"] = float(same)
        if rank == 0:
            out.put(("ok", 0, results))
        leave(out)
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def _alternated(cases: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]],
                repeat: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Each case ``name: (fn, make)`` run ``repeat`` times, the cases alternated
    every repeat; ``fn(make())`` timed without ``make``. The median seconds and
    the last target of each case."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    last: dict[str, Any] = {}
    for _ in range(repeat):
        for name, (fn, make) in cases.items():
            target = make()
            t0 = time.perf_counter()
            fn(target)
            times[name].append(time.perf_counter() - t0)
            last[name] = target
    return {name: statistics.median(v) for name, v in times.items()}, last


def one_process(root: Path, size: dict[str, int], repeat: int) -> dict[str, float]:
    """(phase 2, this process) The ZeRO-3 checkpoint into one process, bytecp against zero_to_fp32."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import bytecp

    url = str(root / "z3" / TAG)
    res: dict[str, float] = {}
    got: dict[str, Any] = {}

    def z2fp32(_: Any = None) -> Any:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per step of its work
            got["masters"] = get_fp32_state_dict_from_zero_checkpoint(str(root / "z3"), tag=TAG)

    def adamw() -> tuple[Any, Any]:
        model = make_module(size)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def nothing() -> None:
        return None

    for _ in range(2):  # both libraries imported and their files in the page cache before timing
        z2fp32()
        bytecp.load_state_dict(url)
    res, last = _alternated({
        "zero_to_fp32": (z2fp32, nothing),
        "bytecp load_state_dict, masters": (
            lambda _: got.update(masters_sd=bytecp.load_state_dict(url, exclude=["optimizer", "engine"])), nothing),
        "bytecp load_state_dict": (lambda _: got.update(sd=bytecp.load_state_dict(url)), nothing),
        "zero_to_fp32 into the module": (lambda m: m.load_state_dict(z2fp32() or got["masters"]),
                                         lambda: make_module(size)),
        "bytecp.load model": (lambda m: bytecp.load(url, {"model": m}, exclude=["optimizer", "engine"]),
                              lambda: make_module(size)),
        "bytecp.load model + AdamW": (
            lambda t: bytecp.load(url, {"model": t[0], "optimizer": t[1]}, exclude=["engine"]), adamw),
    }, repeat)
    model, (model2, opt) = last["bytecp.load model"], last["bytecp.load model + AdamW"]
    masters, sd = got["masters"], got["sd"]
    same = all(torch.equal(sd["model"][k], v) and torch.equal(got["masters_sd"]["model"][k], v)
               for k, v in masters.items())
    same &= all(torch.equal(model.state_dict()[k], v) and torch.equal(model2.state_dict()[k], v)
                for k, v in masters.items())
    moments = opt.state_dict()["state"]
    same &= len(moments) == len(masters) and all(
        torch.equal(moments[i]["exp_avg"], sd["optimizer"]["state"][k]["exp_avg"]) for i, k in enumerate(masters))
    res["bitwise"] = float(same)
    return res


#: (a fresh interpreter) argv: library, checkpoint root, tag, module size, output file
FRESH = """
import sys, json, torch
lib, root, tag, size, out = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
if lib == "bytecp":
    import bytecp
    sd = bytecp.load_state_dict(f"{root}/{tag}", exclude=["optimizer", "engine"])["model"]
else:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sd = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
torch.save(sd, out)
"""


def fresh_process(root: Path, size: dict[str, int], repeat: int, compile_first: bool = True) -> dict[str, float]:
    """(phase 2) Seconds of a fresh interpreter writing the ZeRO-3 masters with
    each library (imports included), the median of ``repeat``; checked equal.
    ``compile_first``: an untimed first run per library byte-compiles it (the
    smoke test's ``--quick`` skips it: it reports every field, it measures nothing)."""
    import json
    import subprocess
    import sys

    import torch

    res: dict[str, float] = {}
    # as an installed package would: byte-compiled once (this checkout may run with PYTHONDONTWRITEBYTECODE)
    env = {**os.environ, **ENV, "PYTHONPYCACHEPREFIX": str(root / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for lib in ("zero_to_fp32", "bytecp"):
        times = []
        for i in range(-1 if compile_first else 0, repeat):  # run -1 compiles, untimed
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", FRESH, lib, str(root / "z3"), TAG, json.dumps(size),
                            str(root / f"{lib}-{i}.pt")], check=True, capture_output=True, timeout=600, env=env)
            times += [time.perf_counter() - t0] if i >= 0 else []
        res[f"fresh process, {lib}"] = statistics.median(times)
    a, b = torch.load(root / "zero_to_fp32-0.pt"), torch.load(root / "bytecp-0.pt")
    res["bitwise fresh"] = float(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))
    return res


def run(size: dict[str, int], *, repeat: int = 3, workdir: str | None = None,
        timeout: float = 1800, compile_first: bool = True) -> dict[str, Any]:
    """Every phase (module docstring); the seconds by case, the state's bytes and the bitwise checks
    (``compile_first``: :func:`fresh_process`'s)."""
    os.environ.update(ENV)
    root = Path(tempfile.mkdtemp(prefix="bytecp-ds-source-", dir=workdir))
    try:
        nbytes, _ = _spawn(2, size, root, 1, timeout, target=write_rank)
        secs: dict[str, float] = {}
        for z in ("z3", "z2"):
            secs[f"ds_to_universal {z}"] = to_universal(root / z / TAG, root / z / f"{TAG}_universal", timeout)
        secs.update(one_process(root, size, repeat))
        secs.update(fresh_process(root, size, repeat, compile_first))
        _, three = _spawn(1, size, root, 3, timeout, target=engine_rank)
        _, four = _spawn(2, size, root, 4, timeout, target=engine_rank)
        files = {z: sum(p.stat().st_size for p in (root / z / TAG).iterdir()) for z in ("z3", "z2")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    secs.update({f"{k} (z3 -> ZeRO-3 x1)": v for k, v in three.items()})
    secs.update({f"{k} (z2 -> ZeRO-1 x2)": v for k, v in four.items()})
    secs["DeepSpeed z3 -> ZeRO-3 x1"] = secs["ds_to_universal z3"] + secs["DeepSpeed universal load (z3 -> ZeRO-3 x1)"]
    secs["DeepSpeed z2 -> ZeRO-1 x2"] = secs["ds_to_universal z2"] + secs["DeepSpeed universal load (z2 -> ZeRO-1 x2)"]
    return {"size": size, "state_bytes": nbytes, "file_bytes": files, "seconds": secs,
            "bitwise": all(secs[k] == 1.0 for k in secs if k.startswith("bitwise")),
            "load_average": os.getloadavg()[0]}


#: (label, bytecp's key, DeepSpeed's key) of the printed table
ROWS = [
    ("ZeRO-3 -> one process, fp32 masters: load_state_dict / zero_to_fp32", "bytecp load_state_dict, masters",
     "zero_to_fp32"),
    ("ZeRO-3 -> nn.Sequential, model only: bytecp.load / zero_to_fp32 + load_state_dict", "bytecp.load model",
     "zero_to_fp32 into the module"),
    ("ZeRO-3 -> fresh interpreter writing the masters (imports included)", "fresh process, bytecp",
     "fresh process, zero_to_fp32"),
    ("ZeRO-3 -> nn.Sequential + torch AdamW / ds_to_universal + universal load (1 rank)",
     "bytecp.load model + AdamW", "DeepSpeed z3 -> ZeRO-3 x1"),
    ("ZeRO-3 x2 -> ZeRO-3 engine x1 / ds_to_universal + universal load", "bytecp load (z3 -> ZeRO-3 x1)",
     "DeepSpeed z3 -> ZeRO-3 x1"),
    ("ZeRO-2 x2 -> ZeRO-1 engine x2 / ds_to_universal + universal load", "bytecp load (z2 -> ZeRO-1 x2)",
     "DeepSpeed z2 -> ZeRO-1 x2"),
    ("ZeRO-2 x2 -> ZeRO-1 engine x2 / the universal load alone (conversion done)", "bytecp load (z2 -> ZeRO-1 x2)",
     "DeepSpeed universal load (z2 -> ZeRO-1 x2)"),
]


def report(got: dict[str, Any]) -> None:
    """Print the Markdown table of one :func:`run`."""
    s, secs = got["size"], got["seconds"]
    print(f"\nMLP hidden {s['hidden']}, {s['layers']} blocks: {got['state_bytes'] / 1e6:.0f} MB of fp32 model + "
          f"Adam state ({got['file_bytes']['z3'] / 1e6:.0f} MB of ZeRO-3 files), load average "
          f"{got['load_average']:.1f} on {os.cpu_count()} CPUs; every load bitwise: {got['bitwise']}\n")
    ratio_table("DeepSpeed", ROWS, secs)
    print(f"\n(load_state_dict of every tensor, 3x the masters' bytes: {secs['bytecp load_state_dict']:.3f} s; "
          f"ds_to_universal alone: ZeRO-3 {secs['ds_to_universal z3']:.2f} s, ZeRO-2 {secs['ds_to_universal z2']:.2f} s)")


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.deepspeed_source [--quick] [--repeat N] [--dir D] [--out F]``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.deepspeed_source", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (the smoke test)")
    p.add_argument("--hidden", type=int, default=FULL["hidden"])
    p.add_argument("--layers", type=int, default=FULL["layers"])
    p.add_argument("--repeat", type=int, default=9, help="runs of each phase-2 case (the median is reported)")
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    args = p.parse_args(argv)
    size = QUICK if args.quick else {"hidden": args.hidden, "layers": args.layers}
    got = run(size, repeat=1 if args.quick else args.repeat, workdir=args.dir, compile_first=not args.quick)
    report(got)
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
