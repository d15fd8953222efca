"""Local-disk backend: ``pwritev`` writes, ``preadv`` reads, fsync, atomic rename.

Called by the engine's writer/reader threads. ``write_file`` returns only
when the file is durable (fsync), and ``commit`` publishes ``metadata.json``
by temp file + fsync + ``rename`` + directory fsync, so a crash at any point
leaves either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from bytecp.errors import CorruptCheckpointError, StorageError, StorageNotFoundError, StoragePermissionError
from bytecp.storage_api import Buffer, Storage

__all__ = ["LocalStorage"]

_IOV_MAX = 1024


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """A checkpoint directory on a local (or mounted) POSIX filesystem."""

    def __init__(self, url: str, *, fsync: bool = True, **options: Any) -> None:
        if options:
            raise StorageError(f"local storage {url!r}: unknown options {sorted(options)}")
        self.url = url
        path = url.split("://", 1)[1] if "://" in url else url
        self.root = os.path.abspath(os.path.expanduser(path))
        self.fsync = fsync
        self._made: set[str] = set()

    def options(self) -> dict[str, Any]:
        return {"fsync": self.fsync}

    def _full(self, path: str) -> str:
        return os.path.join(self.root, *[p for p in path.split("/") if p])

    def _makedirs(self, d: str) -> None:
        if d not in self._made:
            os.makedirs(d, exist_ok=True)
            self._made.add(d)

    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        full = self._full(path)
        self._makedirs(os.path.dirname(full))
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except PermissionError as e:
            raise StoragePermissionError(f"{full}: cannot write ({e})") from e
        try:
            views = [memoryview(b).cast("B") for b in buffers if len(b)]
            offset = 0
            while views:
                batch = views[:_IOV_MAX]
                n = os.pwritev(fd, batch, offset)
                offset += n
                # drop fully written views, trim a partly written one
                while n and views:
                    if n >= len(views[0]):
                        n -= len(views[0])
                        views.pop(0)
                    else:
                        views[0] = views[0][n:]
                        n = 0
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StorageError(f"{full}: no space left on device") from e
            raise StorageError(f"{full}: write failed ({e})") from e
        finally:
            os.close(fd)

    def commit(self, path: str, data: bytes) -> None:
        full = self._full(path)
        d = os.path.dirname(full)
        self._makedirs(d)
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        self.write_file(os.path.relpath(tmp, self.root).replace(os.sep, "/"), [data])
        os.replace(tmp, full)
        if self.fsync:
            _fsync_dir(d)

    def delete(self, paths: Iterable[str]) -> None:
        dirs = set()
        for p in paths:
            full = self._full(p)
            try:
                os.unlink(full)
                dirs.add(os.path.dirname(full))
            except FileNotFoundError:
                pass
        # remove directories left empty (deepest first), never the root
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                self._made.discard(d)
                d = os.path.dirname(d)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        full = self._full(path)
        try:
            fd = os.open(full, os.O_RDONLY)
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{full}: missing") from e
        try:
            want = len(out)
            got = 0
            view = out.cast("B") if out.format != "B" else out
            while got < want:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{full}: file is truncated: wanted bytes [{offset}, {offset + want}), "
                        f"file ends at {offset + got}"
                    )
                got += n
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        try:
            return os.stat(self._full(path)).st_size
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{self._full(path)}: missing") from e

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
        except FileNotFoundError:
            return []
