"""One rank of the chaos run's training job (see test_chaos.py), started by
the driver as a scheduler would: ``python chaos_worker.py CONFIG_JSON`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment.

The job restores from its run directory (``CheckpointManager.restore``),
checks that the restored state is bitwise the one training reaches at that
step (training is deterministic: step N's state is recomputed from scratch),
then trains a tiny model with a checkpoint every step, meeting the fault its
configuration names at its step: SIGKILL or SIGSTOP of a rank mid-save
(``BYTECP_FAULT_KILL`` / a timer thread), a full disk (a filler file), a
read-only remount, SIGKILL of a keeper mid-save (``BYTECP_FAULT_KILL`` with
the keeper's pid). With the memory tier (``memory`` in the configuration)
the rank runs on host ``h<rank>`` and ``maybe_save`` checkpoints to the
keepers' memory every step, to storage (drained) every second one. Failed
saves are caught and counted, as a training loop that keeps training would.
It writes ``<out>/rank<R>.json`` at the end.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tmpfs import remount  # (tests/reliability is on the ranks' path)
from torch import nn

from bytecp import recorder
from bytecp.errors import BytecpError
from bytecp.manager import CheckpointManager
from bytecp.recorder import CheckpointReport


def fresh_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2), "extra": {"step": 0}}


def train_step(state: dict[str, Any], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = ((state["model"](x) - y) ** 2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["extra"]["step"] = step


def digest(state: dict[str, Any]) -> str:
    """Every byte of the model, the optimizer's tensors and the step."""
    h = hashlib.sha256()
    for k, v in state["model"].state_dict().items():
        h.update(k.encode())
        h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    opt = state["optimizer"].state_dict()["state"]
    for k in sorted(opt):
        for name in sorted(opt[k]):
            t = torch.as_tensor(opt[k][name]).reshape(-1).contiguous()
            h.update(f"{k}.{name}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    h.update(str(state["extra"]["step"]).encode())
    return h.hexdigest()


def expected(step: int) -> str:
    state = fresh_state()
    for i in range(1, step + 1):
        train_step(state, i)
    return digest(state)


class Failures:
    """Times of the ``save_failed`` events (asynchronous saves the manager
    reported) and of the ``save_committed_with_errors`` events (a save that
    committed, then lost a rank: a stall after the commit), and the start and
    end of every failed save's report (sync or async): the driver measures a
    stalled peer's error from the later of the stall and the failing save's
    start."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.warned: list[float] = []
        self.saves: list[list[float]] = []

    def on_report(self, report: CheckpointReport) -> None:
        if report.operation == "save" and not report.ok:
            self.saves.append([report.started, report.ended])

    def on_start(self, *args: object, **kwargs: object) -> None:
        pass

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        if name == "save_failed":
            self.times.append(time.time())
        elif name == "save_committed_with_errors":
            self.warned.append(time.time())


def main(cfg: dict[str, Any]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks before it kills a hang
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fault: dict[str, Any] = cfg.get("fault") or {}
    out: dict[str, Any] = {"rank": rank, "errors": [], "saves": 0}
    failures = Failures()
    recorder.add_recorder(failures)
    state = fresh_state()
    memory: dict[str, Any] = {}
    if cfg.get("memory"):
        memory = {"memory_url": cfg["memory"]["url"], "memory_every_n_steps": 1, "memory_keep_last": 2,
                  "memory_storage_options": {**cfg["memory"]["options"], "host": f"h{rank}"}}
    mgr = CheckpointManager(cfg["run_url"], every_n_steps=2 if memory else 1, keep_last=2, async_save=cfg["async"],
                            save_timeout_s=cfg["deadline"], storage_options=cfg.get("storage_options") or {},
                            **memory)
    restored = mgr.restore(state, load_timeout_s=cfg["load_deadline"]) or 0
    out["restored"] = restored
    out["restore_ok"] = digest(state) == expected(restored)
    Path(cfg["out"], f"rank{rank}.restore.json").write_text(json.dumps(out))  # (a killed job writes no more)
    mine = fault.get("rank") == rank
    for step in range(restored + 1, cfg["stop_step"] + 1):
        if step == cfg["stop_step"]:
            time.sleep(cfg.get("settle", 0.0))  # leases of failed saves expire: the last commit sweeps them
        train_step(state, step)
        if step == fault.get("step") and mine:
            kind = fault["kind"]
            if kind == "kill":
                os.environ["BYTECP_FAULT_KILL"] = f"{fault['phase']}:{rank}:{fault['delay']}"
            elif kind == "keeper":  # (once, at the first save reaching the phase)
                os.environ["BYTECP_FAULT_KILL"] = f"{fault['phase']}:{rank}:{fault['delay']}:{fault['pid']}"
            elif kind == "stop":
                def stop() -> None:
                    Path(cfg["out"], "stopped").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGSTOP)

                threading.Timer(fault["delay"], stop).start()
            elif kind == "fill":
                filler = Path(fault["disk"], "filler")
                try:  # (a disk already full refuses even the open)
                    with open(filler, "wb") as f:
                        while True:
                            f.write(b"\0" * (1 << 16))
                            f.flush()
                except OSError:
                    pass
            elif kind == "readonly":
                remount(fault["disk"], "ro")  # (tried again while the save in flight holds a file open)
            out["fired"] = True
        if step == fault.get("step", -9) + 3 and mine:
            if fault["kind"] == "fill":
                Path(fault["disk"], "filler").unlink()
            elif fault["kind"] == "readonly":
                remount(fault["disk"], "rw")
        try:
            if not memory:
                mgr.save(step, state)
            elif not mgr.maybe_save(step, state):
                continue
            out["saves"] += 1
        except BytecpError as e:
            out["errors"].append([time.time(), f"{type(e).__name__}: {e}"[:400]])
    try:
        mgr.wait()
    except BytecpError as e:
        out["errors"].append([time.time(), f"{type(e).__name__}: {e}"[:400]])
    out["failed_async"] = [[t, u] for t, (u, _) in zip(failures.times, mgr.failed, strict=False)]
    out["failed_saves"] = failures.saves
    out["committed_with_errors"] = failures.warned
    out["final"] = digest(state) == expected(cfg["stop_step"])
    recorder.remove_recorder(failures)
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
