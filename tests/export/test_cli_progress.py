"""Progress bars of ``verify``, ``gc`` and ``export``: shown on a terminal
(a real pseudo-terminal here), never in a pipe, off with ``--no-progress``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecp


def leftover(ck: Path) -> None:
    """Files of an older crashed save beside the committed one (what gc removes)."""
    first = next((ck / "data").iterdir()).name
    shutil.copytree(ck / "data" / first, ck / "data" / "20000101T000000-deadbeef")

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(300)]


def on_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``bytecp ARGS`` with stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    import pty

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen([sys.executable, "-m", "bytecp.cli", *args], stdout=subprocess.DEVNULL, stderr=slave,
                         cwd=cwd, env=env)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return p.wait(timeout=120), shown.decode(errors="replace")


def test_progress_bars_only_on_a_terminal(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"model": nn.Linear(64, 64), "w": torch.zeros(1000)})
    leftover(ck)
    for args, desc in ([["verify", str(ck)], "verify"], [["gc", str(ck)], "gc"],
                       [["export", str(ck), str(tmp_path / "hf")], "export"]):
        code, shown = on_terminal(args, tmp_path)
        assert code == 0 and f"{desc}:" in shown and "%|" in shown, shown
    piped = subprocess.run([sys.executable, "-m", "bytecp.cli", "verify", str(ck)], capture_output=True,
                           text=True, cwd=tmp_path)
    assert piped.returncode == 0 and "%|" not in piped.stderr and "OK" in piped.stdout
    code, shown = on_terminal(["verify", str(ck), "--no-progress"], tmp_path)
    assert code == 0 and "%|" not in shown
