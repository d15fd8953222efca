"""``memory://`` backend for tests: fsspec's process-wide in-memory filesystem."""

from __future__ import annotations

from typing import Any

from .fsspec_backend import FsspecStorage

__all__ = ["MemoryStorage"]


class MemoryStorage(FsspecStorage):
    """In-process storage; every ``memory://`` URL in a process shares one store."""

    atomic_put = True  # a dict assignment under fsspec's lock
    remote = False

    def __init__(self, url: str, **options: Any) -> None:
        options.setdefault("request_timeout", None)  # a dict in this process never hangs
        super().__init__(url, **options)
