"""The storage protocol every backend implements, and the URL registry.

Who calls what, and when (per checkpoint directory):

Save
  1. (all ranks, writer threads) ``write_file`` for each data and index file.
     Writes go to names no committed checkpoint references, so a failed save
     never damages an existing one.
  2. (coordinator) ``commit("metadata.json", data, exclusive=not overwrite)``:
     atomic publish of one small file, only after every rank reported its
     files durable. On a filesystem: temp file + fsync + rename + directory
     fsync; on an object store: a single PUT. ``exclusive=True`` makes the
     publish fail with :class:`~bytecp.errors.CheckpointExistsError` if the
     file exists by then (another job committed first): a hard link or
     no-replace rename on filesystems, a conditional PUT (``If-None-Match:
     *``) on object stores. Backends that cannot make that one atomic step
     say so in their docstring and in ``exclusive_commit``.
  3. (coordinator) ``delete`` of files an overwritten checkpoint no longer
     references, and of a failed save's orphans.
Load
  1. (coordinator) ``read_bytes("metadata.json")`` and the index files, and
     ``file_sizes("data")`` to check every size the checkpoint declares
     against the real files before anything is allocated.
  2. (all ranks, reader threads) ``read_ranges`` (a batch of ranges of one
     file, coalesced by object-store backends) or ``read_into`` for byte ranges.
Export (``bytecp export``, one process)
  1. ``write_stream`` for each file larger than memory (safetensors shards),
     atomic per file; ``commit`` for the small ones, the commit file last.
  2. Where ``atomic_rename`` holds (filesystems), the whole output is staged
     beside its destination and published with one ``rename``.

Backends live in ``bytecp.storage`` and register by URL protocol; the core
only reaches them through :func:`open_storage`, which imports the module
named in the registry lazily (a missing optional dependency surfaces as an
error naming the extra to install).
"""

from __future__ import annotations

import abc
import importlib
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format.checksum import Sums
from bytecp.plugins import STORAGE_GROUP, entry_point_targets

__all__ = ["Storage", "SharedArena", "Buffer", "register_storage", "open_storage", "split_protocol", "join"]

Buffer = bytes | bytearray | memoryview


def split_protocol(url: str) -> tuple[str, str]:
    """``"s3://b/k"`` -> ``("s3", "b/k")``; a plain path -> ``("file", path)``."""
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto.lower(), rest
    return "file", url


def join(*parts: str) -> str:
    """Join relative path parts with ``/`` (storage paths are always ``/``)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class SharedArena:
    """Host memory a storage backend lent to a save (:meth:`Storage.staging_arena`).

    ``buffer`` is a writable mapping of ``nbytes`` (page-aligned); the
    stager sets ``used`` to the bytes its layout takes; ``name`` is the
    backend's handle for :meth:`Storage.adopt`.
    """

    __slots__ = ("buffer", "nbytes", "name", "used", "__weakref__")

    def __init__(self, buffer: Any, nbytes: int, name: str) -> None:
        self.buffer, self.nbytes, self.name, self.used = buffer, nbytes, name, 0

    def __repr__(self) -> str:
        return f"SharedArena({self.name!r}, {self.nbytes} bytes)"


class Storage(abc.ABC):
    """One checkpoint directory (or any prefix) on some storage system.

    Paths passed to methods are relative to ``url`` and use ``/``. Every
    method may be called from several threads at once.
    """

    #: the URL this storage is rooted at, as given by the user
    url: str

    #: whether reads cross a network (object stores, HDFS, unknown fsspec
    #: protocols): loads then read replicated data once and exchange it
    #: between ranks instead of every rank reading it (zero-redundancy)
    remote: bool = True

    # -- writing ---------------------------------------------------------
    @abc.abstractmethod
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        """Create (or replace) ``path`` with the concatenation of ``buffers``.

        (all ranks, writer threads) The file MUST be durable when ``commit``
        is later called for the checkpoint; backends that can, make it
        durable before returning.
        """

    #: how ``commit(..., exclusive=True)`` refuses an existing file:
    #: ``"atomic"`` (the existence check and the publish are one step) or
    #: ``"check-then-publish"`` (a window between the two remains, named in
    #: the backend's docstring)
    exclusive_commit: str = "atomic"

    @abc.abstractmethod
    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Atomically publish a small file: readers see all of it or none.

        (coordinator, once per checkpoint) Called last: this is what makes a
        checkpoint exist. ``exclusive=False`` replaces an existing file (its
        old contents stay readable until the new ones are complete);
        ``exclusive=True`` raises :class:`~bytecp.errors.CheckpointExistsError`
        naming the file if it exists, leaving it untouched and no temporary
        behind.
        """

    def write_stream(self, path: str, pieces: Iterable[Buffer], *, size_hint: int | None = None) -> int:
        """Create (or replace) ``path`` from ``pieces``, consumed one at a time; returns its size.

        (one process: ``bytecp export``) For files larger than memory: a piece
        may be overwritten or freed by the producer as soon as the next one is
        requested, so the backend writes (or copies) each piece before it pulls
        the next, and memory holds about one piece plus the backend's write
        buffer. ``size_hint`` (the file's size, when known) lets object stores
        choose their part size. The publish is atomic: readers see the old
        file (or none) or the whole new one, never a part -- filesystems write
        a temporary file and rename it, object stores complete a multipart
        upload. If ``pieces`` raises, the exception propagates and nothing is
        published or left behind.

        This default collects every piece first (memory: the whole file);
        bytecp's backends override it.
        """
        data = [bytes(memoryview(p).cast("B")) for p in pieces]
        self.write_file(path, data)
        return sum(len(d) for d in data)

    #: whether :meth:`rename` works here: one atomic rename of a file or a
    #: whole directory (filesystems). Object stores have none; callers then
    #: publish file by file, the commit file last.
    atomic_rename: bool = False

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        """Rename the file or directory ``src`` to ``dst`` in one atomic step.

        (one process: ``bytecp export`` publishing a staged directory) Only
        where :attr:`atomic_rename` is true. ``replace=False`` raises
        :class:`~bytecp.errors.CheckpointExistsError` if ``dst`` exists (and
        changes nothing); ``replace=True`` swaps an existing ``dst`` out and
        deletes it afterwards.
        """
        raise NotImplementedError(f"{type(self).__name__} has no atomic rename")

    # -- single-copy staging (optional) ----------------------------------
    #: whether :meth:`staging_arena` may lend arenas (saves then stage into them)
    lends_arenas: bool = False

    def staging_arena(self, nbytes: int) -> SharedArena | None:
        """Memory the backend's own process can take over as a data file.

        (every rank, when an async or sync save stages its boxes) ``None``
        (the default): the save copies into the process's private arena and
        writes with :meth:`write_file`. A backend that returns an arena
        (``keeper://``: a shared-memory file of the host's keeper) gets it
        back through :meth:`adopt` instead of a write: the rank copies each
        byte once and never checksums or writes it.
        """
        return None

    def prepare_staging(self, nbytes: int, count: int = 1, pinned: bool = False) -> None:
        """(every rank, at prewarm) Have ``count`` arenas of ``nbytes`` ready
        for the next :meth:`staging_arena` calls (``pinned``: registered for
        CUDA copies, the state being on a device); nothing by default."""

    def adopt(self, path: str, arena: SharedArena,
              ranges: Sequence[tuple[int, int]]) -> tuple[list[Sums], list[int], int]:
        """Make ``arena``'s first ``arena.used`` bytes the data file ``path``.

        (every rank, writer thread; only with an arena of
        :meth:`staging_arena`) ``ranges`` are the ``(offset, nbytes)`` of the
        chunks in it. Returns their checksums (crc32c and block checksums:
        the backend computes them with :func:`bytecp.format.checksum.sums`,
        as the writer would), where each starts in the file and the file's size: a
        backend may copy the ranges out into a smaller file (page-aligned, as
        the writer lays them out) when they are a small part of the arena.
        The arena is the backend's from then on.
        """
        raise NotImplementedError(f"{type(self).__name__} hands out no staging arenas")

    # -- draining (optional) ---------------------------------------------
    #: whether :meth:`drain_to` copies a committed checkpoint elsewhere by itself
    drains: bool = False

    def drain_to(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """(the manager's coordinator, after a memory checkpoint commits) Have
        the backend copy this committed checkpoint to ``url`` in the
        background, ``metadata.json`` last (``keeper://``: the host's keeper
        does). Backends without it (:attr:`drains` False) are drained by the
        manager saving the same step to storage."""
        raise NotImplementedError(f"{type(self).__name__} does not drain checkpoints by itself")

    @abc.abstractmethod
    def delete(self, paths: Iterable[str]) -> None:
        """Delete files; missing ones are ignored."""

    def delete_prefix(self, prefix: str = "") -> None:
        """Delete every file below ``prefix`` (the whole root when empty)."""
        self.delete(self.list_files(prefix))

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort unfinished uploads below ``prefix`` a stopped writer left
        (object stores' multipart uploads); returns how many. Nothing to do
        where a file is written in place."""
        return 0

    # -- reading ---------------------------------------------------------
    @abc.abstractmethod
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``path`` from ``offset``.

        (all ranks, reader threads) Raises :class:`CorruptCheckpointError` if
        the file ends early and :class:`StorageNotFoundError` if it is missing.
        """

    #: whether :meth:`read_ranges` takes ``each`` (a backend that fills ranges one after the other in
    #: memory the caller's thread can reach at once: local disk, buffered)
    reads_each: bool = False

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                    each: Callable[[int], None] | None = None) -> None:
        """Fill each ``out`` of ``ranges`` with ``len(out)`` bytes of ``path`` from its offset.

        (all ranks, reader threads) A batch of :meth:`read_into` calls on one
        file, with the same errors. Backends whose requests carry a high fixed
        cost (object stores: one GET each) coalesce nearby ranges into fewer,
        larger requests and stream the bytes straight into the buffers, so
        callers should hand over all the ranges they need from one file at
        once, rather than one read per tensor.

        ``each`` (passed only where :attr:`reads_each`): called with the index
        of each range as soon as its bytes are in, in order, on the thread
        that read them -- the loader sums each piece while it is still in the
        CPU's cache, inside the one call (a call per piece would cross to the
        request-timeout thread each time). Small ranges that follow each other
        in the file may be filled together first (the local backend reads runs
        of up to 1 MiB with one ``preadv``), each then called in order. An
        exception from it ends the call.
        """
        for i, (offset, out) in enumerate(ranges):
            self.read_into(path, offset, out)
            if each is not None:
                each(i)

    #: whether :meth:`read_ranges_summed` is offered (local disk, buffered, where the compiled checked
    #: reads are: :mod:`bytecp.format.checked_reads`)
    sums_reads: bool = False

    def read_ranges_summed(self, path: str, ranges: Sequence[tuple[int, memoryview]], spans: Any) -> Any:
        """:meth:`read_ranges` of ``ranges`` (in file order), returning the
        crc32c of each file byte span ``[spans[2k], spans[2k + 1])`` (an int64
        array of spans in order, each inside the ranges read, crossing from
        one range into the next only where they are adjacent) as a uint32
        array, every span summed piece by piece as it is read.

        (all ranks, reader threads, where :attr:`sums_reads`) The loader's
        checked reads of local files; same errors as :meth:`read_ranges`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not sum its reads (sums_reads is False)")

    @staticmethod
    def each_after(count: int, each: Callable[[int], None] | None) -> None:
        """(backends whose :attr:`reads_each` is False, at the end of :meth:`read_ranges`)
        Call ``each`` for every range, in order, once all ``count`` are in."""
        if each is not None:
            for i in range(count):
                each(i)

    def read_files(self, reads: Sequence[tuple[str, Sequence[tuple[int, memoryview]]]]) -> None:
        """:meth:`read_ranges` of each ``(path, ranges)`` of ``reads``, in order, with its errors.

        (all ranks) For many small reads of a local disk: a rank loading
        replicated experts reads a segment of each of 2,058 index parts at
        131,072 ranks, and a backend that bounds every request on a worker
        thread (local disk) bounds the whole batch as one request instead of
        handing each file to that thread. Callers keep a batch to a few MB.
        """
        for path, ranges in reads:
            self.read_ranges(path, ranges)

    def read_bytes(self, path: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        """Read ``nbytes`` (default: to the end) from ``offset``."""
        if nbytes is None:
            nbytes = self.size(path) - offset
        buf = bytearray(nbytes)
        if nbytes:
            self.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of ``path`` in bytes; :class:`StorageNotFoundError` if missing."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether the file ``path`` exists."""

    @abc.abstractmethod
    def list_files(self, prefix: str = "") -> list[str]:
        """Every file below ``prefix``, recursively, as paths relative to the root."""

    def file_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every file below ``prefix`` with its size in bytes (paths as :meth:`list_files`).

        (coordinator, when a checkpoint is opened for reading) Backends that
        can (object stores: a listing carries the sizes) answer in one listing
        instead of one request per file.
        """
        out = {}
        for p in self.list_files(prefix):
            try:
                out[p] = self.size(p)
            except (FileNotFoundError, CorruptCheckpointError):
                pass  # deleted meanwhile, or not a regular file (a reader refuses it by name)
        return out

    def list_children(self, prefix: str = "") -> list[str]:
        """Names directly below ``prefix`` (files and directories), sorted."""
        base = prefix.strip("/")
        cut = len(base) + 1 if base else 0
        return sorted({p[cut:].split("/", 1)[0] for p in self.list_files(prefix)})

    def child(self, path: str) -> Storage:
        """A storage rooted at ``path`` below this one (same backend, options)."""
        return open_storage(self.url.rstrip("/") + "/" + path.strip("/"), **self.options())

    def options(self) -> dict[str, Any]:
        """The keyword options this storage was opened with (for :meth:`child`)."""
        return {}

    def close(self) -> None:
        """Release connections and threads."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


StorageFactory = Callable[..., Storage]

# URL protocol -> "module:attribute" (imported lazily) or a factory.
_REGISTRY: dict[str, str | StorageFactory] = {
    "file": "bytecp.storage.local:LocalStorage",
    "local": "bytecp.storage.local:LocalStorage",
    "memory": "bytecp.storage.memory:MemoryStorage",
    "keeper": "bytecp.storage.keeper:KeeperStorage",
    "s3": "bytecp.storage.s3:S3Storage",
    "s3a": "bytecp.storage.s3:S3Storage",
    "hdfs": "bytecp.storage.hdfs:HDFSStorage",
    "viewfs": "bytecp.storage.hdfs:HDFSStorage",
}
_FALLBACK = "bytecp.storage.fsspec_backend:FsspecStorage"
_lock = threading.Lock()
_discovered = False


def register_storage(protocol: str, factory: str | StorageFactory) -> None:
    """Register a backend for a URL protocol (``"module:attr"`` or a callable).

    (any thread) ``factory(url, **options)`` returns a :class:`Storage`.
    Installed packages may instead declare an entry point in the
    ``bytecp.storage`` group (see :mod:`bytecp.plugins`).
    """
    with _lock:
        _REGISTRY[protocol.lower()] = factory


def _lookup(proto: str) -> str | StorageFactory | None:
    """The registered entry for ``proto``; the first miss reads the installed
    ``bytecp.storage`` entry points (once per process) and looks again."""
    global _discovered
    with _lock:
        entry = _REGISTRY.get(proto)
        if entry is not None or _discovered:
            return entry
        _discovered = True
    found = entry_point_targets(STORAGE_GROUP)
    with _lock:
        for name, target in found.items():
            _REGISTRY.setdefault(name.lower(), target)
        return _REGISTRY.get(proto)


def _resolve(entry: str | StorageFactory) -> StorageFactory:
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    factory: StorageFactory = getattr(importlib.import_module(module), attr)
    return factory


def open_storage(url: str, **options: Any) -> Storage:
    """Open the backend registered for ``url``'s protocol.

    Protocols without a tuned backend fall back to the generic fsspec one,
    so any fsspec URL works.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"checkpoint URL must be a non-empty string, got {url!r}")
    proto, _ = split_protocol(url)
    entry = _lookup(proto) or _FALLBACK
    return _resolve(entry)(url, **options)
