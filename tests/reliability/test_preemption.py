"""Pre-emption: a real SIGTERM to a real rank of a 2-process gloo job; every
rank saves the same step, the checkpoint commits, both processes exit 0, and
the checkpoint holds bitwise what the job held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bytecp
from tests.netport import free_port

pytestmark = pytest.mark.spawn

HERE = Path(__file__).parent




@pytest.mark.slow
def test_sigterm_to_one_rank_saves_the_current_step_on_every_rank_and_exits_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "preempt_worker.py"), str(run)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        assert procs[1].stdout is not None
        deadline = time.time() + 180
        while time.time() < deadline:  # training is under way on rank 1
            line = procs[1].stdout.readline()
            if not line or line.startswith("step 3"):
                break
        assert line.startswith("step 3"), procs[1].stderr.read() if procs[1].stderr else ""
        procs[1].send_signal(signal.SIGTERM)  # only rank 1: the other learns it at the same step
        t0 = time.time()
        outs = [p.communicate(timeout=120) for p in procs]
        grace = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "terminate called" not in err
    saved = [int(line.split()[-1]) for out, _ in outs for line in out.splitlines() if line.startswith("saved step")]
    assert len(saved) == len(procs) and len(set(saved)) == 1, outs  # every rank saved, the same step
    step = saved[0]
    expected = torch.load(run / "expected.pt", weights_only=True)
    assert expected["step"] == step
    sd = bytecp.load_state_dict(str(run / f"step-{step}"))
    assert sd["extra"]["step"] == step
    for k, v in expected["model"].items():
        assert torch.equal(sd["model"][k], v), k
    assert "SIGTERM received" in outs[1][1]
    print(f"pre-emption save and exit took {grace:.1f} s after the signal")
