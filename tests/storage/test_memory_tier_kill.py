"""Kill a host mid-run: two simulated hosts (one rank and one keeper process
each, distinct loopback ports) train with a memory tier; host h1's rank and
keeper are killed, the job restarts with a fresh, empty keeper on h1, and
every rank restores the newest memory checkpoint from the peer's memory,
bitwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.storage._keeper_wire import request
from keepers import TOKEN, spawn_keeper

from tests.netport import free_ports

pytestmark = pytest.mark.spawn

WORKER = str(Path(__file__).with_name("memtier_worker.py"))


def ranks(warm: Any, mode: str, tmp: Path, ports: dict[str, int], steps: int) -> list[Any]:
    """The job's two ranks, forked from a warm interpreter (a start costs no torch import)."""
    (master,) = free_ports(1)
    spec = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    procs = []
    for rank, host in enumerate(sorted(ports)):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                   BYTECP_KEEPERS=spec, BYTECP_KEEPER_HOST=host, BYTECP_KEEPER_TOKEN=TOKEN)
        procs.append(warm.popen(
            [sys.executable, WORKER, mode, str(tmp / "run"), str(tmp / f"{mode}-{rank}.pt"), str(steps), "32"],
            env=env, stdout=subprocess.PIPE, stderr=open(tmp / f"{mode}-{rank}.log", "w"), text=True))  # noqa: SIM115
    return procs


def line(proc: subprocess.Popen[str], tmp: Path, name: str) -> dict[str, object]:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    if not text:
        proc.wait(timeout=30)
        pytest.fail(f"{name} ended without a result: {(tmp / (name + '.log')).read_text()[-3000:]}")
    out: dict[str, object] = json.loads(text)
    return out


@pytest.mark.slow
def test_kill_a_host_restore_from_the_peer_bitwise(tmp_path: Path, warm: Any) -> None:
    ports = dict(zip(["h0", "h1"], free_ports(2), strict=True))
    keepers = {n: spawn_keeper(n, ports, tmp_path) for n in ports}
    procs: list[Any] = []
    try:
        procs = ranks(warm(), "train", tmp_path, ports, steps=6)
        trained = [line(p, tmp_path, f"train-{i}") for i, p in enumerate(procs)]
        assert all(len(t["blocked_s"]) == 3 for t in trained)  # type: ignore[arg-type]
        # host h1 dies: its rank and its keeper; then the job stops (its other rank too)
        (hello, _) = request(("127.0.0.1", ports["h1"]), {"op": "hello", "token": TOKEN})
        for p in (procs[1], keepers["h1"], procs[0]):
            p.kill()
            p.wait(timeout=30)
        shutil.rmtree(hello["root"])  # the lost host's memory (a killed keeper frees nothing)
        keepers["h1"] = spawn_keeper("h1", ports, tmp_path)  # the replacement host: empty memory
        t0 = time.perf_counter()
        procs = ranks(warm(), "restore", tmp_path, ports, steps=0)
        restored = [line(p, tmp_path, f"restore-{i}") for i, p in enumerate(procs)]
        for p in procs:
            assert p.wait(timeout=60) == 0
        assert time.perf_counter() - t0 < 120
        assert [(r["step"], r["tier"]) for r in restored] == [(6, "memory"), (6, "memory")]
        for rank in range(2):
            want = torch.load(tmp_path / f"train-{rank}.pt", weights_only=True)
            got = torch.load(tmp_path / f"restore-{rank}.pt", weights_only=True)
            assert want.keys() == got.keys()
            for k, v in want.items():
                assert torch.equal(v.view(torch.uint8) if v.dim() else v, got[k].view(torch.uint8) if v.dim() else got[k]), (rank, k)
        # the step drained to storage is there too
        assert (tmp_path / "run" / "step-4" / "metadata.json").exists()
    finally:
        for p in [*procs, *keepers.values()]:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
