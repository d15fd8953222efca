"""A pool of gloo ranks that runs test functions on every rank.

Starting a Python process and importing torch costs 3-15 s on 2 cores (the
upper figure while other jobs run), so each world size gets one pool per
test session and every check reuses it, and the ranks are forked from
multiprocessing's fork server, which imports torch and bytecp once per
session (:data:`PRELOAD`): a new pool costs a fraction of a second, not a
torch import per rank. Each rank starts with the environment, working
directory and ``sys.path`` the test process has when the pool is made (as a
spawned process would), plus ``env``. Every call is bounded by a timeout: a
hang kills the pool and fails the test, never the suite.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import traceback
from typing import Any

from tests.netport import free_port

#: how long a closing pool waits for a rank's exit before it kills it
_EXIT_SECONDS = 10


def _measured() -> bool:
    """Whether coverage.py measures this run: a rank then writes its data file
    as it exits (seconds on a loaded machine) or on SIGTERM (``sigterm`` in
    ``[tool.coverage.run]``); a rank killed first would drop every line it ran
    from the report (a pool discarded after a deadline test dropped those of
    the files its ranks had served before)."""
    coverage = sys.modules.get("coverage")
    return coverage is not None and coverage.Coverage.current() is not None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: /proc/<pid>/task/<tid>/children), deepest last."""
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        try:
            tids = os.listdir(f"/proc/{cur}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{cur}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


class WorkerError(RuntimeError):
    """One or more ranks raised; the message holds each rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))


#: the folder ``dist.preload`` is imported from (tests/): on the fork server's PYTHONPATH (:func:`context`)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what the fork server imports once, before it forks any rank: torch._dynamo is
#: what the first optimizer a process builds imports (1.5-3 s of CPU),
#: torch._inductor.compile_fx what the first ``torch.compile`` call imports (1.5 s:
#: DeepSpeed's and Megatron-Core's modules call it when imported), dist.preload
#: Megatron-Core's modules and the cases' others, then freezes the collector's view of
#: it all (tests/dist/test_pool_preload.py checks that the ranks hold them); DeepSpeed is
#: imported by the ranks that use it (it reads the environment a pool sets when it is
#: imported)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "numpy", "pyarrow", "bytecp", "bytecp.dist", "bytecp.dist_raw",
           "dist.preload"]


def context() -> Any:
    """multiprocessing's fork-server context, its server preloading :data:`PRELOAD`.

    The server is started here, with ``tests/`` on its ``PYTHONPATH``: Python 3.11's
    fork server imports its preload before it takes the ``sys.path`` it is handed
    (and drops a module it cannot import without a word), so ``dist.preload`` --
    Megatron-Core, transformers and the rest -- would otherwise never be imported
    there and every rank would import them again."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, before) if p)
    try:
        forkserver.ensure_running()  # a server already running is kept (it is this process's)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def _worker(rank: int, world: int, port: int, inq: Any, outq: Any, env: dict[str, str], cwd: str,
            path: list[str]) -> None:
    os.chdir(cwd)
    sys.path[:] = path  # the fork server's is the one of the pool it started for
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    import bytecp.dist_raw  # noqa: F401  (its exit hook lets gloo's threads settle: no abort at exit)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    outq.put((rank, True, "ready"))
    while True:
        task = inq.get()
        if task is None:
            break
        module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            outq.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            outq.put((rank, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class WorkerPool:
    """``world_size`` ranks on gloo; ``run(fn, ...)`` calls ``fn`` on all of them."""

    def __init__(self, world_size: int, *, start_timeout: float = 180, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        ctx = context()
        self._inq = [ctx.Queue() for _ in range(world_size)]
        self._outq = ctx.Queue()
        port = free_port()
        full_env = {**os.environ, **(env or {})}
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._inq[r], self._outq, full_env, os.getcwd(),
                                              list(sys.path)),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._collect(start_timeout)

    def _collect(self, timeout: float) -> list[Any]:
        import time

        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(results) + len(failures) < self.world_size:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in results and r not in failures]
            try:
                rank, ok, val = self._outq.get(timeout=max(0.05, min(left, 1.0)))
            except queue.Empty:
                if dead and left < timeout - 5:
                    for r in dead:
                        failures[r] = f"process exited with code {self.procs[r].exitcode}"
                if left <= 0:
                    self.close(kill=True)
                    missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s") from None
                continue
            (results if ok else failures)[rank] = val
        if failures:
            raise WorkerError(failures)
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Any, *args: Any, timeout: float = 120, **kwargs: Any) -> list[Any]:
        for q in self._inq:
            q.put((fn.__module__, fn.__qualname__, args, kwargs))
        return self._collect(timeout)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._inq:
                try:
                    q.put(None)
                except Exception:
                    pass
            for p in self.procs:
                p.join(timeout=_EXIT_SECONDS * (6 if _measured() else 1))
        # e.g. a framework's own writer processes, orphaned by the kill: they would outlive the suite
        below = {p.pid: _descendants(p.pid) for p in self.procs if p.is_alive() and p.pid}
        if below and _measured():  # SIGTERM first: coverage.py's handler writes what the rank ran
            for p in self.procs:
                if p.pid in below:
                    p.terminate()
            for p in self.procs:
                if p.pid in below:
                    p.join(timeout=_EXIT_SECONDS)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            for pid in below.get(p.pid, []):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
