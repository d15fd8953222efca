"""The S3 backend's plumbing: the service's error codes and their retry
verdicts, the shared client (session, connection pool, request limit) and
the base class every S3 request goes through.

:class:`bytecp.storage.s3.S3Storage` is built on :class:`_S3Base` (via the
writes in :mod:`._s3_write`); the engine's writer/reader threads call its
methods, which run each request as a coroutine on fsspec's I/O event loop
(:meth:`_S3Base._run`) with one retry policy (:meth:`_S3Base._call`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from bytecp.errors import StorageError, StorageNotFoundError
from bytecp.storage_api import Storage

from . import _ranges, _retry
from ._errors import file_url
from ._retry import NOT_FOUND, PERMANENT, PERMISSION, TRANSIENT, RetryPolicy, Verdict

__all__ = ["MIN_PART_SIZE", "MAX_PARTS", "MiB", "plan_parts", "log", "T"]

log = logging.getLogger("bytecp.storage")
T = TypeVar("T")

MiB = 1 << 20
#: S3's smallest allowed part (all but the last part of an upload)
MIN_PART_SIZE = 5 * MiB
#: S3's largest number of parts in one multipart upload
MAX_PARTS = 10_000

_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "ServerBusy",
    "BandwidthLimitExceeded",
}
_PERMISSION_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidSecurity",
    "AccountProblem",
    "UnauthorizedAccess",
    "Forbidden",
    "403",
}
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "NotFound", "404", "NoSuchUpload"}


class _ConditionalPutUnsupported(StorageError):
    """The server answered a conditional PUT with 501 Not Implemented."""


def _client_error_info(exc: BaseException) -> tuple[str, int] | None:
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return None
    code = str((resp.get("Error") or {}).get("Code") or "")
    status = int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return code, status


def _classify_s3(exc: BaseException) -> Verdict | None:
    """Classifier for botocore/aiohttp errors (registered with :mod:`._retry`)."""
    try:
        import botocore.exceptions as bce
    except ImportError:  # pragma: no cover - s3fs depends on botocore
        return None
    if isinstance(exc, bce.ClientError):
        code, status = _client_error_info(exc) or ("", 0)
        if code in _THROTTLE_CODES or status == 429 or status >= 500:
            return Verdict(TRANSIENT, code or f"http_{status}")
        if code in _PERMISSION_CODES or status in (401, 403):
            return Verdict(PERMISSION, code or f"http_{status}")
        if code in _NOT_FOUND_CODES or status == 404:
            return Verdict(NOT_FOUND, code or "http_404")
        return Verdict(PERMANENT, code or f"http_{status}")
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError | bce.CredentialRetrievalError):
        return Verdict(PERMISSION, "no_credentials")
    if isinstance(exc, bce.ConnectionError | bce.HTTPClientError | bce.IncompleteReadError):
        return Verdict(TRANSIENT, type(exc).__name__)
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return None
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientConnectionError):
        return Verdict(TRANSIENT, type(exc).__name__)
    return None


_retry.register_classifier(_classify_s3)

def plan_parts(views: Sequence[memoryview], part_size: int) -> list[list[memoryview]]:
    """Cut a file given as buffers into multipart parts within S3's limits:
    every part but the last has at least ``MIN_PART_SIZE`` bytes, at most
    ``MAX_PARTS`` parts (see :func:`bytecp.storage._ranges.plan_parts`)."""
    return _ranges.plan_parts(views, part_size, min_part=MIN_PART_SIZE, max_parts=MAX_PARTS)

class _Client:
    """One s3fs filesystem (session, connection pool) plus the request limiter.

    Shared by every :class:`S3Storage` opened with the same options in this
    process (children, other checkpoints), so connections are reused.
    """

    def __init__(self, fs: Any, max_concurrency: int) -> None:
        self.fs = fs
        self.max_concurrency = max_concurrency
        self._sem: asyncio.Semaphore | None = None
        #: bucket -> whether the server honours ``If-None-Match: *`` on PUT
        self.conditional_put: dict[str, bool] = {}

    @property
    def sem(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the event loop thread, on first use
            self._sem = asyncio.Semaphore(self.max_concurrency)
        return self._sem

    async def s3(self) -> Any:
        await self.fs.set_session()
        return await self.fs.get_s3()


_clients: dict[tuple, _Client] = {}
_clients_lock = threading.Lock()


def _get_client(fs_kwargs: dict[str, Any], max_concurrency: int) -> _Client:
    import s3fs

    key = (os.getpid(), max_concurrency, repr(sorted(fs_kwargs.items())))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **fs_kwargs)
            fs.retries = 1  # one retry policy: ours (s3fs's loop would retry again)
            client = _clients[key] = _Client(fs, max_concurrency)
        return client


class _S3Base(Storage):
    """Where an S3 storage's requests go and how they are retried (set up by
    :class:`bytecp.storage.s3.S3Storage`'s ``__init__``)."""

    backend = "s3"
    url: str
    bucket: str
    prefix: str
    endpoint_url: str | None
    part_size: int
    multipart_threshold: int
    max_concurrency: int
    read_part_size: int
    retry: RetryPolicy
    conditional_put: bool | None
    _client: _Client
    _options: dict[str, Any]

    # -- plumbing ----------------------------------------------------------
    def options(self) -> dict[str, Any]:
        return {k: v for k, v in self._options.items() if v is not None}

    def __repr__(self) -> str:
        where = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Storage({self.url!r}{where})"

    def _key(self, path: str) -> str:
        path = path.strip("/")
        if not self.prefix:
            return path
        return f"{self.prefix}/{path}" if path else self.prefix

    def _where(self, path: str, op: str) -> str:
        return f"{file_url(self.url, path)} ({op}, endpoint {self.endpoint_url or 'AWS'})"

    def _run(self, fn: Callable[[], Awaitable[T]]) -> T:
        import fsspec.asyn

        return fsspec.asyn.sync(self._client.fs.loop, fn)

    async def _call(self, method: str, where: str, *, limit: bool = True, **kwargs: Any) -> Any:
        """One S3 API call with retries (and a place in the request limit)."""

        async def attempt() -> Any:
            s3 = await self._client.s3()
            return await getattr(s3, method)(**kwargs)

        async def limited() -> Any:
            async with self._client.sem:
                return await attempt()

        return await _retry.acall(
            limited if limit else attempt, policy=self.retry, where=where, backend=self.backend
        )

    def _error(self, exc: BaseException, path: str, op: str) -> BaseException:
        """Name bucket problems plainly (they are the most common setup mistake)."""
        cause = exc.__cause__ or exc
        info = _client_error_info(cause)
        if info and info[0] == "NoSuchBucket":
            return StorageNotFoundError(
                f"{self._where(path, op)}: bucket {self.bucket!r} does not exist at this endpoint; "
                "create it first or fix the URL"
            )
        return exc

    # -- listing ---------------------------------------------------------------
    def _rel(self, key: str) -> str:
        if not self.prefix:
            return key
        return key[len(self.prefix) :].lstrip("/")

    async def _list(
        self, prefix: str, delimiter: str | None, sizes: dict[str, int] | None = None
    ) -> list[tuple[str, str]]:
        """``(relative path, key)`` of objects (and, with a delimiter, common
        prefixes); ``sizes`` (if given) receives each object's size."""
        base = self._key(prefix)
        base = f"{base}/" if base else ""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
        if delimiter:
            kw["Delimiter"] = delimiter
        out: list[tuple[str, str]] = []
        where = self._where(prefix, "list_objects_v2")
        while True:
            try:
                page = await self._call("list_objects_v2", where, **kw)
            except StorageError as e:
                raise self._error(e, prefix, "list") from e
            for obj in page.get("Contents", []) or []:
                out.append((self._rel(obj["Key"]), obj["Key"]))
                if sizes is not None:
                    sizes[self._rel(obj["Key"])] = int(obj.get("Size", 0))
            for cp in page.get("CommonPrefixes", []) or []:
                out.append((self._rel(cp["Prefix"]), cp["Prefix"]))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out
            kw["ContinuationToken"] = token
