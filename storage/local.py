"""Local-disk backend: ``pwritev`` writes, ``preadv`` reads, fsync, atomic rename.

Called by the engine's writer/reader threads. ``write_file`` returns only
when the file's bytes are durable (fsync); ``commit`` first fsyncs every
directory that gained a file since the last commit (so the data files'
names are durable too), then publishes ``metadata.json`` by temp file +
fsync + ``rename`` + directory fsync. A crash at any point leaves either the
old or the new checkpoint, never a torn one. An exclusive commit (a save
without ``overwrite``) publishes the durable temp file with a hard link
(``renameat2(RENAME_NOREPLACE)`` where hard links are refused), which
fails atomically if another save committed first.

Reads never follow a symbolic link inside the checkpoint: every path
component below the root is opened with ``O_NOFOLLOW`` (relative to its
parent's descriptor), so a crafted checkpoint cannot make a reader open a
file outside it. The root itself may be a link.

``direct=True`` opens files with ``O_DIRECT`` (bypassing the page cache, so
a large save does not evict the training job's working set); I/O then goes
through a page-aligned bounce buffer. Filesystems without ``O_DIRECT``
(tmpfs, some network filesystems) fall back to buffered I/O with a warning.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from bytecp.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
)
from bytecp.format import checked_reads
from bytecp.storage_api import Buffer, Storage

from . import _timeout
from ._buffers import byte_view, byte_views
from ._errors import exists, missing, truncated
from ._posix import (
    NO_RENAMEAT2,
    O_DIRECT,
    O_DIRECTORY,
    O_NOFOLLOW,
    RENAME_EXCHANGE,
    adjacent_runs,
    fsync_dir,
    holds,
    is_file,
    list_dir,
    list_tree,
    os_error,
    publish_exclusive,
    read_all,
    read_direct,
    read_direct_ranges,
    read_vectored,
    remove_tree,
    rename_flags,
    rename_noreplace,
    symlink_refused,
    unlink_quietly,
    write_all,
    write_direct,
)

__all__ = ["LocalStorage", "DIRECT_MIN_BYTES"]

log = logging.getLogger("bytecp.storage")


#: with ``direct=None``, files at least this large are written with O_DIRECT
DIRECT_MIN_BYTES = 16 << 20


@_timeout.bounded(("write_file", "commit", "read_into", "read_ranges", ("read_ranges_summed", 1), "read_files"),
                  ("rename", "delete", "size", "exists", "list_files", "list_children"))
class LocalStorage(Storage):
    """A checkpoint directory on a local (or mounted) POSIX filesystem.

    Options: ``fsync`` (default True): make files and directory entries
    durable before ``commit`` returns; ``direct``: ``True`` writes every file
    with ``O_DIRECT``, ``False`` never, ``None`` (default) files of at least
    :data:`DIRECT_MIN_BYTES` -- on disks where buffered writes plus fsync are
    slower than direct ones (measured: about 2x on a virtio disk), and
    without filling the page cache with checkpoint data. Filesystems that
    refuse O_DIRECT (tmpfs, some network mounts) fall back to buffered
    writes, with one warning. ``request_timeout`` (120 s; ``None``: none):
    the most one call may wait for the filesystem (more for files over 1 GiB;
    a hung NFS mount), then it fails naming the file (not retried).
    """

    backend = "local"
    remote = False

    def __init__(self, url: str, *, fsync: bool = True, direct: bool | None = None,
                 request_timeout: float | None = _timeout.DEFAULT_REQUEST_TIMEOUT_S, **options: Any) -> None:
        if options:
            raise ConfigError(
                f"local storage {url!r}: unknown option(s) {sorted(options)}; "
                "known: fsync, direct, request_timeout"
            )
        self.request_timeout = _timeout.check(request_timeout, url)
        if direct and not O_DIRECT:
            raise ConfigError(f"local storage {url!r}: direct=True needs O_DIRECT, which this OS lacks")
        self.url = url
        path = url.split("://", 1)[1] if "://" in url else url
        self.root = os.path.abspath(os.path.expanduser(path))
        self.fsync = fsync
        self.direct = direct if O_DIRECT else False
        self._made: set[str] = set()
        self._dirty_dirs: set[str] = set()
        self._lock = threading.Lock()

    def options(self) -> dict[str, Any]:
        return {"fsync": self.fsync, "direct": self.direct, "request_timeout": self.request_timeout}

    def _full(self, path: str) -> str:
        return os.path.join(self.root, *[p for p in path.split("/") if p])

    def _makedirs(self, d: str) -> None:
        if d in self._made:
            return
        missing = []
        p = d
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise os_error(e, d, "create directory") from e
        with self._lock:
            self._made.add(d)
            # a new directory's entry lives in its parent
            self._dirty_dirs.update(os.path.dirname(m) for m in missing)

    # -- writing -------------------------------------------------------------
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        full = self._full(path)
        d = os.path.dirname(full)
        self._makedirs(d)
        views = byte_views(buffers)
        direct = self.direct
        if direct is None:
            direct = sum(len(v) for v in views) >= DIRECT_MIN_BYTES
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0), 0o644)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                log.warning("%s: O_DIRECT not supported here; using buffered writes", full)
                self.direct = direct = False
                return self.write_file(path, buffers)
            raise os_error(e, full, "create the file") from e
        refused = False
        try:
            if direct:
                write_direct(fd, views)
            else:
                write_all(fd, views)
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise os_error(e, full, "write") from e
            refused = True  # opened with O_DIRECT, but writes refuse it
        finally:
            os.close(fd)
        if refused:
            log.warning("%s: O_DIRECT writes refused here; using buffered writes", full)
            self.direct = False
            return self.write_file(path, buffers)
        with self._lock:
            self._dirty_dirs.add(d)

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        full = self._full(path)
        d = os.path.dirname(full)
        self._makedirs(d)
        with self._lock:
            dirty, self._dirty_dirs = self._dirty_dirs, set()
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            if self.fsync:  # data files' directory entries durable before the commit point
                for dd in sorted(dirty, key=len, reverse=True):
                    if os.path.isdir(dd):
                        fsync_dir(dd)
            if exclusive and os.path.lexists(full):  # cheap early answer; the publish below decides
                raise exists(full)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_all(fd, byte_views([data]))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                publish_exclusive(tmp, full)
            else:
                os.replace(tmp, full)
            if self.fsync:
                fsync_dir(d)
        except CheckpointExistsError:
            unlink_quietly(tmp)
            if holds(full, data):  # the same commit again (a caller's retry): not a conflict
                return
            raise
        except OSError as e:
            unlink_quietly(tmp)
            raise os_error(e, full, "commit") from e

    def write_stream(self, path: str, pieces: Iterable[Buffer], *, size_hint: int | None = None) -> int:
        """Buffered sequential writes to ``<path>.tmp-<id>``, fsync, rename over
        ``path``, directory fsync; the temporary is removed if anything fails."""
        full = self._full(path)
        d = os.path.dirname(full)
        self._makedirs(d)
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise os_error(e, full, "create the file") from e
        total = 0
        try:
            try:
                for piece in pieces:  # errors of the producer propagate unchanged
                    view = byte_view(piece)
                    try:
                        while len(view):
                            n = os.write(fd, view)
                            view = view[n:]
                            total += n
                    except OSError as e:
                        raise os_error(e, full, "write") from e
                try:
                    if self.fsync:
                        os.fsync(fd)
                except OSError as e:
                    raise os_error(e, full, "write") from e
            finally:
                os.close(fd)
            try:
                os.replace(tmp, full)
                if self.fsync:
                    fsync_dir(d)
            except OSError as e:
                raise os_error(e, full, "publish") from e
        except BaseException:
            unlink_quietly(tmp)
            raise
        return total

    atomic_rename = True

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        """``renameat2(RENAME_NOREPLACE)``, or with ``replace`` and an existing
        ``dst`` ``renameat2(RENAME_EXCHANGE)`` then deleting the old tree.
        Where the kernel or filesystem lacks those flags: a check then
        ``rename`` (a window of one call), and for a replacement the old
        ``dst`` is first renamed aside to ``<dst>.bytecp-old-<id>`` (a crash
        between the two renames leaves it there)."""
        s, d = self._full(src), self._full(dst)
        self._makedirs(os.path.dirname(d))
        with self._lock:
            self._made.clear()  # directories below src move
        try:
            if not (replace and os.path.lexists(d)):
                try:
                    rename_noreplace(s, d)
                except FileExistsError:
                    raise CheckpointExistsError(
                        f"{d} already exists; remove it or replace it explicitly"
                    ) from None
                except OSError as e:
                    if e.errno not in NO_RENAMEAT2:
                        raise
                    if os.path.lexists(d):
                        raise CheckpointExistsError(f"{d} already exists; remove it or replace it explicitly") from None
                    os.rename(s, d)
            else:
                try:
                    rename_flags(s, d, RENAME_EXCHANGE)
                    old = s
                except OSError as e:
                    if e.errno not in NO_RENAMEAT2:
                        raise
                    old = f"{d}.bytecp-old-{uuid.uuid4().hex[:8]}"
                    os.rename(d, old)
                    try:
                        os.rename(s, d)
                    except OSError:
                        os.rename(old, d)  # put the old one back: a failed replacement changes nothing
                        raise
                try:
                    remove_tree(old)
                except OSError as e:  # the new tree is in place: leftovers are only garbage
                    log.warning("bytecp: replaced %s, but could not remove the old tree %s: %s", d, old, e)
            if self.fsync:
                for dd in {os.path.dirname(s), os.path.dirname(d)}:
                    fsync_dir(dd)
        except CheckpointExistsError:
            raise
        except OSError as e:
            raise os_error(e, d, f"rename {s} to it") from e

    def delete(self, paths: Iterable[str]) -> None:
        dirs = set()
        for p in paths:
            full = self._full(p)
            try:
                os.unlink(full)
                dirs.add(os.path.dirname(full))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise os_error(e, full, "delete") from e
        # remove directories left empty (deepest first), never the root
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                with self._lock:
                    self._made.discard(d)
                d = os.path.dirname(d)

    def delete_prefix(self, prefix: str = "") -> None:
        """Delete every file below ``prefix``, then the directories below it
        left empty and ``prefix`` itself when it is an emptied directory
        (never the root): a removed staging folder leaves no trace, even one
        whose writes all failed before a file was complete."""
        self.delete(self.list_files(prefix))
        top = self._full(prefix)
        if top == self.root or not os.path.isdir(top) or os.path.islink(top):
            return
        for here, _, _ in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
            try:
                os.rmdir(here)  # only an empty one: a file written meanwhile keeps its folder
            except OSError:
                continue
            with self._lock:
                self._made.discard(here)

    # -- reading -------------------------------------------------------------
    def _open_read(self, path: str, flags: int = 0) -> int:
        """Open ``path`` for reading without following any link below the root.

        (reader threads) Each directory component is opened with
        ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent, the file with
        ``O_NOFOLLOW``: a symlink anywhere inside the checkpoint is refused
        with :class:`CorruptCheckpointError` before anything is read.
        """
        parts = [p for p in path.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise CorruptCheckpointError(f"{self._full(path)}: refusing path {path!r} (not a file below the checkpoint)")
        dfd = os.open(self.root, os.O_RDONLY | O_DIRECTORY)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    nfd = os.open(part, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW, dir_fd=dfd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self._full("/".join(parts[: i + 1]))):
                        raise symlink_refused(self._full("/".join(parts[: i + 1]))) from e
                    raise
                os.close(dfd)
                dfd = nfd
            try:
                # O_NONBLOCK: a FIFO planted in the checkpoint must not block the open
                fd = os.open(parts[-1], os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK | flags, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise symlink_refused(self._full(path)) from e
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise CorruptCheckpointError(
                    f"{self._full(path)} is not a regular file; refusing to read it as part of a checkpoint"
                )
            return fd
        finally:
            os.close(dfd)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        full = self._full(path)
        view = byte_view(out)
        want = len(view)
        direct = self.direct
        try:
            fd = self._open_read(path, O_DIRECT if direct else 0)
        except FileNotFoundError as e:
            raise missing(full) from e
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                self.direct = False
                return self.read_into(path, offset, out)
            raise os_error(e, full, "open for reading") from e
        try:
            got = read_direct(fd, offset, view) if direct else read_all(fd, offset, view)
        except OSError as e:
            raise os_error(e, full, "read") from e
        finally:
            os.close(fd)
        if got < want:
            raise truncated(full, offset, want, offset + got)

    @property
    def reads_each(self) -> bool:  # type: ignore[override]
        """Buffered reads fill the ranges one after the other (O_DIRECT ones go through a bounce buffer)."""
        return not self.direct

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                    each: Callable[[int], None] | None = None) -> None:
        if self.direct:
            self._read_ranges_direct(path, ranges)
            if each is not None:
                for i in range(len(ranges)):
                    each(i)
            return
        self._read_ranges(path, ranges, each)

    @property
    def sums_reads(self) -> bool:  # type: ignore[override]
        """Buffered reads, where the compiled checked reads are (O_DIRECT ones go through a bounce buffer)."""
        return not self.direct and checked_reads.compiled() is not None

    def read_ranges_summed(self, path: str, ranges: Sequence[tuple[int, memoryview]], spans: Any) -> Any:
        k = checked_reads.compiled()
        if k is None or self.direct:
            return super().read_ranges_summed(path, ranges, spans)
        fd, full = self._open_batch(path)
        crcs = np.zeros(len(spans) // 2, np.uint32)
        try:
            short = k.read_sums(fd, [(offset, byte_view(out)) for offset, out in ranges],
                                np.ascontiguousarray(spans, np.int64), crcs, checked_reads.PIECE_BYTES,
                                checked_reads.mapped())
        except OSError as e:
            raise os_error(e, full, "read") from e
        finally:
            os.close(fd)
        if short is not None:
            i, got = short
            offset, out = ranges[i]
            raise truncated(full, offset, len(byte_view(out)), offset + got)
        return crcs

    def read_files(self, reads: Sequence[tuple[str, Sequence[tuple[int, memoryview]]]]) -> None:  # one request
        for path, ranges in reads:
            if self.direct:
                self._read_ranges_direct(path, ranges)
            else:
                self._read_ranges(path, ranges)

    def _read_ranges_direct(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """O_DIRECT: one open and one bounce buffer for the batch, adjacent ranges read as one span."""
        full = self._full(path)
        try:
            fd = self._open_read(path, O_DIRECT)
        except FileNotFoundError as e:
            raise missing(full) from e
        except OSError as e:
            if e.errno == errno.EINVAL:  # a filesystem without O_DIRECT: buffered from now on
                self.direct = False
                return self._read_ranges(path, ranges)
            raise os_error(e, full, "open for reading") from e
        try:
            short = read_direct_ranges(fd, [(o, byte_view(v)) for o, v in ranges])
        except OSError as e:
            raise os_error(e, full, "read") from e
        finally:
            os.close(fd)
        if short is not None:
            offset, want, got = short
            raise truncated(full, offset, want, offset + got)

    def _open_batch(self, path: str) -> tuple[int, str]:
        """(buffered reads of a batch) One descriptor for the whole batch, and the file's URL for errors."""
        full = self._full(path)
        try:
            return self._open_read(path), full
        except FileNotFoundError as e:
            raise missing(full) from e
        except OSError as e:
            raise os_error(e, full, "open for reading") from e

    def _read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                     each: Callable[[int], None] | None = None) -> None:
        fd, full = self._open_batch(path)
        try:
            views = [(offset, byte_view(out)) for offset, out in ranges]
            for lo, hi in adjacent_runs(views):  # ranges that follow each other: one preadv
                offset = views[lo][0]
                got = read_vectored(fd, offset, [v for _, v in views[lo:hi]])
                for i in range(lo, hi):
                    at, view = views[i]
                    if got < at - offset + len(view):
                        raise truncated(full, at, len(view), offset + got)
                    if each is not None:
                        each(i)
        except OSError as e:
            raise os_error(e, full, "read") from e
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        try:
            fd = self._open_read(path)  # the same no-link, regular-file rules as reads
        except FileNotFoundError as e:
            raise missing(self._full(path)) from e
        except OSError as e:
            raise os_error(e, self._full(path), "stat") from e
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return is_file(self._full(path))

    def list_files(self, prefix: str = "") -> list[str]:
        return list_tree(self.root, self._full(prefix))

    def list_children(self, prefix: str = "") -> list[str]:
        return list_dir(self._full(prefix))
