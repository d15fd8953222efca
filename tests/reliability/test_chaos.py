"""The chaos run: a 2-rank training job saving every step meets a seeded
random fault per episode (SIGKILL or SIGSTOP of a rank mid-save, a full disk,
a read-only remount, S3 faults through the fault proxy, SIGKILL of a keeper
of the memory tier mid-save) and restarts as a scheduler would; after every restart the restored state is bitwise the
training's, every committed checkpoint verifies, no file is left that kept
checkpoints do not need, and nothing hangs (see chaos.py).

The ranks are forked from a warm interpreter (tests/warm.py: an episode
costs its job, not two torch imports); ``benchmarks/chaos.py`` starts real
interpreters. The short version (one episode of each fault) runs in the suite;
``BYTECP_CHAOS_EPISODES=200`` runs that many seeded random episodes
(``benchmarks/chaos.py`` prints the figures)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .chaos import STORAGE_TESTS, Chaos
from .tmpfs import mounted_tmpfs

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(900)]

EPISODES = int(os.environ.get("BYTECP_CHAOS_EPISODES", "0"))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of the job's own, unmounted after the test."""
    with mounted_tmpfs(tmp_path, 32) as root:
        yield root


@pytest.fixture
def s3() -> Iterator[tuple[object, str]]:
    sys.path.insert(0, str(STORAGE_TESTS))
    import s3_servers

    server = s3_servers.start_moto()
    try:
        yield server, server.new_bucket("chaos")
    finally:
        server.stop()


def test_chaos_short(disk: Path, s3: tuple[object, str], warm: Any) -> None:
    """One episode of each fault, then a clean one; a keeper killed with the
    memory tier, then a clean restart from the memory tier (every invariant
    checked after each). The kill lands on the rank that is not the
    coordinator just after the commit reached it (``committed``): the
    checkpoint is committed, its files stay, the restart resumes from it."""
    chaos = Chaos(disk, seed=1, s3=s3, steps=6, popen=warm().popen)
    try:
        chaos.episode("kill", memory=False, phase="committed", rank=1)
        for kind in ("stop", "fill", "readonly", "s3", "none"):
            chaos.episode(kind, memory=False)
        chaos.episode("keeper")
        chaos.episode("none", memory=True)
    finally:
        chaos.close()
    fig = chaos.fig
    print(fig.line())
    assert fig.problems == [], fig.problems
    assert set(fig.faults) >= {"kill", "stop", "fill", "readonly", "s3", "keeper"}, fig.faults
    assert fig.stalls and max(fig.stalls) < chaos.deadline + 3.0 + 5.0, fig.stalls


@pytest.mark.skipif(not EPISODES, reason="the long chaos run: BYTECP_CHAOS_EPISODES=N")
def test_chaos_long(disk: Path, s3: tuple[object, str], warm: Any) -> None:
    chaos = Chaos(disk, seed=int(os.environ.get("BYTECP_CHAOS_SEED", "0")), s3=s3, popen=warm().popen)
    try:
        for _ in range(EPISODES):
            chaos.episode()
    finally:
        chaos.close()
    print(chaos.fig.line())
    assert chaos.fig.problems == [], chaos.fig.problems
