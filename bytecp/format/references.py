"""Checkpoints of one run that share bytes (format version 3).

A checkpoint may name, in its index rows and ``data_files``, data files of
another committed checkpoint of the same run, as
``../<name>/data/<save_id>/<file>.bin`` -- ``<name>`` a sibling directory
under the run's root, listed in ``metadata.json``'s ``references`` with the
save id committed there. References are flat: a checkpoint lists every
checkpoint whose files it reads, never a chain to follow, so a read never
goes more than one hop.

Who calls what:

- :func:`check_references` -- the coordinator of a save before it commits
  (through :func:`bytecp.saving.pins.check_bases`, which also reads the
  doom markers and the files themselves), and :func:`bytecp.loading.opened.open_checkpoint` (the coordinator of a
  load; every one-process tool): every referenced checkpoint is committed
  (its ``metadata.json``, or the ``base.json`` retention leaves in place of
  it, see :data:`BASE_FILE`), still holds the save that was referenced, and
  holds each referenced file itself, with the size recorded here.
- :class:`LinkedStorage` -- wraps the checkpoint's storage for every reader:
  paths ``../<name>/...`` are read from the sibling checkpoint ``<name>``
  (same backend and options), everything else from the checkpoint itself.
"""

from __future__ import annotations

import itertools
import json
import logging
import posixpath
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.checked_reads import sums_of_spans
from bytecp.format.header import BASE_FILE, Files, read_files, read_header
from bytecp.format.json_head import HEADER_KEYS
from bytecp.storage_api import Buffer, Storage, open_storage

log = logging.getLogger("bytecp")

__all__ = [
    "BASE_FILE", "DOOM_DIR", "PIN_DIR", "LinkedStorage", "check_references", "linked", "name_of",
    "referenced_by", "retired_bytes", "retired_names", "run_url", "sibling",
]

#: where a save in flight marks the checkpoints it references (one file per
#: save; written and read by :mod:`bytecp.saving.pins`)
PIN_DIR = "pins"
#: where a deleter (retention, an overwrite) names the data files it may
#: delete in a checkpoint (one file per deleter; :mod:`bytecp.saving.pins`)
DOOM_DIR = "doomed"


def run_url(url: str) -> str:
    """The run's root: the directory holding the checkpoint ``url``."""
    head, _, _ = url.rstrip("/").rpartition("/")
    if not head and "://" not in url:
        return "."  # a relative path: the working directory
    if not head or head.endswith(":/"):
        raise CorruptCheckpointError(f"{url}: a checkpoint at the root of its storage has no run to share files with")
    return head


def name_of(url: str) -> str:
    """The checkpoint's name in its run (the last part of its URL)."""
    return url.rstrip("/").rpartition("/")[2]


def sibling(storage: Storage, name: str) -> Storage:
    """The checkpoint ``name`` of the run ``storage`` belongs to (same backend and options)."""
    return open_storage(run_url(storage.url) + "/" + name, **storage.options())


def retired_bytes(files: Files, retained: Iterable[str]) -> bytes:
    """``base.json`` of a checkpoint retired by retention (its ``metadata.json``,
    or the ``base.json`` it already was, as :func:`~bytecp.format.header.read_files`
    read it), keeping ``retained``."""
    if files.header.format_version >= 4:  # its header and files: nobody loads a retired checkpoint (§6.7)
        doc = {k: v for k, v in files.doc.items() if k in HEADER_KEYS}
        d = {**doc, "index_files": [], "data_files": files.data_files, "retained": sorted(set(retained))}
    else:  # the whole metadata (what bytecp before format 4 reads back)
        d = {**files.doc, "data_files": files.data_files, "retained": sorted(set(retained))}
    return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()


def retired_names(root: Storage) -> list[str]:
    """Checkpoints below the run ``root`` that retention retired (a :data:`BASE_FILE`, no ``metadata.json``)."""
    return [n for n in root.list_children("") if root.exists(f"{n}/{BASE_FILE}")
            and not root.exists(f"{n}/{fmt.METADATA_FILE}")]


def referenced_by(storage: Storage) -> list[str]:
    """(coordinator of an overwrite, before it plans) The committed checkpoints
    of the run that reference the checkpoint at ``storage`` (none at a
    storage's root)."""
    try:
        root = open_storage(run_url(storage.url), **storage.options())
    except CorruptCheckpointError:
        return []
    me = name_of(storage.url)
    out = []
    for name in root.list_children(""):
        if name != me and root.exists(f"{name}/{fmt.METADATA_FILE}"):
            try:
                head = read_header(root.child(name))
            except Exception:  # noqa: BLE001 - an unreadable checkpoint reads nothing
                continue
            if head is not None and me in head.references:
                out.append(name)
    return out


def check_references(storage: Storage, md: fmt.Metadata) -> None:
    """(coordinator of a save before its commit; whoever opens a checkpoint)
    Every checkpoint ``md`` references is a committed checkpoint of the same
    run, holding the referenced save and each referenced file itself; one
    :class:`CorruptCheckpointError` naming the reference otherwise."""
    me = name_of(storage.url)
    for name, save_id in sorted(md.references.items()):
        where = f"{storage.url}: reference to checkpoint {name!r} of the run"
        if name == me:
            raise CorruptCheckpointError(f"{where} is a reference to itself (a cycle); the checkpoint is corrupt")
        base = read_files(sibling(storage, name))  # its data files, not its tensors and index
        if base is None:
            raise CorruptCheckpointError(
                f"{where}: {run_url(storage.url)}/{name} is not a committed checkpoint (no metadata.json); "
                "the checkpoint cannot be read without it"
            )
        if base.header.save_id != save_id:
            raise CorruptCheckpointError(
                f"{where}: it holds save {base.header.save_id}, not the referenced save {save_id} (it was overwritten)"
            )
        own = base.own_data_files
        for path, size in sorted(md.files_of(name).items()):
            if own.get(path) == size:
                continue
            if me in base.header.references:
                raise CorruptCheckpointError(f"{where}: the references form a cycle ({me} -> {name} -> {me})")
            raise CorruptCheckpointError(
                f"{where}: data file {path} ({size} bytes) is not one of the files that checkpoint holds "
                "(its own, or those retention kept for newer checkpoints)"
            )


class LinkedStorage(Storage):
    """A checkpoint's storage whose reads of ``../<name>/...`` go to the
    sibling checkpoint ``<name>`` (only names in ``references``). Writes,
    deletes and listings stay inside the checkpoint."""

    def __init__(self, inner: Storage, references: Iterable[str]) -> None:
        self.inner = inner
        self.url, self.remote = inner.url, inner.remote
        self.exclusive_commit, self.atomic_rename = inner.exclusive_commit, inner.atomic_rename
        self._names = frozenset(references)
        self._siblings: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def _route(self, path: str) -> tuple[Storage, str]:
        if not path.startswith("../"):
            return self.inner, path
        parts = path.split("/", 2)
        if len(parts) != 3 or parts[1] not in self._names:
            raise CorruptCheckpointError(f"{self.url}: refusing to read {path!r}: not a referenced checkpoint")
        with self._lock:
            s = self._siblings.get(parts[1])
            if s is None:
                s = self._siblings[parts[1]] = sibling(self.inner, parts[1])
        return s, posixpath.normpath(parts[2])

    # reads follow references
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        s, p = self._route(path)
        s.read_into(p, offset, out)

    @property
    def reads_each(self) -> bool:  # type: ignore[override]
        return self.inner.reads_each  # (a sibling that does not: ``each`` called once it is read)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                    each: Callable[[int], None] | None = None) -> None:
        s, p = self._route(path)
        if each is not None and s.reads_each:
            s.read_ranges(p, ranges, each=each)
            return
        s.read_ranges(p, ranges)
        if each is not None:
            for i in range(len(ranges)):
                each(i)

    @property
    def sums_reads(self) -> bool:  # type: ignore[override]
        return self.inner.sums_reads  # (a sibling that does not: summed here once it is read)

    def read_ranges_summed(self, path: str, ranges: Sequence[tuple[int, memoryview]], spans: Any) -> Any:
        s, p = self._route(path)
        if s.sums_reads:
            return s.read_ranges_summed(p, ranges, spans)
        s.read_ranges(p, ranges)
        return sums_of_spans(ranges, spans)

    def read_files(self, reads: Sequence[tuple[str, Sequence[tuple[int, memoryview]]]]) -> None:
        routed = [(*self._route(path), ranges) for path, ranges in reads]
        for s, group in itertools.groupby(routed, key=lambda r: r[0]):  # (runs of one checkpoint's files: one request)
            s.read_files([(p, ranges) for _, p, ranges in group])

    def read_bytes(self, path: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        s, p = self._route(path)
        return s.read_bytes(p, offset, nbytes)

    def size(self, path: str) -> int:
        s, p = self._route(path)
        return s.size(p)

    def exists(self, path: str) -> bool:
        s, p = self._route(path)
        return s.exists(p)

    # everything else is the checkpoint's own
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        self.inner.write_file(path, buffers)

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self.inner.commit(path, data, exclusive=exclusive)

    def write_stream(self, path: str, pieces: Iterable[Buffer], *, size_hint: int | None = None) -> int:
        return self.inner.write_stream(path, pieces, size_hint=size_hint)

    def delete(self, paths: Iterable[str]) -> None:
        self.inner.delete([p for p in paths if not p.startswith("../")])

    def list_files(self, prefix: str = "") -> list[str]:
        return self.inner.list_files(prefix)

    def file_sizes(self, prefix: str = "") -> dict[str, int]:
        return self.inner.file_sizes(prefix)

    def options(self) -> dict[str, Any]:
        return self.inner.options()

    def close(self) -> None:
        for s in self._siblings.values():
            s.close()


def linked(storage: Storage, md: fmt.Metadata) -> Storage:
    """``storage`` itself, or wrapped so that ``md``'s references are read."""
    if not md.references or isinstance(storage, LinkedStorage):
        return storage
    return LinkedStorage(storage, md.references)
