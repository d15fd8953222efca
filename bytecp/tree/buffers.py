"""Buffers reused from one use to the next, and the debug mode that catches
a use after release.

bytecp keeps a few buffers across operations: a load's pinned read slabs
(:mod:`bytecp.loading.device_reads`), a save's staging arena
(:mod:`bytecp.saving.staging`), the memory tier's arenas (the keeper's pool
of files, ``storage/_keeper_arenas.py``). Each has a :class:`Guard`: its
holder *acquires* it before it fills the buffer, *checks* it at each hand-off
while the bytes are in use (a read done, a checksum, a copy out, a write),
and *releases* it once nothing may touch the bytes any more.

With ``BYTECP_DEBUG_BUFFERS=1`` (read at each call; tests and stress runs
set it) a released buffer is filled with :data:`POISON` (``0xBD`` bytes),
and any use after its release fails loudly with :class:`UseAfterRelease`
naming the buffer: a holder that checks it after it was released (or
released and acquired again by another use: its token is stale), or a
late writer (a storage read that timed out and still fills it, a device
copy still in flight), whose bytes are found in the poison when the buffer
is acquired again. A reader that reads a released buffer without checking
reads the poison, which no checksum and no bitwise comparison accepts.
Without it (the default) a guard only counts its uses: no fill, no scan.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["POISON", "debug", "Guard", "UseAfterRelease", "poison", "poisoned"]

#: the byte a released buffer is filled with in debug mode
POISON = 0xBD


def debug() -> bool:
    """Whether ``BYTECP_DEBUG_BUFFERS=1`` (read each time: a test may set it)."""
    return os.environ.get("BYTECP_DEBUG_BUFFERS") == "1"


class UseAfterRelease(RuntimeError):
    """A reused buffer was used after its holder released it (debug mode)."""


def _bytes(view: Any) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8) if len(view) else np.zeros(0, np.uint8)


def poison(view: Any) -> None:
    """Fill the writable buffer ``view`` with :data:`POISON`."""
    n = len(view)
    if n:
        ctypes.memset(_bytes(view).ctypes.data, POISON, n)


def poisoned(view: Any) -> int:
    """-1 when every byte of ``view`` is :data:`POISON`, else the offset of the first that is not."""
    arr = _bytes(view)
    bad = np.flatnonzero(arr != POISON) if len(arr) else arr
    return int(bad[0]) if len(bad) else -1


class Guard:
    """The use of one reused buffer (``view``: its bytes; None: the guard only
    tracks generations, for a buffer it cannot see, e.g. the memory tier's
    file)."""

    def __init__(self, what: str, view: Any = None) -> None:
        self.what, self.view = what, view
        self._lock = threading.Lock()
        self._gen = 0
        self._released = False
        self._poisoned = False

    def acquire(self) -> int:
        """(a new use, before it fills the buffer) -> its token for :meth:`check`.
        Debug mode: a byte written since the release fails here."""
        with self._lock:
            if self._poisoned and self.view is not None:
                at = poisoned(self.view)
                if at >= 0:
                    raise UseAfterRelease(
                        f"{self.what}: byte {at} of {len(self.view)} was written after the buffer was released "
                        "(a late writer: a storage read that timed out, a copy still in flight)")
            self._gen += 1
            self._released = self._poisoned = False
            return self._gen

    @property
    def poisoned(self) -> bool:
        """Whether the buffer was filled with :data:`POISON` at its last release
        (debug mode), not yet taken again: bytes its holder keeps there (a
        reused layout's padding) must be written again."""
        with self._lock:
            return self._poisoned

    def token(self) -> int:
        """The current use's token (its holders hand it along with the bytes)."""
        with self._lock:
            return self._gen

    def check(self, token: int | None = None) -> None:
        """(a holder, at a hand-off) Debug mode: fail if the buffer was released
        since ``token`` was taken (or at all, with no token)."""
        if not debug():
            return
        with self._lock:
            if self._released or (token is not None and token != self._gen):
                raise UseAfterRelease(
                    f"{self.what} used after it was released"
                    f"{'' if token is None or token == self._gen else ' and taken for another use'}")

    def release(self, before: Callable[[], Any] | None = None) -> None:
        """(the holder, once nothing may touch the bytes) Debug mode: ``before()``
        (e.g. wait for copies in flight), then fill the buffer with :data:`POISON`."""
        with self._lock:
            self._released = True
            self._gen += 1
            if not debug() or self.view is None:
                return
            if before is not None:
                before()
            poison(self.view)
            self._poisoned = True
