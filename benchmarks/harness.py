"""Worker side of the harness: one spawned process per rank runs a list of cases.

The launcher (:mod:`benchmarks.run`) starts a group of W processes for one
framework and topology (:func:`launch`); every process (:func:`worker_main`)
joins a gloo process group, builds and wraps the model, trains one step, and
then runs the cases in lockstep: barrier, optional page-cache drop (rank 0),
the measured call, barrier. Each rank writes its records to a JSON file the
launcher reads back. Resident memory is sampled on a thread (self plus child
processes, every 20 ms) so each case reports its peak above the level it
started from.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.netport import free_port

__all__ = ["Case", "Ctx", "GroupSpec", "RssSampler", "launch", "worker_main", "drop_caches",
           "can_drop_caches", "timed_between_barriers", "ratio_table", "NOT_AVAILABLE"]

NOT_AVAILABLE = "n/a (not available)"


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured operation.

    ``run(ctx)`` is called on every rank and returns ``blocking_s`` (how long
    the caller was stalled), ``total_s`` (until the checkpoint is durable, or
    the load is applied) and, for saves, ``path`` (the checkpoint written).
    """

    name: str
    #: "bytecp" or "dcp"
    lib: str
    #: "save", "async", "lazy" or "load"
    kind: str
    run: Callable[[Ctx], dict[str, Any]]
    #: drop the page cache before the call (loads)
    cold: bool = False
    #: a reason the case cannot run here (None: it can); takes the framework
    unavailable: Callable[[str], str | None] = lambda fw: None


@dataclasses.dataclass(kw_only=True)
class GroupSpec:
    """What one spawned group runs (JSON-able: it crosses the spawn)."""

    #: label of the group in the results ("fsdp2", "reshard 2->3", ...)
    label: str
    framework: str
    world_size: int
    gb: float
    cases: list[str]
    repeats: int
    #: folder for this group's checkpoints
    root: str
    result_dir: str
    #: lib -> checkpoint the load cases read (default: this group's own saves)
    load_from: dict[str, str] = dataclasses.field(default_factory=dict)
    #: lib -> parameter fingerprint those checkpoints hold
    expected: dict[str, float] = dataclasses.field(default_factory=dict)
    seed: int = 0


class RssSampler:
    """Samples the resident set of this process plus its children."""

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)
        self._thread.start()

    def current(self) -> int:
        total = self._proc.memory_info().rss
        try:
            for c in self._proc.children(recursive=True):
                try:
                    total += c.memory_info().rss
                except Exception:
                    pass
        except Exception:
            pass
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            v = self.current()
            with self._lock:
                self._peak = max(self._peak, v)

    def reset(self) -> int:
        v = self.current()
        with self._lock:
            self._peak = v
        return v

    def peak(self) -> int:
        v = self.current()
        with self._lock:
            self._peak = max(self._peak, v)
            return self._peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


def timed_between_barriers(fn: Callable[[], Any]) -> float:
    """(every rank of a framework benchmark) Seconds ``fn()`` takes, from a
    barrier before to a barrier after: the slowest rank's time, seen by all."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def ratio_table(other: str, rows: list[tuple[str, str, str]], results: dict[str, float]) -> None:
    """(a framework benchmark's launcher) Print the markdown table of bytecp
    against ``other``: one row per (label, bytecp's result key, the other's)."""
    print(f"| case | bytecp (s) | {other} (s) | ratio |")
    print("| --- | --- | --- | --- |")
    for label, b, o in rows:
        print(f"| {label} | {results[b]:.2f} | {results[o]:.2f} | {results[b] / results[o]:.2f}x |")


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def read_through(path: str) -> int:
    """Read every file under ``path`` once (into the page cache); the bytes read."""
    buf = bytearray(16 << 20)
    total = 0
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return total


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Ctx:
    """What a case sees: this rank's model, optimizer, groups and folders."""

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        import torch.distributed as dist

        from .model import build, config_for_gb, fingerprint, state_bytes

        self.spec = spec
        self.rank = rank
        self.world = spec.world_size
        self.framework = spec.framework
        self.cfg = config_for_gb(spec.gb)
        #: checkpoint collectives that may run in the background get their own group
        self.ckpt_pg = dist.new_group(backend="gloo")
        t0 = time.perf_counter()
        self.model, self.optim = build(self.cfg, spec.framework, seed=spec.seed)
        self.build_s = time.perf_counter() - t0
        self.state_bytes = state_bytes(self.model, self.optim)
        self.load_from = dict(spec.load_from)
        self.expected = dict(spec.expected)
        self.scratch: dict[str, Any] = {}
        #: resident bytes of the trained process before any checkpointing
        self.rss_train = 0
        self._fingerprint = fingerprint

    def path(self, name: str) -> str:
        return str(Path(self.spec.root) / name)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def fingerprint(self) -> float:
        return self._fingerprint(self.model, self.framework)

    def check_loaded(self, lib: str) -> bool | None:
        """Whether the model now holds the parameters the loaded checkpoint was saved with."""
        want = self.expected.get(lib)
        if want is None:
            return None
        got = self.fingerprint()
        return abs(got - want) <= 1e-5 * max(1.0, abs(want))

    def load_path(self, lib: str) -> str:
        """The checkpoint ``lib``'s load cases read: given to the group, else this group's sync save."""
        return self.load_from.get(lib) or self.path(f"{lib}-save")

    def fresh_dir(self, path: str) -> None:
        """Remove ``path`` (rank 0) before a save that does not overwrite by itself."""
        import shutil

        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()


def _all_cases() -> dict[str, Case]:
    from .bytecp_cases import CASES as B
    from .dcp_cases import CASES as D

    return {**B, **D}


def bytes_written(lib: str, path: str, rank: int) -> int | None:
    """Bytes of data files this rank wrote into the checkpoint at ``path``."""
    from .bytecp_cases import rank_bytes as bytecp_rank_bytes
    from .dcp_cases import rank_bytes as dcp_rank_bytes

    try:
        return bytecp_rank_bytes(path, rank) if lib == "bytecp" else dcp_rank_bytes(path, rank)
    except Exception:
        return None


def _run_case(ctx: Ctx, case: Case, repeat: int, sampler: RssSampler) -> dict[str, Any]:
    rec: dict[str, Any] = {"case": case.name, "repeat": repeat, "rank": ctx.rank}
    gc.collect()
    ctx.barrier()
    if case.cold:
        if ctx.rank == 0:
            drop_caches()
        ctx.barrier()
    elif case.kind == "load":  # warm: whatever ran before (a cold case drops the cache), the files are cached
        if ctx.rank == 0:
            read_through(ctx.load_path(case.lib))
        ctx.barrier()
    base = sampler.reset()
    try:
        out = case.run(ctx)
        peak = sampler.peak()
        rec.update({k: v for k, v in out.items() if k != "path"})
        if "path" in out:
            rec["bytes_written"] = bytes_written(case.lib, out["path"], ctx.rank)
        rec["rss_base"] = base
        rec["rss_peak_delta"] = max(0, peak - base)
        rec["rss_over_train"] = max(0, peak - ctx.rss_train)
    except Exception as e:  # recorded; the other ranks see the same failure or a timeout
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-4000:]
    ctx.barrier()
    return rec


def _order(names: list[str], repeat: int, cases: dict[str, Case]) -> list[str]:
    """Alternate which library goes first in odd repeats.

    Adjacent bytecp/DCP cases of the same family (saves, or loads at the same
    cache temperature) swap places; a case without a partner keeps its slot.
    """
    if repeat % 2 == 0:
        return list(names)

    def family(c: Case) -> tuple[str, bool]:
        return ("load" if c.kind == "load" else "save", c.cold)

    out: list[str] = []
    i = 0
    while i < len(names):
        a = cases[names[i]]
        b = cases[names[i + 1]] if i + 1 < len(names) else None
        if b is not None and a.lib != b.lib and family(a) == family(b):
            out += [b.name, a.name]
            i += 2
        else:
            out.append(a.name)
            i += 1
    return out


def worker_main(rank: int, spec_json: str) -> None:
    """Entry point of one rank (spawned by :func:`launch`)."""
    import datetime

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # torch's deprecation notes, once per rank and call
    spec = GroupSpec(**json.loads(spec_json))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(spec.world_size)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=600))
    out_path = Path(spec.result_dir) / f"{spec.label.replace(' ', '_').replace('>', '')}-rank{rank}.json"
    result: dict[str, Any] = {"label": spec.label, "rank": rank, "records": []}
    sampler = RssSampler()
    ctx = None
    try:
        ctx = Ctx(spec, rank)
        gc.collect()
        ctx.rss_train = sampler.reset()
        result.update(build_s=ctx.build_s, state_bytes=ctx.state_bytes)
        cases = _all_cases()
        for r in range(spec.repeats):
            for name in _order(spec.cases, r, cases):
                rec = _run_case(ctx, cases[name], r, sampler)
                result["records"].append(rec)
                out_path.write_text(json.dumps(result))
        result.update(load_from=ctx.load_from, expected=ctx.expected)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        out_path.write_text(json.dumps(result))
        if ctx is not None:
            from .dcp_cases import close as dcp_close

            dcp_close(ctx)
        sampler.close()
        try:
            dist.barrier()
        except Exception:
            dist.destroy_process_group()
        else:  # every rank's result is written: out at once, not through the slow native shutdown
            os._exit(0)




#: what the fork server imports before it forks any rank (torch._dynamo: what the
#: first optimizer a rank builds imports, 1.5-3 s of CPU per rank otherwise;
#: torch._inductor.compile_fx: what the first ``torch.compile`` call imports, 1.5 s,
#: DeepSpeed's modules call it when imported)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.checkpoint",
           "bytecp", "benchmarks.harness"]


def launch(spec: GroupSpec, *, timeout_s: float) -> list[dict[str, Any]]:
    """Run one group of ``spec.world_size`` ranks; their results, rank by rank. The ranks
    are forked from multiprocessing's fork server, which imports torch once per run
    (:data:`PRELOAD`), not once per rank and group."""
    import multiprocessing

    import torch.multiprocessing as mp

    Path(spec.result_dir).mkdir(parents=True, exist_ok=True)
    Path(spec.root).mkdir(parents=True, exist_ok=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # before it starts
    pc = mp.start_processes(worker_main, args=(json.dumps(dataclasses.asdict(spec)),),
                            nprocs=spec.world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        while True:
            try:
                if pc.join(timeout=2):
                    break
            except Exception as e:  # a rank died: the others are stopped by join
                failure = f"{type(e).__name__}: {e}"
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s"
                break
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for rank in range(spec.world_size):
        f = Path(spec.result_dir) / f"{spec.label.replace(' ', '_').replace('>', '')}-rank{rank}.json"
        r = json.loads(f.read_text()) if f.exists() else {"label": spec.label, "rank": rank, "records": []}
        if failure and "error" not in r:
            r["error"] = failure
        results.append(r)
    return results
