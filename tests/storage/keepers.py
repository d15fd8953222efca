"""Keepers for the tests: in-process ones on threads (the contract, the
manager), keeper processes (the kill-a-host test) and the job token they share."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from bytecp.storage.keeper_server import Keeper

from tests.netport import free_ports

__all__ = ["TOKEN", "start_keepers", "spec", "free_ports", "spawn_keeper"]

TOKEN = "t-" + uuid.uuid4().hex


def start_keepers(names: list[str], *, replicas: int = 2, budget: int | None = None) -> list[Keeper]:
    """One keeper per name on a free loopback port, each knowing the others, serving on a thread."""
    keepers = [Keeper(n, 0, TOKEN, {}, replicas=replicas, budget_bytes=budget) for n in names]
    addrs = {k.name: ("127.0.0.1", k.port) for k in keepers}
    for k in keepers:
        k.peers = {n: a for n, a in addrs.items() if n != k.name}
        threading.Thread(target=k.serve_forever, daemon=True).start()
    return keepers


def pair_fixture(*names: str) -> Callable[[], Iterator[list[Keeper]]]:
    """A module-scoped fixture of two (or more) in-process keepers named
    ``names``, closed after the module: ``pair = pair_fixture("h0", "h1")``."""

    @pytest.fixture(scope="module")
    def pair() -> Iterator[list[Keeper]]:
        keepers = start_keepers(list(names))
        yield keepers
        for k in keepers:
            k.close()

    return pair  # type: ignore[no-any-return]


def spec(keepers: list[Keeper]) -> str:
    """The ``keepers=`` option naming them."""
    return ",".join(f"{k.name}=127.0.0.1:{k.port}" for k in keepers)




def spawn_keeper(name: str, ports: dict[str, int], tmp: Path, *, replicas: int = 2,
                 args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """A keeper process (as a host runs it: ``bytecp keeper``, with ``args``
    added: ``--metrics-port``...), serving once this returns."""
    ready = tmp / f"keeper-{name}-{uuid.uuid4().hex[:6]}.ready"
    env = dict(os.environ, BYTECP_KEEPER_TOKEN=TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bytecp.storage.keeper_server", "--name", name, "--port", str(ports[name]),
         "--keepers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()),
         "--replicas", str(replicas), "--ready-file", str(ready), *args],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"keeper-{name}.log", "ab"))  # noqa: SIM115
    deadline = time.time() + 60
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"keeper {name} did not start: {(tmp / f'keeper-{name}.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc
