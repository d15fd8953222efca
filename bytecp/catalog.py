"""The committed checkpoints of a run directory (``<run>/step-<N>``).

Read by :class:`~bytecp.manager.CheckpointManager` (latest, retention),
``bytecp ls`` and the wrong-path diagnosis (a run directory names its
latest committed checkpoint). Imports nothing of the save or load path.
"""

from __future__ import annotations

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
)
from bytecp.format import metadata as fmt
from bytecp.format.header import read_header
from bytecp.format.references import retired_names
from bytecp.storage_api import Storage, open_storage

__all__ = ["CheckpointInfo", "list_checkpoints", "list_bases", "checkpoint_is_bad", "one_line"]

log = logging.getLogger("bytecp.manager")
_STEP = re.compile(r"^step-(\d+)$")
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


def list_checkpoints(run_url: str, *, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly below ``run_url``, oldest step first
    (each read as far as its header: a W-rank checkpoint's ``metadata.json``
    is O(W), and retention lists the run twice per save)."""
    root = open_storage(run_url, **(storage_options or {}))
    out = []
    for name in root.list_children(""):
        if root.exists(f"{name}/{fmt.METADATA_FILE}"):
            ck = root.child(name)  # read through the checkpoint's own storage: a step folder may be a link
            try:
                head = read_header(ck, committed=True)
            except FormatVersionError:
                raise  # never resume silently from an older checkpoint than the newest
            except Exception as e:
                if _bytecp(ck):  # (not another format's folder, torch_dist: bytecp.interop.runs reads those)
                    log.warning("bytecp: skipping %s/%s: unreadable metadata.json (%s)", run_url, name, e)
                continue
            if head is None:
                continue  # deleted meanwhile
            m = _STEP.match(name)
            step = head.step if head.step is not None else (int(m.group(1)) if m else None)
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(head.created))
            out.append(CheckpointInfo(name, f"{run_url.rstrip('/')}/{name}", step, created,
                                      tuple(sorted(head.references))))
    out.sort(key=lambda c: (c.step is None, c.step or 0, c.created))
    return out


def _bytecp(ck: Storage) -> bool:
    """Whether the unreadable ``metadata.json`` at ``ck`` is bytecp's (or too damaged to tell)."""
    try:
        return fmt.names_bytecp(ck.read_bytes(fmt.METADATA_FILE))
    except Exception:  # noqa: BLE001 - gone or unreadable: warned about as bytecp's
        return True


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


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error as one short line, for warnings that name several of them."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
