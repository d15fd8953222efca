"""Error messages every backend words the same way.

Called by the backends' reads (a short file or object), exclusive commits
(another save committed first) and lookups (a missing file); each message
names the full URL of the file and what to do.
"""

from __future__ import annotations

from bytecp.errors import CheckpointExistsError, CorruptCheckpointError, StorageNotFoundError

__all__ = ["file_url", "truncated", "exists", "missing"]


def file_url(url: str, path: str) -> str:
    """The URL of ``path`` below a storage root ``url``, for messages."""
    return f"{url.rstrip('/')}/{path.strip('/')}"


def truncated(name: str, offset: int, n: int, ends: int | None, *, kind: str = "file") -> CorruptCheckpointError:
    """Bytes ``[offset, offset + n)`` of ``name`` were wanted; the ``kind``
    (file, object) ends at ``ends`` (None: somewhere before the end)."""
    at = f"{kind} ends at {ends}" if ends is not None else f"the {kind} is shorter"
    return CorruptCheckpointError(
        f"{name}: {kind} is truncated: wanted bytes [{offset}, {offset + n}), {at}"
    )


def exists(name: str) -> CheckpointExistsError:
    """An exclusive commit of ``name`` found another save's commit there."""
    return CheckpointExistsError(
        f"{name} already exists: another save committed here first; pass overwrite=True to "
        "replace it, or save to another URL"
    )


def missing(name: str, cause: object = None) -> StorageNotFoundError:
    """The file ``name`` is not there (``cause``: the backend's own answer, if any)."""
    return StorageNotFoundError(f"{name}: missing ({cause})" if cause is not None else f"{name}: missing")
