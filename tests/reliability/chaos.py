"""The chaos run's driver: episodes of a 2-rank training job, each meeting one
seeded random fault, each followed by a restart as a scheduler would make
(new processes, ``CheckpointManager.restore``). Used by test_chaos.py (short)
and benchmarks/chaos.py (long).

Faults: ``kill`` (SIGKILL of a rank at a random point of a save: plan,
stage, write, commit, just after the commit), ``stop`` (SIGSTOP of a rank
mid-save, past the save deadline; continued by the driver after it),
``fill`` (the disk, a real small tmpfs, filled for 3 steps), ``readonly``
(the tmpfs remounted read-only for 3 steps), ``s3`` (the job saves to moto
through the fault proxy: 503, 500, resets before and after the server acted,
truncated replies), ``keeper`` (SIGKILL of a keeper process of the memory
tier at a random point of a save, restarted empty by the driver at once),
``none``. ``none``, ``kill``, ``stop`` and ``keeper`` episodes may run with
the memory tier (``chaos_keepers.py``: a keeper per rank's host, memory
checkpoints every step replicated to the peer's keeper, every second one
drained to the disk); the disk faults and ``s3`` never do (the ranks do not
write to storage then). A kill or a keeper kill names only phase/rank pairs
that are reached: ``commit`` only on the coordinator (rank 0);
``committed`` on either rank (the coordinator just after writing
``metadata.json``, the other once the outcome reached it: the checkpoint is
committed, its files must stay and the restart must resume from it). Invariants checked after every episode:

- the restored state is bitwise the state training reaches at that step;
- every committed checkpoint passes ``bytecp verify`` (memory ones too);
- after a job that ended normally, no file is left but those kept
  checkpoints need (their data, index, metadata, reports, retired bases),
  on the disk and in the keepers' memory (after the keepers' drains); a
  keeper killed while draining a checkpoint to the disk leaves the part it
  wrote (as any killed process does), which the next job's retention must
  have removed by its end;
- every kill and keeper kill fired;
- the job's last save commits once its fault is over (``none``, ``stop``,
  ``fill``, ``readonly`` on disk): ranks a stall left a save apart come
  back into step;
- no episode runs past its timeout; a stalled rank's peer has its error
  within the deadline plus the roll call plus slack (a failed save, or, for
  a stall after a save's commit, its CommittedWithErrorsWarning).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import posixpath
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bytecp import faults
from bytecp.dist import DistContext
from bytecp.format import metadata as fmt
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify
from tests.netport import free_port as _port

HERE = Path(__file__).resolve().parent
#: the S3 servers and the fault proxy live beside the storage tests
STORAGE_TESTS = HERE.parent / "storage"
KINDS = ("none", "kill", "stop", "fill", "readonly", "keeper")
PHASES = ("plan", "stage", "write", "commit", "committed")
#: the kinds that may run with the memory tier (``keeper`` always does)
MEMORY_KINDS = ("none", "kill", "stop", "keeper")
#: the kinds whose job's last save (its fault long over, the stalled rank back) must commit
LAST_COMMITS = ("none", "stop", "fill", "readonly")
MEMORY_URL = "keeper://chaos"


@dataclasses.dataclass
class Figures:
    episodes: int = 0
    saves: int = 0
    failed_saves: int = 0
    restarts: int = 0
    verified: int = 0
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    stalls: list[float] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        stall = f", stall->error {min(self.stalls):.2f}-{max(self.stalls):.2f} s" if self.stalls else ""
        return (f"{self.episodes} episodes, {self.restarts} restarts, {self.saves} saves ({self.failed_saves} failed), "
                f"faults {dict(self.faults)}, {self.verified} checkpoint verifications{stall}, "
                f"{len(self.problems)} problems, {self.seconds:.0f} s")




def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def leftovers(storage: Any) -> list[str]:
    """Files below a run that no committed checkpoint needs."""
    files = storage.list_files("")
    needed: set[str] = set()
    for name in sorted({f.split("/", 1)[0] for f in files}):
        if f"{name}/{fmt.METADATA_FILE}" not in files:
            continue
        md = fmt.Metadata.from_bytes(storage.read_bytes(f"{name}/{fmt.METADATA_FILE}"), name)
        needed |= {posixpath.normpath(f"{name}/{ref}") for ref in md.referenced_files()}
        needed |= {f for f in files if f.startswith((f"{name}/reports/", f"{name}/metadata.json"))}
    dirs = {f.split("/", 1)[0] for f in needed}
    return sorted(f for f in files if f not in needed and not (f.endswith("/base.json") and f.split("/")[0] in dirs))


class Chaos:
    """Runs episodes against one local run (on ``disk``, a tmpfs) and, when
    ``s3`` is given (server, bucket), one S3 run behind a fault proxy."""

    def __init__(self, disk: Path, *, seed: int = 0, s3: tuple[Any, str] | None = None, deadline: float = 3.0,
                 steps: int = 8, episode_timeout: float = 90.0, log: Any = print,
                 popen: Any = subprocess.Popen) -> None:
        self.disk, self.rng, self.s3, self.deadline = disk, random.Random(seed), s3, deadline
        #: starts a rank (``subprocess.Popen``; the suite passes a warm interpreter's ``popen``)
        self.popen = popen
        self.steps, self.episode_timeout, self.log = steps, episode_timeout, log
        self.fig = Figures()
        self.stop_step = {"local": 0, "s3": 0, "memory": 0}
        self.keepers: Any = None  # chaos_keepers.Keepers, from the first memory episode on
        #: per run URL: files a keeper episode left on disk (a drain the kill cut short), gone after the next job
        self.drained_late: dict[str, set[str]] = {}

    def kinds(self) -> tuple[str, ...]:
        return KINDS + (("s3",) if self.s3 else ())

    def close(self) -> None:
        """Stop the keepers (when a memory episode started them)."""
        if self.keepers is not None:
            self.keepers.close()
            self.keepers = None

    def episode(self, kind: str | None = None, memory: bool | None = None, *,
                phase: str | None = None, rank: int | None = None) -> None:
        """One episode of fault ``kind`` (random when None), with the memory
        tier when ``memory`` (random for the kinds it fits when None), at
        ``phase`` on ``rank`` (random when None: a phase of ``PHASES`` and a
        rank that reaches it)."""
        rng = self.rng
        kind = kind or rng.choice(self.kinds())
        if memory is None:
            memory = kind == "keeper" or kind in MEMORY_KINDS and rng.random() < 0.3
        if kind == "keeper" and not memory or memory and kind not in MEMORY_KINDS:
            raise ValueError(f"a {kind} episode {'needs' if kind == 'keeper' else 'cannot have'} the memory tier")
        where = "s3" if kind == "s3" else "memory" if memory else "local"
        start = self.stop_step[where]
        stop_step = self.stop_step[where] = start + self.steps
        chosen = rng.choice(PHASES)
        phase = phase or chosen
        # (commit: the coordinator's alone; another rank never reaches it)
        chosen_rank = 0 if phase in faults.COORDINATOR_PHASES else rng.randint(0, 1)
        fault: dict[str, Any] = {"kind": kind, "step": start + rng.randint(2, self.steps - 3),
                                 "rank": chosen_rank if rank is None else rank,
                                 "phase": phase, "delay": round(rng.uniform(0.0, 0.03), 4), "disk": str(self.disk)}
        mem_cfg: dict[str, Any] | None = None
        if memory:
            if self.keepers is None:
                from .chaos_keepers import Keepers

                self.keepers = Keepers()
            self.keepers.revive()
            host = f"h{rng.randint(0, 1)}"
            fault.update(host=host, pid=self.keepers.pids()[host])
            mem_cfg = {"url": MEMORY_URL, "options": self.keepers.options()}
        revived: list[str] = []
        proxy = None
        if where == "s3":
            if str(STORAGE_TESTS) not in sys.path:
                sys.path.insert(0, str(STORAGE_TESTS))
            from fault_proxy import FaultProxy, Rule

            server, bucket = self.s3  # type: ignore[misc]
            proxy = FaultProxy(server.endpoint_url, seed=rng.randint(0, 1 << 30)).__enter__()
            proxy.rules.append(Rule(rate=0.08))
            run_url = f"s3://{bucket}/chaos"
            options = {**server.options(), "endpoint_url": proxy.endpoint_url, "request_timeout": 5.0,
                       "retry": {"deadline": 20.0, "initial_backoff": 0.02, "max_backoff": 0.3}}
            clean_options = server.options()
            fault = {}
        else:
            run_url, options, clean_options = str(self.disk / ("mem" if memory else "run")), {}, {}
        out = Path(tempfile.mkdtemp(prefix="chaos-"))
        cfg = {"run_url": run_url, "storage_options": options, "stop_step": stop_step, "async": rng.random() < 0.5,
               "deadline": self.deadline, "load_deadline": 60.0, "out": str(out), "fault": fault,
               "settle": 1.2, "memory": mem_cfg}
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
               "BYTECP_LEASE_SECONDS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        env.pop("BYTECP_FAULT_KILL", None)
        t0, problems = time.monotonic(), len(self.fig.problems)
        procs = [self.popen([sys.executable, str(HERE / "chaos_worker.py"), json.dumps(cfg)],
                            env={**env, "RANK": str(r)}, cwd=str(HERE),
                            stdout=subprocess.DEVNULL, stderr=open(out / f"err{r}.txt", "w"))
                 for r in range(2)]
        resumed = False
        try:
            while [p.poll() for p in procs].count(None):  # (every process polled: no short circuit)
                if any(p.returncode not in (None, 0) for p in procs):  # a rank died: the scheduler ends the job
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGCONT)
                            p.kill()
                    break
                stopped = out / "stopped"
                if not resumed and stopped.exists() and _state_of(procs[fault["rank"]].pid) == "T":
                    since = float(stopped.read_text() or time.time())
                    if time.time() > since + self.deadline + DistContext.ROLL_CALL_SECONDS + 2.0:
                        procs[fault["rank"]].send_signal(signal.SIGCONT)
                        resumed = True
                if self.keepers is not None:
                    revived += self.keepers.revive()  # (as a host's supervisor: at once, memory empty)
                if time.monotonic() - t0 > self.episode_timeout:
                    finished = len(list(out.glob("rank?.json"))) == 2  # main() returned on both: an exit hang
                    self.fig.problems.append(f"episode {self.fig.episodes} ({kind}) hung past {self.episode_timeout} s"
                                             + (" at interpreter exit, after the job's last step" if finished else ""))
                    for p in procs:  # stacks into err<rank>.txt first
                        p.send_signal(signal.SIGCONT)
                        p.send_signal(signal.SIGUSR1)
                    time.sleep(1.0)
                    for p in procs:
                        p.send_signal(signal.SIGCONT)
                        p.kill()
                    break
                time.sleep(0.05)
            for p in procs:
                p.wait(30)
        finally:
            if proxy is not None:
                proxy.__exit__(None, None, None)
            subprocess.run(["mount", "-o", "remount,rw", str(self.disk)], capture_output=True)
            (self.disk / "filler").unlink(missing_ok=True)
        if memory:
            revived += self.keepers.revive()
            if kind == "keeper":
                if revived:
                    self.fig.faults["keeper"] += 1
                else:
                    self.fig.problems.append(f"episode {self.fig.episodes}: the keeper kill at {fault['phase']} "
                                             f"on rank {fault['rank']} never fired")
            if not self.keepers.drained():
                self.fig.problems.append(f"episode {self.fig.episodes} ({kind}): a keeper's drain ran past 60 s")
        self._check(kind, fault, out, procs, run_url, clean_options, memory)
        if memory:
            self._check_memory(kind, procs)
        self.fig.episodes += 1
        self.fig.restarts += 1
        self.fig.seconds += time.monotonic() - t0
        if len(self.fig.problems) == problems:  # the ranks' logs and figures are kept only to explain a problem
            shutil.rmtree(out, ignore_errors=True)
        else:
            self.log(f"episode {self.fig.episodes - 1}: the ranks' logs are in {out}")

    def _check(self, kind: str, fault: dict[str, Any], out: Path, procs: list[Any], run_url: str,
               options: dict[str, Any], memory: bool) -> None:
        fig, ep = self.fig, self.fig.episodes
        ran = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.restore.json"))]
        if len(ran) < 2 and kind != "kill":
            fig.problems.append(f"episode {ep} ({kind}): a rank did not restore: "
                                f"{[(out / f'err{r}.txt').read_text()[-800:] for r in range(2)]}")
        for r in ran:
            if not r["restore_ok"]:
                fig.problems.append(f"episode {ep} ({kind}): rank {r['rank']} restored step {r['restored']} "
                                    "not bitwise equal to the training's state at that step")
        clean = all(p.returncode == 0 for p in procs)
        ends = [json.loads(p.read_text()) for p in sorted(out.glob("rank?.json"))]
        if kind != "kill" and not clean:
            fig.problems.append(f"episode {ep} ({kind}): exit codes {[p.returncode for p in procs]}: "
                                f"{[(out / f'err{r}.txt').read_text()[-800:] for r in range(2)]}")
        if kind == "kill" and not clean or kind not in ("none", "keeper") and any(e.get("fired") for e in ends) \
                or kind == "s3":
            fig.faults[kind] += 1
        if kind == "kill" and clean:
            fig.problems.append(f"episode {ep}: the kill at {fault['phase']} on rank {fault['rank']} never fired")
        for e in ends:
            if e["rank"] == 0:
                fig.saves += e["saves"]
                fig.failed_saves += len(e["errors"]) + len(e["failed_async"])
            if not e["final"]:
                fig.problems.append(f"episode {ep}: rank {e['rank']} ended with a state training never had")
        if kind == "stop" and (out / "stopped").exists() and len(ends) == 2:
            since = float((out / "stopped").read_text())
            peer = ends[1 - fault["rank"]]
            # each failed save's error, measured from the later of the stall and that save's start
            # (a save that began after the stall has its whole deadline from its own start)
            after = [end - max(since, start) for start, end in peer["failed_saves"] if end >= since]
            if not after:  # (an error raised before its save's report opened, or a stall after a commit:
                # the save stays committed and the peer hears of the stall as a CommittedWithErrorsWarning)
                times = [t for t, _ in peer["errors"]] + [t for t, _ in peer["failed_async"]]
                after = [t - since for t in times + peer["committed_with_errors"] if t >= since]
            if after:
                fig.stalls.append(min(after))
                if min(after) > self.deadline + DistContext.ROLL_CALL_SECONDS + 5.0:
                    fig.problems.append(f"episode {ep}: the stalled rank's peer erred {min(after):.1f} s after the stall")
            else:
                fig.problems.append(f"episode {ep}: no error on the peer of the stopped rank")
        root = open_storage(run_url, **options)
        last = f"step-{self.stop_step['local']}"
        if kind in LAST_COMMITS and not memory and clean and not root.exists(f"{last}/{fmt.METADATA_FILE}"):
            fig.problems.append(f"episode {ep} ({kind}): the job's last save ({last}) did not commit: "
                                f"{[e['errors'][-1:] + e['failed_async'][-1:] for e in ends]}")
        for name in root.list_children(""):
            if root.exists(f"{name}/{fmt.METADATA_FILE}"):
                _, problems = verify(root.child(name))
                fig.verified += 1
                if problems:
                    fig.problems.append(f"episode {ep}: committed {name} fails verify: {problems[:3]}")
        if clean:
            left = leftovers(root)
            late = sorted(set(left) & self.drained_late.pop(run_url, set()))
            if late:  # a killed keeper's partial drain outlived the next job's retention
                fig.problems.append(f"episode {ep} ({kind}): a killed keeper's partial drain is still there: {late[:6]}")
            if kind == "keeper":  # (its drain in flight died with it: the next job's retention sweeps it)
                self.drained_late[run_url] = set(left)
            elif left:
                fig.problems.append(f"episode {ep} ({kind}): files no kept checkpoint needs: {left[:6]}")
        self.log(f"episode {ep}: {kind}{' (memory tier)' if memory else ''} "
                 f"{fault.get('phase', '') if kind in ('kill', 'keeper') else ''}"
                 f"{' keeper ' + fault['host'] if kind == 'keeper' else ''} "
                 f"rank {fault.get('rank')} step {fault.get('step')} -> exit {[p.returncode for p in procs]}, "
                 f"restored {[r['restored'] for r in ran]}")

    def _check_memory(self, kind: str, procs: list[Any]) -> None:
        """The memory tier's committed checkpoints verify; after a job that
        ended normally, the keepers hold nothing else."""
        fig, ep = self.fig, self.fig.episodes
        mem = open_storage(MEMORY_URL, **self.keepers.options())
        for name in mem.list_children(""):
            if mem.exists(f"{name}/{fmt.METADATA_FILE}"):
                _, problems = verify(mem.child(name))
                fig.verified += 1
                if problems:
                    fig.problems.append(f"episode {ep}: committed memory checkpoint {name} fails verify: "
                                        f"{problems[:3]}")
        if all(p.returncode == 0 for p in procs):
            left = leftovers(mem)
            if left:
                fig.problems.append(f"episode {ep} ({kind}): files in the keepers' memory no kept memory "
                                    f"checkpoint needs: {left[:6]}")
