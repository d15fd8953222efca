"""Why a URL is not a checkpoint: one clear line naming the path and what to do.

Called by :func:`bytecp.loading.opened.read_metadata` (every reader: ``load``,
``load_state_dict``, ``inspect``, ``verify``, ``export``) when
``metadata.json`` cannot be read, and only then, so the look-ups here cost
nothing on the normal path. The cases, in the order they are checked:

- the URL names a **file** (``ckpt/metadata.json``, a ``.pt`` file): name
  the directory to use instead;
- the URL is a **run directory** holding committed checkpoints (``step-N``
  folders): name its latest committed checkpoint;
- a ``base.json``: a checkpoint **retired by retention**, kept only for the
  files newer checkpoints reference;
- files but no ``metadata.json``: an **interrupted or failed save**;
- **nothing** there: say so, and how to list a run's checkpoints.

Storage errors that are not "missing" (permissions, throttling, an
unreachable server) are returned unchanged: they already say what is wrong.
"""

from __future__ import annotations

import logging
import os
from typing import NoReturn

from bytecp.errors import CheckpointNotFoundError, IncompleteCheckpointError, StorageError
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage, open_storage, split_protocol

__all__ = ["not_a_checkpoint", "raise_not_a_checkpoint"]

log = logging.getLogger(__name__)


def not_a_checkpoint(storage: Storage, error: BaseException) -> BaseException:
    """(coordinator) The error to raise for a checkpoint URL without a readable
    ``metadata.json``; ``error`` is what reading it raised."""
    url = storage.url.rstrip("/")
    missing = isinstance(error, FileNotFoundError)
    if not missing and not isinstance(error, StorageError):
        return error
    if _is_a_file(storage):
        parent = url.rsplit("/", 1)[0] if "/" in url else "."
        hint = (
            f"use its directory {parent}"
            if url.endswith("/" + fmt.METADATA_FILE) or url == fmt.METADATA_FILE
            else "pass the checkpoint's directory (the one holding metadata.json); "
            "a single-file checkpoint (torch.save) is not a bytecp checkpoint"
        )
        return CheckpointNotFoundError(f"{url} is a file, not a checkpoint directory: {hint}")
    if not missing:
        return error  # a real storage failure (permission, network): it says what is wrong
    latest = _latest_committed(storage)
    if latest is not None:
        return CheckpointNotFoundError(
            f"{url} is a run directory, not a checkpoint: its latest committed checkpoint is "
            f"{url}/{latest}; load that (or use CheckpointManager({url!r}).restore, which picks it)"
        )
    try:
        leftovers = storage.list_files("")
    except Exception:  # noqa: BLE001 - listing is only for the message
        leftovers = []
    if "base.json" in leftovers:  # format version 3: retention retired it (bytecp.format.references)
        return CheckpointNotFoundError(
            f"{url} was retired by retention: it only holds the files newer checkpoints of its run "
            "reference (base.json); load one of those (`bytecp ls RUN_DIR` lists them)"
        )
    if leftovers:
        return IncompleteCheckpointError(
            f"{url} has no metadata.json but holds {len(leftovers)} file(s): an interrupted or "
            "failed save; it is not a checkpoint (load an earlier one; `bytecp gc` removes the files)"
        )
    return CheckpointNotFoundError(
        f"no checkpoint at {url}: nothing is stored there; check the path "
        "(`bytecp ls RUN_DIR` lists a run's committed checkpoints)"
    )


def raise_not_a_checkpoint(storage: Storage, error: BaseException) -> NoReturn:
    """Raise :func:`not_a_checkpoint`'s answer (``error`` itself when it is a real storage failure)."""
    err = not_a_checkpoint(storage, error)
    if err is error:
        raise error
    raise err from None


def _is_a_file(storage: Storage) -> bool:
    """Whether the URL itself names a file (asked of its parent directory)."""
    url = storage.url.rstrip("/")
    proto, rest = split_protocol(url)
    if proto in ("file", "local"):
        path = os.path.abspath(os.path.expanduser(rest))
        parent_url, name = os.path.dirname(path), os.path.basename(path)
    elif "/" in rest.strip("/"):
        parent_url, name = url.rsplit("/", 1)
    else:
        return False  # a bucket or filesystem root is never a file
    if not name or parent_url == url:
        return False
    try:
        return open_storage(parent_url, **storage.options()).exists(name)
    except Exception as e:  # noqa: BLE001 - only a better message is at stake
        log.debug("bytecp: could not check whether %s is a file: %s", url, e)
        return False


def _latest_committed(storage: Storage) -> str | None:
    """The committed checkpoint directly below the URL with the highest step, if any."""
    from bytecp.catalog import list_checkpoints

    try:
        found = list_checkpoints(storage.url, storage_options=storage.options())
    except Exception as e:  # noqa: BLE001 - only a better message is at stake
        log.debug("bytecp: could not list checkpoints below %s: %s", storage.url, e)
        return None
    return found[-1].name if found else None
