"""A thread pool kept for the process (:class:`KeptPool`): made at its first
use, its threads kept between calls (a thread's setup -- torch's intra-op
team, a storage client -- paid once, not at every save, load or poll), and
made afresh in a forked child, which has the pool object but none of its
threads. Torch-free. Used by the save's copy-ahead and union threads, a
follower's apply threads, the run scan and the keeper's summing threads."""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["KeptPool"]


class KeptPool:
    """``get()``: the process's pool of ``workers`` threads named ``name``."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = workers, name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:  # (a forked child: no threads, and another thread may have held the lock)
        self._lock = threading.Lock()
        self._pool = None

    def get(self, workers: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
        """The pool; ``workers``, where given, sizes it when this call makes it."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(workers or self.workers, thread_name_prefix=self.name)
            return self._pool
