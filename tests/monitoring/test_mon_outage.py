"""A collector killed in the middle of a run: training goes on, reports resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from bytecp.monitoring.client import CollectorClient
from bytecp.monitoring.push import PushRecorder

import bytecp
from tests.netport import free_port

pytestmark = pytest.mark.spawn


def _start_collector(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        # through the `bytecp` command, as people run it
        [sys.executable, "-m", "bytecp.cli", "monitor", "serve", "--grpc", f"127.0.0.1:{port}", "--metrics", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "grpc <port> metrics None" once bound
    assert line.startswith(f"grpc {port}"), line
    return proc


def _until(cond: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _steps_known(addr: str) -> set[int]:
    with CollectorClient(addr) as client:
        return {c.step for c in client.list(job="outage", operation="save")}


def test_collector_killed_mid_run(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BYTECP_JOB", "outage")
    port = free_port()
    addr = f"127.0.0.1:{port}"
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a short delivery timeout keeps the test quick; the monitor= string path
    # (resolve_monitor) is exercised by the multi-process test
    push = PushRecorder(addr, timeout=1.0)

    def train_and_save(step: int) -> float:
        loss = model(torch.randn(8, 64)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = time.perf_counter()
        bytecp.save(str(tmp_path / f"step-{step}"), {"model": model, "optim": opt}, step=step, monitor=push)
        return time.perf_counter() - t

    proc = _start_collector(port)
    try:
        train_and_save(1)
        assert push.flush(20)
        _until(lambda: _steps_known(addr) == {1})

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        dropped = push.dropped
        for step in (2, 3):
            assert train_and_save(step) < 5.0  # the dead collector costs training nothing
            assert (tmp_path / f"step-{step}" / "metadata.json").exists()
        push.flush(20)
        assert push.dropped > dropped

        proc = _start_collector(port)
        step = 4
        deadline = time.monotonic() + 60
        while True:  # the first report after the restart may still meet a reconnect backoff
            train_and_save(step)
            push.flush(20)
            if step in _steps_known(addr):
                break
            assert time.monotonic() < deadline, "reports did not resume"
            step += 1
        assert not ({2, 3} & _steps_known(addr))  # those were dropped, not replayed
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(10)
