"""A follower's held-step marker for retention (``dtype=`` followers).

Made by :class:`bytecp.serving.follow._Follower` on the coordinator of a
follower that holds its state in a serving dtype, given the step it holds
after each update (``mark_held``) and closed when the follower ends. A
retention reads the markers (:func:`bytecp.tools.retention.followed_from`)
and keeps the serving deltas of later checkpoints while the follower's lease
lives. Written by a thread of its own so that an update is yielded at once:
a marker a moment behind keeps more deltas, never fewer.
"""

from __future__ import annotations

import logging
import threading

from bytecp.catalog import one_line
from bytecp.storage_api import Storage

__all__ = ["HeldMarker"]

log = logging.getLogger("bytecp")


class HeldMarker:
    """A follower's held-step marker (``<run>/.followers/held/<id>.json``),
    written by a thread of its own: the latest of what it is given, the rest dropped."""

    def __init__(self, storage: Storage, path: str, run_url: str) -> None:
        self.storage, self.path, self.run_url = storage, path, run_url
        self._cv = threading.Condition()
        self._want: bytes | None = None
        self._done = False
        self._thread = threading.Thread(target=self._run, name="bytecp-follow-marker", daemon=True)
        self._thread.start()

    def put(self, body: bytes) -> None:
        with self._cv:
            self._want = body
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._want is None and not self._done:
                    self._cv.wait()
                body, self._want = self._want, None
                if body is None:
                    return
            try:
                self.storage.commit(self.path, body)
            except Exception as e:  # noqa: BLE001 - only the deltas a retention keeps for it are at stake
                log.warning("bytecp.follow: cannot write its held marker under %s (%s); a retention may remove "
                            "the deltas it needs next (it then reads those tensors whole)", self.run_url, one_line(e))

    def close(self) -> None:
        """Write what is pending, then remove the marker."""
        with self._cv:
            self._done = True
            self._cv.notify()
        self._thread.join(timeout=30)
        try:
            self.storage.delete([self.path])
        except Exception:  # noqa: BLE001,S110 - a marker left behind keeps deltas until its lease lapses
            pass
