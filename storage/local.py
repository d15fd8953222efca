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

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from bytecp.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from bytecp.storage_api import Buffer, Storage

__all__ = ["LocalStorage"]

log = logging.getLogger("bytecp.storage")

_IOV_MAX = 1024
_ALIGN = 4096
_DIRECT_CHUNK = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _symlink_refused(full: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{full} is a symbolic link; bytecp never follows links inside a checkpoint (a crafted "
        "checkpoint could point them at files outside it). Copy the real file in its place"
    )


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(e: OSError, full: str, op: str) -> StorageError:
    if isinstance(e, PermissionError):
        return StoragePermissionError(f"{full}: permission denied while trying to {op} ({e})")
    if isinstance(e, FileNotFoundError):
        return StorageNotFoundError(f"{full}: missing ({e})")
    if e.errno == errno.ENOSPC:
        return StorageError(f"{full}: no space left on device while trying to {op}; free space or save elsewhere")
    if e.errno == errno.EDQUOT:
        return StorageError(f"{full}: disk quota exceeded while trying to {op}")
    return StorageError(f"{full}: {op} failed ({e})")


def _exists(full: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{full} already exists: another save committed here first; pass overwrite=True to "
        "replace it, or save to another URL"
    )


def _holds(full: str, data: bytes) -> bool:
    """Whether the regular file ``full`` has exactly ``data`` (never follows a link)."""
    try:
        fd = os.open(full, os.O_RDONLY | _O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != len(data):
            return False
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() == bytes(data)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_renameat2: Any = None


def _rename_flags(src: str, dst: str, flags: int) -> None:
    """``renameat2(src, dst, flags)`` (Linux >= 3.15; ext4, xfs, btrfs, tmpfs)."""
    global _renameat2
    if _renameat2 is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, "renameat2", None)
        if fn is None:
            raise OSError(errno.ENOSYS, "renameat2 is not available in this C library")
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _renameat2 = fn
    at_fdcwd = -100
    if _renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


def _rename_noreplace(src: str, dst: str) -> None:
    """``renameat2(RENAME_NOREPLACE)``: fails with EEXIST if ``dst`` exists."""
    _rename_flags(src, dst, _RENAME_NOREPLACE)


#: errors meaning "this kernel or filesystem has no such renameat2 flag"
_NO_RENAMEAT2 = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _remove_tree(path: str) -> None:
    """Delete a file or a whole directory tree (never following links)."""
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _publish_exclusive(tmp: str, full: str) -> None:
    """Give the durable ``tmp`` the name ``full`` only if nothing has that name.

    A hard link is atomic and refuses to replace (POSIX, NFS included); where
    the filesystem has no hard links, ``renameat2(RENAME_NOREPLACE)``. Both
    fail with EEXIST when another save committed first. ``tmp`` is gone
    afterwards either way.
    """
    try:
        os.link(tmp, full)
    except FileExistsError:
        raise _exists(full) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
        try:
            _rename_noreplace(tmp, full)
        except FileExistsError:
            raise _exists(full) from None
        except OSError as e2:
            raise OSError(
                e2.errno,
                f"this filesystem supports neither hard links ({e.strerror}) nor "
                f"renameat2(RENAME_NOREPLACE) ({e2.strerror}), so an exclusive commit is impossible "
                "here; save with overwrite=True (no protection against a concurrent save) or elsewhere",
            ) from e2
        return
    os.unlink(tmp)  # the link holds the data now


def _page_aligned(v: memoryview) -> bool:
    """Whether ``v`` is whole pages starting at a page boundary (written with
    O_DIRECT as it is); read-only buffers are never taken as such."""
    if not len(v) or len(v) % _ALIGN:
        return False
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(v)) % _ALIGN == 0
    except (TypeError, ValueError):  # read-only, or not contiguous bytes
        return False


#: with ``direct=None``, files at least this large are written with O_DIRECT
DIRECT_MIN_BYTES = 16 << 20


class LocalStorage(Storage):
    """A checkpoint directory on a local (or mounted) POSIX filesystem.

    Options: ``fsync`` (default True): make files and directory entries
    durable before ``commit`` returns; ``direct``: ``True`` writes every file
    with ``O_DIRECT``, ``False`` never, ``None`` (default) files of at least
    :data:`DIRECT_MIN_BYTES` -- on disks where buffered writes plus fsync are
    slower than direct ones (measured: about 2x on a virtio disk), and
    without filling the page cache with checkpoint data. Filesystems that
    refuse O_DIRECT (tmpfs, some network mounts) fall back to buffered
    writes, with one warning.
    """

    backend = "local"
    remote = False

    def __init__(self, url: str, *, fsync: bool = True, direct: bool | None = None, **options: Any) -> None:
        if options:
            raise ConfigError(
                f"local storage {url!r}: unknown option(s) {sorted(options)}; "
                "known: fsync, direct"
            )
        if direct and not _O_DIRECT:
            raise ConfigError(f"local storage {url!r}: direct=True needs O_DIRECT, which this OS lacks")
        self.url = url
        path = url.split("://", 1)[1] if "://" in url else url
        self.root = os.path.abspath(os.path.expanduser(path))
        self.fsync = fsync
        self.direct = direct if _O_DIRECT else False
        self._made: set[str] = set()
        self._dirty_dirs: set[str] = set()
        self._lock = threading.Lock()

    def options(self) -> dict[str, Any]:
        return {"fsync": self.fsync, "direct": self.direct}

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
            raise _os_error(e, d, "create directory") from e
        with self._lock:
            self._made.add(d)
            # a new directory's entry lives in its parent
            self._dirty_dirs.update(os.path.dirname(m) for m in missing)

    # -- writing -------------------------------------------------------------
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        full = self._full(path)
        d = os.path.dirname(full)
        self._makedirs(d)
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        direct = self.direct
        if direct is None:
            direct = sum(len(v) for v in views) >= DIRECT_MIN_BYTES
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0), 0o644)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                log.warning("%s: O_DIRECT not supported here; using buffered writes", full)
                self.direct = direct = False
                return self.write_file(path, buffers)
            raise _os_error(e, full, "create the file") from e
        refused = False
        try:
            if direct:
                self._pwrite_direct(fd, views)
            else:
                self._pwritev(fd, views)
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise _os_error(e, full, "write") from e
            refused = True  # opened with O_DIRECT, but writes refuse it
        finally:
            os.close(fd)
        if refused:
            log.warning("%s: O_DIRECT writes refused here; using buffered writes", full)
            self.direct = False
            return self.write_file(path, buffers)
        with self._lock:
            self._dirty_dirs.add(d)

    @staticmethod
    def _pwritev(fd: int, views: list[memoryview]) -> None:
        offset = 0
        while views:
            n = os.pwritev(fd, views[:_IOV_MAX], offset)
            offset += n
            # drop fully written views, trim a partly written one
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0

    @staticmethod
    def _pwrite_direct(fd: int, views: list[memoryview]) -> None:
        """Write whole aligned pages straight from the caller's buffers (a
        staging arena lays boxes out so), everything else through an aligned
        bounce buffer; pad the tail, then truncate to size."""
        total = sum(len(v) for v in views)
        with mmap.mmap(-1, _DIRECT_CHUNK) as bounce:
            buf = memoryview(bounce)
            try:
                filled = 0
                offset = 0

                def flush(nbytes: int) -> None:
                    nonlocal offset
                    done = 0
                    while done < nbytes:
                        done += os.pwrite(fd, buf[done:nbytes], offset + done)
                    offset += nbytes

                for v in views:
                    if filled % _ALIGN == 0 and _page_aligned(v):
                        if filled:
                            flush(filled)
                            filled = 0
                        done = 0
                        while done < len(v):
                            done += os.pwrite(fd, v[done:], offset + done)
                        offset += len(v)
                        continue
                    pos = 0
                    while pos < len(v):
                        take = min(len(v) - pos, _DIRECT_CHUNK - filled)
                        buf[filled : filled + take] = v[pos : pos + take]
                        filled += take
                        pos += take
                        if filled == _DIRECT_CHUNK:
                            flush(filled)
                            filled = 0
                if filled:
                    padded = -(-filled // _ALIGN) * _ALIGN
                    buf[filled:padded] = bytes(padded - filled)
                    flush(padded)
                os.ftruncate(fd, total)
            finally:
                buf.release()

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
                        _fsync_dir(dd)
            if exclusive and os.path.lexists(full):  # cheap early answer; the publish below decides
                raise _exists(full)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                self._pwritev(fd, [memoryview(data).cast("B")] if len(data) else [])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                _publish_exclusive(tmp, full)
            else:
                os.replace(tmp, full)
            if self.fsync:
                _fsync_dir(d)
        except CheckpointExistsError:
            _unlink_quietly(tmp)
            if _holds(full, data):  # the same commit again (a caller's retry): not a conflict
                return
            raise
        except OSError as e:
            _unlink_quietly(tmp)
            raise _os_error(e, full, "commit") from e

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
            raise _os_error(e, full, "create the file") from e
        total = 0
        try:
            try:
                for piece in pieces:  # errors of the producer propagate unchanged
                    view = memoryview(piece).cast("B")
                    try:
                        while len(view):
                            n = os.write(fd, view)
                            view = view[n:]
                            total += n
                    except OSError as e:
                        raise _os_error(e, full, "write") from e
                try:
                    if self.fsync:
                        os.fsync(fd)
                except OSError as e:
                    raise _os_error(e, full, "write") from e
            finally:
                os.close(fd)
            try:
                os.replace(tmp, full)
                if self.fsync:
                    _fsync_dir(d)
            except OSError as e:
                raise _os_error(e, full, "publish") from e
        except BaseException:
            _unlink_quietly(tmp)
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
                    _rename_noreplace(s, d)
                except FileExistsError:
                    raise CheckpointExistsError(
                        f"{d} already exists; remove it or replace it explicitly"
                    ) from None
                except OSError as e:
                    if e.errno not in _NO_RENAMEAT2:
                        raise
                    if os.path.lexists(d):
                        raise CheckpointExistsError(f"{d} already exists; remove it or replace it explicitly") from None
                    os.rename(s, d)
            else:
                try:
                    _rename_flags(s, d, _RENAME_EXCHANGE)
                    old = s
                except OSError as e:
                    if e.errno not in _NO_RENAMEAT2:
                        raise
                    old = f"{d}.bytecp-old-{uuid.uuid4().hex[:8]}"
                    os.rename(d, old)
                    try:
                        os.rename(s, d)
                    except OSError:
                        os.rename(old, d)  # put the old one back: a failed replacement changes nothing
                        raise
                try:
                    _remove_tree(old)
                except OSError as e:  # the new tree is in place: leftovers are only garbage
                    log.warning("bytecp: replaced %s, but could not remove the old tree %s: %s", d, old, e)
            if self.fsync:
                for dd in {os.path.dirname(s), os.path.dirname(d)}:
                    _fsync_dir(dd)
        except CheckpointExistsError:
            raise
        except OSError as e:
            raise _os_error(e, d, f"rename {s} to it") from e

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
                raise _os_error(e, full, "delete") from e
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
        dfd = os.open(self.root, os.O_RDONLY | _O_DIRECTORY)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    nfd = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW, dir_fd=dfd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self._full("/".join(parts[: i + 1]))):
                        raise _symlink_refused(self._full("/".join(parts[: i + 1]))) from e
                    raise
                os.close(dfd)
                dfd = nfd
            try:
                # O_NONBLOCK: a FIFO planted in the checkpoint must not block the open
                fd = os.open(parts[-1], os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK | flags, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise _symlink_refused(self._full(path)) from e
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
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        want = len(view)
        direct = self.direct
        try:
            fd = self._open_read(path, _O_DIRECT if direct else 0)
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{full}: missing") from e
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                self.direct = False
                return self.read_into(path, offset, out)
            raise _os_error(e, full, "open for reading") from e
        try:
            got = self._pread_direct(fd, offset, view) if direct else self._preadv(fd, offset, view)
        except OSError as e:
            raise _os_error(e, full, "read") from e
        finally:
            os.close(fd)
        if got < want:
            raise CorruptCheckpointError(
                f"{full}: file is truncated: wanted bytes [{offset}, {offset + want}), "
                f"file ends at {offset + got}"
            )

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        if self.direct:
            return super().read_ranges(path, ranges)
        full = self._full(path)
        try:
            fd = self._open_read(path)  # one open for the whole batch
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{full}: missing") from e
        except OSError as e:
            raise _os_error(e, full, "open for reading") from e
        try:
            for offset, out in ranges:
                view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
                got = self._preadv(fd, offset, view)
                if got < len(view):
                    raise CorruptCheckpointError(
                        f"{full}: file is truncated: wanted bytes [{offset}, {offset + len(view)}), "
                        f"file ends at {offset + got}"
                    )
        except OSError as e:
            raise _os_error(e, full, "read") from e
        finally:
            os.close(fd)

    @staticmethod
    def _preadv(fd: int, offset: int, view: memoryview) -> int:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    @staticmethod
    def _pread_direct(fd: int, offset: int, view: memoryview) -> int:
        want = len(view)
        got = 0
        with mmap.mmap(-1, _DIRECT_CHUNK) as bounce:
            buf = memoryview(bounce)
            try:
                while got < want:
                    pos = offset + got
                    start = pos - pos % _ALIGN
                    skip = pos - start
                    n = os.preadv(fd, [buf], start)
                    if n <= skip:
                        break
                    take = min(n - skip, want - got)
                    view[got : got + take] = buf[skip : skip + take]
                    got += take
                    if n < _DIRECT_CHUNK:  # end of file
                        break
            finally:
                buf.release()
        return got

    def size(self, path: str) -> int:
        try:
            fd = self._open_read(path)  # the same no-link, regular-file rules as reads
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{self._full(path)}: missing") from e
        except OSError as e:
            raise _os_error(e, self._full(path), "stat") from e
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.isfile(self._full(path))

    def list_files(self, prefix: str = "") -> list[str]:
        base = self._full(prefix)
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), self.root)
                out.append(rel.replace(os.sep, "/"))
        return sorted(out)

    def list_children(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._full(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []
