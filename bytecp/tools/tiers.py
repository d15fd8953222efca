"""The memory tier of a :class:`~bytecp.manager.CheckpointManager`.

``CheckpointManager(run_url, memory_url="keeper://<job>/<run>",
memory_every_n_steps=N, every_n_steps=M)`` checkpoints to the hosts'
memory every N steps (the ``keeper://`` backend: each host's keeper holds
its ranks' files and replicates them to peers, see
:mod:`bytecp.storage.keeper`) and, every M steps, drains the memory
checkpoint to ``run_url``: the keeper copies it, ``metadata.json`` last, so
the training processes write nothing twice.

Who calls what, and when:

- ``MemoryTier.due`` / ``url_for`` (every rank, every step, from
  ``maybe_save``): whether this step goes to memory, and where;
- ``MemoryTier.drain`` (the coordinator, once the memory checkpoint has
  committed: at once when synchronous, on the save's background thread when
  asynchronous): hands the copy to the keeper;
- ``MemoryTier.latest`` (every rank, in ``restore``): the newest memory
  checkpoint that is *complete*: every file its ``metadata.json`` lists is
  held by some live keeper, at its size. One that lost a file (evicted at
  one keeper, or gone with its host and every peer holding it) is skipped
  (``incomplete``), never loaded in part; the next older one is a candidate;
- :func:`restore_order` (every rank, in ``restore``): the tiers to try,
  newest committed checkpoint first, memory before storage on a tie; the
  manager loads the first that loads (a memory copy that fails its
  checksums falls through to the next), so it never resumes from an older
  step than the newest complete one.

The core reaches the keepers only through the storage registry; a memory
backend that does not drain (``Storage.drains`` False: ``memory://`` in tests) is drained by a
normal save to storage from the training processes.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from typing import Any

from bytecp.catalog import CheckpointInfo, list_checkpoints
from bytecp.errors import ConfigError, StorageError
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage, open_storage

__all__ = ["MemoryTier", "Candidate", "restore_order"]

log = logging.getLogger("bytecp.manager")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A committed checkpoint a restore may load, and from which tier."""

    info: CheckpointInfo
    tier: str  # "memory" or "storage"
    storage_options: dict[str, Any]


class MemoryTier:
    """Where and when the manager's memory checkpoints go."""

    def __init__(self, url: str, every_n_steps: int, keep_last: int | None,
                 storage_options: dict[str, Any] | None) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"memory_every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"memory_keep_last must be >= 1 or None, got {keep_last}")
        self.url = url.rstrip("/")
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        #: (url, why) of the memory checkpoints the last :meth:`latest` skipped as incomplete
        self.incomplete: list[tuple[str, str]] = []
        self._drains: bool | None = None

    def url_for(self, step: int) -> str:
        return f"{self.url}/step-{step}"

    def due(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def can_drain(self) -> bool:
        """Whether the memory backend copies checkpoints to storage itself
        (:attr:`Storage.drains`; asked of its class once)."""
        if self._drains is None:
            self._drains = open_storage(self.url, **self.storage_options).drains
        return self._drains

    def drain(self, step: int, to_url: str, to_options: dict[str, Any]) -> None:
        """(coordinator, after the memory commit) Have the keeper copy ``step`` to ``to_url``."""
        open_storage(self.url_for(step), **self.storage_options).drain_to(to_url, to_options)

    def latest(self, found: list[CheckpointInfo] | None = None) -> CheckpointInfo | None:
        """The newest complete committed memory checkpoint, or None (also when no keeper answers).
        ``found``: the tier's listing when the caller has it (a follower, which also counts the steps)."""
        self.incomplete = []
        try:
            if found is None:
                found = list_checkpoints(self.url, storage_options=self.storage_options)
            root = open_storage(self.url, **self.storage_options)
            held = root.file_sizes("")
            for info in reversed(found):
                why = _missing(root, held, info.name)
                if why is None:
                    return info
                self.incomplete.append((info.url, why))
                log.warning("bytecp: memory checkpoint %s is incomplete (%s); not a restore candidate",
                            info.url, why)
        except StorageError as e:
            log.warning("bytecp: memory tier %s unavailable (%s); using storage", self.url, e)
        return None

    def restore(self, storage_newest: CheckpointInfo | None, storage_options: dict[str, Any], state: dict[str, Any],
                skipped: list[tuple[str, str]], **load_kwargs: Any) -> CheckpointInfo | None:
        """(every rank, in ``restore``) Load the newest complete memory checkpoint
        into ``state`` when it is at least as new as ``storage_newest``; return
        it, or None (then storage's candidates are tried). One that does not
        load because its files are bad or the keepers fail is noted in
        ``skipped`` (the incomplete ones too) with a warning."""
        from bytecp.api import load
        from bytecp.catalog import checkpoint_is_bad, one_line

        first = restore_order(self.latest(), self.storage_options, storage_newest, storage_options)
        skipped.extend(self.incomplete)  # never loaded in part
        if not first or first[0].tier != "memory":
            return None
        info = first[0].info
        try:
            load(info.url, state, storage_options=self.storage_options, **load_kwargs)
        except Exception as e:
            if not (checkpoint_is_bad(e) or isinstance(e, StorageError)):
                raise
            skipped.append((info.url, one_line(e)))
            log.warning("bytecp: memory checkpoint %s does not load (%s); trying storage", info.url, one_line(e))
            return None
        return info


def _missing(root: Storage, held: dict[str, int], name: str) -> str | None:
    """What checkpoint ``name`` below ``root`` lacks in ``held`` (every live
    keeper's files, path -> size), or None when it lacks nothing."""
    md = fmt.Metadata.from_bytes(fmt.read_metadata(root, f"{name}/{fmt.METADATA_FILE}"), f"{root.url}/{name}")
    want: dict[str, int | None] = {posixpath.normpath(f"{name}/{p}"): n for p, n in md.data_files.items()}
    for f in md.referenced_files() - set(md.data_files):
        want.setdefault(posixpath.normpath(f"{name}/{f}"), None)
    for path, size in sorted(want.items()):
        if path not in held:
            return f"{path} is in no live keeper"
        if size is not None and held[path] != size:
            return f"{path} holds {held[path]} bytes of {size}"
    return None


def restore_order(memory: CheckpointInfo | None, memory_options: dict[str, Any],
                  storage: CheckpointInfo | None, storage_options: dict[str, Any]) -> list[Candidate]:
    """The checkpoints to try, best first: the newer step first, memory first on a tie."""
    out = []
    if memory is not None and memory.step is not None:
        out.append(Candidate(memory, "memory", memory_options))
    if storage is not None:
        out.append(Candidate(storage, "storage", storage_options))
    out.sort(key=lambda c: (-(c.info.step or 0), c.tier != "memory"))
    return out
