"""``python -m benchmarks.run`` / ``make bench``: bytecp against DCP in one run.

Spawns W gloo ranks per framework (DDP, FSDP1, FSDP2), builds a GPT-like model
whose parameters + Adam state take ``--gb`` GB, and measures, alternating the
two libraries across repeats: blocking time and time to durable commit of
sync and async saves, load time with the page cache warm and dropped,
resharding loads (W -> W+1 and W -> 1), bytes written and peak RSS per rank.
The disk's own figures come from ``dd`` in the same run. Prints a Markdown
table and writes JSON (``--out``) and a PNG (``--png``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "parse_args"]

SAVE_CASES = [
    "bytecp.save", "dcp.save",
    "bytecp.async_save", "dcp.async_save thread",
    "bytecp.async_save lazy", "dcp.async_save thread reused stager",
]
LOAD_CASES = ["bytecp.load cold", "dcp.load cold", "bytecp.load warm", "dcp.load warm"]
#: last: its daemon process stays resident and would count in every later case's memory
LAST_CASES = ["dcp.async_save process"]
#: what the other frameworks run unless --all-cases (keeps a full run near 10 minutes)
SHORT_CASES = {
    "ddp": ["bytecp.save", "dcp.save", "bytecp.async_save", "dcp.async_save thread",
            "bytecp.load warm", "dcp.load warm"],
    "fsdp1": ["bytecp.save", "dcp.save", "bytecp.load warm", "dcp.load warm"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks per group (default 2)")
    p.add_argument("--gb", type=float, default=2.0, help="parameters + Adam state in GB (default 2.0)")
    p.add_argument("--frameworks", default="fsdp2,ddp,fsdp1",
                   help="comma-separated, the first is also resharded (default fsdp2,ddp,fsdp1); fsdp2_tp: "
                        "FSDP2 x TP on a dp x tp=2 mesh, resharded into FSDP2 alone at the same world size")
    p.add_argument("--repeats", type=int, default=None, help="repeats per case (default 3; 1 with --quick)")
    p.add_argument("--dir", default=None,
                   help="folder on the disk under test; a fresh subfolder is used and removed (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--png", default=None, help="write the plot of blocking and total times here")
    p.add_argument("--quick", action="store_true", help="tiny config (~50 MB) for smoke tests")
    p.add_argument("--all-cases", action="store_true",
                   help="every save and load case for every framework (default: the full set for the first only)")
    p.add_argument("--cases", default=None,
                   help="comma-separated case names to run (default: all for the framework)")
    p.add_argument("--no-reshard", action="store_true", help="skip the W -> W+1 and W -> 1 loads")
    p.add_argument("--no-dd", action="store_true", help="skip the dd figures")
    p.add_argument("--group-timeout", type=float, default=None, help="seconds per spawned group")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    args = p.parse_args(argv)
    if args.quick:
        args.gb = 0.05 if args.gb == 2.0 else args.gb
        args.repeats = args.repeats or 1
    args.repeats = args.repeats or 3
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()] if args.cases else None
    known = SAVE_CASES + LOAD_CASES + LAST_CASES
    if args.cases and [c for c in args.cases if c not in known]:
        p.error(f"unknown cases {[c for c in args.cases if c not in known]}; known: {known}")
    bad = [f for f in args.frameworks if f not in ("fsdp2", "ddp", "fsdp1", "fsdp2_tp")]
    if bad:
        p.error(f"unknown frameworks {bad}; choose from fsdp2, ddp, fsdp1, fsdp2_tp")
    if "fsdp2_tp" in args.frameworks and args.world_size % 2:
        p.error("fsdp2_tp runs on a dp x tp=2 mesh: --world-size must be even")
    if args.world_size < 1 or args.repeats < 1 or args.gb <= 0:
        p.error("--world-size, --repeats and --gb must be positive")
    return args


def _split(cases: list[str], framework: str, extra_unavailable: dict[str, str] | None = None
           ) -> tuple[list[str], dict[str, str]]:
    from .harness import _all_cases

    defs = _all_cases()
    run, skip = [], {}
    for name in cases:
        why = (extra_unavailable or {}).get(name) or defs[name].unavailable(framework)
        if why:
            skip[name] = why
        else:
            run.append(name)
    return run, skip


def _group(spec: Any, unavailable: dict[str, str], timeout: float, log: Any) -> dict[str, Any]:
    import dataclasses

    from .harness import launch
    from .report import aggregate

    t0 = time.perf_counter()
    log(f"[bench] {spec.label}: {spec.world_size} ranks, {len(spec.cases)} cases x {spec.repeats} repeats"
        + (f", {len(unavailable)} not available" if unavailable else ""))
    ranks = launch(spec, timeout_s=timeout) if spec.cases else []
    g = {**dataclasses.asdict(spec), "ranks": ranks, "unavailable": unavailable}
    if not ranks:
        g["ranks"] = [{"rank": r, "records": []} for r in range(spec.world_size)]
    summary = aggregate(g)
    summary["wall_s"] = time.perf_counter() - t0
    summary["_raw"] = ranks
    log(f"[bench] {spec.label}: done in {summary['wall_s']:.0f} s"
        + (f" ({'; '.join(summary['errors'])})" if summary.get("errors") else ""))
    return summary


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


class _LoadSampler:
    """The 1-minute load average every 5 s while the benchmark runs (ours included)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            la = _loadavg()
            if la:
                self.samples.append(la[0])
            if self._stop.wait(5):
                return

    def stop(self) -> dict[str, float]:
        self._stop.set()
        s = self.samples
        return {"loadavg_1m_mean": sum(s) / len(s), "loadavg_1m_max": max(s)} if s else {}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every case that can run here ran, else 1."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from . import disk, report
    from .harness import GroupSpec, can_drop_caches
    from .model import config_for_gb, describe

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    cfg = config_for_gb(args.gb)
    w = args.world_size
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bytecp-bench-", dir=base))
    results_dir = work / "results"
    timeout = args.group_timeout or (180 + 150 * cfg.state_gb * args.repeats * (2 if args.all_cases else 1))
    cold_why = None if can_drop_caches() else "n/a (dropping the page cache needs root)"
    cold = {c: cold_why for c in LOAD_CASES if c.endswith("cold") and cold_why}
    log(f"[bench] {cfg.params / 1e6:.1f}M parameters, {cfg.state_gb:.2f} GB of state, world {w}, "
        f"repeats {args.repeats}, folder {work}")
    out: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": w, "repeats": args.repeats, "config": describe(cfg),
        "torch": torch.__version__, "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                            "loadavg_start": _loadavg()},
        "folder": str(work),
    }
    loads = _LoadSampler()
    try:
        out["disk"] = {} if args.no_dd else disk.measure(str(work), int(cfg.state_gb * 1e9), w)
        groups: dict[str, Any] = {}
        for i, fw in enumerate(args.frameworks):
            wanted = SAVE_CASES + LOAD_CASES + LAST_CASES if (i == 0 or args.all_cases) else SHORT_CASES[fw]
            if args.cases:
                wanted = [c for c in wanted if c in args.cases]
            run, skip = _split(wanted, fw, cold)
            spec = GroupSpec(label=fw, framework=fw, world_size=w, gb=args.gb, cases=run,
                             repeats=args.repeats, root=str(work / fw), result_dir=str(results_dir))
            groups[fw] = _group(spec, skip, timeout, log)
            if i > 0 and not args.keep:
                shutil.rmtree(work / fw, ignore_errors=True)
        if not args.no_reshard and args.frameworks:
            src = args.frameworks[0]
            raw = groups[src]["_raw"]
            r0 = raw[0] if raw else {}
            load_from, expected = r0.get("load_from", {}), r0.get("expected", {})
            missing = {f"{lib}.load {t}": f"n/a (no {lib} checkpoint from {src})"
                       for lib in ("bytecp", "dcp") if lib not in load_from for t in ("cold", "warm")}
            first = ((f"reshard {w // 2}x2->fsdp2 {w}", "fsdp2", w) if src == "fsdp2_tp"
                     else (f"reshard {w}->{w + 1}", src, w + 1))
            for label, fw, ws in (first, (f"reshard {w}->1", "plain", 1)):
                wanted = [c for c in LOAD_CASES if not args.cases or c in args.cases]
                run, skip = _split(wanted, fw, {**cold, **missing})
                spec = GroupSpec(label=label, framework=fw, world_size=ws, gb=args.gb, cases=run,
                                 repeats=args.repeats, root=str(work / label.replace(" ", "_")),
                                 result_dir=str(results_dir), load_from=load_from, expected=expected)
                groups[label] = _group(spec, skip, timeout, log)
        for g in groups.values():
            g["raw"] = g.pop("_raw", None)
        out["groups"] = groups
        out["ratios"] = report.ratios(groups)
        out["targets"] = report.targets(groups, out["disk"], args.frameworks[0] if args.frameworks else "", w)
        out["host"]["loadavg_end"] = _loadavg()
        out["host"].update(loads.stop())
        out["wall_s"] = time.perf_counter() - t_start
        if args.out:  # first, so a failure below still leaves the figures
            Path(args.out).write_text(json.dumps(out, indent=1))
        text = report.table(out)
        print(text)
        out["table"] = text
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
            log(f"[bench] JSON: {args.out}")
        if args.png:
            report.plot(out, args.png)
            log(f"[bench] PNG: {args.png}")
        print(json.dumps({k: out[k] for k in ("ratios", "targets")}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [f"{lbl}: {n}" for lbl, g in out.get("groups", {}).items() for n, c in g["cases"].items()
              if c.get("status") in ("failed", "not run")]
    if failed:
        log("[bench] failed: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
