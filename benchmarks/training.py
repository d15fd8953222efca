"""What a checkpoint costs training, end to end (``python -m benchmarks.training``).

FSDP2 on W gloo ranks trains a stack of Linear+GELU blocks; every
``--every`` steps it checkpoints, and the last checkpoint is waited for
before the clock stops. Modes, alternated round by round in the same
processes (medians of the rounds):

- ``none``: no checkpoint (the baseline);
- ``dcp``: DCP's best practice: ``dcp.async_save`` with one reused
  ``DefaultStager`` and its own gloo group, the previous save waited for
  before the next;
- ``bytecp eager``: ``bytecp.async_save``;
- ``bytecp lazy``: ``bytecp.async_save(lazy=True)``.

Reported: the added training time per checkpoint, ``(T_mode - T_none) /
checkpoints``, the blocking time of the call, and per step the wall time
(so a picture shows where the checkpoint's cost lands). The floor on a
machine is the rank's bytes copied once (``--floor`` measures the copy
bandwidth into a reused buffer) plus their crc32c.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

MODES = ["none", "dcp", "bytecp eager", "bytecp lazy"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import bytecp

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    dim = args["dim"]
    model = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(args["blocks"])))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args["batch"], dim, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    ckpt_pg = dist.new_group(backend="gloo")
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    root = args["dir"]

    def checkpoint(mode: str, path: str) -> tuple[Any, float]:
        """Start one checkpoint; -> (what to wait for, seconds the call blocked)."""
        t0 = time.perf_counter()
        if mode == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, opt)
            resp = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=ckpt_pg,
                                  async_stager=stager)
            staged = getattr(resp, "staging_completion", None)
            if staged is not None:
                staged.result()
            waiter: Any = getattr(resp, "upload_completion", resp)
        else:
            waiter = bytecp.async_save(path, {"model": model, "optim": opt}, lazy=mode == "bytecp lazy")
        return waiter, time.perf_counter() - t0

    def wait(waiter: Any) -> None:
        if waiter is None:
            return
        (waiter.result if hasattr(waiter, "result") and not hasattr(waiter, "wait") else waiter.wait)()

    results: list[dict[str, Any]] = []
    for rnd in range(args["rounds"]):
        order = MODES[rnd % len(MODES):] + MODES[: rnd % len(MODES)]
        for mode in order:
            dist.barrier()
            pending, blocking, step_times = None, [], []
            t_start = time.perf_counter()
            for s in range(args["steps"]):
                t0 = time.perf_counter()
                step()
                if mode != "none" and (s + 1) % args["every"] == 0:
                    wait(pending)  # one save in flight, as a training loop does
                    path = os.path.join(root, f"r{rnd}-{mode.replace(' ', '-')}-s{s}")
                    pending, b = checkpoint(mode, path)
                    blocking.append(b)
                step_times.append(time.perf_counter() - t0)
            wait(pending)
            total = time.perf_counter() - t_start
            t = torch.tensor([total])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results.append({"round": rnd, "mode": mode, "total_s": float(t), "blocking_s": blocking,
                            "step_s": step_times})
            dist.barrier()
            if rank == 0:
                import shutil

                for name in os.listdir(root):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _floor(nbytes: int) -> dict[str, float]:
    """Seconds to copy ``nbytes`` into a reused buffer, and to crc32c them, here."""
    import crc32c
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    copy_s = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    crc32c.crc32c(memoryview(dst.numpy()).cast("B"))
    return {"copy_s": copy_s, "crc_s": time.perf_counter() - t0}


def summarize(results: list[dict[str, Any]], checkpoints: int) -> dict[str, Any]:
    by_mode: dict[str, list[float]] = {}
    blocking: dict[str, list[float]] = {}
    for r in results:
        by_mode.setdefault(r["mode"], []).append(r["total_s"])
        blocking.setdefault(r["mode"], []).extend(r["blocking_s"])
    base = statistics.median(by_mode["none"])
    out: dict[str, Any] = {"none_total_s": base, "modes": {}}
    per_round_none = {r["round"]: r["total_s"] for r in results if r["mode"] == "none"}
    for mode in MODES[1:]:
        added = [(r["total_s"] - per_round_none[r["round"]]) / checkpoints for r in results if r["mode"] == mode]
        out["modes"][mode] = {
            "added_per_checkpoint_s": statistics.median(added),
            "added_rounds_s": added,
            "blocking_median_s": statistics.median(blocking[mode]) if blocking[mode] else 0.0,
            "total_s": statistics.median(by_mode[mode]),
        }
    dcp = out["modes"]["dcp"]["added_per_checkpoint_s"]
    for mode in ("bytecp eager", "bytecp lazy"):
        m = out["modes"][mode]
        m["vs_dcp_added"] = m["added_per_checkpoint_s"] / dcp if dcp > 0 else None
    return out


def plot(results: list[dict[str, Any]], summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    modes = MODES[1:]
    added = [summary["modes"][m]["added_per_checkpoint_s"] for m in modes]
    blocking = [summary["modes"][m]["blocking_median_s"] for m in modes]
    xs = range(len(modes))
    a.bar([x - 0.2 for x in xs], added, 0.4, label="added training time per checkpoint")
    a.bar([x + 0.2 for x in xs], blocking, 0.4, label="blocking time of the call")
    a.set_xticks(list(xs), modes)
    a.set_ylabel("seconds")
    a.legend(fontsize=8)
    a.set_title("cost of a checkpoint to training (medians)")
    last = max(r["round"] for r in results)
    for r in results:
        if r["round"] == last:
            b.plot(range(1, len(r["step_s"]) + 1), r["step_s"], marker="o", label=r["mode"])
    b.set_xlabel("training step (a checkpoint starts after every even step)")
    b.set_ylabel("step wall time, s")
    b.set_title(f"step times, round {last}")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--png", default=None, help="write the picture here")
    p.add_argument("--quick", action="store_true", help="a tiny config for smoke tests")
    a = p.parse_args(argv)
    if a.quick:
        a.blocks, a.dim, a.batch, a.steps, a.rounds = 2, 256, 8, 4, 1
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        args = {"dim": a.dim, "blocks": a.blocks, "batch": a.batch, "steps": a.steps, "every": a.every,
                "rounds": a.rounds, "dir": tmp}
        out = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(a.world_size, _free_port(), args, out), nprocs=a.world_size,
                           join=True, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
    checkpoints = a.steps // a.every
    summary = summarize(results, checkpoints)
    nbytes = 3 * a.blocks * (a.dim * a.dim + a.dim) * 4 // a.world_size  # params + Adam moments per rank
    summary["floor"] = _floor(nbytes)
    summary["config"] = vars(a) | {"rank_state_bytes": nbytes}
    _print(summary)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)
    if a.png:
        plot(results, summary, a.png)
    return 0


def _print(summary: dict[str, Any]) -> None:
    c = summary["config"]
    print(f"FSDP2, {c['world_size']} ranks, {c['blocks']} x Linear({c['dim']})+GELU, batch {c['batch']}, "
          f"{c['steps']} steps, a checkpoint every {c['every']}, {c['rounds']} rounds; "
          f"{c['rank_state_bytes'] / 1e9:.2f} GB of state per rank")
    print(f"no checkpoint: {summary['none_total_s']:.2f} s")
    print("| mode | added training time per checkpoint | blocking (call) | vs DCP |")
    print("|---|---|---|---|")
    for mode, m in summary["modes"].items():
        ratio = m.get("vs_dcp_added")
        print(f"| {mode} | {m['added_per_checkpoint_s']:.3f} s | {m['blocking_median_s']:.3f} s | "
              f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    f = summary["floor"]
    print(f"floor here: copy {f['copy_s']:.3f} s + crc32c {f['crc_s']:.3f} s per checkpoint and rank")


if __name__ == "__main__":
    sys.exit(main())
