"""``metadata.json`` read in part (docs/FORMAT.md §6.2 "Header"): its header
members, and its data files, without the tensors, skeleton and index.

A W-rank checkpoint's ``metadata.json`` is O(W) and O(tensors): 29 MB for a
DeepSeek-V3-like state at 131,072 ranks, about a second and 150 MB to parse
whole. Tools over a run's checkpoints want a few members of each: listing a
run (every retention lists it twice) wants the step, the save id and the
references; ``gc`` the committed save's id; retention the references and
data files. Format version 4 writes the header members first, ``references``
among them, so :func:`read_header` reads the file's first 64 KiB and stops
at the first other member; an older file (``references`` at the end) or a
header longer than that is parsed whole, as JSON only.

Who calls what:

- :func:`read_header` -- :func:`bytecp.catalog.list_checkpoints` (every
  checkpoint of a run), ``bytecp gc`` (the committed save's id),
  :func:`bytecp.format.references.referenced_by` and retention's
  :func:`~bytecp.tools.retention.live_files` (which checkpoints reference others);
- :func:`read_files` -- :func:`~bytecp.format.references.check_references`
  (a referenced checkpoint's own files) and retention (the kept checkpoints'
  references, the doomed ones' own files and their ``base.json``).

Both read ``metadata.json``, else the ``base.json`` retention leaves
(:data:`~bytecp.format.references.BASE_FILE`), and check what they return
as :meth:`~bytecp.format.metadata.Metadata.from_bytes` does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from bytecp.errors import CorruptCheckpointError, StorageError
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.format.json_head import HEADER_BYTES, HEADER_KEYS, leading_members, scan_header
from bytecp.storage_api import Storage

__all__ = ["Header", "Files", "BASE_FILE", "read_header", "read_files", "committed_save_id"]

#: what retention leaves of a checkpoint that kept checkpoints still
#: reference: its header and data files, moved out of ``metadata.json`` (so it
#: is no longer a checkpoint: ``latest``, ``ls`` and loads skip it), with a
#: ``retained`` member listing the data files it keeps for them
#: (:mod:`bytecp.format.references`, FORMAT.md §6.7)
BASE_FILE = "base.json"
#: what :func:`read_files` wants of a version-4 file, which writes them first
_FILES_KEYS = (*HEADER_KEYS, "index_files", "data_files", "retained")


@dataclasses.dataclass(frozen=True)
class Header:
    """A checkpoint's header members, checked."""

    save_id: str
    format_version: int
    step: int | None
    created: float
    references: dict[str, str]


@dataclasses.dataclass
class Files:
    """A checkpoint's header, its data files (those ``base.json`` retained, for
    a retired one) and the whole parsed document (``base.json`` is written from it)."""

    header: Header
    data_files: dict[str, int]
    doc: dict[str, Any]

    @property
    def own_data_files(self) -> dict[str, int]:
        return fmt.own_files(self.data_files)

    def files_of(self, name: str) -> dict[str, int]:
        return fmt.files_in(self.data_files, name)


def _text(data: bytes, whole: bool, where: str) -> str:
    """``data`` decoded; a prefix may end inside a character."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        if not whole and e.start >= len(data) - 3:
            return data[: e.start].decode(errors="replace")
        raise CorruptCheckpointError(f"{where} is not valid UTF-8 ({e.reason} at byte {e.start})") from e


def _read(storage: Storage, committed: bool = False, whole: bool = False) -> tuple[str, bytes, int] | None:
    """(which file, its first :data:`HEADER_BYTES` or all of it, its size) of
    ``metadata.json``, else (not ``committed`` only) ``base.json``; None:
    neither. A file replaced or moved meanwhile (retention moves
    ``metadata.json`` to ``base.json``) is read again, once."""
    for attempt in (0, 1):
        for f in (fmt.METADATA_FILE,) if committed else (fmt.METADATA_FILE, BASE_FILE):
            try:
                size = storage.size(f)
            except FileNotFoundError:  # (StorageNotFoundError too; another storage error is raised)
                continue
            if whole:
                limits.check_metadata_size(size, storage.url, f)
            try:
                return f, storage.read_bytes(f, 0, size if whole else min(size, HEADER_BYTES)), size
            except (FileNotFoundError, StorageError):
                if attempt:
                    raise
                break  # changed between the two requests: look again
        else:
            return None
    return None


def _doc(storage: Storage, f: str, data: bytes, size: int) -> dict[str, Any]:
    where = f"{storage.url}/{f}"
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({str(e)[:200]})") from e
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: metadata.json is not a bytecp checkpoint")
    return d


def header_of(d: dict[str, Any], where: str) -> Header:
    """Check the header members of a parsed ``metadata.json`` (as :meth:`Metadata.from_bytes` does)."""
    if d.get("format") != fmt.FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: metadata.json is not a bytecp checkpoint")
    version = fmt.check_version(d.get("format_version"), where)
    step = d.get("step")
    try:
        created = float(d.get("created", 0.0))  # (as Metadata.from_bytes reads it, and limits checks it)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an integer beyond any float)
        created = -1.0
    if (step is not None and type(step) is not int) or not 0 <= created < 2**33 or "save_id" not in d:
        raise CorruptCheckpointError(f"{where}: metadata.json's step, created or save_id is malformed")
    refs = fmt.check_references(d.get("references"), where) if version >= 3 else {}
    return Header(str(d["save_id"]), version, step, created, refs)


def read_header(storage: Storage, *, committed: bool = False) -> Header | None:
    """The header of the checkpoint at ``storage`` (committed, or retired by
    retention unless ``committed``); None when it has neither file. Raises
    :class:`CorruptCheckpointError` (or :class:`FormatVersionError`) naming the file."""
    got = _read(storage, committed)
    if got is None:
        return None
    f, data, size = got
    d = scan_header(_text(data, len(data) == size, f"{storage.url}/{f}"))
    if d is None and len(data) < size:
        got = _read(storage, committed, whole=True)  # (parsed whole: an older version, or a long header)
        if got is None:
            return None
        f, data, size = got
    return header_of(_doc(storage, f, data, size) if d is None else d, f"{storage.url}/{f}")


_ID_KEYS = ("format", "format_version", "bytecp_version", "save_id")


def committed_save_id(storage: Storage) -> str | None:
    """The save the ``metadata.json`` at ``storage`` commits, from its leading
    members alone (``save_id`` is the fourth member every version writes: at
    most its first :data:`HEADER_BYTES` are read, whatever its size or its
    ``user_metadata``); None when there is none. A file whose first bytes
    name no save is a :class:`CorruptCheckpointError` (not this process's
    commit); a storage error is raised as it comes. Asked by a failed save's
    clean-up (:mod:`bytecp.saving.commit`), which must never take its own
    commit for another's."""
    got = _read(storage, committed=True)
    if got is None:
        return None
    f, data, size = got
    where = f"{storage.url}/{f}"
    d = leading_members(_text(data, len(data) == size, where), _ID_KEYS)
    if d is None or d.get("format") != fmt.FORMAT_NAME or not isinstance(d.get("save_id"), str):
        raise CorruptCheckpointError(f"{where}: its first bytes name no bytecp save")
    return str(d["save_id"])


def read_files(storage: Storage, *, committed: bool = False) -> Files | None:
    """The header and data files of the checkpoint at ``storage``, parsed as
    JSON only; a retired checkpoint's data files are those it retained
    (``committed``: a retired one reads as None, as one with neither file)."""
    got = _read(storage, committed, whole=True)
    if got is None:
        return None
    f, data, size = got
    where = f"{storage.url}/{f}"
    # version 4: the header, index_files, data_files (and a base's retained) come first
    d = scan_header(_text(data, True, where), _FILES_KEYS)
    if d is None or not isinstance(d.get("data_files"), dict) or (f == BASE_FILE and "retained" not in d) or (
            "references" not in d and any(p.startswith("../") for p in d["data_files"])):  # (refused, whole)
        d = _doc(storage, f, data, size)
    header = header_of(d, where)
    files = d.get("data_files")
    if not isinstance(files, dict) or not all(type(n) is int and n >= 0 for n in files.values()):
        raise CorruptCheckpointError(f"{where}: metadata.json's data_files is malformed")
    refs = header.references if header.format_version >= 3 else None
    for p in files:
        fmt.check_data_file(p, where, refs)
    if f == BASE_FILE:
        retained = d.get("retained") or []
        if type(retained) is not list or not all(type(p) is str for p in retained):
            raise CorruptCheckpointError(f"{where}: base.json's retained is not a list of file names")
        kept = set(retained)
        files = {p: n for p, n in files.items() if p in kept}
    return Files(header, files, d)
