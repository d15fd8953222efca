"""What a checkpoint costs training, end to end (``python -m benchmarks.training``).

FSDP2 on W gloo ranks trains a stack of Linear+GELU blocks. The unit of
measure is a *window*, what a training loop pays for one checkpoint: the
call, the next ``--every`` steps (the save runs in the background) and the
wait for the save to end before the next checkpoint (one save in flight, as
a loop keeps it). A round runs one window per mode, in an order rotated
round by round, in the same processes:

- ``none``: no checkpoint (the baseline);
- ``dcp``: DCP's best practice: ``dcp.async_save`` with one reused
  ``DefaultStager`` and its own gloo group;
- ``bytecp eager``: ``bytecp.async_save``;
- ``bytecp lazy``: ``bytecp.async_save(lazy=True)``;
- variants for ``--modes`` (``bytecp lazy nice``, ...).

Each mode's window is compared with the ``none`` window of its round: the
added training time per checkpoint is the median over rounds of that
difference. Alternating at this grain keeps the comparison fair on a
machine whose load drifts. Also reported: the blocking time (the call, plus
for lazy saves what ``optimizer.step()`` waited in bytecp's pre-step hook),
the CPU seconds the checkpoint used on all ranks (every thread but the
training thread's steps, over the baseline's; steadier than wall time on a
shared machine), the first checkpoint of the process (untimed warm-up), the
load average before and after, and a picture: the added time and blocking
per mode, and the windows of the last round (rank 0) with the call, the
steps, the wait and the checkpoint's background phases (bytecp's traced
phases; DCP's background until its future is done). The floor on a machine
is the rank's bytes copied once into a reused buffer plus their crc32c
(measured here with one thread, as a rank has).

One command writes the table (stdout), the JSON and the PNG::

    python -m benchmarks.training --rounds 12 --out training.json --png training.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from tests.netport import free_port as _free_port

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
    "bytecp eager 2 threads": {"lazy": False, "staging_threads": 2},
}
MODES = ["none", "dcp", "bytecp eager", "bytecp lazy"]




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


def _hook_wait(phases: list[tuple[str, float, float]]) -> float:
    return sum(d for ph, _, d in phases if ph == "lazy_wait")


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
    # a round: one window per mode, in an order rotated round by round; a
    # window is what a training loop pays for one checkpoint: the call, the
    # next ``every`` steps (the save runs in the background) and the wait for
    # it before the next checkpoint (as a loop with one save in flight does)
    for rnd in range(args["rounds"]):
        order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
        for mode in order:
            dist.barrier()
            steps: list[tuple[float, float]] = []
            done: dict[str, float] = {}
            t_start, w_start, cpu_start = time.perf_counter(), time.time(), _cpu_seconds()
            pending, path, call = None, "", (w_start, w_start)
            if KNOWN[mode] is not None:
                path = os.path.join(root, f"r{rnd}-{mode.replace(' ', '-')}")
                pending, c0, c1 = checkpoint(mode, path, done)
                call = (c0, c1)
            train_cpu = 0.0  # CPU seconds of the training thread inside step()
            for _ in range(args["every"]):
                w0, c0 = time.time(), time.thread_time()
                step()
                steps.append((w0, time.time()))
                train_cpu += time.thread_time() - c0
            w1 = time.time()
            wait(pending)
            waited = (w1, time.time())
            total = time.perf_counter() - t_start
            t = torch.tensor([total])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            cpu = torch.tensor([_cpu_seconds() - cpu_start, train_cpu])
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)

            def rel(w: float, w_start: float = w_start) -> float:
                return w - w_start

            phases = spans.by_url.get(path, [])
            results.append({
                "round": rnd, "mode": mode, "total_s": float(t), "cpu_s": float(cpu[0]),
                "train_cpu_s": float(cpu[1]),
                # the call, plus (lazy) what optimizer.step() waited in bytecp's pre-step hook
                "blocking_s": call[1] - call[0] + _hook_wait(phases) if pending is not None else None,
                "hook_wait_s": _hook_wait(phases),
                "step_s": [b - a for a, b in steps],
                "steps": [(rel(a), rel(b)) for a, b in steps],
                "wait": (rel(waited[0]), rel(waited[1])),
                "checkpoint": None if pending is None else {
                    "call": (rel(call[0]), rel(call[1])),
                    "done": rel(done[path]) if path in done else None,
                    "phases": [(ph, rel(st), d) for ph, st, d in phases],
                },
            })
            dist.barrier()
            if rank == 0:
                import shutil

                for name in os.listdir(root):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    floor = _floor_together(model, opt)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rounds": results, "first_blocking_s": first, "floor_together": floor}, f)
    dist.barrier()
    dist.destroy_process_group()


def _floor_together(model: Any, opt: Any) -> dict[str, float]:
    """(every rank at once) Seconds to copy this rank's own state tensors into
    reused buffers of their own, every rank at the same time as in a
    checkpoint: ``memcpy`` (bytecp's copy without its bookkeeping) and
    torch's copy kernel; medians of 5, slowest rank."""
    import torch
    import torch.distributed as dist

    from bytecp.saving.hostcopy import copy_boxes

    srcs = []
    for p in model.parameters():
        srcs.append(getattr(p, "_local_tensor", p).detach())
        srcs.extend(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    srcs = [getattr(t, "_local_tensor", t) for t in srcs]
    dsts = [torch.zeros_like(t) for t in srcs]
    pairs = list(zip(dsts, srcs, strict=True))
    out = {}
    for name, fn in (("memcpy_s", lambda: copy_boxes(pairs, threads=torch.get_num_threads())),
                     ("copy_s", lambda: torch._foreach_copy_(dsts, srcs))):
        ts = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = float(t)
    return out


def _floor(nbytes: int, threads: int) -> dict[str, float]:
    """Seconds to copy ``nbytes`` into a reused buffer (torch's copy kernel and
    ``memcpy``, ``threads`` threads as a rank has), and to crc32c them, here;
    medians of 5."""
    import torch

    from bytecp.format.checksum import crc32c
    from bytecp.saving.hostcopy import copy_boxes
    from bytecp.tree.dtypes import host_memoryview

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


def summarize(results: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Medians over rounds; every window against the ``none`` window of its round."""
    none = {r["round"]: r for r in results if r["mode"] == "none"}
    out: dict[str, Any] = {"none_window_s": statistics.median(r["total_s"] for r in none.values()), "modes": {}}
    for mode in modes:
        if mode == "none":
            continue
        rs = [r for r in results if r["mode"] == mode]
        added = [r["total_s"] - none[r["round"]]["total_s"] for r in rs]
        cpu = [r["cpu_s"] - none[r["round"]]["cpu_s"] for r in rs]
        # every thread but the training thread's steps, over the baseline's
        own = [(r["cpu_s"] - r["train_cpu_s"]) - (none[r["round"]]["cpu_s"] - none[r["round"]]["train_cpu_s"])
               for r in rs]
        blocking = [r["blocking_s"] for r in rs]
        out["modes"][mode] = {
            "added_per_checkpoint_s": statistics.median(added),
            "added_rounds_s": added,
            "blocking_median_s": statistics.median(blocking),
            "blocking_rounds_s": blocking,
            "hook_wait_median_s": statistics.median(r["hook_wait_s"] for r in rs),
            "added_cpu_per_checkpoint_s": statistics.median(cpu),
            "checkpoint_cpu_per_checkpoint_s": statistics.median(own),
            "checkpoint_cpu_rounds_s": own,
            "window_s": statistics.median(r["total_s"] for r in rs),
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
    floor, together = summary.get("floor"), summary.get("floor_together")
    if floor and together:
        a.axhline(together["memcpy_s"] + floor["crc_s"], color="k", ls="--", lw=0.8,
                  label="floor: the ranks' copies at once + crc32c")
        a.axhline(together["memcpy_s"], color="tab:orange", ls=":", lw=0.8, label="floor of blocking: the copy")
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
        w0, w1 = r["wait"]
        if w1 - w0 > 0.002:
            b.barh(y + 0.15, w1 - w0, left=w0, height=0.45, color="darkred")
        c = r["checkpoint"]
        if c is None:
            continue
        c0, c1 = c["call"]
        b.barh(y + 0.15, max(c1 - c0, 0.002), left=c0, height=0.45, color="tab:red")
        if c["phases"]:
            for ph, st, d in c["phases"]:
                if ph in _PHASE_COLORS and d > 0:
                    b.barh(y - 0.22, max(d, 0.005), left=st, height=0.22, color=_PHASE_COLORS[ph])
        elif c["done"] is not None:
            b.barh(y - 0.22, c["done"] - c1, left=c1, height=0.22, color="tab:purple")
    b.set_yticks(range(len(lanes)), [r["mode"] for r in reversed(lanes)], fontsize=8)
    b.set_xlabel("seconds since the checkpoint call (rank 0)")
    b.set_title(f"round {last}: the call (red), the training steps (grey), the wait before the next "
                "checkpoint (dark red); the checkpoint's phases below", fontsize=10)
    b.legend(handles=[Patch(color="0.7", label="training step"), Patch(color="tab:red", label="call blocks"),
                      Patch(color="darkred", label="wait for the save to end"),
                      Patch(color="tab:red", label="lazy: optimizer.step() waits (below)"),
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
    p.add_argument("--every", type=int, default=2, help="training steps between two checkpoints")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds; each runs one checkpoint window per mode (default 12, --quick 2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(KNOWN)} (none is always run)")
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default="training.json", help="write the JSON results here ('' for none)")
    p.add_argument("--png", default="training.png", help="write the picture here ('' for none)")
    p.add_argument("--quick", action="store_true", help="a tiny config for smoke tests")
    a = p.parse_args(argv)
    if a.quick:
        a.blocks, a.dim, a.batch = 2, 256, 8
    if a.rounds is None:
        a.rounds = 2 if a.quick else 12
    modes = ["none"] + [m.strip() for m in a.modes.split(",") if m.strip() and m.strip() != "none"]
    unknown = [m for m in modes if m not in KNOWN]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {list(KNOWN)}")
    import torch.multiprocessing as mp

    load_before = _loadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        args = {"dim": a.dim, "blocks": a.blocks, "batch": a.batch, "every": a.every,
                "rounds": a.rounds, "dir": tmp, "modes": modes}
        out = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(a.world_size, _free_port(), args, out), nprocs=a.world_size,
                           join=True, start_method="spawn")
        with open(out) as f:
            raw = json.load(f)
    results = raw["rounds"]
    summary = summarize(results, modes)
    for mode, b in raw["first_blocking_s"].items():
        summary["modes"][mode]["first_blocking_s"] = b
    summary["floor_together"] = raw["floor_together"]
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
          f"a checkpoint every {c['every']} steps, {c['rounds']} rounds; "
          f"{c['rank_state_bytes'] / 1e9:.2f} GB of state per rank; load average before "
          f"{summary['loadavg_before']}, after {summary['loadavg_after']}; {summary['wall_s']:.0f} s")
    print(f"no checkpoint: {summary['none_window_s']:.2f} s for {c['every']} steps (median window)")
    print("| mode | added training time per checkpoint (median) | rounds (min, max) | blocking | vs DCP added | "
          "vs DCP blocking | CPU of the checkpoint, all ranks | added CPU, all ranks |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, m in summary["modes"].items():
        ratio, bratio = m.get("vs_dcp_added"), m.get("vs_dcp_blocking")
        rounds = f"{min(m['added_rounds_s']):.2f}, {max(m['added_rounds_s']):.2f}"
        print(f"| {mode} | {m['added_per_checkpoint_s']:.3f} s | {rounds} | {m['blocking_median_s']:.3f} s | "
              f"{'' if ratio is None else f'{ratio:.2f}x'} | {'' if bratio is None else f'{bratio:.2f}x'} | "
              f"{m['checkpoint_cpu_per_checkpoint_s']:.3f} s | {m['added_cpu_per_checkpoint_s']:.3f} s |")
    print("first checkpoint of the process (untimed warm-up), blocking: " + ", ".join(
        f"{mode} {m['first_blocking_s']:.3f} s" for mode, m in summary["modes"].items() if "first_blocking_s" in m))
    f = summary["floor"]
    print(f"floor here (one rank's bytes, alone): copy {f['copy_s']:.3f} s (torch) / {f['memcpy_s']:.3f} s "
          f"(memcpy), crc32c {f['crc_s']:.3f} s, memcpy with fused crc32c {f['memcpy_crc_fused_s']:.3f} s")
    g = summary["floor_together"]
    print(f"floor, every rank copying its own state tensors at once (slowest rank): memcpy {g['memcpy_s']:.3f} s, "
          f"torch copy {g['copy_s']:.3f} s")
    for t in summary["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        print(f"target: {t['target']} = {v} (limit {t['limit']}): {t['status']}")


if __name__ == "__main__":
    sys.exit(main())
