"""Loads under contention, every tensor compared bitwise with what was saved:
the suite's short run (``tests/core/test_load_stress.py``) and its long form.

    python -m benchmarks.load_stress [--jobs 3] [--seconds 60] [--json out.json]

A checkpoint of tensors of several shapes and dtypes, saved as boxes (row
slabs, column slabs, flat ranges, whole tensors; chunks over one block and
under), is loaded again and again by several threads of a process at once
-- and, in the long form, by several processes at once on this machine's
two cores -- with ``sys.setswitchinterval`` tiny, eight reader threads per
load, tiny read batches, random delays at every hand-off
(``BYTECP_FAULT_HANDOFF``) and every reused buffer poisoned when released
(``BYTECP_DEBUG_BUFFERS=1``). Each thread runs, in turn:

- a **resharded read**: random boxes of every tensor (rows, columns, a
  corner) read as a load's read phase reads them (``rows_for``,
  ``plan_load``, ``execute_reads``: partial reads of chunks, checked block by
  block);
- a **whole-chunk load**: ``bytecp.load`` into full tensors, two of whose
  entries share memory (as a Megatron fp32 model's parameters and its
  distributed optimizer's main parameters do) and were saved with different
  values: the later entry's values must be what the memory holds;
- (one thread) an **async save** of a live state, its arena reused from the
  last one, then loaded back.

Every loaded tensor is compared bitwise with the values saved. The Megatron
scenario that first showed the race (a TP2 x EP2 MoE saved by 4 gloo ranks,
loaded twice in one process at TP1 x EP1, three jobs at once) is
``--megatron``; ``--python`` runs it with another interpreter (e.g. a
checkout before the fix). The long form's results are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import bytecp
from bytecp.loading import reader
from bytecp.loading.checks import block_bytes_of
from bytecp.loading.opened import open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace
from bytecp.tree.dtypes import itemsize
from bytecp.tree.regions import Region
from bytecp.tree.state import Shard, TensorLeaf

__all__ = ["Report", "contention", "saved_state", "stress", "main"]


@dataclasses.dataclass
class Report:
    """What a run did, and each failure as one line."""

    resharded: int = 0
    whole: int = 0
    saves: int = 0
    bytes: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Report) -> None:
        self.resharded += other.resharded
        self.whole += other.whole
        self.saves += other.saves
        self.bytes += other.bytes
        self.failures += other.failures


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def saved_state(scale: int = 1) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The state saved (boxes held as a sharded save holds them) and the full tensors it holds."""
    full = {
        "rows": _values((768 * scale, 640), torch.float32, 1),  # 1.9 MiB: row slabs over one block and under
        "cols": _values((300, 1000 * scale), torch.bfloat16, 2),  # column slabs: every read of rows is partial
        "flat": _values((97, 513 * scale), torch.float64, 3),  # flat ranges (FSDP1, ZeRO): boxes of 1-3 rows
        "whole": _values((1 << 19,), torch.int32, 4),  # 2 MiB in one chunk
        "small": _values((33, 7), torch.float16, 5),
        "model": {"w": _values((128, 256), torch.float32, 6)},
        "optim": {"w": _values((128 * 256,), torch.float32, 7)},  # loaded into the same memory as model.w
    }
    rows, cols, flat = full["rows"], full["cols"], full["flat"]
    r0, r1 = 200 * scale, 520 * scale
    cut = [0, 900, flat.numel() // 2 + 7, flat.numel()]
    flat_shards = [sh for a, b in zip(cut, cut[1:], strict=False)
                   for sh in TensorLeaf.from_flat(tuple(flat.shape), flat.dtype, a, flat.reshape(-1)[a:b]).shards]
    state = {
        "rows": TensorLeaf(tuple(rows.shape), rows.dtype, [
            Shard(Region((0, 0), (r0, 640)), rows[:r0]), Shard(Region((r0, 0), (r1 - r0, 640)), rows[r0:r1]),
            Shard(Region((r1, 0), (rows.shape[0] - r1, 640)), rows[r1:])]),
        "cols": TensorLeaf(tuple(cols.shape), cols.dtype, [
            Shard(Region((0, c), (300, 250 * scale)), cols[:, c : c + 250 * scale])
            for c in range(0, cols.shape[1], 250 * scale)]),
        "flat": TensorLeaf(tuple(flat.shape), flat.dtype, flat_shards),
        "whole": full["whole"], "small": full["small"], "model": full["model"], "optim": full["optim"],
    }
    return state, _flat(full)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@contextlib.contextmanager
def contention(*, switch: float = 1e-6, handoff: str = "*:0.0005", batch: int = 64 << 10) -> Iterator[None]:
    """Thread switches every ``switch`` s, ``handoff`` delays (``BYTECP_FAULT_HANDOFF``), reused
    buffers poisoned (``BYTECP_DEBUG_BUFFERS``), read batches of ``batch`` bytes."""
    old_switch, old_batch = sys.getswitchinterval(), reader.READ_BATCH_MIN_BYTES
    old_env = {k: os.environ.get(k) for k in ("BYTECP_FAULT_HANDOFF", "BYTECP_DEBUG_BUFFERS")}
    sys.setswitchinterval(switch)
    reader.READ_BATCH_MIN_BYTES = batch
    os.environ.update(BYTECP_FAULT_HANDOFF=handoff, BYTECP_DEBUG_BUFFERS="1")
    try:
        yield
    finally:
        sys.setswitchinterval(old_switch)
        reader.READ_BATCH_MIN_BYTES = old_batch
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _box(shape: tuple[int, ...], rnd: random.Random) -> Region:
    """A random non-empty box: rows, columns or a corner."""
    kind = rnd.choice(("rows", "cols", "corner"))
    offs, lens = [], []
    for d, n in enumerate(shape):
        if (kind == "rows" and d > 0) or (kind == "cols" and d == 0):
            offs.append(0)
            lens.append(n)
            continue
        a = rnd.randrange(n)
        offs.append(a)
        lens.append(rnd.randint(1, n - a))
    return Region(tuple(offs), tuple(lens))


def _resharded(url: str, full: dict[str, torch.Tensor], rnd: random.Random, out: Report) -> None:
    """Random boxes of every tensor, read as a load's read phase reads them; compared bitwise."""
    opened = open_checkpoint(url)
    md = opened.metadata
    names = [k for k in full if k not in ("model.w", "optim.w")]
    boxes = {fqn: [_box(tuple(full[fqn].shape), rnd) for _ in range(rnd.randint(1, 3))] for fqn in names}
    rows = opened.rows_for(boxes).rows
    targets = [Target(fqn, b, torch.full(b.lengths, 7, dtype=full[fqn].dtype)) for fqn, bs in boxes.items() for b in bs]
    blocks = block_bytes_of(md)
    reqs = plan_load([(t.fqn, t.box) for t in targets], rows, block_bytes=blocks,
                     itemsizes={fqn: itemsize(full[fqn].dtype) for fqn in names})
    out.bytes += execute_reads(opened.storage, rows, targets, reqs, io_threads=8, verify=True,
                               trace=Trace("load", url), block_bytes=blocks)
    for t in targets:
        if not torch.equal(t.view.view(torch.uint8), full[t.fqn][t.box.slices()].contiguous().view(torch.uint8)):
            out.failures.append(f"{url}: resharded read of {t.fqn} {t.box} differs from what was saved")
    out.resharded += 1


def _whole(url: str, full: dict[str, torch.Tensor], out: Report) -> None:
    """``bytecp.load`` into full tensors, ``optim.w`` sharing ``model.w``'s memory: the later one wins."""
    dst = {k: torch.zeros_like(v) for k, v in full.items() if "." not in k}
    shared = torch.zeros_like(full["model.w"])
    state = {**dst, "model": {"w": shared}, "optim": {"w": shared.view(-1)}}
    bytecp.load(url, state, io_threads=8)
    for k, v in dst.items():
        if not torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)) or not torch.equal(
                v.view(torch.uint8), full[k].view(torch.uint8)):
            out.failures.append(f"{url}: bytecp.load of {k} differs from what was saved")
    if not torch.equal(shared.view(-1), full["optim.w"]):
        out.failures.append(f"{url}: model.w and optim.w share memory: it holds "
                            f"{'model.w' if torch.equal(shared, full['model.w']) else 'neither'}'s values, not "
                            "optim.w's (the later entry)")
    out.whole += 1


def _saves(root: Path, stop: threading.Event, out: Report, scale: int) -> None:
    """Async saves of a live state (its arena reused), each loaded back and compared."""
    state, _ = saved_state(scale)
    live = {k: state[k] for k in ("whole", "small", "model")}
    k = 0
    while not stop.is_set():
        k += 1
        live["whole"].add_(1)
        live["model"]["w"].mul_(-1)
        want = {"whole": live["whole"].clone(), "small": live["small"].clone(), "model.w": live["model"]["w"].clone()}
        url = str(root / f"save-{os.getpid()}-{k}")  # (the jobs of a run share ``root``: each its own saves)
        bytecp.async_save(url, live).wait(120)
        live["whole"].add_(1000)  # the live state moves on: the checkpoint must hold the copy
        got = _flat(bytecp.load_state_dict(url))
        for name, v in want.items():
            if not torch.equal(got[name].view(torch.uint8), v.view(torch.uint8)):
                out.failures.append(f"{url}: async save of {name} loads back other values")
        out.saves += 1
        shutil.rmtree(url, ignore_errors=True)


def stress(root: Path, *, threads: int = 4, seconds: float = 3.0, loads: int | None = None, scale: int = 1,
           saves: bool = True, seed: int = 0) -> Report:
    """(one process) Loads of the checkpoint at ``root/ck`` (saved here first) by ``threads``
    threads under :func:`contention` for ``seconds`` (or until ``loads`` loads per thread)."""
    url = str(root / "ck")
    if not (root / "ck" / "metadata.json").exists():
        state, _ = saved_state(scale)
        bytecp.save(url, state)
    _, full = saved_state(scale)
    report = Report()
    lock = threading.Lock()
    stop = threading.Event()
    deadline = time.monotonic() + seconds

    def run(i: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        mine = Report()
        n = 0
        try:
            while (loads is None and time.monotonic() < deadline) or (loads is not None and n < loads):
                if n % 3 == 2:
                    _whole(url, full, mine)
                else:
                    _resharded(url, full, rnd, mine)
                n += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the others
            mine.failures.append(f"thread {i}: {type(e).__name__}: {e}")
        with lock:
            report.add(mine)

    def saving() -> None:
        mine = Report()
        try:
            _saves(root, stop, mine, scale)
        except Exception as e:  # noqa: BLE001
            mine.failures.append(f"saves: {type(e).__name__}: {e}")
        with lock:
            report.add(mine)

    with contention():
        workers = [threading.Thread(target=run, args=(i,), name=f"stress-{i}") for i in range(threads)]
        saver = threading.Thread(target=saving, name="stress-save") if saves else None
        for t in [*workers, *([saver] if saver else [])]:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        if saver:
            saver.join()
    return report


# -- the long form: several processes at once ----------------------------------------------
def _job(args: argparse.Namespace, root: Path, k: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "benchmarks.load_stress", "--one", str(root), "--seconds", str(args.seconds),
           "--threads", str(args.threads), "--seed", str(k), "--scale", str(args.scale)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3, help="processes at once")
    p.add_argument("--threads", type=int, default=4, help="loading threads per process")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--scale", type=int, default=2, help="tensor sizes (1: the suite's)")
    p.add_argument("--megatron", type=int, default=0, metavar="RUNS",
                   help="instead: the Megatron-Core MoE reproduction, RUNS fresh processes per job")
    p.add_argument("--python", default=sys.executable, help="interpreter of the --megatron loads")
    p.add_argument("--json", type=Path)
    p.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:  # one job: its report as JSON on stdout
        report = stress(args.one, threads=args.threads, seconds=args.seconds, scale=args.scale, seed=args.seed)
        print(json.dumps(dataclasses.asdict(report)))
        return 0
    if args.megatron:
        from benchmarks import load_stress_megatron

        return load_stress_megatron.main(args)
    with tempfile.TemporaryDirectory(prefix="bytecp-stress-") as tmp:
        root = Path(tmp)
        state, _ = saved_state(args.scale)
        bytecp.save(str(root / "ck"), state)
        t0 = time.monotonic()
        procs = [_job(args, root, k) for k in range(args.jobs)]
        total = Report()
        for proc in procs:
            out, _ = proc.communicate(timeout=args.seconds * 10 + 300)
            lines = out.strip().splitlines()
            if proc.returncode or not lines:
                total.failures.append(f"a job exited with {proc.returncode}")
                continue
            total.add(Report(**json.loads(lines[-1])))
        wall = time.monotonic() - t0
    summary = {"jobs": args.jobs, "threads": args.threads, "seconds": round(wall, 1), **dataclasses.asdict(total),
               "failures": total.failures[:20], "failed": len(total.failures)}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if total.failures else 0


if __name__ == "__main__":
    sys.exit(main())
