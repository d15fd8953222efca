"""The chaos run's memory tier: two keeper processes, hosts ``h0`` and ``h1``
(rank r runs on host ``h<r>``), replicas 2. They are started once and
outlive the job's restarts, as a host's keeper does; the ``keeper`` fault
SIGKILLs one mid-save, and the driver starts it again at once on the same
port with empty memory (a host's supervisor restarting the service: what the
dead process held is gone, the peer holds a copy of every committed file)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bytecp.storage._keeper_wire import KeeperUnreachable, request

#: the keeper helpers of the storage tests
STORAGE_TESTS = Path(__file__).resolve().parent.parent / "storage"
HOSTS = ("h0", "h1")

__all__ = ["HOSTS", "Keepers"]


class Keepers:
    """Two keeper processes and what a job needs to reach them."""

    def __init__(self) -> None:
        if str(STORAGE_TESTS) not in sys.path:
            sys.path.insert(0, str(STORAGE_TESTS))
        import keepers as kp

        self._kp = kp
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos-keepers-"))
        self.ports = dict(zip(HOSTS, kp.free_ports(len(HOSTS)), strict=True))
        self.token: str = kp.TOKEN
        self.procs: dict[str, Any] = {}
        self.roots: dict[str, str] = {}
        for name in HOSTS:
            self._start(name)

    def _start(self, name: str) -> None:
        self.procs[name] = self._kp.spawn_keeper(name, self.ports, self.tmp)
        hello, _ = request(("127.0.0.1", self.ports[name]), {"op": "hello", "token": self.token})
        self.roots[name] = str(hello["root"])

    def options(self, host: str = HOSTS[0]) -> dict[str, Any]:
        """``storage_options`` of ``keeper://`` for a process on ``host``."""
        return {"keepers": ",".join(f"{n}=127.0.0.1:{p}" for n, p in self.ports.items()), "host": host,
                "token": self.token}

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def revive(self) -> list[str]:
        """Start again, with empty memory, each keeper that died; their names."""
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        for name in dead:
            shutil.rmtree(self.roots[name], ignore_errors=True)  # (a killed keeper frees nothing)
            self._start(name)
        return dead

    def drained(self, timeout: float = 60.0) -> bool:
        """Wait until no keeper is draining a checkpoint to storage; False after ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            running = False
            for port in self.ports.values():
                try:
                    stats, _ = request(("127.0.0.1", port), {"op": "stats", "token": self.token})
                except KeeperUnreachable:
                    continue
                running |= any(d["state"] == "running" for d in stats["drains"].values())
            if not running:
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except Exception:  # noqa: BLE001 - a keeper that ignores SIGTERM
                    proc.kill()
                    proc.wait(timeout=10)
            shutil.rmtree(self.roots[name], ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
