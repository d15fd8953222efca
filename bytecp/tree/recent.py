"""A bounded memo shared by threads (:class:`Recent`): torch-free, so the
commands that read metadata only (``bytecp ls``) may use it; the memos of
answers kept between saves (:mod:`bytecp.tree.kept`) use it too."""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Recent"]

_T = TypeVar("_T")
_K = TypeVar("_K", bound=Hashable)


class Recent(Generic[_K, _T]):
    """The values last put under at most ``limit`` keys (a key put again is
    the newest; the oldest goes first), shared by threads: the process's
    memos of answers between saves that are not kept with a state (the
    object blobs already checked, the checkpoints this process committed,
    the unions of the ranks' descriptions a coordinator built)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: dict[_K, _T] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:  # (a forked child: another thread may have held the lock)
        self._lock = threading.Lock()
        self._items = {}

    def get(self, key: _K) -> _T | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: _K, value: _T) -> None:
        with self._lock:
            self._items.pop(key, None)
            while len(self._items) >= self.limit:
                self._items.pop(next(iter(self._items)))
            self._items[key] = value

    def items(self) -> list[tuple[_K, _T]]:
        """Every (key, value), the oldest first (a copy: others may put meanwhile)."""
        with self._lock:
            return list(self._items.items())

    def pop(self, key: _K) -> None:
        with self._lock:
            self._items.pop(key, None)
