"""Generic backend over any fsspec filesystem (the fallback for unknown protocols).

Tuned backends (local, S3, HDFS, memory) subclass or replace it. Called by the
core's engine from writer/reader threads; fsspec filesystems are thread-safe
for the calls used here.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec

from bytecp.errors import CorruptCheckpointError, StorageError, StorageNotFoundError
from bytecp.storage_api import Buffer, Storage

__all__ = ["FsspecStorage"]


class FsspecStorage(Storage):
    """A checkpoint directory on any fsspec filesystem."""

    #: whether ``commit`` must go through temp + rename (filesystems) or a
    #: single PUT is already atomic (object stores)
    atomic_put = False

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self._options = dict(options)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            raise StorageError(
                f"no fsspec implementation for {url!r}: {e}. Install the package for "
                "that protocol (for example `pip install bytecp[s3]` or `bytecp[hdfs]`)."
            ) from e
        self.root = root.rstrip("/")

    def options(self) -> dict[str, Any]:
        return dict(self._options)

    def _full(self, path: str) -> str:
        path = path.strip("/")
        return f"{self.root}/{path}" if path else self.root

    def _rel(self, full: str) -> str:
        full = full.rstrip("/")
        root = self.root.lstrip("/") if not full.startswith("/") else self.root
        return full[len(root) :].lstrip("/")

    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        full = self._full(path)
        self.fs.makedirs(posixpath.dirname(full), exist_ok=True)
        with self.fs.open(full, "wb") as f:
            for b in buffers:
                f.write(b)

    def commit(self, path: str, data: bytes) -> None:
        full = self._full(path)
        self.fs.makedirs(posixpath.dirname(full), exist_ok=True)
        if self.atomic_put:
            self.fs.pipe_file(full, data)
            return
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, full)

    def delete(self, paths: Iterable[str]) -> None:
        for p in paths:
            try:
                self.fs.rm(self._full(p))
            except FileNotFoundError:
                pass

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        n = len(out)
        if n == 0:
            return
        full = self._full(path)
        try:
            data = self.fs.cat_file(full, start=offset, end=offset + n)
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{self.url}/{path}: missing ({e})") from e
        if len(data) != n:
            raise CorruptCheckpointError(
                f"{self.url}/{path}: file is truncated: wanted bytes [{offset}, {offset + n}), "
                f"got {len(data)} bytes"
            )
        out[:] = data

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._full(path)))
        except FileNotFoundError as e:
            raise StorageNotFoundError(f"{self.url}/{path}: missing") from e

    def exists(self, path: str) -> bool:
        return bool(self.fs.isfile(self._full(path)))

    def list_files(self, prefix: str = "") -> list[str]:
        base = self._full(prefix)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(self._rel(f) for f in found)
