"""``make gpu-check``: every CUDA test, then the GPU benchmark beside DCP, one JSON and one table.

    python -m benchmarks.gpu_check [--out DIR] [--gb 4.2] [--tests-only] [--no-every-step | --every-step-only]

Runs from the project root on a machine with a CUDA device (about 4-6
minutes on one H100 or H200):

1. ``pytest -m gpu`` over the CUDA test files (tests/gpu, and the GPU case
   of tests/core/test_async.py): the CUDA paths by design and the layouts'
   correctness (plain, DDP and FSDP2 on a world-1 NCCL group: save, eager
   and lazy async saves while training continues, loaded back onto the GPU
   and into FSDP2 on two CPU ranks, bitwise; the memory tier with a local
   keeper);
2. :mod:`benchmarks.gpu` on a GPU-resident transformer of ``--gb`` GB of
   state, beside DCP in the same process;
3. :mod:`benchmarks.every_step`: a model of at least 1.2B parameters trained
   with a lazy checkpoint to this host's memory tier (a keeper started for
   it) after every step and one drained to disk every 50 steps, against the
   same loop without checkpoints (about 4 minutes; ``--no-every-step``
   skips it).

Writes ``gpu-check.json`` (which GPU, every test case and its outcome, the
figures, their ratios and the issue's targets) and ``gpu-check.md`` (the
table) to ``--out`` (default ``$OUT`` when set, else the current folder),
and prints the table. Exits 1 if a test failed or a benchmark section
broke. Without CUDA it says so and exits 0 (CI runs it that way, so it
stays importable and runnable).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

__all__ = ["main", "targets", "table", "TEST_PATHS"]

#: the files holding every ``gpu``-marked test (pytest collects only these: the
#: lent machine lacks the other tests' servers and frameworks)
TEST_PATHS = ("tests/gpu", "tests/core/test_async.py")

#: (name, figure, comparison, target): the GPU issue's targets
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("eager async blocking vs pinned D2H floor", "eager_block_vs_d2h_floor", "<=", 1.1),
    ("lazy call blocking (ms)", "lazy_call_ms", "<=", 5.0),
    ("training time added per checkpoint, lazy vs DCP pinned async", "added_lazy_vs_dcp_async", "<=", 0.1),
    ("load into the GPU model vs the read floor (speed)", "load_speed_vs_read_floor", ">=", 0.8),
    ("training time added per step, a checkpoint every step to the memory tier (%)", "every_step_added_pct",
     "<=", 1.0),
)


def _device() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the project needs torch
        return False, f"torch is not importable: {e}"
    if not torch.cuda.is_available():
        return False, f"no CUDA device (torch {torch.__version__})"
    return True, torch.cuda.get_device_name(0)


def run_tests(out: Path, timeout: float) -> tuple[list[dict[str, Any]], str]:
    """``pytest -m gpu`` on :data:`TEST_PATHS`; every case with its outcome, and the output's tail."""
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *TEST_PATHS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-6000:]
    except subprocess.TimeoutExpired as e:
        got = (e.stdout or b"") + (e.stderr or b"")
        text = got.decode(errors="replace") if isinstance(got, bytes) else str(got)
        return [{"name": "pytest -m gpu", "outcome": "failed", "message": f"timed out after {timeout} s"}], text[-6000:]
    cases: list[dict[str, Any]] = []
    if xml.exists():
        for tc in ET.parse(xml).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                el = tc.find(kind)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    message = (el.get("message") or "")[:500]
            cases.append({"name": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                          "seconds": round(float(tc.get("time") or 0), 2), "message": message})
    if not cases:
        cases.append({"name": "pytest -m gpu", "outcome": "failed", "message": f"no results (exit {proc.returncode})"})
    return cases, tail


def run_bench(out: Path, gb: float, timeout: float) -> tuple[dict[str, Any], str]:
    """:mod:`benchmarks.gpu` in its own process (its own NCCL group)."""
    path = out / "gpu-bench.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--gb", str(gb), "--json", str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail = proc.stderr[-6000:]
    except subprocess.TimeoutExpired as e:
        got = e.stderr or b""
        text = got.decode(errors="replace") if isinstance(got, bytes) else str(got)
        return {"errors": {"bench": f"timed out after {timeout} s"}}, text[-6000:]
    if not path.exists():
        return {"errors": {"bench": f"exit {proc.returncode}, no results"}}, tail
    return json.loads(path.read_text()), tail


def run_every_step(out: Path, timeout: float) -> tuple[dict[str, Any], str]:
    """:mod:`benchmarks.every_step` in its own process (its own keeper)."""
    path = out / "every-step.json"
    cmd = [sys.executable, "-m", "benchmarks.every_step", "--steps", "52", "--rounds", "1", "--batch", "32",
           "--json", str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail = proc.stderr[-6000:]
    except subprocess.TimeoutExpired as e:
        got = e.stderr or b""
        text = got.decode(errors="replace") if isinstance(got, bytes) else str(got)
        return {"errors": {"every_step": f"timed out after {timeout} s"}}, text[-6000:]
    if not path.exists():
        return {"errors": {"every_step": f"exit {proc.returncode}, no results"}}, tail
    return json.loads(path.read_text()), tail


def targets(bench: dict[str, Any], every: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The issue's targets against the figures (value None: not measured)."""
    ratios = dict(bench.get("ratios", {}))
    if bench.get("bytecp_lazy_call_s") is not None:
        ratios["lazy_call_ms"] = bench["bytecp_lazy_call_s"] * 1e3
    if every and every.get("added_fraction") is not None:
        ratios["every_step_added_pct"] = every["added_fraction"] * 100
    rows = []
    for name, key, op, goal in TARGETS:
        value = ratios.get(key)
        met = None if value is None else (value <= goal if op == "<=" else value >= goal)
        rows.append({"target": name, "value": None if value is None else round(value, 3), "goal": f"{op} {goal}",
                     "met": met})
    return rows


def table(report: dict[str, Any]) -> str:
    """The markdown table of one check."""
    b = report.get("bench", {})
    lines = [f"GPU check on {report.get('gpu')} ({report.get('date')}, torch {b.get('torch', '?')}): "
             f"{b.get('state_bytes', 0) / 1e9:.2f} GB of state (bf16 weights, fp32 master and Adam), "
             f"{b.get('params', 0) / 1e6:.0f}M parameters", ""]
    passed = sum(c["outcome"] == "passed" for c in report["tests"])
    lines.append(f"CUDA tests: {passed} passed of {len(report['tests'])}")
    for c in report["tests"]:
        if c["outcome"] != "passed":
            lines.append(f"- {c['outcome']}: {c['name']} {c['message'][:200]}")
    lines += ["", "| figure | bytecp | DCP | ratio |", "| --- | --- | --- | --- |"]

    def row(label: str, ours: str | None, theirs: str | None, note: str = "") -> None:
        def f(k: str | None) -> str:
            return "-" if k is None or b.get(k) is None else f"{b[k]:.3f} s"
        ratio = (f"{b[ours] / b[theirs]:.2f}x" if ours and theirs and b.get(ours) is not None and b.get(theirs)
                 else note)
        lines.append(f"| {label} | {f(ours)} | {f(theirs)} | {ratio} |")

    row("pinned D2H floor (same bytes)", "d2h_floor_s", None)
    row("async save: blocking (eager copy / DCP call + staging)", "bytecp_eager_block_s", "dcp_async_block_s")
    row("DCP async save: the call alone", None, "dcp_async_call_s")
    row("lazy async save: call", "bytecp_lazy_call_s", "dcp_async_block_s")
    row("lazy async save: wait in the next optimizer step", "bytecp_lazy_hook_s", None)
    row("training time added per checkpoint (lazy)", "added_bytecp_lazy_s", "added_dcp_async_s")
    row("training time added per checkpoint (eager)", "added_bytecp_eager_s", "added_dcp_async_s")
    row("async save to durable commit", "bytecp_eager_commit_s", "dcp_async_commit_s")
    row("sync save (to durable commit)", "bytecp_save_s", "dcp_save_s")
    row("load into the GPU model (page cache warm)", "bytecp_load_s", "dcp_load_s")
    row("load, checksums not verified", "bytecp_load_unverified_s", "dcp_load_s")
    row("read floor (data files into pinned memory)", "read_floor_s", None)
    row("one training step", "train_step_s", None)
    lines += ["", "| target | value | goal | met |", "| --- | --- | --- | --- |"]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['value']} | {t['goal']} | {t['met']} |")
    if b.get("errors"):
        lines += ["", "Benchmark sections that broke: " + "; ".join(f"{k}: {v}" for k, v in b["errors"].items())]
    e = report.get("every_step") or {}
    if e.get("skipped"):
        lines += ["", f"Checkpoint at every step: skipped ({e['skipped']})"]
    elif e.get("step_with_s"):
        lines += ["", f"Checkpoint at every step ({e['params'] / 1e9:.2f}B parameters, {e['state_bytes'] / 1e9:.1f} GB "
                      f"of state, batch {e['batch']} x {e['seq']}): step {e['step_without_s']['mean']:.3f} s without, "
                      f"{e['step_with_s']['mean']:.3f} s with a lazy memory-tier checkpoint after every step "
                      f"(disk every {e['disk_every']}): {e['added_per_step_s'] * 1e3:+.1f} ms a step "
                      f"({e['added_fraction'] * 100:+.2f}%); the call {e['call_s']['median'] * 1e3:.1f} ms, "
                      f"the optimizer step {e['optimizer_with_s'] * 1e3:.1f} ms with and "
                      f"{e['optimizer_without_s'] * 1e3:.1f} ms without; last checkpoint bitwise: "
                      f"{e.get('last_checkpoint_bitwise')}; failed saves: {e.get('failed_saves')}"]
    for tier, ph in (e.get("save_phases_s") or {}).items():
        parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ph.items() if k not in ("saves", "duration", "stall"))
        lines += ["", f"Its {tier}-tier saves ({ph['saves']}), median: {ph['duration'] * 1e3:.0f} ms from the call to "
                      f"the commit, stall {ph['stall'] * 1e3:.1f} ms; by phase: {parts}"]
    if e.get("pinning"):
        pin, ar = e["pinning"], e.get("keeper_arenas") or {}
        lines += ["", f"Pinned: {pin['registered_bytes'] / 1e9:.1f} GB in {pin['registered']} registrations, "
                      f"{pin['register_failures']} failed; arena mappings {pin['arena_mapping_hits']} reused, "
                      f"{pin['arena_mapping_misses']} made; keeper: {ar.get('adopted')} arenas adopted, "
                      f"{ar.get('lent_total')} lent, {ar.get('free')} pooled, {ar.get('keeper_cpu_s')} s of CPU"]
    if e.get("errors"):
        lines += ["", "Checkpoint at every step broke: " + "; ".join(f"{k}: {v}" for k, v in e["errors"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for gpu-check.json and .md")
    ap.add_argument("--gb", type=float, default=4.2, help="the benchmark's state size in GB")
    ap.add_argument("--tests-only", action="store_true", help="the CUDA tests only, no benchmark")
    ap.add_argument("--no-every-step", action="store_true", help="skip the checkpoint-at-every-step loop")
    ap.add_argument("--every-step-only", action="store_true",
                    help="the checkpoint-at-every-step loop alone (a second call after --no-every-step, each "
                         "inside one command's time limit)")
    ap.add_argument("--test-timeout", type=float, default=200)
    ap.add_argument("--bench-timeout", type=float, default=260)
    ap.add_argument("--every-step-timeout", type=float, default=420)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok, device = _device()
    if not ok:
        print(f"gpu-check: {device}: nothing to check here (the CUDA tests and the GPU benchmark need a GPU)")
        (out / "gpu-check.json").write_text(json.dumps({"skipped": device}))
        return 0
    t0 = time.perf_counter()
    report: dict[str, Any] = {"gpu": device, "date": datetime.date.today().isoformat()}
    bench: dict[str, Any] = {}
    every: dict[str, Any] = {}
    bench_tail = every_tail = tests_tail = ""
    report["tests"] = []
    if not args.every_step_only:
        print(f"gpu-check on {device}: pytest -m gpu ...", flush=True)
        report["tests"], tests_tail = run_tests(out, args.test_timeout)
    report["tests_seconds"] = round(time.perf_counter() - t0, 1)
    if args.every_step_only:
        print(f"gpu-check on {device}: the checkpoint-at-every-step loop alone ...", flush=True)
        every, every_tail = run_every_step(out, args.every_step_timeout)
    elif not args.tests_only:
        print(f"gpu-check: tests done in {report['tests_seconds']} s; the benchmark ...", flush=True)
        bench, bench_tail = run_bench(out, args.gb, args.bench_timeout)
        if not args.no_every_step:
            print("gpu-check: the checkpoint-at-every-step loop ...", flush=True)
            every, every_tail = run_every_step(out, args.every_step_timeout)
    report["bench"] = bench
    report["every_step"] = every
    report["targets"] = targets(bench, every)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    text = table(report)
    (out / "gpu-check.md").write_text(text)
    failed = [c for c in report["tests"] if c["outcome"] in ("failed", "error")]
    if failed:
        print(tests_tail)
    if bench.get("errors"):
        print(bench_tail)
    if every.get("errors"):
        print(every_tail)
    print(text)
    print(f"gpu-check: {report['seconds']} s in all")
    return 1 if failed or bench.get("errors") or every.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
