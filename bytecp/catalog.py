"""The committed checkpoints of a run directory (``<run>/step-<N>``).

Read by :class:`~bytecp.manager.CheckpointManager` (latest, retention),
``bytecp ls`` and the wrong-path diagnosis (a run directory names its
latest committed checkpoint). Imports nothing of the save or load path.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import re
import time
from typing import Any

from bytecp.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatVersionError,
    StorageNotFoundError,
    one_line,
)
from bytecp.format import metadata as fmt
from bytecp.format.header import read_header
from bytecp.format.references import retired_names
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.pools import KeptPool
from bytecp.tree.recent import Recent

__all__ = ["CheckpointInfo", "Unreadable", "list_checkpoints", "scan", "list_bases", "checkpoint_is_bad", "one_line"]

log = logging.getLogger("bytecp.manager")
_STEP = re.compile(r"^step-(\d+)$")
#: the unreadable metadata.json files this process warned of, (url, why)
_TOLD: Recent[tuple[str, str], bool] = Recent(256)
#: the errors that mean "this checkpoint's own files are bad", as exception
#: classes (one process) and as the type names a rank's failure carries
#: (every rank of a distributed load gets the same failure texts)
_BAD = (CorruptCheckpointError, CheckpointNotFoundError, StorageNotFoundError)
_BAD_NAMES = re.compile(
    r"(?:^|: )(?:CorruptCheckpointError|CheckpointNotFoundError|IncompleteCheckpointError|StorageNotFoundError): "
)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    name: str
    url: str
    step: int | None
    created: str
    #: format version 3: the checkpoints of the run whose files this one reads
    references: tuple[str, ...] = ()
    #: ``"bytecp"``, or the name of the :data:`bytecp.interop.SOURCES` format that reads it
    format: str = "bytecp"


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A folder of a run whose ``metadata.json`` is bytecp's (or too damaged to
    tell) but does not read: a committed checkpoint whose own files are bad."""

    name: str
    url: str
    why: str


def list_checkpoints(run_url: str, *, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly below ``run_url``, oldest step first
    (each read as far as its header: a W-rank checkpoint's ``metadata.json``
    is O(W), and retention lists the run twice per save). One whose
    ``metadata.json`` does not read is left out with a warning (the resume
    decision, :mod:`bytecp.tools.resume`, tries it and falls back); a storage
    error is raised, never read as "no checkpoint"."""
    return scan(open_storage(run_url, **(storage_options or {})), run_url)[0]


def scan(root: Storage, run_url: str, names: list[str] | None = None) -> tuple[list[CheckpointInfo], list[Unreadable]]:
    """(the catalog, and the resume decision with the run's listing ``names``)
    The committed checkpoints below ``root``, oldest step first, and the
    folders whose bytecp ``metadata.json`` does not read. On a remote store
    the folders are read on up to :data:`SCAN_THREADS` threads: a follower's
    every poll, a resume and each retention read every checkpoint's header,
    three requests each, which one after the other took 2.37 s for 40
    checkpoints on a Ceph RGW here (0.43 s on the threads; seconds more on a
    store far away); on local disk one by one (15 ms, 19 on threads). The
    first storage error, in the listing's order, is raised as it was one by one."""
    names = root.list_children("") if names is None else names
    if len(names) <= 4 or not root.remote:  # (local disk, the memory tier: threads only add hand-offs)
        got = [_scan_one(root, run_url, n) for n in names]
    else:
        pool = _POOL.get()
        ctx = contextvars.copy_context()  # (the caller's context variables, a deadline's, on every thread)
        got = list(pool.map(lambda n: ctx.copy().run(_scan_one, root, run_url, n), names))
    out = [g for g in got if isinstance(g, CheckpointInfo)]
    bad = [g for g in got if isinstance(g, Unreadable)]
    out.sort(key=lambda c: (c.step is None, c.step or 0, c.created))
    return out, bad


#: the threads :func:`scan` reads a run's folders on (kept between calls: a follower scans at every poll)
SCAN_THREADS = 16
_POOL = KeptPool(SCAN_THREADS, "bytecp-scan")


def _scan_one(root: Storage, run_url: str, name: str) -> CheckpointInfo | Unreadable | None:
    """(a :func:`scan` thread) The folder ``name``: a committed checkpoint, one whose
    bytecp ``metadata.json`` does not read, or None (not a checkpoint, or deleted meanwhile)."""
    if not root.exists(f"{name}/{fmt.METADATA_FILE}"):
        return None
    ck = root.child(name)  # read through the checkpoint's own storage: a step folder may be a link
    url = f"{run_url.rstrip('/')}/{name}"
    try:
        head = read_header(ck, committed=True)
    except CorruptCheckpointError as e:
        if _bytecp(ck):  # (not another format's folder, torch_dist: bytecp.interop.runs reads those)
            why = one_line(e)
            if _TOLD.get((url, why)) is None:  # once per process: a follower lists the run at every poll
                _TOLD.put((url, why), True)
                log.warning("bytecp: %s has an unreadable metadata.json (%s)", url, why)
            return Unreadable(name, url, why)
        return None
    # (a newer format version, a storage error: raised, never read as "no checkpoint")
    if head is None:
        return None  # deleted meanwhile
    m = _STEP.match(name)
    step = head.step if head.step is not None else (int(m.group(1)) if m else None)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(head.created))
    return CheckpointInfo(name, url, step, created, tuple(sorted(head.references)))


def _bytecp(ck: Storage) -> bool:
    """Whether the unreadable ``metadata.json`` at ``ck`` is bytecp's (or too
    damaged to tell); False when it is gone. A storage error is raised."""
    try:
        return fmt.is_bytecp_metadata(ck)
    except FileNotFoundError:
        return False


def list_bases(run_url: str, *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Checkpoints below ``run_url`` that retention retired (``base.json``, no
    ``metadata.json``): no longer checkpoints, kept for the files newer ones reference."""
    return retired_names(open_storage(run_url, **(storage_options or {})))


def checkpoint_is_bad(error: BaseException) -> bool:
    """Whether ``error`` (raised by a load) blames the checkpoint's own files,
    so an older checkpoint may load where this one did not.

    Called by ``CheckpointManager.restore`` on every rank: a distributed
    load raises the same :class:`~bytecp.errors.DistributedCheckpointError`
    everywhere, so every rank decides alike. Every failed rank must blame
    the files; a newer format, a state that does not fit, refused pickles
    and storage refusing access are never a reason to go back.
    """
    if isinstance(error, FormatVersionError):
        return False
    if isinstance(error, _BAD):
        return True
    if isinstance(error, DistributedCheckpointError) and error.failures:
        return all(_BAD_NAMES.search(text) for text in error.failures.values())
    return False


