"""``python -m benchmarks.megatron_bench``: bytecp against Megatron-Core's own
``dist_checkpointing`` on the same GPTModel, in one run.

Two gloo ranks (CPU) build a GPTModel at TP=2 with Megatron DDP and the
distributed optimizer, train one step, then alternate the two libraries on:

- save of model + optimizer to durable commit (bytecp: default ``model_space``
  optimizer layout; Megatron: ``torch_dist`` backend with its fully-parallel
  save wrapper, ``fully_reshardable`` optimizer layout -- 0.16's default
  ``fully_sharded_model_space`` fails);
- load at the same layout (Megatron: fully-parallel load wrapper, then
  ``model.load_state_dict`` and ``optimizer.load_state_dict``);
- TP 2 -> 1 resharded load (TP=1, DP=2).

With ``--moe``: a mixture-of-experts GPTModel (4 SequentialMLP experts,
top-2) at EP=2 (Megatron chains a dense and an expert distributed
optimizer), the same save and load, and an EP 2 -> 1 resharded load
(bytecp: model and optimizer; Megatron: the model only -- its optimizer does
not resume across an EP change).

Every time is the slowest rank's, between barriers. The CPU patches Megatron
needs here come from ``tests/megatron/megatron_cases.py`` (benchmark and test
processes only, never the library). Prints a Markdown table; ``--out`` writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ratio_table
from benchmarks.harness import timed_between_barriers as _timed_b
from tests.netport import free_port

ROOT = Path(__file__).resolve().parents[1]


def _paths() -> None:
    for p in (ROOT / "tests", ROOT / "tests" / "megatron"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


# ----------------------------------------------------------------- per rank
def _dp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _megatron_sd(loading: bool, with_optimizer: bool = True) -> dict[str, Any]:
    import megatron_cases as mc

    model_sd = mc._STATE["model"].sharded_state_dict()
    if not with_optimizer:
        return {"model": model_sd}
    with mc.CpuDeviceMode():
        osd = mc._STATE["optimizer"].sharded_state_dict(
            model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )
    return {"model": model_sd, "optimizer": osd}


def megatron_save(path: str) -> float:
    import megatron_cases as mc
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    def run() -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), _dp_group())
        with mc.CpuDeviceMode():
            dist_checkpointing.save(_megatron_sd(False), path, sharded_strategy=strategy)

    return _timed_b(run)


def megatron_load(path: str, with_optimizer: bool = True) -> float:
    import megatron_cases as mc
    from bytecp.adapters.megatron.optimizer_layout import _init_fresh_state, _load_optimizer
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    def run() -> None:
        _init_fresh_state(mc._STATE["optimizer"])
        strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path), _dp_group())
        with mc.CpuDeviceMode():
            loaded = dist_checkpointing.load(_megatron_sd(True, with_optimizer), path, sharded_strategy=strategy)
            mc._STATE["model"].load_state_dict(loaded["model"])
            if not with_optimizer:
                return
            # Megatron 0.16's own optimizer.load_state_dict fails with torch's
            # Adam (KeyError 'step'); the same Megatron calls with step set aside
            _load_optimizer(mc._STATE["optimizer"], loaded["optimizer"])

    return _timed_b(run)


def bytecp_save(path: str) -> float:
    import megatron_cases as mc

    return _timed_b(lambda: mc.save(path, with_optimizer=True))


def bytecp_load(path: str, verify: bool = True) -> float:
    import megatron_cases as mc

    return _timed_b(lambda: mc.load(path, with_optimizer=True, verify=verify))


def build(tp: int, size: dict[str, int], ep: int | None = None) -> float:
    """TP x DP dense, or (``ep`` given) the MoE model at EP; one training step."""
    import megatron_cases as mc
    import moe_cases

    t0 = time.perf_counter()
    if ep is None:
        mc.build(tp, dist_opt=True, **size)
        mc.train_step(1)
    else:
        moe_cases.build(tp, ep, **size)
        moe_cases.train_step(1)
    return time.perf_counter() - t0


def state_bytes() -> int:
    import megatron_cases as mc
    import torch

    n = sum(p.numel() * p.element_size() for p in mc._STATE["model"].parameters())
    opt = mc._STATE["optimizer"]
    for o in getattr(opt, "chained_optimizers", [opt]):
        for st in o.optimizer.state.values():
            n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return n


def rank_main(rank: int, port: int, size: dict[str, int], root: str, out: Any, moe: bool = False) -> None:
    """One rank of the run (a non-daemon process: Megatron's writer starts its own)."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    _paths()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    results: dict[str, float] = {}
    r = Path(root)

    def case(name: str, fn: Any, *a: Any) -> None:
        t = torch.tensor([fn(*a)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[name] = float(t)
        if rank == 0:
            print(f"{name}: {results[name]:.3f} s", flush=True)

    try:
        if moe:
            build(1, size, ep=2)
        else:
            build(2, size)
        n = torch.tensor([state_bytes()])
        dist.all_reduce(n)
        # alternate the libraries; Megatron's first save pays a one-off setup
        case("Megatron save (first)", megatron_save, str(r / "mcore-0"))
        case("bytecp save", bytecp_save, str(r / "bytecp"))
        case("Megatron save", megatron_save, str(r / "mcore"))
        case("bytecp load", bytecp_load, str(r / "bytecp"))
        case("Megatron load", megatron_load, str(r / "mcore"))
        case("bytecp load, verify=False", bytecp_load, str(r / "bytecp"), False)
        if moe:
            build(1, size, ep=1)
            case("bytecp EP 2 -> 1 load", bytecp_load, str(r / "bytecp"))
            case("Megatron EP 2 -> 1 load (model only)", megatron_load, str(r / "mcore"), False)
        else:
            build(1, size)
            case("bytecp TP 2 -> 1 load", bytecp_load, str(r / "bytecp"))
            case("Megatron TP 2 -> 1 load", megatron_load, str(r / "mcore"))
        if rank == 0:
            out.put(("ok", int(n), results))
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megatron_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is abandoned")
    p.add_argument("--moe", action="store_true", help="the mixture-of-experts model at EP=2 (4 experts, top-2)")
    args = p.parse_args(argv)
    import multiprocessing as mp
    import queue

    size = {"hidden": args.hidden, "layers": args.layers, "ffn": args.ffn, "heads": args.heads, "vocab": args.vocab}
    root = Path(tempfile.mkdtemp(prefix="bytecp-megatron-bench-", dir=args.dir))
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, size, str(root), q, args.moe)) for r in range(2)]
    try:
        for pr in procs:
            pr.start()
        try:
            status, nbytes, results = q.get(timeout=args.timeout)
        except queue.Empty:
            print(f"no result within {args.timeout} s", file=sys.stderr)
            return 1
        if status != "ok":
            print(f"rank {nbytes} failed: {results}", file=sys.stderr)
            return 1
    finally:
        for pr in procs:
            pr.join(timeout=60)
            if pr.is_alive():
                pr.kill()
        shutil.rmtree(root, ignore_errors=True)

    load = os.getloadavg()[0]
    what = "MoE GPTModel (4 experts, top-2), 2 ranks (EP=2)" if args.moe else "GPTModel, 2 ranks (TP=2)"
    print(f"\n{what}, hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, vocab {args.vocab}: "
          f"{nbytes / 1e9:.2f} GB of model + optimizer state, one run, "
          f"load average {load:.1f} on {os.cpu_count()} CPUs\n")
    reshard = (("load EP 2 -> 1 (Megatron: model only)", "bytecp EP 2 -> 1 load", "Megatron EP 2 -> 1 load (model only)")
               if args.moe else ("load TP 2 -> 1", "bytecp TP 2 -> 1 load", "Megatron TP 2 -> 1 load"))
    ratio_table("Megatron dist_checkpointing", [
        ("save to durable commit", "bytecp save", "Megatron save"),
        ("load, same layout (bytecp verifies every chunk's crc32c)", "bytecp load", "Megatron load"),
        ("load, same layout, bytecp verify=False", "bytecp load, verify=False", "Megatron load"),
        reshard,
    ], results)
    print(f"\n(Megatron's first save: {results['Megatron save (first)']:.2f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"size": size, "state_bytes": nbytes, "load_average": load, "seconds": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
