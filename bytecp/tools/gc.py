"""``bytecp gc``: remove the files of saves that never committed.

A save that crashed (the process killed before it could clean up) leaves its
``data/<save_id>/`` and ``index/<save_id>/`` files (and its lease) at the
checkpoint URL: beside a committed checkpoint, or in a directory with no
``metadata.json`` at all. They are removed once the save cannot be running
any more: its lease has expired, or it has none and started more than one
lease term ago (:mod:`bytecp.saving.leases` says how). Files of a save that
may still be running, of this job or another, are never touched. The next
successful save to the same URL removes the same files by itself.

The URL may be a checkpoint, a directory of a save that never committed, or
a run directory (each ``step-<N>`` below it is collected).

Racing saves and retention (format version 3): a reference names only files
of the save committed at the referenced checkpoint (its ``metadata.json``,
or the ``base.json`` retention moves it to), and gc removes only files of
other saves, reading the committed save from either file. So gc never
removes a file a checkpoint references or a save in flight checks, and
needs no doom marker: retention (:mod:`bytecp.tools.retention`) alone
removes committed files, under the protocol of :mod:`bytecp.saving.pins`.
"""

from __future__ import annotations

import dataclasses

from bytecp.catalog import one_line
from bytecp.errors import CorruptCheckpointError
from bytecp.format.header import read_header
from bytecp.format.references import BASE_FILE
from bytecp.saving.leases import LEASE_DIR, orphans
from bytecp.storage_api import Storage
from bytecp.tools.progress import NO_PROGRESS, Progress
from bytecp.tools.retention import LEFT_BEHIND, only_left_behind

__all__ = ["GcResult", "collect_garbage"]


@dataclasses.dataclass
class GcResult:
    removed: list[str]
    kept_newer: list[str]  # files of saves that may still be running
    #: (checkpoint, why) of those left untouched: which save committed there cannot be read
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)


#: files deleted per storage call (one S3 DeleteObjects request holds 1,000)
DELETE_BATCH = 1000
_SAVE_FOLDERS = ("data", "index", "serving", LEASE_DIR)



def _committed_id(storage: Storage) -> str | None:
    """The committed save's id at ``storage`` (None: nothing committed there):
    from ``metadata.json``, or from ``base.json`` once retention retired it --
    a retention racing this gc moves one to the other, and the save stays the
    committed one (files kept checkpoints reference are never orphans)."""
    head = read_header(storage)  # its references need not resolve: only its own files matter here
    return None if head is None else head.save_id


def _targets(storage: Storage) -> list[tuple[str, Storage]]:
    """(prefix for the paths reported, storage) of every checkpoint URL to collect."""
    names = storage.list_children("")
    if BASE_FILE in names and "metadata.json" not in names:
        return []  # retired by retention: its files are those kept checkpoints reference
    if storage.exists("metadata.json") or any(n in _SAVE_FOLDERS for n in names) or _left_behind(set(names)):
        return [("", storage)]
    out = []
    for name in names:  # a run directory: its checkpoints, committed or not
        kids = set(storage.list_children(name))
        if BASE_FILE in kids and "metadata.json" not in kids:
            continue  # a retired base (format version 3): never a save that did not commit
        if "metadata.json" in kids or kids & set(_SAVE_FOLDERS) or _left_behind(kids):
            out.append((name + "/", storage.child(name)))
    return out


def _left_behind(names: set[str]) -> bool:
    """A directory holding only what outlives a checkpoint whose other files went (its reports, a doom marker)."""
    return bool(names) and names <= {n.rstrip("/") for n in LEFT_BEHIND}


def collect_garbage(storage: Storage, *, dry_run: bool = False, progress: Progress = NO_PROGRESS) -> GcResult:
    """Delete the files of saves that never committed and cannot be running.

    ``progress`` hears the files as they are deleted (batches of :data:`DELETE_BATCH`).
    A checkpoint whose ``metadata.json`` does not read is left untouched and
    named in ``skipped`` (which of its files the committed save holds cannot
    be told); the others are collected.
    Raises :class:`~bytecp.errors.CheckpointNotFoundError` when the URL holds
    neither a checkpoint, nor a save's files, nor a run's checkpoints."""
    targets = _targets(storage)
    if not targets:
        from bytecp.loading.diagnose import not_a_checkpoint

        raise not_a_checkpoint(storage, FileNotFoundError(storage.url))
    removed: list[str] = []
    newer: list[str] = []
    skipped: list[tuple[str, str]] = []
    plans = []
    for prefix, st in targets:
        try:
            committed = _committed_id(st)
        except CorruptCheckpointError as e:  # its files may be the committed save's: none is an orphan
            skipped.append((prefix or st.url, one_line(e)))
            continue
        dead, running = orphans(st, committed)
        if committed is None and not running:  # what is left once they go: a retention cut short, its reports
            gone = set(dead)
            left = [f for f in st.list_files("") if f not in gone]
            if only_left_behind(left):
                dead = [*dead, *left]
        plans.append((st, dead))
        removed += [prefix + p for p in dead]
        newer += [prefix + p for p in running]
    if removed and not dry_run:
        progress.start(len(removed))
        for st, dead in plans:
            for i in range(0, len(dead), DELETE_BATCH):
                batch = dead[i : i + DELETE_BATCH]
                st.delete(batch)
                progress.advance(len(batch))
    return GcResult(removed, newer, skipped)
