"""Checkpoints of a training run: list, find the latest committed, retention.

``CheckpointManager`` is what training loops use: ``save`` every N steps into
``<run>/step-<N>``, keep the last K committed checkpoints, resume from the
latest *committed* one (a directory without ``metadata.json`` is an
interrupted save and is never picked, nor counted by retention).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any

from . import format as fmt
from .errors import ConfigError, FormatVersionError
from .storage_api import open_storage

__all__ = ["CheckpointInfo", "list_checkpoints", "CheckpointManager"]

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    name: str
    url: str
    step: int | None
    created: str


def list_checkpoints(run_url: str, *, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly below ``run_url``, oldest step first."""
    root = open_storage(run_url, **(storage_options or {}))
    out = []
    for name in root.list_children(""):
        if root.exists(f"{name}/{fmt.METADATA_FILE}"):
            try:
                md = fmt.Metadata.from_bytes(root.read_bytes(f"{name}/{fmt.METADATA_FILE}"), f"{run_url}/{name}")
            except FormatVersionError:
                raise  # never resume silently from an older checkpoint than the newest
            except Exception as e:
                log.warning("bytecp: skipping %s/%s: unreadable metadata.json (%s)", run_url, name, e)
                continue
            m = _STEP.match(name)
            step = md.step if md.step is not None else (int(m.group(1)) if m else None)
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(md.created))
            out.append(CheckpointInfo(name, f"{run_url.rstrip('/')}/{name}", step, created))
    out.sort(key=lambda c: (c.step is None, c.step or 0, c.created))
    return out


class CheckpointManager:
    """Save every ``every_n_steps`` into ``<run_url>/step-<N>``; keep the last ``keep_last``.

    Call ``maybe_save(step, state)`` every step (all ranks) and
    ``restore(state)`` at start-up (all ranks); it returns the restored step
    or ``None`` when there is nothing to resume from.
    """

    def __init__(
        self,
        run_url: str,
        *,
        every_n_steps: int = 1000,
        keep_last: int | None = 3,
        storage_options: dict[str, Any] | None = None,
        **save_kwargs: Any,
    ) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.run_url = run_url.rstrip("/")
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.save_kwargs = save_kwargs

    def url_for(self, step: int) -> str:
        return f"{self.run_url}/step-{step}"

    def latest(self) -> CheckpointInfo | None:
        found = list_checkpoints(self.run_url, storage_options=self.storage_options)
        return found[-1] if found else None

    def maybe_save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        if not force and step % self.every_n_steps:
            return False
        self.save(step, state)
        return True

    def save(self, step: int, state: dict[str, Any]) -> None:
        from .api import save

        save(self.url_for(step), state, step=step, storage_options=self.storage_options, **self.save_kwargs)
        self._retain()

    def restore(self, state: dict[str, Any], **load_kwargs: Any) -> int | None:
        from .api import load

        latest = self.latest()
        if latest is None:
            return None
        load(latest.url, state, storage_options=self.storage_options, **load_kwargs)
        return latest.step

    def _retain(self) -> None:
        from .dist import DistContext

        if self.keep_last is None or not DistContext().is_coordinator:
            return
        found = list_checkpoints(self.run_url, storage_options=self.storage_options)
        root = open_storage(self.run_url, **self.storage_options)
        for old in found[: max(0, len(found) - self.keep_last)]:
            # metadata.json first: the checkpoint stops existing before its data goes
            root.delete([f"{old.name}/{fmt.METADATA_FILE}"])
            root.delete_prefix(old.name)
