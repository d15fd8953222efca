"""Generic backend over any fsspec filesystem (the fallback for unknown protocols).

``open_storage("gcs://...")``, ``"abfs://..."``, ``"sftp://..."`` and every
other protocol fsspec knows land here. Tuned backends (memory, HDFS)
subclass it. Called by the core's engine from writer/reader threads; fsspec
filesystems are thread-safe for the calls used here. Every call goes
through the retry policy of :mod:`bytecp.storage._retry`; errors are mapped
onto :class:`~bytecp.errors.StorageError` subclasses naming the URL.
"""

from __future__ import annotations

import posixpath
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from bytecp.errors import (
    CheckpointExistsError,
    StorageError,
    StorageNotFoundError,
)
from bytecp.storage_api import Buffer, Storage, split_protocol

from . import _retry
from ._buffers import byte_view, byte_views
from ._errors import exists, file_url, missing, truncated
from ._retry import RetryPolicy
from ._timeout import DEFAULT_REQUEST_TIMEOUT_S
from ._timeout import check as check_timeout

__all__ = ["FsspecStorage"]

#: serialises exclusive puts on filesystems whose put is atomic (memory)
_PUT_LOCK = threading.Lock()

T = TypeVar("T")


class FsspecStorage(Storage):
    """A checkpoint directory on any fsspec filesystem.

    Options: ``retry`` (a :class:`~bytecp.storage._retry.RetryPolicy`, a dict
    of its fields, or a deadline in seconds); ``request_timeout`` (120 s;
    ``None``: none): the most one attempt of a call may take (more for calls
    moving over 1 GiB), then it is abandoned and retried under ``retry``;
    every other keyword goes to the fsspec filesystem's constructor.
    """

    #: whether ``commit`` must go through temp + rename (filesystems) or a
    #: single PUT is already atomic (object stores)
    atomic_put = False
    backend = "fsspec"

    def __init__(
        self,
        url: str,
        *,
        retry: RetryPolicy | dict | float | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
        **options: Any,
    ) -> None:
        self.url = url
        self.request_timeout = check_timeout(request_timeout, url)
        self.retry = RetryPolicy.from_options(retry, self.request_timeout)
        self._retry_option = retry
        self._options = dict(options)
        self.fs, root = self._make_fs(url, options)
        self.root = root.rstrip("/") if root not in ("/", "") else root

    def _make_fs(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        proto, _ = split_protocol(url)
        try:
            return fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as e:
            if proto not in fsspec.available_protocols():
                raise StorageError(
                    f"{url}: unknown URL scheme {proto + '://'!r}: neither bytecp nor fsspec knows it; "
                    "check the URL for a typo (bytecp takes paths, file://, s3://, hdfs://, memory:// "
                    "and any fsspec protocol), or `pip install` the package that provides it"
                ) from e
            raise StorageError(
                f"no usable fsspec implementation for {url!r} (protocol {proto!r}): {e}. "
                "Install the package that provides it (for example `pip install 'bytecp[s3]'`, "
                "`pip install 'bytecp[hdfs]'`, gcsfs, adlfs)."
            ) from e

    def options(self) -> dict[str, Any]:
        opts = dict(self._options)
        if self._retry_option is not None:
            opts["retry"] = self._retry_option
        opts["request_timeout"] = self.request_timeout
        return opts

    def child(self, path: str) -> Storage:
        # same class, not a registry look-up: the fallback serves protocols
        # that may also have a tuned backend (file:// through fsspec)
        return type(self)(file_url(self.url, path), **self.options())

    def _full(self, path: str) -> str:
        path = path.strip("/")
        if not path:
            return self.root
        return f"{self.root.rstrip('/')}/{path}"

    def _rel(self, full: str) -> str:
        full = full.rstrip("/")
        root = self.root.rstrip("/")
        if not full.startswith("/"):
            root = root.lstrip("/")
        return full[len(root) :].lstrip("/")

    def _call(self, fn: Callable[[], T], path: str, op: str, nbytes: int = 0) -> T:
        where = f"{file_url(self.url, path)} ({op})"
        return _retry.call(fn, policy=self.retry, where=where, backend=self.backend, nbytes=nbytes)

    # -- writing -------------------------------------------------------------
    def _makedirs(self, full_dir: str) -> None:
        if full_dir and full_dir != "/":
            self.fs.makedirs(full_dir, exist_ok=True)

    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        full = self._full(path)

        def write() -> None:
            self._makedirs(posixpath.dirname(full))
            with self.fs.open(full, "wb") as f:
                for v in byte_views(buffers):
                    f.write(v)

        self._call(write, path, "write", sum(v.nbytes for v in byte_views(buffers)))

    def write_stream(self, path: str, pieces: Iterable[Buffer], *, size_hint: int | None = None) -> int:
        """fsspec's buffered file writer, into a temporary name renamed over
        ``path``. Where a put is atomic (memory, whose files are visible while
        they are written) the pieces are joined and put at once: the bytes
        live in memory there anyway. Not retried as a whole (the pieces
        cannot be replayed); errors name the URL."""
        full = self._full(path)
        where = f"{file_url(self.url, path)} (write)"
        if self.atomic_put:
            data = bytearray()
            for piece in pieces:
                data += byte_view(piece)

            def put() -> None:
                self._makedirs(posixpath.dirname(full))
                self.fs.pipe_file(full, bytes(data))

            self._call(put, path, "write")
            return len(data)
        target = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        total = 0
        f: Any = None
        try:
            try:
                self._makedirs(posixpath.dirname(full))
                f = self.fs.open(target, "wb")
            except Exception as e:
                raise _retry.to_storage_error(e, where) from e
            for piece in pieces:  # errors of the producer propagate unchanged
                view = byte_view(piece)
                try:
                    f.write(view)
                except Exception as e:
                    raise _retry.to_storage_error(e, where) from e
                total += len(view)
            try:
                f.close()
                f = None
                self._rename_over(target, full)
            except Exception as e:
                raise _retry.to_storage_error(e, where) from e
        except BaseException:
            if f is not None:
                try:
                    f.discard() if hasattr(f, "discard") else f.close()
                except Exception:  # noqa: BLE001 - best effort; the original error matters
                    pass
            try:
                if self.fs.exists(target):
                    self.fs.rm(target)
            except Exception:  # noqa: BLE001
                pass
            raise
        return total

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        full = self._full(path)
        payload = bytes(data)
        if exclusive:

            def publish_new() -> None:
                self._makedirs(posixpath.dirname(full))
                if self.fs.isfile(full):
                    # a retried attempt whose first try published (its answer lost)
                    # finds its own bytes: that is success, not a conflict
                    if self.fs.cat_file(full) == payload:
                        return
                    raise self._exists(path)
                self._publish_exclusive(full, payload, path)

            self._call(publish_new, path, "exclusive commit")
            return
        if self.atomic_put:

            def put() -> None:
                self._makedirs(posixpath.dirname(full))
                self.fs.pipe_file(full, payload)

            self._call(put, path, "commit")
            return
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"

        def publish() -> None:
            self._makedirs(posixpath.dirname(full))
            self.fs.pipe_file(tmp, payload)
            self._rename_over(tmp, full)

        self._call(publish, path, "commit")

    @property
    def exclusive_commit(self) -> str:  # type: ignore[override]
        """``"atomic"`` on fsspec's local and memory filesystems; elsewhere the
        generic path checks, then renames (a window of one rename)."""
        if self.atomic_put or self._links_locally():
            return "atomic"
        return "check-then-publish"

    def _links_locally(self) -> bool:
        """Whether exclusive commits publish with a local hard link (fsspec's local filesystem)."""
        return isinstance(self.fs, LocalFileSystem)

    def _exists(self, path: str) -> CheckpointExistsError:
        return exists(file_url(self.url, path))

    def _publish_exclusive(self, full: str, payload: bytes, path: str) -> None:
        """Publish ``payload`` at ``full`` unless something is there (it was absent a moment ago).

        - memory (``atomic_put``): check and put under one process-wide lock
          (a memory filesystem is visible to this process only): atomic;
        - fsspec's local filesystem: temp file, then a hard link that refuses
          to replace (as the local backend): atomic;
        - any other filesystem: temp file, a second existence check, then a
          rename -- a save committing between that check and the rename is
          replaced (the window is one rename; use a tuned backend where it
          matters).
        """
        if self.atomic_put:
            with _PUT_LOCK:
                if self.fs.isfile(full):
                    raise self._exists(path)
                self.fs.pipe_file(full, payload)
            return
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        self.fs.pipe_file(tmp, payload)
        try:
            if self._links_locally():
                from ._posix import publish_exclusive

                try:
                    publish_exclusive(self.fs._strip_protocol(tmp), self.fs._strip_protocol(full))
                except CheckpointExistsError:
                    raise self._exists(path) from None
                return
            self._rename_new(tmp, full, path)
        except BaseException:
            try:
                self.fs.rm(tmp)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
            raise

    def _rename_over(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, replacing it (atomic where the filesystem's rename is)."""
        self.fs.mv(src, dst)

    def _rename_new(self, src: str, dst: str, path: str) -> None:
        """Rename ``src`` to ``dst``, which must not exist (check-then-rename here;
        backends whose rename can refuse to replace override this)."""
        if self.fs.isfile(dst):
            raise self._exists(path)
        self.fs.mv(src, dst)

    def delete(self, paths: Iterable[str]) -> None:
        for p in paths:
            full = self._full(p)

            def rm(full: str = full) -> None:
                try:
                    self.fs.rm(full)
                except FileNotFoundError:
                    pass

            self._call(rm, p, "delete")

    # -- reading -------------------------------------------------------------
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = byte_view(out)
        n = len(view)
        full = self._full(path)

        def read() -> bytes:
            if n == 0:
                if not self.fs.isfile(full):
                    raise FileNotFoundError(full)
                return b""
            return self.fs.cat_file(full, start=offset, end=offset + n)

        try:
            data = self._call(read, path, f"read bytes [{offset}, {offset + n})", n)
        except StorageNotFoundError as e:
            raise missing(file_url(self.url, path), e) from e
        if len(data) != n:
            raise truncated(file_url(self.url, path), offset, n, offset + len(data))
        view[:] = data

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                    each: Callable[[int], None] | None = None) -> None:
        """One ``cat_ranges`` call: async filesystems (gcsfs, adlfs, ...) fetch the ranges concurrently."""
        self._read_ranges_all(path, ranges)
        self.each_after(len(ranges), each)  # (``reads_each`` False: once every range is in)

    def _read_ranges_all(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        items = [(off, v) for off, v in ((off, byte_view(out)) for off, out in ranges) if len(v)]
        if not items:
            return
        full = self._full(path)

        def read() -> list[bytes]:
            return list(
                self.fs.cat_ranges(
                    [full] * len(items), [off for off, _ in items], [off + len(v) for off, v in items], on_error="raise"
                )
            )

        try:
            datas = self._call(read, path, f"read {len(items)} ranges", sum(len(v) for _, v in items))
        except StorageNotFoundError as e:
            raise missing(file_url(self.url, path), e) from e
        for (off, v), data in zip(items, datas, strict=True):
            if isinstance(data, BaseException):
                raise data
            if len(data) != len(v):
                raise truncated(file_url(self.url, path), off, len(v), off + len(data))
            v[:] = data

    def size(self, path: str) -> int:
        full = self._full(path)

        def size() -> int:
            info = self.fs.info(full)
            if info.get("type") == "directory":
                raise FileNotFoundError(f"{full} is a directory")
            return int(info["size"])

        try:
            return self._call(size, path, "size")
        except StorageNotFoundError as e:
            raise missing(file_url(self.url, path)) from e

    def exists(self, path: str) -> bool:
        full = self._full(path)
        return bool(self._call(lambda: self.fs.isfile(full), path, "exists"))

    def file_sizes(self, prefix: str = "") -> dict[str, int]:
        """One ``find(detail=True)``: the listing carries the sizes."""
        base = self._full(prefix)

        def find() -> dict[str, Any]:
            try:
                if not self.fs.isdir(base):
                    return {}
                return dict(self.fs.find(base, detail=True))
            except FileNotFoundError:
                return {}

        found = self._call(find, prefix, "list")
        return {
            self._rel(f): int(info.get("size") or 0)
            for f, info in found.items()
            if info.get("type", "file") != "directory"
        }

    def list_files(self, prefix: str = "") -> list[str]:
        base = self._full(prefix)

        def find() -> list[str]:
            try:
                if not self.fs.isdir(base):
                    return []
                return list(self.fs.find(base))
            except FileNotFoundError:
                return []

        found = self._call(find, prefix, "list")
        return sorted(self._rel(f) for f in found)
