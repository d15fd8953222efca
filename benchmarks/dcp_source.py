"""A DCP checkpoint loaded by bytecp (``format`` detected, no conversion)
against ``torch.distributed.checkpoint.load`` on the same work.

One run: a GPT-like model (:mod:`benchmarks.model`, 24 blocks of hidden
256, about 280 MB of fp32 parameters and Adam moments, some 1,200 tensors)
is trained one step under FSDP2 on 2 gloo ranks and saved with
``dcp.save(get_state_dict(...))``. Then, alternating the order of the two
libraries every repeat, with the checkpoint's files read once beforehand
(warm page cache):

- **FSDP2 x W** (``--world-sizes``, default 3 and 1; fresh spawned gloo
  groups, model and Adam built and stepped once, outside the timing):
  ``bytecp.load(path, {"model": model, "optim": optim})`` against what DCP's
  documentation shows: ``get_state_dict`` -> ``dcp.load`` ->
  ``set_state_dict``. The figure is the slowest rank's time between two
  barriers (an all-reduce of the maxima).
- **one process, no process group**: ``bytecp.load_state_dict(path)`` (full
  tensors, allocated by bytecp) against ``dcp.load`` into full tensors
  preallocated beforehand from ``.metadata`` (allocation outside DCP's
  timing); and ``bytecp.load`` into a plain module + Adam against
  ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict`` on the same.

Each load is verified: the model's fingerprint equals the saved one.
Reported: medians of ``--repeats`` (default 5), the ratios bytecp / DCP
(below 1: bytecp faster) and a Markdown table.

Run: ``python -m benchmarks.dcp_source [--repeats 5] [--dir PATH] [--out FILE]``;
``--quick`` (a 4-block model of hidden 64, one repeat, FSDP2 x 3 only) is
what ``tests/bench/test_bench_smoke.py`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.netport import free_port as _port

__all__ = ["FULL", "QUICK", "run", "table", "main"]

#: the full run's model: about 280 MB of state
FULL = {"layers": 24, "hidden": 256, "vocab": 8192}
#: ``--quick``: a few MB
QUICK = {"layers": 4, "hidden": 64, "vocab": 512}




def _warm(path: str) -> None:
    """Every file of the checkpoint read once: the page cache holds it."""
    for p in Path(path).iterdir():
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def _timed(cases: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[float], float]) -> dict[str, list[float]]:
    """Each case once per repeat, the order reversed every other repeat; ``sync``
    turns a rank's seconds into the slowest rank's (identity in one process)."""
    times: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(repeats):
        for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
            sync(0.0)
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(sync(time.perf_counter() - t0))
    return times


def _save(rank: int, world: int, port: int, cfg: dict[str, int], path: str, out: Any) -> None:
    """(each rank of the saving group) FSDP2, one Adam step, ``dcp.save``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from benchmarks.model import GPTConfig, build, fingerprint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, optim = build(GPTConfig(**cfg), "fsdp2", seed=0)
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        fp = fingerprint(model, "fsdp2")
        state: Any = osd["state"]
        if rank == 0:
            out.put({"fingerprint": fp, "tensors": len(msd) + sum(len(s) for s in state.values())})
    finally:
        dist.destroy_process_group()


def _load(rank: int, world: int, port: int, cfg: dict[str, int], path: str, repeats: int, out: Any) -> None:
    """(each rank of a loading group) FSDP2 x ``world``: bytecp.load against get/dcp.load/set."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bytecp
    from benchmarks.model import GPTConfig, build, fingerprint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, optim = build(GPTConfig(**cfg), "fsdp2", seed=1)
        prints: dict[str, float] = {}

        def by_bytecp() -> None:
            bytecp.load(path, {"model": model, "optim": optim})
            prints["bytecp"] = fingerprint(model, "fsdp2")

        def by_dcp() -> None:
            msd, osd = get_state_dict(model, optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            prints["dcp"] = fingerprint(model, "fsdp2")

        def slowest(s: float) -> float:
            t = torch.tensor([s], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        if rank == 0:
            _warm(path)
        times = _timed({"bytecp.load": by_bytecp, "dcp.load": by_dcp}, repeats, slowest)
        if rank == 0:
            out.put({"times": times, "fingerprints": prints})
    finally:
        dist.destroy_process_group()


def _one_process(cfg: dict[str, int], path: str, repeats: int) -> dict[str, Any]:
    """No process group: full tensors (bytecp allocates; DCP's preallocated), and a plain module + Adam."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bytecp
    from benchmarks.model import GPTConfig, build, fingerprint

    md = FileSystemReader(path).read_metadata()
    full: dict[str, Any] = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                            for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    model, optim = build(GPTConfig(**cfg), "plain", seed=1)
    prints: dict[str, float] = {}

    def into_module_bytecp() -> None:
        bytecp.load(path, {"model": model, "optim": optim})
        prints["bytecp"] = fingerprint(model, "plain")

    def into_module_dcp() -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        prints["dcp"] = fingerprint(model, "plain")

    _warm(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: assuming one process"
        times = _timed({
            "bytecp.load_state_dict": lambda: bytecp.load_state_dict(path),
            "dcp.load (preallocated)": lambda: dcp.load(full, checkpoint_id=path),
            "bytecp.load (module)": into_module_bytecp,
            "dcp.load + set_state_dict (module)": into_module_dcp,
        }, repeats, lambda s: s)
    return {"times": times, "fingerprints": prints}


def _spawn(fn: Callable[..., None], world: int, *args: Any) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{fn.__name__} x {world}: exit codes {[p.exitcode for p in procs]}")
    got: dict[str, Any] = out.get()
    return got


_PAIRS = {"bytecp.load": "dcp.load", "bytecp.load_state_dict": "dcp.load (preallocated)",
          "bytecp.load (module)": "dcp.load + set_state_dict (module)"}


def run(*, quick: bool = False, repeats: int = 5, world_sizes: tuple[int, ...] = (3, 1),
        workdir: str | None = None) -> dict[str, Any]:
    """(the benchmark's one process) The figures of one run (module docstring)."""
    from benchmarks.model import GPTConfig

    cfg = QUICK if quick else FULL
    base = Path(tempfile.mkdtemp(prefix="bytecp-dcp-source-", dir=workdir))
    try:
        path = str(base / "dcp")
        saved = _spawn(_save, 2, cfg, path)
        size = sum(p.stat().st_size for p in Path(path).iterdir())
        groups = {f"FSDP2 x2 -> FSDP2 x{w}": _spawn(_load, w, cfg, path, repeats) for w in world_sizes}
        groups["FSDP2 x2 -> one process"] = _one_process(cfg, path, repeats)
        report: dict[str, Any] = {"model": cfg, "params": GPTConfig(**cfg).params, "checkpoint_bytes": size,
                                  "tensors": saved["tensors"], "repeats": repeats, "groups": {}}
        for label, g in groups.items():
            med = {n: statistics.median(v) for n, v in g["times"].items()}
            report["groups"][label] = {
                "seconds": {n: round(v, 4) for n, v in med.items()},
                "runs": {n: [round(x, 4) for x in v] for n, v in g["times"].items()},
                "ratios": {f"{b} / {d}": round(med[b] / med[d], 3) for b, d in _PAIRS.items() if b in med},
                "verified": all(fp == saved["fingerprint"] for fp in g["fingerprints"].values()),
            }
        return report
    finally:
        shutil.rmtree(base, ignore_errors=True)


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table: one row per pair of cases."""
    rows = ["| layout | bytecp | s | DCP | s | bytecp / DCP |", "|---|---|---|---|---|---|"]
    for label, g in report["groups"].items():
        for b, d in _PAIRS.items():
            if b in g["seconds"]:
                rows.append(f"| {label} | `{b}` | {g['seconds'][b]:.3f} | `{d}` | {g['seconds'][d]:.3f} | "
                            f"{g['ratios'][f'{b} / {d}']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, one repeat, FSDP2 x3 only")
    ap.add_argument("--repeats", type=int, help="repeats of every case (default 5; 1 with --quick)")
    ap.add_argument("--world-sizes", default="3,1", help="FSDP2 world sizes loading the x2 checkpoint")
    ap.add_argument("--dir", help="where the checkpoint is written (default: the temp directory)")
    ap.add_argument("--out", help="the JSON report")
    args = ap.parse_args(argv)
    sizes = (3,) if args.quick else tuple(int(w) for w in args.world_sizes.split(","))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = run(quick=args.quick, repeats=args.repeats or (1 if args.quick else 5), world_sizes=sizes,
                 workdir=args.dir)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(table(report))


if __name__ == "__main__":
    main()
