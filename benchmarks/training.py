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
checkpoints`` (each round against its own ``none`` run), the blocking time
of the call, the load average before and after, and a picture: the added
time and blocking per mode, and a timeline of one round (rank 0) with every
training step, the call that blocked, and the checkpoint's background
phases (bytecp's traced phases; DCP's background until its future is done).
The floor on a machine is the rank's bytes copied once into a reused buffer
plus their crc32c (measured here, one thread as a rank has).

One command writes the table (stdout), the JSON and the PNG::

    python -m benchmarks.training --rounds 5 --out training.json --png training.png
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

#: every mode the benchmark knows: name -> bytecp.async_save keyword arguments
#: (None: no checkpoint; "dcp": DCP's best practice)
KNOWN: dict[str, Any] = {
    "none": None,
    "dcp": "dcp",
    "bytecp eager": {"lazy": False},
    "bytecp lazy": {"lazy": True},
    # variants, for --modes
    "bytecp eager nice": {"lazy": False, "background_nice": 10},
    "bytecp lazy nice": {"lazy": True, "background_nice": 10},
    "bytecp lazy 2 threads": {"lazy": True, "staging_threads": 2},
}
MODES = ["none", "dcp", "bytecp eager", "bytecp lazy"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loadavg() -> list[float] | None:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


class _Spans:
    """A bytecp recorder that keeps every save's phase spans by URL (rank-local)."""

    def __init__(self) -> None:
        self.by_url: dict[str, list[tuple[str, float, float]]] = {}

    def on_report(self, report: Any) -> None:
        self.by_url[report.url] = [(s.phase, s.start, s.duration) for s in report.spans]

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        pass


def _cpu_seconds() -> float:
    """CPU seconds this process has used, every thread (user + system)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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
    spans = _Spans()
    root = args["dir"]

    def checkpoint(mode: str, path: str, done: dict[str, float]) -> tuple[Any, float, float]:
        """Start one checkpoint; -> (what to wait for, call start, call end) (wall clock)."""
        t0, w0 = time.perf_counter(), time.time()
        if KNOWN[mode] == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, opt)
            resp = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=ckpt_pg,
                                  async_stager=stager)
            staged = getattr(resp, "staging_completion", None)
            if staged is not None:
                staged.result()
            waiter: Any = getattr(resp, "upload_completion", resp)
            waiter.add_done_callback(lambda _: done.setdefault(path, time.time()))
        else:
            waiter = bytecp.async_save(path, {"model": model, "optim": opt}, monitor=spans, **KNOWN[mode])
            waiter.add_done_callback(lambda _: done.setdefault(path, time.time()))
        return waiter, w0, w0 + (time.perf_counter() - t0)

    def wait(waiter: Any) -> None:
        if waiter is None:
            return
        (waiter.result if hasattr(waiter, "result") and not hasattr(waiter, "wait") else waiter.wait)()

    results: list[dict[str, Any]] = []
    modes = args["modes"]
    # one untimed checkpoint per mode first, as a training job has long taken
    # its first: what a first save costs (arena, plan, DCP's staging buffers)
    # is reported apart
    first: dict[str, float] = {}
    for mode in modes:
        if KNOWN[mode] is not None:
            dist.barrier()
            waiter, c0, c1 = checkpoint(mode, os.path.join(root, f"warmup-{mode.replace(' ', '-')}"), {})
            first[mode] = c1 - c0
            wait(waiter)
    for rnd in range(args["rounds"]):
        order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
        for mode in order:
            dist.barrier()
            pending = None
            steps: list[tuple[float, float]] = []
            calls: list[tuple[str, float, float]] = []
            done: dict[str, float] = {}
            t_start, w_start, cpu_start = time.perf_counter(), time.time(), _cpu_seconds()
            waits: list[tuple[float, float]] = []
            for s in range(args["steps"]):
                w0 = time.time()
                step()
                w1 = time.time()
                steps.append((w0, w1))
                if KNOWN[mode] is not None and (s + 1) % args["every"] == 0:
                    wait(pending)  # one save in flight, as a training loop does
                    waits.append((w1, time.time()))
                    path = os.path.join(root, f"r{rnd}-{mode.replace(' ', '-')}-s{s}")
                    pending, c0, c1 = checkpoint(mode, path, done)
                    calls.append((path, c0, c1))
            w1 = time.time()
            wait(pending)
            waits.append((w1, time.time()))
            total = time.perf_counter() - t_start
            t = torch.tensor([total])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            cpu = torch.tensor([_cpu_seconds() - cpu_start])
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            def rel(w: float, w_start: float = w_start) -> float:
                return w - w_start

            results.append({
                "round": rnd, "mode": mode, "total_s": float(t), "cpu_s": float(cpu),
                "blocking_s": [c1 - c0 for _, c0, c1 in calls],
                "step_s": [b - a for a, b in steps],
                "steps": [(rel(a), rel(b)) for a, b in steps],
                "waits": [(rel(a), rel(b)) for a, b in waits],
                "checkpoints": [{
                    "call": (rel(c0), rel(c1)),
                    "done": rel(done[p]) if p in done else None,
                    "phases": [(ph, rel(st), d) for ph, st, d in spans.by_url.get(p, [])],
                } for p, c0, c1 in calls],
            })
            dist.barrier()
            if rank == 0:
                import shutil

                for name in os.listdir(root):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rounds": results, "first_blocking_s": first}, f)
    dist.barrier()
    dist.destroy_process_group()


def _floor(nbytes: int, threads: int) -> dict[str, float]:
    """Seconds to copy ``nbytes`` into a reused buffer (torch's copy kernel and
    ``memcpy``, ``threads`` threads as a rank has), and to crc32c them, here;
    medians of 5."""
    import torch

    from bytecp.checksum import crc32c
    from bytecp.dtypes import host_memoryview
    from bytecp.hostcopy import copy_boxes

    torch.set_num_threads(threads)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)

    def timed(fn: Any) -> float:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    view = host_memoryview(dst)
    return {
        "copy_s": timed(lambda: dst.copy_(src)),
        "memcpy_s": timed(lambda: copy_boxes([(dst, src)], threads=threads)),
        "crc_s": timed(lambda: crc32c(view)),
        "memcpy_crc_fused_s": timed(lambda: copy_boxes([(dst, src)], threads=1, checksums=True)),
    }


def summarize(results: list[dict[str, Any]], checkpoints: int, modes: list[str]) -> dict[str, Any]:
    by_mode: dict[str, list[float]] = {}
    blocking: dict[str, list[float]] = {}
    for r in results:
        by_mode.setdefault(r["mode"], []).append(r["total_s"])
        blocking.setdefault(r["mode"], []).extend(r["blocking_s"])
    base = statistics.median(by_mode["none"])
    out: dict[str, Any] = {"none_total_s": base, "modes": {}}
    per_round_none = {r["round"]: r["total_s"] for r in results if r["mode"] == "none"}
    cpu_none = {r["round"]: r["cpu_s"] for r in results if r["mode"] == "none"}
    for mode in modes:
        if mode == "none":
            continue
        added = [(r["total_s"] - per_round_none[r["round"]]) / checkpoints for r in results if r["mode"] == mode]
        cpu = [(r["cpu_s"] - cpu_none[r["round"]]) / checkpoints for r in results if r["mode"] == mode]
        out["modes"][mode] = {
            "added_per_checkpoint_s": statistics.median(added),
            "added_rounds_s": added,
            "added_cpu_per_checkpoint_s": statistics.median(cpu),
            "blocking_median_s": statistics.median(blocking[mode]) if blocking[mode] else 0.0,
            "total_s": statistics.median(by_mode[mode]),
        }
    dcp = out["modes"].get("dcp")
    for mode, m in out["modes"].items():
        if mode != "dcp" and dcp is not None:
            m["vs_dcp_added"] = m["added_per_checkpoint_s"] / dcp["added_per_checkpoint_s"] \
                if dcp["added_per_checkpoint_s"] > 0 else None
            m["vs_dcp_blocking"] = m["blocking_median_s"] / dcp["blocking_median_s"] \
                if dcp["blocking_median_s"] > 0 else None
    return out


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue targets: eager blocking <= 0.6x DCP's; lazy added <= 0.3x DCP's and <= eager's."""
    ms = summary["modes"]
    out = []

    def row(name: str, value: float | None, limit: float) -> None:
        status = "n/a" if value is None else ("met" if value <= limit else "missed")
        out.append({"target": name, "value": value, "limit": limit, "status": status})

    if "dcp" in ms and "bytecp eager" in ms:
        row("eager blocking / DCP blocking", ms["bytecp eager"].get("vs_dcp_blocking"), 0.6)
    if "dcp" in ms and "bytecp lazy" in ms:
        row("lazy added time / DCP added time", ms["bytecp lazy"].get("vs_dcp_added"), 0.3)
    if "bytecp eager" in ms and "bytecp lazy" in ms:
        eager = ms["bytecp eager"]["added_per_checkpoint_s"]
        lazy = ms["bytecp lazy"]["added_per_checkpoint_s"]
        row("lazy added time - eager added time (s)", lazy - eager, 0.0)
    return out


_PHASE_COLORS = {"stage": "tab:orange", "plan": "tab:gray", "write": "tab:blue", "commit": "tab:green",
                 "lazy_wait": "tab:red", "wait_previous": "tab:pink"}


def plot(results: list[dict[str, Any]], summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [1, 2.2]})
    modes = list(summary["modes"])
    added = [summary["modes"][m]["added_per_checkpoint_s"] for m in modes]
    blocking = [summary["modes"][m]["blocking_median_s"] for m in modes]
    xs = list(range(len(modes)))
    a.bar([x - 0.2 for x in xs], added, 0.4, label="added training time per checkpoint (median)")
    a.bar([x + 0.2 for x in xs], blocking, 0.4, label="blocking time of the call (median)")
    for x, m in zip(xs, modes, strict=True):
        rounds = summary["modes"][m]["added_rounds_s"]
        a.plot([x - 0.2] * len(rounds), rounds, "k.", markersize=4)
    floor = summary.get("floor")
    if floor:
        a.axhline(floor["memcpy_s"] + floor["crc_s"], color="k", ls="--", lw=0.8,
                  label="floor: copy + crc32c of the rank's bytes")
    a.set_xticks(xs, modes, fontsize=8)
    a.set_ylabel("seconds")
    a.legend(fontsize=7)
    a.set_title("cost of a checkpoint to training (dots: rounds)", fontsize=10)

    last = max(r["round"] for r in results)
    lanes = [r for r in results if r["round"] == last]
    lanes.sort(key=lambda r: list(KNOWN).index(r["mode"]) if r["mode"] in KNOWN else 99)
    for y, r in enumerate(reversed(lanes)):
        for i, (s0, s1) in enumerate(r["steps"]):
            b.barh(y + 0.15, s1 - s0, left=s0, height=0.45, color="0.80" if i % 2 else "0.65", edgecolor="white")
        for w0, w1 in r.get("waits", []):
            if w1 - w0 > 0.002:
                b.barh(y + 0.15, w1 - w0, left=w0, height=0.45, color="darkred")
        for c in r.get("checkpoints", []):
            c0, c1 = c["call"]
            b.barh(y + 0.15, max(c1 - c0, 0.01), left=c0, height=0.45, color="tab:red")
            if c["phases"]:
                for ph, st, d in c["phases"]:
                    if ph in _PHASE_COLORS and d > 0:
                        b.barh(y - 0.22, max(d, 0.005), left=st, height=0.22, color=_PHASE_COLORS[ph])
            elif c["done"] is not None:
                b.barh(y - 0.22, c["done"] - c1, left=c1, height=0.22, color="tab:purple")
    b.set_yticks(range(len(lanes)), [r["mode"] for r in reversed(lanes)], fontsize=8)
    b.set_xlabel("seconds since the start of the round (rank 0)")
    b.set_title(f"round {last}: training steps (grey), the call that blocked (red), the checkpoint in the "
                "background (below)", fontsize=10)
    b.legend(handles=[Patch(color="0.7", label="training step"), Patch(color="tab:red", label="call blocks"),
                      Patch(color="darkred", label="waits for the previous save"),
                      Patch(color="tab:orange", label="stage (copy)"), Patch(color="tab:blue", label="write"),
                      Patch(color="tab:green", label="commit"), Patch(color="tab:gray", label="plan"),
                      Patch(color="tab:purple", label="DCP background")],
             fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
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
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds of every mode (default 3, --quick 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(KNOWN)} (none is always run)")
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default="training.json", help="write the JSON results here ('' for none)")
    p.add_argument("--png", default="training.png", help="write the picture here ('' for none)")
    p.add_argument("--quick", action="store_true", help="a tiny config for smoke tests")
    a = p.parse_args(argv)
    if a.quick:
        a.blocks, a.dim, a.batch, a.steps = 2, 256, 8, 4
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    modes = ["none"] + [m.strip() for m in a.modes.split(",") if m.strip() and m.strip() != "none"]
    unknown = [m for m in modes if m not in KNOWN]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {list(KNOWN)}")
    import torch.multiprocessing as mp

    load_before = _loadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        args = {"dim": a.dim, "blocks": a.blocks, "batch": a.batch, "steps": a.steps, "every": a.every,
                "rounds": a.rounds, "dir": tmp, "modes": modes}
        out = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(a.world_size, _free_port(), args, out), nprocs=a.world_size,
                           join=True, start_method="spawn")
        with open(out) as f:
            raw = json.load(f)
    results = raw["rounds"]
    checkpoints = a.steps // a.every
    summary = summarize(results, checkpoints, modes)
    for mode, b in raw["first_blocking_s"].items():
        summary["modes"][mode]["first_blocking_s"] = b
    nbytes = 3 * a.blocks * (a.dim * a.dim + a.dim) * 4 // a.world_size  # params + Adam moments per rank
    summary["floor"] = _floor(nbytes, max(1, (os.cpu_count() or 2) // a.world_size))
    summary["config"] = vars(a) | {"rank_state_bytes": nbytes, "modes": modes}
    summary["loadavg_before"], summary["loadavg_after"] = load_before, _loadavg()
    summary["wall_s"] = time.time() - t0
    summary["targets"] = targets(summary)
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
          f"{c['rank_state_bytes'] / 1e9:.2f} GB of state per rank; load average before "
          f"{summary['loadavg_before']}, after {summary['loadavg_after']}; {summary['wall_s']:.0f} s")
    print(f"no checkpoint: {summary['none_total_s']:.2f} s for {c['steps']} steps")
    print("| mode | added training time per checkpoint (median) | rounds | blocking (call) | vs DCP added | "
          "vs DCP blocking | added CPU per checkpoint, all ranks |")
    print("|---|---|---|---|---|---|---|")
    for mode, m in summary["modes"].items():
        ratio, bratio = m.get("vs_dcp_added"), m.get("vs_dcp_blocking")
        rounds = " / ".join(f"{x:.2f}" for x in m["added_rounds_s"])
        print(f"| {mode} | {m['added_per_checkpoint_s']:.3f} s | {rounds} | {m['blocking_median_s']:.3f} s | "
              f"{'' if ratio is None else f'{ratio:.2f}x'} | {'' if bratio is None else f'{bratio:.2f}x'} | "
              f"{m['added_cpu_per_checkpoint_s']:.3f} s |")
    print("first checkpoint of the process (untimed warm-up), blocking: " + ", ".join(
        f"{mode} {m['first_blocking_s']:.3f} s" for mode, m in summary["modes"].items() if "first_blocking_s" in m))
    f = summary["floor"]
    print(f"floor here (one rank's bytes): copy {f['copy_s']:.3f} s (torch) / {f['memcpy_s']:.3f} s (memcpy), "
          f"crc32c {f['crc_s']:.3f} s, memcpy with fused crc32c {f['memcpy_crc_fused_s']:.3f} s")
    for t in summary["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        print(f"target: {t['target']} = {v} (limit {t['limit']}): {t['status']}")


if __name__ == "__main__":
    sys.exit(main())
