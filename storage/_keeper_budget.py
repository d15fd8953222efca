"""The keeper's memory budget: what it holds, and the eviction of older
memory checkpoints to make room.

A mixin of :class:`bytecp.storage.keeper_server.Keeper`. Called, under the
keeper's lock, before a file is stored (``put``, ``replicate``), an arena
is lent (``alloc``, ``prepare``); ``evict`` is a peer's request to evict a
checkpoint it evicted for its own budget (no keeper keeps a part of it).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

from bytecp.errors import StorageError

from ._keeper_arenas import Arenas
from ._keeper_wire import Addr, request, safe_path

__all__ = ["Budget", "METADATA"]

log = logging.getLogger("bytecp.storage.keeper")
METADATA = "metadata.json"


class Budget:
    """Memory accounting and eviction; the keeper supplies these attributes."""

    name: str
    token: str
    root: str
    budget: int | None
    peers: dict[str, Addr]
    arenas: Arenas
    _lock: threading.Lock
    #: bytes of puts being received (room made, file not complete yet): counted by
    #: :meth:`_room_for` in place of their temporary files, so concurrent puts never overshoot
    _pending: int = 0

    def _full(self, path: str) -> str:
        return os.path.join(self.root, safe_path(path))

    def _committed_here(self, path: str) -> None:
        """(``commit``, or a ``put`` of a peer's commit) ``path`` is a checkpoint's
        ``metadata.json``: its copied-out arenas join the free pool, within the budget."""
        if os.path.basename(path) != METADATA:
            return
        self.arenas.committed(os.path.dirname(path))
        if self.budget is not None:
            with self._lock:
                held = self.held_bytes()
                while held > self.budget:
                    freed = self.arenas.drop_free()
                    if not freed:
                        break
                    held -= freed

    def held_bytes(self, *, pending: bool = False) -> int:
        """Bytes of every file below the root (checkpoints, peers' copies,
        arenas); ``pending``: puts being received count at their full size
        (see :attr:`_pending`), their temporary files not at all."""
        total = self._pending if pending else 0
        for d, _, files in os.walk(self.root):
            for f in files:
                if pending and ".tmp-" in f:
                    continue
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except FileNotFoundError:  # removed meanwhile (a delete, an eviction)
                    pass
        return total

    def _room_for(self, path: str, nbytes: int) -> None:
        """Evict older committed checkpoints until ``nbytes`` more fit, or refuse."""
        if self.budget is None:
            return
        held = self.held_bytes(pending=True)
        while held + nbytes > self.budget:
            freed = self.arenas.drop_free()
            if not freed:
                break
            held -= freed
        if held + nbytes <= self.budget:
            return
        for old in self._evictable(protect=safe_path(path)):
            self._evict(old)
            held = self.held_bytes(pending=True)  # (a peer's eviction may have removed it, or more, meanwhile)
            threading.Thread(target=self._evict_at_peers, args=(old,), name="bytecp-keeper-evict",
                             daemon=True).start()
            log.info("keeper %s: evicted memory checkpoint %s (budget %d bytes)", self.name, old, self.budget)
            if held + nbytes <= self.budget:
                return
        raise StorageError(
            f"memory budget of {self.budget} bytes cannot hold {path} ({nbytes} more bytes, {held} held "
            f"after evicting every older memory checkpoint): raise the keeper's --budget-bytes, lower "
            f"replicas, or checkpoint less state to memory")

    def _evict(self, ckpt: str) -> None:
        """Remove a checkpoint here: ``metadata.json`` first (it is no longer listed), then its files."""
        try:
            os.unlink(self._full(ckpt + "/" + METADATA))
        except FileNotFoundError:
            pass
        shutil.rmtree(self._full(ckpt), ignore_errors=True)

    def _evict_at_peers(self, ckpt: str) -> None:
        """A checkpoint evicted here goes at every peer too: no keeper keeps a part of it."""
        for name, addr in self.peers.items():
            try:
                request(addr, {"op": "evict", "token": self.token, "path": ckpt}, timeout=60)
            except StorageError as e:
                log.warning("keeper %s: peer %s did not evict %s: %s", self.name, name, ckpt, e)

    def op_evict(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        """(a peer that evicted ``path`` for its budget) Evict it here too, under the
        lock: a :meth:`_room_for` here sees it either committed or gone, never half removed."""
        with self._lock:
            self._evict(safe_path(h["path"]))
        return {}, []

    def _evictable(self, protect: str) -> list[str]:
        """Committed checkpoint directories, oldest first, except each run's newest and ``protect``'s own."""
        runs: dict[str, list[tuple[float, str]]] = {}
        for d, _, files in os.walk(self.root):
            if METADATA in files:
                rel = os.path.relpath(d, self.root).replace(os.sep, "/")
                runs.setdefault(os.path.dirname(rel), []).append((os.path.getmtime(os.path.join(d, METADATA)), rel))
        out = [rel for found in runs.values() for _, rel in sorted(found)[:-1]]
        return sorted((r for r in out if not protect.startswith(r + "/")),
                      key=lambda r: os.path.getmtime(self._full(r + "/" + METADATA)))
