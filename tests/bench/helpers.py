"""Running a benchmark module as a user would (``python -m benchmarks.X``)
from the smoke tests, with the checkout on ``PYTHONPATH``."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def numeric(v: object) -> bool:
    """A finite number (a figure the report must carry)."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def run_benchmark(module: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<module> ARGS`` from the checkout; asserts it exited 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
