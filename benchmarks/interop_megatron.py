"""``python -m benchmarks.interop_megatron``: a Megatron-Core ``torch_dist``
checkpoint loaded TP 2 -> 1 by bytecp as a source (no conversion) against
Megatron's own ``dist_checkpointing.load``, in one run on one machine.

Two gloo ranks (CPU) build a GPTModel at TP=2 with Megatron DDP and the
distributed optimizer, train one step and save model + optimizer with
Megatron's ``dist_checkpointing.save`` (torch_dist backend, fully-parallel
save wrapper, ``fully_reshardable`` optimizer layout:
:func:`benchmarks.megatron_bench.megatron_save`). Then at TP=1 x DP=2,
alternated ``--repeat`` times, each timed between barriers (the slowest
rank's time):

- ``bytecp``: ``bytecp.load(folder, {"model", "optimizer"})``: the
  torch_dist source (:mod:`bytecp.interop.torch_dist`) and the Megatron
  adapter, each rank reading only the boxes it owns;
- ``Megatron``: ``dist_checkpointing.load`` (fully-parallel load wrapper),
  ``model.load_state_dict`` and the optimizer's
  (:func:`benchmarks.megatron_bench.megatron_load`).

After the last run of each, every model and optimizer tensor (full,
gathered) is compared bitwise between the two. Prints the medians, bests
and their ratio; ``--out`` writes JSON. The CPU patches Megatron needs
come from ``tests/megatron/megatron_cases.py`` (benchmark processes only).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import megatron_bench as mb
from benchmarks.harness import timed_between_barriers as _timed_b
from tests.netport import free_port

__all__ = ["torch_dist_tp2_to_tp1", "rank_main", "main"]


def _full() -> dict[str, Any]:
    import megatron_cases as mc

    return {"model": mc.full_model_state(), "optim": mc.full_optimizer_state()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(set(a[p]) == set(b[p]) and all(torch.equal(a[p][k], b[p][k]) for k in a[p]) for p in a)


def rank_main(rank: int, port: int, size: dict[str, int], root: str, repeat: int, out: Any) -> None:
    """One rank of the run (a non-daemon process: Megatron's writer starts its own)."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    mb._paths()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    try:
        import megatron_cases as mc

        path = str(Path(root) / "iter_0000001")
        mb.build(2, size)
        n = torch.tensor([mb.state_bytes()])
        dist.all_reduce(n)
        save_s = mb.megatron_save(path)
        mb.build(1, size)
        times: dict[str, list[float]] = {"bytecp": [], "Megatron": []}
        got: dict[str, Any] = {}
        for _ in range(repeat):
            times["bytecp"].append(_timed_b(lambda: mc.load(path, with_optimizer=True)))
            got["bytecp"] = _full() if len(times["bytecp"]) == repeat else None
            times["Megatron"].append(mb.megatron_load(path))
            got["Megatron"] = _full() if len(times["Megatron"]) == repeat else None
        slowest = {}
        for lib, ts in times.items():
            t = torch.tensor(ts)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[lib] = t.tolist()
        if rank == 0:
            out.put(("ok", int(n), {"save_s": save_s, "seconds": slowest,
                                    "bitwise_equal": _equal(got["bytecp"], got["Megatron"])}))
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def torch_dist_tp2_to_tp1(size: dict[str, int], repeat: int = 3, workdir: str | None = None,
                          timeout: float = 1800) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    import multiprocessing as mp

    root = Path(tempfile.mkdtemp(prefix="bytecp-torch-dist-bench-", dir=workdir))
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, size, str(root), repeat, q)) for r in range(2)]
    try:
        for pr in procs:
            pr.start()
        try:
            status, nbytes, res = q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no result within {timeout} s") from None
        if status != "ok":
            raise RuntimeError(f"rank {nbytes} failed: {res}")
    finally:
        for pr in procs:
            pr.join(timeout=60)
            if pr.is_alive():
                pr.kill()
        shutil.rmtree(root, ignore_errors=True)
    sec = res["seconds"]
    med = {lib: statistics.median(ts) for lib, ts in sec.items()}
    best = {lib: min(ts) for lib, ts in sec.items()}
    return {
        "size": size, "state_bytes": nbytes, "repeat": repeat, "megatron_save_s": round(res["save_s"], 3),
        "load_s": {lib: [round(t, 3) for t in ts] for lib, ts in sec.items()},
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "best_s": {k: round(v, 3) for k, v in best.items()},
        "ratio_median_bytecp_over_megatron": round(med["bytecp"] / med["Megatron"], 3),
        "ratio_best_bytecp_over_megatron": round(best["bytecp"] / best["Megatron"], 3),
        "bitwise_equal": res["bitwise_equal"], "load_average": round(os.getloadavg()[0], 1),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interop_megatron", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is abandoned")
    args = p.parse_args(argv)
    size = {"hidden": args.hidden, "layers": args.layers, "ffn": args.ffn, "heads": args.heads, "vocab": args.vocab}
    try:
        res = torch_dist_tp2_to_tp1(size, args.repeat, args.dir, args.timeout)
    except (TimeoutError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
