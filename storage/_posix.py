"""POSIX file primitives of the local-disk backend (:mod:`bytecp.storage.local`).

Error mapping, durable directory entries (fsync), exclusive publishing
(hard link or ``renameat2``), link-refusing checks, and the write/read loops
(``pwritev``/``preadv``, and O_DIRECT through a page-aligned bounce buffer).
Called by :class:`~bytecp.storage.local.LocalStorage` from the engine's
writer/reader threads; no state of their own beyond the looked-up
``renameat2``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Any

from bytecp.errors import (
    CorruptCheckpointError,
    StorageError,
    StoragePermissionError,
)

from ._errors import exists, missing

__all__ = [
    "O_DIRECT",
    "O_NOFOLLOW",
    "O_DIRECTORY",
    "RENAME_EXCHANGE",
    "NO_RENAMEAT2",
    "symlink_refused",
    "fsync_dir",
    "os_error",
    "holds",
    "is_file",
    "list_dir",
    "list_tree",
    "unlink_quietly",
    "rename_flags",
    "rename_noreplace",
    "remove_tree",
    "publish_exclusive",
    "page_aligned",
    "write_all",
    "write_direct",
    "read_all",
    "read_vectored",
    "adjacent_runs",
    "VECTOR_BYTES",
    "read_direct",
    "read_direct_ranges",
]

_IOV_MAX = 1024
_ALIGN = 4096
_DIRECT_CHUNK = 8 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def symlink_refused(full: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{full} is a symbolic link; bytecp never follows links inside a checkpoint (a crafted "
        "checkpoint could point them at files outside it). Copy the real file in its place"
    )


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_error(e: OSError, full: str, op: str) -> StorageError:
    if isinstance(e, PermissionError):
        return StoragePermissionError(f"{full}: permission denied while trying to {op} ({e})")
    if isinstance(e, FileNotFoundError):
        return missing(full, e)
    if e.errno == errno.ENOSPC:
        return StorageError(f"{full}: no space left on device while trying to {op}; free space or save elsewhere")
    if e.errno == errno.EFBIG:
        return StorageError(f"{full}: file too large while trying to {op}: past the largest file allowed here "
                            "(the process's file-size limit, `ulimit -f`, or the filesystem's)")
    if e.errno == errno.EDQUOT:
        return StorageError(f"{full}: disk quota exceeded while trying to {op}")
    return StorageError(f"{full}: {op} failed ({e})")


def is_file(full: str) -> bool:
    """Whether ``full`` is a regular file; a directory that may not be read is an error, never "absent"."""
    try:
        return stat.S_ISREG(os.stat(full).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise os_error(e, full, "stat") from e


def list_dir(full: str) -> list[str]:
    """The names in directory ``full``, sorted; a missing one lists nothing, a refused one raises."""
    try:
        return sorted(os.listdir(full))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:  # permission denied, I/O error: never "empty"
        raise os_error(e, full, "list") from e


def list_tree(root: str, base: str) -> list[str]:
    """Every file below ``base``, as "/"-paths relative to ``root``, sorted; a
    missing ``base`` lists nothing, a directory that may not be read raises."""
    out = []

    def refused(e: OSError) -> None:
        if not isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise os_error(e, e.filename or base, "list") from e

    for dirpath, _, files in os.walk(base, onerror=refused):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return sorted(out)


def holds(full: str, data: bytes) -> bool:
    """Whether the regular file ``full`` has exactly ``data`` (never follows a link)."""
    try:
        fd = os.open(full, os.O_RDONLY | O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != len(data):
            return False
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() == bytes(data)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_renameat2: Any = None


def rename_flags(src: str, dst: str, flags: int) -> None:
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


def rename_noreplace(src: str, dst: str) -> None:
    """``renameat2(RENAME_NOREPLACE)``: fails with EEXIST if ``dst`` exists."""
    rename_flags(src, dst, _RENAME_NOREPLACE)


#: errors meaning "this kernel or filesystem has no such renameat2 flag"
NO_RENAMEAT2 = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def remove_tree(path: str) -> None:
    """Delete a file or a whole directory tree (never following links)."""
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def publish_exclusive(tmp: str, full: str) -> None:
    """Give the durable ``tmp`` the name ``full`` only if nothing has that name.

    A hard link is atomic and refuses to replace (POSIX, NFS included); where
    the filesystem has no hard links, ``renameat2(RENAME_NOREPLACE)``. Both
    fail with EEXIST when another save committed first. ``tmp`` is gone
    afterwards either way.
    """
    try:
        os.link(tmp, full)
    except FileExistsError:
        raise exists(full) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
        try:
            rename_noreplace(tmp, full)
        except FileExistsError:
            raise exists(full) from None
        except OSError as e2:
            raise OSError(
                e2.errno,
                f"this filesystem supports neither hard links ({e.strerror}) nor "
                f"renameat2(RENAME_NOREPLACE) ({e2.strerror}), so an exclusive commit is impossible "
                "here; save with overwrite=True (no protection against a concurrent save) or elsewhere",
            ) from e2
        return
    os.unlink(tmp)  # the link holds the data now


def page_aligned(v: memoryview) -> bool:
    """Whether ``v`` is whole pages starting at a page boundary (written with
    O_DIRECT as it is); read-only buffers are never taken as such."""
    if not len(v) or len(v) % _ALIGN:
        return False
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(v)) % _ALIGN == 0
    except (TypeError, ValueError):  # read-only, or not contiguous bytes
        return False


def _past(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes: those a vectored call filled
    (or wrote) whole dropped, one it reached in part trimmed."""
    k = 0
    while k < len(views) and n >= len(views[k]):
        n -= len(views[k])
        k += 1
    rest = views[k:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def write_all(fd: int, views: list[memoryview]) -> None:
    offset = 0
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += n
        views = _past(views, n)


def write_direct(fd: int, views: list[memoryview]) -> None:
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
                if filled % _ALIGN == 0 and page_aligned(v):
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


def read_all(fd: int, offset: int, view: memoryview) -> int:
    """Fill ``view`` from ``offset`` on; -> the bytes read (fewer only at the end of the file)."""
    return read_vectored(fd, offset, [view])


#: adjacent ranges read by one ``preadv`` hold at most this many bytes (a larger range is read
#: alone): small enough that a reader summing each range after the call still finds it in the
#: CPU's cache
VECTOR_BYTES = 1 << 20


def adjacent_runs(ranges: Sequence[tuple[int, memoryview]]) -> list[tuple[int, int]]:
    """``[lo, hi)`` index runs of ``ranges`` (offset, byte view) that follow
    each other in the file with no gap, each at most :data:`VECTOR_BYTES`
    (or one range) and ``_IOV_MAX`` ranges: what one ``preadv`` can fill."""
    runs: list[tuple[int, int]] = []
    lo, end, size = 0, -1, 0
    for i, (offset, view) in enumerate(ranges):
        n = len(view)
        if i == lo or (offset == end and size + n <= VECTOR_BYTES and i - lo < _IOV_MAX):
            end, size = offset + n, size + n
            continue
        runs.append((lo, i))
        lo, end, size = i, offset + n, n
    if ranges:
        runs.append((lo, len(ranges)))
    return runs


def read_vectored(fd: int, offset: int, views: Sequence[memoryview]) -> int:
    """Fill ``views`` (byte views, in order) from ``offset`` on with as few
    ``preadv`` calls as the kernel allows; -> the bytes read (fewer only at
    the end of the file). One call for many small ranges: a load of tens of
    thousands of small tensors made one system call (and one release of the
    GIL, which four reader threads then queued for) per tensor."""
    todo = [v for v in views if len(v)]
    got = 0
    while todo:
        n = os.preadv(fd, todo[:_IOV_MAX], offset + got)
        if n == 0:
            break
        got += n
        todo = _past(todo, n)
    return got


def read_direct(fd: int, offset: int, view: memoryview, bounce: memoryview | None = None) -> int:
    """Read ``len(view)`` bytes at ``offset`` of an O_DIRECT descriptor through a
    page-aligned bounce buffer (``bounce``: one the caller reuses; else one of
    its own); -> the bytes read (fewer at the end of the file)."""
    if bounce is None:
        with mmap.mmap(-1, _DIRECT_CHUNK) as own:
            buf = memoryview(own)
            try:
                return read_direct(fd, offset, view, buf)
            finally:
                buf.release()
    want = len(view)
    got = 0
    while got < want:
        pos = offset + got
        start = pos - pos % _ALIGN
        skip = pos - start
        n = os.preadv(fd, [bounce], start)
        if n <= skip:
            break
        take = min(n - skip, want - got)
        view[got : got + take] = bounce[skip : skip + take]
        got += take
        if n < len(bounce):  # end of file
            break
    return got


def read_direct_ranges(fd: int, ranges: Sequence[tuple[int, memoryview]]) -> tuple[int, int, int] | None:
    """Read each ``(offset, view)`` of an O_DIRECT descriptor through one bounce
    buffer, ranges that follow each other read as one span (a load's checked
    read asks for a request's bytes and the rest of its blocks as adjacent
    ranges); -> None, or the first short range as (offset, wanted, got)."""
    order = sorted(range(len(ranges)), key=lambda k: ranges[k][0])
    with mmap.mmap(-1, _DIRECT_CHUNK) as own:
        bounce = memoryview(own)
        try:
            k = 0
            while k < len(order):
                run = [order[k]]
                end = ranges[order[k]][0] + len(ranges[order[k]][1])
                while k + len(run) < len(order) and ranges[order[k + len(run)]][0] == end:
                    run.append(order[k + len(run)])
                    end += len(ranges[run[-1]][1])
                start = ranges[run[0]][0]
                span = bytearray(end - start) if len(run) > 1 else None
                target = memoryview(span) if span is not None else ranges[run[0]][1]
                got = read_direct(fd, start, target, bounce)
                if span is not None:
                    for j in run:
                        o, v = ranges[j]
                        v[:] = target[o - start : o - start + len(v)]
                if got < end - start:
                    return start, end - start, got
                k += len(run)
        finally:
            bounce.release()
    return None
