"""A checkpoint at every step on one GPU: what it adds to a training step.

    python -m benchmarks.every_step [--params 1.2e9] [--batch 16] [--seq 1024] [--steps 60]
                                    [--disk-every 50] [--rounds 2] [--json out.json]

The headline of FastPersist and DataStates-LLM (checkpoint every iteration at
negligible cost), measured: a GPT (benchmarks/model.py) of at least
``--params`` parameters, bf16 weights on the GPU trained with fp32 master
weights and fp32 Adam moments (2 + 12 bytes a parameter, all of it saved),
runs ``--steps`` training steps in loops that alternate (``--rounds`` of
each, so a warming GPU or a busy host hits both alike):

- without checkpoints;
- with ``CheckpointManager(async_save=True, lazy=True,
  memory_url="keeper://...", memory_every_n_steps=1, every_n_steps=--disk-every)``:
  after every step a lazy save to this host's keeper (``bytecp keeper``
  started here: shared memory, the single-copy path, arenas pinned and
  prewarmed), and every ``--disk-every``-th step the keeper drains that
  checkpoint to local disk (``--dir``).

Figures (seconds): each loop's step times (median and mean; the device is
synchronized at the end of every step, as a loss read would), the training
time a checkpoint adds per step (the mean with checkpoints less the mean
without) and as a fraction of the step (goal: at most 1%), what the
``maybe_save`` call and the optimizer's pre-step hook (a lazy save's copy
not yet queued) take per step, the memory and disk checkpoints committed,
and whether the last memory checkpoint reads back bitwise equal to the
state it saved.

Without CUDA it says so and writes ``{"skipped": reason}``; ``--device cpu``
runs the same logic on the CPU at any size (the tests run it tiny).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tests.netport import free_port

__all__ = ["Job", "config_for_params", "Keeper", "run", "phases", "summary", "main"]

#: the goal: training time added per step, as a fraction of the step
GOAL = 0.01


def config_for_params(n: float, seq: int) -> Any:
    """The smallest GPT (benchmarks/model.py) of at least ``n`` parameters
    (16 blocks and a 32k vocabulary from 5e8 up; 2 blocks and 256 below)."""
    from benchmarks.model import GPTConfig

    layers, vocab = (16, 32768) if n >= 5e8 else (2, 256)
    hidden = 64
    while GPTConfig(layers=layers, hidden=hidden, vocab=vocab, seq=seq).params < n:
        hidden += 64
    return GPTConfig(layers=layers, hidden=hidden, vocab=vocab, seq=seq)


class Job:
    """The training job: bf16 weights on ``device``, fp32 master weights, fp32 Adam (fused on CUDA)."""

    def __init__(self, params: float, batch: int, seq: int, device: str, seed: int = 0) -> None:
        from benchmarks.model import GPT

        self.device = torch.device(device)
        self.cfg = config_for_params(params, seq)
        torch.manual_seed(seed)
        with self.device:
            self.model = GPT(self.cfg).to(torch.bfloat16)
            self.master = GPT(self.cfg)
        self.master.load_state_dict({k: v.float() for k, v in self.model.state_dict().items()})
        self.optimizer = torch.optim.Adam(self.master.parameters(), lr=1e-5, fused=self.device.type == "cuda")
        self._params = list(self.model.parameters())
        self._masters = list(self.master.parameters())
        for q in self._masters:
            q.grad = torch.zeros_like(q)
        g = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.tokens = torch.randint(self.cfg.vocab, (batch, seq + 1), device=self.device, generator=g)
        self.step()  # Adam state exists from here on

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def state(self) -> dict[str, Any]:
        """What is checkpointed: the bf16 model, the fp32 masters and Adam (its hook guards lazy saves)."""
        return {"model": self.model, "master": self.master, "optimizer": self.optimizer}

    def state_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in (*self._params, *self._masters))
        return n + sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                       for v in st.values() if isinstance(v, torch.Tensor))

    def step(self) -> None:
        """Forward, backward (bf16), Adam on the fp32 masters, masters back into the bf16 weights."""
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, self.cfg.vocab).float(), self.tokens[:, 1:].reshape(-1)).backward()
        torch._foreach_copy_([q.grad for q in self._masters], [p.grad for p in self._params])
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self._params, self._masters)
        for p in self._params:
            p.grad = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Keeper:
    """This host's keeper (``bytecp keeper``) in a process of its own, one host, one copy."""

    def __init__(self, root: Path) -> None:
        port = free_port()
        token = "t-" + uuid.uuid4().hex
        ready = root / f"keeper-{port}.ready"
        self.log = root / "keeper.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bytecp.storage.keeper_server", "--name", "h0", "--port", str(port),
             "--keepers", f"h0=127.0.0.1:{port}", "--replicas", "1", "--ready-file", str(ready)],
            env=dict(os.environ, BYTECP_KEEPER_TOKEN=token), stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"))  # noqa: SIM115 - the process keeps it
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the keeper did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.options = {"keepers": f"h0=127.0.0.1:{port}", "host": "h0", "token": token}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # (a stopped keeper frees its shared memory)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _loop(job: Job, steps: int, save: Callable[[int], None] | None, first: int = 0) -> dict[str, list[float]]:
    """``steps`` training steps, ``save(step)`` after each update; per step:
    its time (the device synchronized at its end), the save call's, and the
    optimizer step's (where a lazy save's hook waits)."""
    out: dict[str, list[float]] = {"step_s": [], "call_s": [], "optimizer_s": []}
    opt_step = job.optimizer.step
    spent: list[float] = []

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return opt_step(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t)

    job.optimizer.step = timed_step  # type: ignore[method-assign]
    try:
        job.sync()
        for s in range(first, first + steps):
            spent.clear()
            t0 = time.perf_counter()
            job.step()
            t1 = time.perf_counter()
            if save is not None:
                save(s)
            t2 = time.perf_counter()
            job.sync()
            out["step_s"].append(time.perf_counter() - t0)
            out["call_s"].append(t2 - t1)
            out["optimizer_s"].append(sum(spent))
    finally:
        del job.optimizer.step  # the instance attribute goes: the class's method again
    return out


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def run(params: float, batch: int, seq: int, steps: int, disk_every: int, rounds: int, root: Path,
        device: str = "cuda", verify: bool = True) -> dict[str, Any]:
    """Every figure, in this process; the keeper in its own."""
    import bytecp
    from bytecp.catalog import list_checkpoints
    from bytecp.recorder import recording

    if device == "cuda" and not torch.cuda.is_available():
        return {"skipped": f"no CUDA device (torch {torch.__version__})"}
    job = Job(params, batch, seq, device)
    nbytes = job.state_bytes()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                           "torch": torch.__version__, "params": job.n_params, "state_bytes": nbytes,
                           "batch": batch, "seq": seq, "steps": steps, "disk_every": disk_every}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    need = 3 * nbytes  # the arenas a save takes turns in (one kept checkpoint, one being saved) and slack
    if _free_bytes(shm) < need:
        return {**out, "skipped": f"{shm} has {_free_bytes(shm) / 1e9:.1f} GB free, the memory tier needs about "
                                  f"{need / 1e9:.1f} GB for {nbytes / 1e9:.1f} GB of state"}
    keeper = Keeper(root)
    try:
        run_dir = root / "run"
        mgr = bytecp.CheckpointManager(
            str(run_dir), every_n_steps=disk_every, keep_last=1, async_save=True, lazy=True,
            memory_url="keeper://every-step/run", memory_every_n_steps=1, memory_keep_last=1,
            memory_storage_options=keeper.options)
        mgr.maybe_save(0, job.state())  # prewarms (the arenas, mapped and pinned) and saves once
        mgr.wait()
        _loop(job, 2, None, first=1)  # warm
        loops: dict[str, dict[str, list[float]]] = {"without": {}, "with": {}}
        state = job.state()
        step = 3

        def save(s: int) -> None:
            mgr.maybe_save(s, state)

        with recording() as reports:
            for _ in range(rounds):
                for name in ("without", "with"):
                    got = _loop(job, steps, save if name == "with" else None, first=step)
                    for k, v in got.items():
                        loops[name].setdefault(k, []).extend(v)
                    step += steps
                    mgr.wait()  # the last checkpoint committed before the loop without
        out["save_phases_s"] = phases(reports)
        last = step - 1  # the last step saved (to memory) by the last loop with checkpoints
        out.update(summary(loops))
        out["memory_checkpoints_kept"] = [c.step for c in list_checkpoints("keeper://every-step/run",
                                                                            storage_options=keeper.options)]
        out["disk_checkpoints_kept"] = [c.step for c in list_checkpoints(str(run_dir))]
        out["last_step"] = last
        out["failed_saves"] = len(mgr.failed)
        out["pinning"] = _pinning()
        out["keeper_arenas"] = _keeper_arenas(keeper.options)
        if verify:
            out["last_checkpoint_bitwise"] = _bitwise(f"keeper://every-step/run/step-{last}", keeper.options,
                                                      job.state())
    finally:
        keeper.close()
    return out


def _pinning() -> dict[str, int]:
    """This process's host memory pinned for CUDA copies (the keeper's arenas among it: a failed
    registration leaves device copies at pageable speed) and its mappings of the keeper's arenas
    (a miss maps, and pins, an arena again)."""
    from bytecp.storage._keeper_maps import MAPPINGS

    from bytecp import device_memory

    st = device_memory.STATS
    return {"registered": st.registered, "registered_bytes": st.registered_bytes,
            "register_failures": st.register_failures, "device_to_host_batches": st.device_to_host,
            "arena_mapping_hits": MAPPINGS.hits, "arena_mapping_misses": MAPPINGS.misses}


def _keeper_arenas(options: dict[str, Any]) -> dict[str, Any]:
    """The keeper's arena counters (lent, adopted, pooled) and its CPU seconds."""
    from bytecp.storage_api import open_storage

    stats = open_storage("keeper://every-step/run", **options).keeper_stats()  # type: ignore[attr-defined]
    return {**(stats[0].get("arenas") or {}), "keeper_cpu_s": stats[0].get("cpu_s")} if stats else {}


def _bitwise(url: str, options: dict[str, Any], state: dict[str, Any]) -> bool:
    """Whether the checkpoint at ``url`` holds every tensor of ``state`` (as it is now) bitwise."""
    import bytecp

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().reshape(-1).view(torch.uint8)

    got = bytecp.load_state_dict(url, storage_options=options)
    for key in ("model", "master"):
        for name, t in state[key].state_dict().items():
            if not torch.equal(bits(got[key][name]), bits(t)):
                return False
    names = {id(p): f"master.{n}" for n, p in state["master"].named_parameters()}  # (two modules: by key)
    for p, st in state["optimizer"].state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not torch.equal(bits(got["optimizer"]["state"][names[id(p)]][k]),
                                                               bits(v)):
                return False
    return True


def phases(reports: list[Any]) -> dict[str, Any]:
    """Where the saves of the loops with checkpoints spent their time: each
    phase's median seconds a save (its spans summed), the save's whole
    duration, and how many saves; memory-tier saves and disk saves apart
    (a disk save's URL is not ``keeper://``)."""
    out: dict[str, Any] = {}
    for tier in ("memory", "disk"):
        done = [r for r in reports if r.operation == "save" and r.ok
                and r.url.startswith("keeper://") == (tier == "memory")]
        if not done:
            continue
        names = sorted({p for r in done for p in r.phase_seconds()})
        out[tier] = {"saves": len(done), "duration": statistics.median(r.duration for r in done),
                     "stall": statistics.median(r.stall_seconds for r in done),
                     **{n: statistics.median(r.phase_seconds().get(n, 0.0) for r in done) for n in names}}
    return out


def summary(loops: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """The figures of the loops without and with checkpoints (their per-step lists)."""
    base, ck = loops["without"]["step_s"], loops["with"]["step_s"]
    mean_base, mean_ck = statistics.fmean(base), statistics.fmean(ck)
    added = mean_ck - mean_base
    fraction = added / mean_base if mean_base > 0 else math.inf
    return {
        "step_without_s": {"median": statistics.median(base), "mean": mean_base, "min": min(base)},
        "step_with_s": {"median": statistics.median(ck), "mean": mean_ck, "min": min(ck)},
        "added_per_step_s": added,
        "added_fraction": fraction,
        "call_s": {"median": statistics.median(loops["with"]["call_s"]), "max": max(loops["with"]["call_s"])},
        "optimizer_with_s": statistics.median(loops["with"]["optimizer_s"]),
        "optimizer_without_s": statistics.median(loops["without"]["optimizer_s"]),
        "target": {"added_fraction": round(fraction, 5), "goal": GOAL, "met": fraction <= GOAL},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.2e9, help="parameters of the model, at least")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60, help="steps of each loop")
    ap.add_argument("--disk-every", type=int, default=50, help="every this many steps a checkpoint drains to disk")
    ap.add_argument("--rounds", type=int, default=2, help="loops of each kind, alternated")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-verify", action="store_true", help="skip reading the last checkpoint back")
    ap.add_argument("--dir", default=None, help="where the disk tier and the keeper's log go (default: temporary)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bytecp-every-step-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        out = run(args.params, args.batch, args.seq, args.steps, args.disk_every, args.rounds, root,
                  device=args.device, verify=not args.no_verify)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
