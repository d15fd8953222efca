"""``bytecp gc``: remove what a committed checkpoint does not reference.

A save that crashed (the process killed before it could clean up) leaves its
``data/<save_id>/`` and ``index/<save_id>/`` files beside the committed
checkpoint. They are garbage once a *newer* save has committed; files of
saves newer than the committed one may belong to a save still running and
are never touched. Save ids start with their UTC start time, so "older" is a
string comparison.
"""

from __future__ import annotations

import dataclasses

from bytecp.loading.opened import open_checkpoint
from bytecp.storage_api import Storage
from bytecp.tools.progress import NO_PROGRESS, Progress

__all__ = ["GcResult", "collect_garbage"]


@dataclasses.dataclass
class GcResult:
    removed: list[str]
    kept_newer: list[str]  # files of saves that may still be running


#: files deleted per storage call (one S3 DeleteObjects request holds 1,000)
DELETE_BATCH = 1000


def collect_garbage(storage: Storage, *, dry_run: bool = False, progress: Progress = NO_PROGRESS) -> GcResult:
    """Delete unreferenced data/index files of saves older than the committed one.

    ``progress`` hears the files as they are deleted (batches of :data:`DELETE_BATCH`)."""
    opened = open_checkpoint(storage)
    md = opened.metadata
    keep = md.referenced_files()
    removed: list[str] = []
    newer: list[str] = []
    for path in opened.stored_files():
        parts = path.split("/")
        if len(parts) != 3 or parts[0] not in ("data", "index") or path in keep:
            continue
        if parts[1] > md.save_id:
            newer.append(path)
        else:
            removed.append(path)
    if removed and not dry_run:
        progress.start(len(removed))
        for i in range(0, len(removed), DELETE_BATCH):
            batch = removed[i : i + DELETE_BATCH]
            storage.delete(batch)
            progress.advance(len(batch))
    return GcResult(removed, newer)


