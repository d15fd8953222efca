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
        assert rec["skipped"] == 0, rec  # (step 2 was printed, as an error record)
        gen.close()
    assert caplog.text.count("unreadable metadata.json") == 1, caplog.text


def test_commits_passed_over_between_two_lines_are_counted(tmp_path: Path) -> None:
    """Steps 2, 3 and 4 commit within one poll: only step 4 is printed, with
    ``skipped`` 2 (it said nothing of the others); the first record says 0."""
    from bytecp.serving.cli import watch

    run = tmp_path / "run"
    model = nn.Linear(8, 8)
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    mgr.save(1, {"model": model})
    gen = watch(str(run), poll_s=0.01)
    assert next(gen)["skipped"] == 0
    for step in (2, 3, 4):
        mgr.save(step, {"model": model})
    rec = next(gen)
    assert (rec["step"], rec["skipped"]) == (4, 2), rec
    gen.close()


def test_storage_options_reach_the_run_and_bad_json_is_one_line(tmp_path: Path) -> None:
    """``--storage-options`` as for the other commands (the s3 endpoint of a
    non-AWS store): given to the listing; a value that is not JSON is one
    line naming the flag, exit 2."""
    from bytecp.serving.cli import main

    run = tmp_path / "run"
    bytecp.CheckpointManager(str(run), every_n_steps=1).save(1, {"model": nn.Linear(4, 4)})
    assert main([str(run), "--json", "--idle-timeout-s", "0.01", "--poll-s", "0.01",
                 "--storage-options", '{"fsync": false}']) == 0
    assert main([str(run), "--idle-timeout-s", "0.01", "--storage-options", '{"endpoint_url": "x"}']) == 2
    got = subprocess.run([sys.executable, "-m", "bytecp.cli", "follow", str(run), "--storage-options", "{bad"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert got.returncode == 2 and "--storage-options: not valid JSON" in got.stderr, got


def test_a_sigterm_while_it_starts_exits_0(tmp_path: Path) -> None:
    """A scheduler stopping it at once: the SIGTERM arriving as soon as the
    handler is there, before the run is listed or the readers (and torch)
    are imported, ends it with exit 0 (the default handler's 143 came from a
    SIGTERM during those imports)."""
    run = tmp_path / "run"
    bytecp.CheckpointManager(str(run), every_n_steps=1).save(1, {"model": nn.Linear(4, 4)})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    code = f"""
import os, signal, sys
from bytecp.serving import cli
install = signal.signal
def installed_then_signalled(sig, handler):
    install(sig, handler)
    if sig == signal.SIGTERM:
        os.kill(os.getpid(), sig)
signal.signal = installed_then_signalled
code = cli.main([{str(run)!r}, "--poll-s", "0.05"])
print("torch imported" if "torch" in sys.modules else "no torch")
sys.exit(code)
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "no torch", got.stdout
