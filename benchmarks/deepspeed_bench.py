"""``python -m benchmarks.deepspeed_bench``: bytecp against DeepSpeed's own
checkpointing on the same ZeRO-3 engine, in one run.

Phase 1, two gloo ranks (CPU accelerator): a ZeRO-3 engine over an MLP
(``--hidden``, ``--layers``; fp32, torch AdamW) trains one step, then the two
libraries alternate on a save of model + optimizer to durable commit
(DeepSpeed: ``engine.save_checkpoint``; bytecp: ``bytecp.save(url,
{"model": engine})``) and a load at the same layout
(``engine.load_checkpoint`` / ``bytecp.load``).

Phase 2, a data-parallel change 2 -> 1: DeepSpeed loads at another size
only through Universal Checkpointing, so its time is the offline
``python -m deepspeed.checkpoint.ds_to_universal`` conversion plus the
universal load (``"checkpoint": {"load_universal": true}``) on one
process; bytecp loads the phase-1 checkpoint on that process directly.

Times are the slowest rank's between barriers, warm page cache, one run.
Prints a Markdown table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.harness import ratio_table
from benchmarks.harness import timed_between_barriers as _timed_b
from tests.netport import free_port

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
TAG = "step1"


def _engine(size: dict[str, int], universal: bool) -> Any:
    import deepspeed
    import torch
    from torch import nn

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo needs no shm op
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h = size["hidden"]
    layers: list[nn.Module] = []
    for _ in range(size["layers"]):
        layers += [nn.Linear(h, 4 * h), nn.ReLU(), nn.Linear(4 * h, h)]
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "checkpoint": {"load_universal": universal},
    }
    engine, *_ = deepspeed.initialize(model=nn.Sequential(*layers), config=cfg)
    x = torch.randn(2, h)
    engine.backward(engine(x).sum())
    engine.step()
    return engine


def _state_bytes(engine: Any) -> int:
    """Model + fp32 master + optimizer state over every rank (ZeRO-3: partitions)."""
    import torch
    import torch.distributed as dist

    opt = engine.optimizer
    n = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    n += sum(f.numel() * f.element_size() for f in opt.fp32_partitioned_groups_flat)
    for st in opt.optimizer.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor) and t.dim())
    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t)


def rank_setup(rank: int, world: int, port: int, label: str = "") -> tuple[dict[str, float], Callable[[str, Any], None]]:
    """(a spawned rank) The environment and gloo group of one benchmark rank;
    -> its results and ``case(name, fn)``, which times ``fn`` between barriers
    and records the slowest rank's seconds."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    results: dict[str, float] = {}

    def case(name: str, fn: Any) -> None:
        t = torch.tensor([_timed_b(fn)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[name] = float(t)
        if rank == 0:
            print(f"{label}{name}: {results[name]:.3f} s", flush=True)

    return results, case


def leave(out: Any) -> NoReturn:
    """(each rank, its work done and rank 0's result put on ``out``) Past one
    barrier, the queue flushed, out of the process at once: the native
    shutdown after DeepSpeed's process groups takes 10 s or more here, and
    :func:`_spawn` waits for every rank's exit."""
    import torch.distributed as dist

    dist.barrier()
    out.close()
    out.join_thread()
    os._exit(0)


def rank_main(rank: int, world: int, port: int, size: dict[str, int], root: str, phase: int, out: Any) -> None:
    results, case = rank_setup(rank, world, port)
    import torch.distributed as dist

    import bytecp

    r = Path(root)
    try:
        engine = _engine(size, universal=phase == 2)
        nbytes = _state_bytes(engine)
        if phase == 1:
            # alternate the libraries; each one's first save in a process pays a one-off setup
            case("DeepSpeed save (first)", lambda: engine.save_checkpoint(str(r / "ds0"), tag=TAG))
            case("bytecp save (first)", lambda: bytecp.save(str(r / "bytecp0"), {"model": engine}))
            case("bytecp save", lambda: bytecp.save(str(r / "bytecp"), {"model": engine}))
            case("DeepSpeed save", lambda: engine.save_checkpoint(str(r / "ds"), tag=TAG))
            case("bytecp load", lambda: bytecp.load(str(r / "bytecp"), {"model": engine}))
            case("DeepSpeed load", lambda: engine.load_checkpoint(str(r / "ds"), tag=TAG))
            case("bytecp load, verify=False", lambda: bytecp.load(str(r / "bytecp"), {"model": engine}, verify=False))
        else:
            case("DeepSpeed universal load", lambda: engine.load_checkpoint(str(r / "ds"), tag=TAG + "_universal"))
            case("bytecp DP 2 -> 1 load", lambda: bytecp.load(str(r / "bytecp"), {"model": engine}))
        if rank == 0:
            out.put(("ok", nbytes, results))
        leave(out)
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def _spawn(world: int, size: dict[str, Any], root: Path, phase: int, timeout: float,
           target: Any = None) -> tuple[int, dict[str, float]]:
    """Run ``target`` (default :func:`rank_main`: ``(rank, world, port, size, root,
    phase, queue)``) on ``world`` spawned ranks; rank 0's ``(state bytes, results)``."""
    import multiprocessing as mp
    import queue

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target or rank_main, args=(r, world, port, size, str(root), phase, q))
             for r in range(world)]
    try:
        for pr in procs:
            pr.start()
        try:
            status, nbytes, results = q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"phase {phase}: no result within {timeout} s") from None
        if status != "ok":
            raise RuntimeError(f"phase {phase}: rank {nbytes} failed: {results}")
        return nbytes, results
    finally:
        for pr in procs:
            pr.join(timeout=30)  # DeepSpeed's process groups make the ranks' exit slow here
            if pr.is_alive():
                pr.kill()


def to_universal(src: Path, dst: Path, timeout: float) -> float:
    """DeepSpeed's offline conversion of checkpoint folder ``src`` (``global_step``/tag) to
    a universal one at ``dst``; its seconds. Raises with DeepSpeed's last lines where it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
         "--output_folder", str(dst), "--inject_missing_state", "--num_extract_workers", "1",
         "--num_merge_workers", "1"],
        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode:
        raise RuntimeError(f"ds_to_universal failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.deepspeed_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a phase is abandoned")
    args = p.parse_args(argv)
    size = {"hidden": args.hidden, "layers": args.layers}
    root = Path(tempfile.mkdtemp(prefix="bytecp-deepspeed-bench-", dir=args.dir))
    try:
        nbytes, results = _spawn(2, size, root, 1, args.timeout)
        results["ds_to_universal"] = to_universal(root / "ds" / TAG, root / "ds" / f"{TAG}_universal", args.timeout)
        print(f"ds_to_universal: {results['ds_to_universal']:.3f} s", flush=True)
        _, more = _spawn(1, size, root, 2, args.timeout)
        results.update(more)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["DeepSpeed DP 2 -> 1"] = results["ds_to_universal"] + results["DeepSpeed universal load"]

    load = os.getloadavg()[0]
    print(f"\nZeRO-3 MLP hidden {args.hidden}, {args.layers} blocks: {nbytes / 1e9:.2f} GB of model + fp32 "
          f"master + Adam state over 2 ranks, one run, load average {load:.1f} on {os.cpu_count()} CPUs\n")
    ratio_table("DeepSpeed", [
        ("save to durable commit", "bytecp save", "DeepSpeed save"),
        ("load, same layout (bytecp verifies every chunk's crc32c)", "bytecp load", "DeepSpeed load"),
        ("load, same layout, bytecp verify=False", "bytecp load, verify=False", "DeepSpeed load"),
        ("DP 2 -> 1 (DeepSpeed: ds_to_universal + universal load)", "bytecp DP 2 -> 1 load", "DeepSpeed DP 2 -> 1"),
    ], results)
    print(f"\n(first saves: DeepSpeed {results['DeepSpeed save (first)']:.2f} s, bytecp "
          f"{results['bytecp save (first)']:.2f} s; ds_to_universal alone "
          f"{results['ds_to_universal']:.2f} s, universal load {results['DeepSpeed universal load']:.2f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"size": size, "state_bytes": nbytes, "load_average": load, "seconds": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
