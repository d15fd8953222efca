"""Keepers for the tests: in-process ones on threads (the contract, the
manager) and the job token they share."""

from __future__ import annotations

import threading
import uuid

from bytecp.storage.keeper_server import Keeper

__all__ = ["TOKEN", "start_keepers", "spec"]

TOKEN = "t-" + uuid.uuid4().hex


def start_keepers(names: list[str], *, replicas: int = 2, budget: int | None = None) -> list[Keeper]:
    """One keeper per name on a free loopback port, each knowing the others, serving on a thread."""
    keepers = [Keeper(n, 0, TOKEN, {}, replicas=replicas, budget_bytes=budget) for n in names]
    addrs = {k.name: ("127.0.0.1", k.port) for k in keepers}
    for k in keepers:
        k.peers = {n: a for n, a in addrs.items() if n != k.name}
        threading.Thread(target=k.serve_forever, daemon=True).start()
    return keepers


def spec(keepers: list[Keeper]) -> str:
    """The ``keepers=`` option naming them."""
    return ",".join(f"{k.name}=127.0.0.1:{k.port}" for k in keepers)
