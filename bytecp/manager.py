"""Checkpoints of a training run: list, find the latest committed, retention.

``CheckpointManager`` is what training loops use: ``save`` every N steps into
``<run>/step-<N>``, keep the last K committed checkpoints, resume from the
latest *committed* one (a directory without ``metadata.json`` is an
interrupted save and is never picked, nor counted by retention).

With ``async_save=True`` (and optionally ``lazy=True``) each save goes
through :func:`bytecp.async_save`; the same retention rules hold: the
in-flight checkpoint is never counted (it has no ``metadata.json`` yet), the
last committed one is never deleted before a newer one commits (retention
runs only after a commit, and always keeps the newest), and deletion runs on
the save's background thread once it has committed, never on the training
thread. A failed save deletes nothing; its error is raised by the next
``save``/``wait``.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any

from bytecp.catalog import CheckpointInfo, list_checkpoints
from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.storage_api import open_storage

if TYPE_CHECKING:  # pragma: no cover
    from bytecp.saving.handles import SaveHandle

__all__ = ["CheckpointInfo", "list_checkpoints", "CheckpointManager"]

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointManager:
    """Save every ``every_n_steps`` into ``<run_url>/step-<N>``; keep the last ``keep_last``.

    Call ``maybe_save(step, state)`` every step (all ranks) and
    ``restore(state)`` at start-up (all ranks); it returns the restored step
    or ``None`` when there is nothing to resume from.

    ``async_save=True``: saves return once staged (``lazy=True``: at once,
    staging before the next ``optimizer.step``) and commit in the
    background; retention runs on that background thread after the commit.
    ``wait()`` blocks until the in-flight save and its retention are done.
    """

    def __init__(
        self,
        run_url: str,
        *,
        every_n_steps: int = 1000,
        keep_last: int | None = 3,
        async_save: bool = False,
        lazy: bool = False,
        storage_options: dict[str, Any] | None = None,
        **save_kwargs: Any,
    ) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {keep_last}")
        if lazy and not async_save:
            raise ConfigError("lazy=True needs async_save=True (a lazy save is an asynchronous one)")
        self.run_url = run_url.rstrip("/")
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.save_kwargs = save_kwargs
        self.async_save = async_save
        self.lazy = lazy
        #: the in-flight (or last) asynchronous save and the event set once
        #: its retention has run
        self._pending: SaveHandle | None = None
        self._retained = threading.Event()
        self._retained.set()
        self._retain_lock = threading.Lock()
        self._prewarmed = False

    def url_for(self, step: int) -> str:
        return f"{self.run_url}/step-{step}"

    def latest(self) -> CheckpointInfo | None:
        found = list_checkpoints(self.run_url, storage_options=self.storage_options)
        return found[-1] if found else None

    def maybe_save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """(all ranks, every step) Save when ``step`` is a multiple of
        ``every_n_steps`` (or ``force``). With ``async_save`` the first call
        prewarms the staging memory (:func:`bytecp.prewarm`), so the first
        save blocks like the later ones."""
        if self.async_save and not self._prewarmed:
            from bytecp.saving.prewarm import prewarm

            prewarm(state, framework=self.save_kwargs.get("framework"),
                    process_group=self.save_kwargs.get("process_group"),
                    coordinator_rank=self.save_kwargs.get("coordinator_rank", 0))
            self._prewarmed = True
        if not force and step % self.every_n_steps:
            return False
        self.save(step, state)
        return True

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        """Save ``state`` as ``step-<step>`` (all ranks), then apply retention.

        Synchronous: returns ``None`` once committed and pruned. With
        ``async_save``: returns the :class:`~bytecp.SaveHandle` once staged;
        the previous save must have ended first (its error, if any, is raised
        here), and retention runs when this one commits.
        """
        if not self.async_save:
            from bytecp.api import save

            save(self.url_for(step), state, step=step, storage_options=self.storage_options, **self.save_kwargs)
            self._retain()
            return None
        from bytecp.api import async_save

        handle = async_save(
            self.url_for(step), state, lazy=self.lazy, step=step,
            storage_options=self.storage_options, **self.save_kwargs,
        )
        self._pending = handle
        self._retained.clear()
        handle.add_done_callback(self._after_async_save)
        return handle

    def _after_async_save(self, handle: SaveHandle) -> None:
        """(the save's background thread) Prune once the save has committed."""
        try:
            if handle.exception() is None:
                self._retain()
        finally:
            if handle is self._pending:
                self._retained.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight asynchronous save has committed and its
        retention has run; raise the save's error (no-op when synchronous)."""
        handle = self._pending
        if handle is None:
            return
        handle.wait(timeout)
        if not self._retained.wait(timeout):
            raise TimeoutError(f"retention after the save to {handle.url} not finished after {timeout} s")

    def restore(self, state: dict[str, Any], **load_kwargs: Any) -> int | None:
        from bytecp.api import load

        if self._pending is not None:  # never list while a save or its retention is in flight
            from bytecp.saving.handles import wait_for_pending_save

            wait_for_pending_save()
            self._retained.wait()
        latest = self.latest()
        if latest is None:
            return None
        load(latest.url, state, storage_options=self.storage_options, **load_kwargs)
        return latest.step

    def _retain(self) -> None:
        """(coordinator; the training thread when synchronous, the save's
        background thread when asynchronous) Delete all but the newest
        ``keep_last`` committed checkpoints. Only committed checkpoints are
        listed, so an in-flight save is never counted, and the newest
        committed one is always kept."""
        from bytecp.dist import DistContext

        if self.keep_last is None or not DistContext().is_coordinator:
            return
        with self._retain_lock:
            found = list_checkpoints(self.run_url, storage_options=self.storage_options)
            root = open_storage(self.run_url, **self.storage_options)
            for old in found[: max(0, len(found) - self.keep_last)]:
                # metadata.json first: the checkpoint stops existing before its data goes
                root.delete([f"{old.name}/{fmt.METADATA_FILE}"])
                root.delete_prefix(old.name)
