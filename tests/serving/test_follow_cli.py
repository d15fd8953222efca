"""``bytecp follow RUN --json`` in a subprocess: one JSON line per newly
committed checkpoint with the bytes that changed, exit 0 on a real SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
import torch
from torch import nn

import bytecp

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(300)]


def _line(out: IO[str]) -> dict[str, object]:
    line = out.readline()
    assert line, "bytecp follow ended early"
    return json.loads(line)


def test_follow_cli_prints_each_commit_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=3)
    mgr.save(1, {"model": model})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-m", "bytecp.cli", "follow", str(run), "--json", "--poll-s", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = _line(proc.stdout)  # type: ignore[arg-type]
        total = sum(t.nbytes for t in model.state_dict().values())
        assert first["step"] == 1 and first["tier"] == "storage" and first["bytes_changed"] == total
        for step in (2, 3):
            model(torch.randn(2, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model})
            rec = _line(proc.stdout)  # type: ignore[arg-type]
            assert rec["step"] == step and rec["url"] == f"{run}/step-{step}"
            assert rec["bytes_changed"] == sum(t.nbytes for t in model[1].state_dict().values())
            assert rec["tensors_changed"] == 2 and rec["tensors"] == 4
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_checkpoint_with_bad_files_is_reported_once_and_passed_over(tmp_path: Path, caplog) -> None:
    """The newest checkpoint's metadata.json unreadable: ``bytecp follow``
    prints it once as an error record (as ``bytecp.follow`` reports a failed
    update), warns of it once however often it lists the run, and prints the
    next checkpoint that commits."""
    import logging

    from bytecp.serving.cli import watch

    run = tmp_path / "run"
    model = nn.Linear(8, 8)
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    for step in (1, 2):
        mgr.save(step, {"model": model})
    (run / "step-2" / "metadata.json").write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="bytecp"):
        gen = watch(str(run), poll_s=0.01)
        bad = next(gen)
        assert bad["step"] == 2 and bad["url"] == f"{run}/step-2" and "not valid JSON" in str(bad["error"]), bad
        mgr.save(3, {"model": model})  # the next listing sees step-2 again: neither printed nor warned of
        rec = next(gen)
        assert rec["step"] == 3 and "error" not in rec and rec["tensors"] == 2, rec
        gen.close()
    assert caplog.text.count("unreadable metadata.json") == 1, caplog.text
