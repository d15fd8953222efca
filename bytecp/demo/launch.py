"""The demo's launcher: one training job of N processes, what torchrun does
for it, plus the kill.

Called by :mod:`bytecp.demo.story`, one :func:`run_job` per stage. It starts
``python -m bytecp.demo.train`` once per rank with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``...) and, as
torchrun's agent does, hosts the job's rendezvous store itself, relays rank
0's lines to the terminal with the job's label, and keeps every rank's
stderr in ``logs/``. With ``kill=True`` it waits for the victim rank to
announce itself (``victim.json``, written by the training job once its part
of the doomed save is staged) and sends it SIGKILL. Whatever happens, no
process outlives the call: once one rank has ended badly the others get
``grace`` seconds to stop on their own (bytecp carries the failure to them),
then they are killed; a job past ``timeout`` is killed whole. The outcome
says, rank by rank, how each one ended.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["RankExit", "JobOutcome", "run_job"]


@dataclasses.dataclass
class RankExit:
    """How one rank's process ended."""

    rank: int
    pid: int
    returncode: int
    #: "exited" (on its own), "killed by the demo" (the victim), "killed after the grace period", "killed at timeout"
    how: str
    #: seconds from the kill (or the first bad exit) to this process's end; None if nothing went wrong first
    after_failure_s: float | None


@dataclasses.dataclass
class JobOutcome:
    label: str
    world: int
    exits: list[RankExit]
    seconds: float
    #: rank 0's result.json (None if it wrote none)
    result: dict[str, Any] | None
    #: what the victim announced before it was killed (kill=True only)
    victim: dict[str, Any] | None
    logs: dict[int, str]

    @property
    def clean(self) -> bool:
        return all(e.how == "exited" and e.returncode == 0 for e in self.exits)

    def log_tail(self, rank: int, chars: int = 1500) -> str:
        with open(self.logs[rank], errors="replace") as f:
            return f.read()[-chars:]


def _rendezvous(world: int, timeout: float) -> Any:
    """The job's rendezvous store, hosted by this process as torchrun's agent
    hosts it (the ranks connect to it: ``TORCHELASTIC_USE_AGENT_STORE``). Its
    server binds a port the kernel picks and holds it for the job's life: a
    port found free and handed to rank 0 to bind later could be taken
    meanwhile (any ``connect()`` on the host may be given it as its local
    port), and the job would fail with EADDRINUSE."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)


def _relay(stream: IO[str], label: str) -> None:
    for line in stream:
        print(f"  [{label}] {line.rstrip()}", flush=True)


def run_job(label: str, world: int, train_args: list[str], results: str, logs: str, *, kill: bool = False,
            on_kill: Callable[[dict[str, Any]], None] | None = None, grace: float = 60.0,
            timeout: float = 300.0) -> JobOutcome:
    """Run one training job of ``world`` processes to its end (see the module
    doc); ``on_kill(victim)`` is called just after the victim is killed."""
    os.makedirs(results, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    for stale in ("result.json", "victim.json"):
        if os.path.exists(os.path.join(results, stale)):
            os.remove(os.path.join(results, stale))
    store = _rendezvous(world, timeout)
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "bytecp.demo.train", *train_args, "--results", results]
    procs: list[subprocess.Popen[str]] = []
    files = []
    log_paths = {}
    t0 = time.monotonic()
    relay: threading.Thread | None = None
    try:
        for rank in range(world):
            log_paths[rank] = os.path.join(logs, f"{label.replace(' ', '-')}-rank{rank}.log")
            f = open(log_paths[rank], "w")  # noqa: SIM115 - closed below
            files.append(f)
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            out = subprocess.PIPE if rank == 0 else f
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=f, text=True, start_new_session=True))
        assert procs[0].stdout is not None
        relay = threading.Thread(target=_relay, args=(procs[0].stdout, label), daemon=True)
        relay.start()
        exits, victim = _supervise(procs, results, kill=kill, on_kill=on_kill, grace=grace, deadline=t0 + timeout)
    finally:
        for p in procs:  # never leave a process behind, whatever went wrong here
            if p.poll() is None:
                _kill(p)
                p.wait()
        if relay is not None:
            relay.join(timeout=10)
        for f in files:
            f.close()
        del store  # every rank has ended: the server stops with it
    path = os.path.join(results, "result.json")
    result = json.loads(open(path).read()) if os.path.exists(path) else None
    return JobOutcome(label, world, exits, time.monotonic() - t0, result, victim, log_paths)


def _kill(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: it and anything it started
    except ProcessLookupError:
        pass


def _supervise(procs: list[subprocess.Popen[str]], results: str, *, kill: bool,
               on_kill: Callable[[dict[str, Any]], None] | None, grace: float,
               deadline: float) -> tuple[list[RankExit], dict[str, Any] | None]:
    """Poll the ranks until all have ended; kill the victim on cue, the
    stragglers after ``grace`` seconds, everyone at ``deadline``."""
    ended: dict[int, RankExit] = {}
    failed_at: float | None = None  # when the first rank died or ended badly
    victim: dict[str, Any] | None = None
    killed: dict[int, str] = {}
    vpath = os.path.join(results, "victim.json")
    while len(ended) < len(procs):
        now = time.monotonic()
        if kill and victim is None and os.path.exists(vpath):
            victim = json.loads(open(vpath).read())
            rank = int(victim["rank"])
            _kill(procs[rank])
            killed[rank] = "killed by the demo"
            victim["killed_at"] = time.time()
            failed_at = now
            if on_kill is not None:
                on_kill(victim)
        for rank, p in enumerate(procs):
            if rank in ended or p.poll() is None:
                continue
            if failed_at is None and p.returncode != 0:
                failed_at = now
            after = None if failed_at is None else max(0.0, now - failed_at)
            ended[rank] = RankExit(rank, p.pid, p.returncode, killed.get(rank, "exited"), after)
        if len(ended) == len(procs):
            break
        late = now > deadline
        if late or (failed_at is not None and now - failed_at > grace):
            for rank, p in enumerate(procs):
                if rank not in ended and rank not in killed:
                    killed[rank] = "killed at timeout" if late else "killed after the grace period"
                    _kill(p)
        time.sleep(0.02)
    return [ended[r] for r in range(len(procs))], victim
