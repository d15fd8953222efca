"""S3 backend (``s3://bucket/prefix``, ``s3a://``) over s3fs/aiobotocore.

Works with AWS S3 and any S3-compatible server (Ceph RADOS Gateway, MinIO,
...) through ``endpoint_url``. Called by the engine's writer/reader threads;
every request runs as a coroutine on fsspec's I/O event loop, so many
threads share one connection pool and one bound on in-flight requests.

- ``write_file``: one PUT for a small file; otherwise a multipart upload
  whose parts go up concurrently, at most ``max_concurrency`` requests in
  flight per client. Parts follow the buffers' edges (:func:`plan_parts`):
  a large tensor goes up as zero-copy slices of ``part_size``, runs of small
  ones are joined into one part only while it is in flight. It returns only
  when the object is complete; on failure the upload is aborted, so no
  orphaned parts remain.
- ``commit``: a single PUT of the small file, which S3 makes visible
  atomically. The engine calls it after every ``write_file`` returned, so
  ``metadata.json`` never exists before the data it describes. An
  exclusive commit (a save without ``overwrite``) is a conditional PUT,
  ``If-None-Match: *``: the server refuses it (412) if the object exists,
  so of two jobs racing to one URL exactly one commits (AWS S3 since
  August 2024, Ceph RGW, MinIO, moto). ``conditional_put=None`` (default)
  checks once per bucket and process that the server honours the header
  (two conditional PUTs of a probe object); where it does not, or with
  ``conditional_put=False``, the commit falls back to HEAD, PUT, then a
  read-back: a save committing between the HEAD and the PUT is replaced
  (a window of one request), and is told so only if the read-back sees it.
- ``read_into``: ranged GETs of ``read_part_size`` bytes in parallel,
  each streamed straight into the caller's buffer. ``read_ranges`` (many
  ranges of one object) first merges nearby ranges into GETs of up to
  ``read_part_size``: on S3 a request costs milliseconds whatever its size,
  so a checkpoint's many small tensors must not each cost one.
- Credentials come from the standard AWS chain (environment, ``~/.aws``,
  instance/container roles) unless ``key``/``secret``/``token``/``profile``
  are given; they never appear in logs, reprs or error messages.
- Transient errors (throttling, 5xx, resets, timeouts) are retried with
  backoff and jitter under a total deadline (:mod:`bytecp.storage._retry`);
  botocore's and s3fs's own retries are switched off so there is exactly one
  retry policy. Access denied, bad signatures and missing buckets fail at once.

Fast-over-HTTP client settings are the default: no payload signing, and
checksums only where the API requires them (botocore's default SHA-256
payload hash and CRC32 checksums halve throughput on plain-HTTP endpoints).
Set the region with ``region=`` or ``AWS_DEFAULT_REGION``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from bytecp.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
    StorageNotFoundError,
    TransientStorageError,
)
from bytecp.storage_api import Buffer, Storage, split_protocol

from . import _retry
from ._retry import NOT_FOUND, PERMANENT, PERMISSION, TRANSIENT, RetryPolicy, Verdict

__all__ = ["S3Storage", "MIN_PART_SIZE", "MAX_PARTS", "plan_parts"]

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
    """Cut a file given as buffers into multipart parts, zero-copy where possible.

    Each part is a list of slices of the buffers (concatenated, they are the
    file). A buffer of at least ``part_size`` bytes starts a part of its own
    (the current part is closed early when it already has ``MIN_PART_SIZE``,
    or topped up to that from the buffer's head) and is cut into slices of ``part_size``, a short tail going into the last
    slice or, from ``MIN_PART_SIZE`` up, into a part of its own: large tensors
    go up without a copy. Runs of small buffers are packed into parts of about
    ``part_size`` (joined when sent). Every part but the last has at least
    ``MIN_PART_SIZE`` bytes, and there are at most ``MAX_PARTS`` parts.
    """
    parts: list[list[memoryview]] = []
    cur: list[memoryview] = []
    cur_len = 0
    if len(views) > 4 * MAX_PARTS:  # keep planning cheap for absurd buffer counts
        return _fixed_parts(views, part_size)

    def flush() -> None:
        nonlocal cur, cur_len
        if cur:
            parts.append(cur)
            cur, cur_len = [], 0

    for v in views:
        n = len(v)
        if n >= part_size and cur_len >= MIN_PART_SIZE:
            flush()
        pos = 0
        while pos < n:
            left = n - pos
            if cur_len == 0 and left >= MIN_PART_SIZE:
                take = part_size if left >= part_size else left
                if 0 < left - take < MIN_PART_SIZE:
                    take = left  # no tiny tail: the last slice grows a little
                parts.append([v[pos : pos + take]])
                pos += take
                continue
            if n >= part_size:  # top a short part up to the minimum, then go zero-copy
                take = min(left, MIN_PART_SIZE - cur_len)
            else:
                take = min(part_size - cur_len, left)
            cur.append(v[pos : pos + take])
            cur_len += take
            pos += take
            if cur_len >= part_size or (n >= part_size and cur_len >= MIN_PART_SIZE):
                flush()
    flush()
    # a short part may only be last: merge any short part into its successor
    merged: list[list[memoryview]] = []
    carry: list[memoryview] = []
    for p in parts:
        carry = carry + p
        if sum(len(x) for x in carry) >= MIN_PART_SIZE:
            merged.append(carry)
            carry = []
    if carry:
        merged.append(carry)  # the last part may be short
    if len(merged) > MAX_PARTS:  # many mid-sized buffers: fall back to fixed offsets
        return _fixed_parts(views, part_size)
    return merged


def _fixed_parts(views: Sequence[memoryview], part_size: int) -> list[list[memoryview]]:
    parts: list[list[memoryview]] = [[]]
    room = part_size
    for v in views:
        pos = 0
        while pos < len(v):
            if room == 0:
                parts.append([])
                room = part_size
            take = min(room, len(v) - pos)
            parts[-1].append(v[pos : pos + take])
            pos += take
            room -= take
    return [p for p in parts if p]


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


class S3Storage(Storage):
    """A checkpoint prefix in an S3 bucket.

    Options (keywords of :func:`bytecp.storage_api.open_storage`):

    ``endpoint_url``: the S3 endpoint (Ceph RGW, MinIO, ...); default AWS, or
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` from the environment.
    ``key``, ``secret``, ``token``, ``profile``: explicit credentials; default
    the standard AWS chain. ``region``: default ``AWS_DEFAULT_REGION``.
    ``part_size`` (16 MiB): multipart part size, >= 5 MiB; files up to
    ``multipart_threshold`` (default ``part_size``) go up in one PUT.
    ``max_concurrency`` (8): requests in flight per client (all threads).
    ``read_part_size`` (16 MiB): size of each parallel ranged GET.
    ``coalesce_gap`` (1 MiB): ``read_ranges`` merges ranges of one object
    whose gap is at most this into one GET (the gap bytes are read and dropped).
    ``retry``: a :class:`~bytecp.storage._retry.RetryPolicy`, a dict of its
    fields, or a deadline in seconds. ``connect_timeout`` (10 s) and
    ``read_timeout`` (60 s): per request. ``conditional_put``: how an
    exclusive commit refuses an existing object -- ``None`` (default) a
    conditional PUT after checking once per bucket that the server honours
    it, ``True`` a conditional PUT without the check, ``False`` HEAD, PUT
    and read-back (for servers without conditional writes; not atomic).
    ``s3fs_options``: extra keywords for ``s3fs.S3FileSystem`` (advanced).
    """

    backend = "s3"

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        key: str | None = None,
        secret: str | None = None,
        token: str | None = None,
        profile: str | None = None,
        region: str | None = None,
        part_size: int = 16 * MiB,
        multipart_threshold: int | None = None,
        max_concurrency: int = 8,
        read_part_size: int = 16 * MiB,
        coalesce_gap: int = 1 * MiB,
        retry: RetryPolicy | dict | float | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        conditional_put: bool | None = None,
        s3fs_options: dict[str, Any] | None = None,
    ) -> None:
        proto, rest = split_protocol(url)
        bucket, _, prefix = rest.partition("/")
        if proto not in ("s3", "s3a") or not bucket:
            raise ConfigError(f"{url!r} is not an S3 URL: expected s3://BUCKET[/PREFIX]")
        if part_size < MIN_PART_SIZE:
            raise ConfigError(
                f"{url}: part_size={part_size} is below S3's minimum part size of 5 MiB ({MIN_PART_SIZE})"
            )
        if max_concurrency < 1 or read_part_size < 1:
            raise ConfigError(
                f"{url}: max_concurrency and read_part_size must be >= 1, "
                f"got {max_concurrency} and {read_part_size}"
            )
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = int(part_size)
        self.multipart_threshold = int(multipart_threshold if multipart_threshold is not None else part_size)
        self.max_concurrency = int(max_concurrency)
        self.read_part_size = int(read_part_size)
        self.coalesce_gap = int(coalesce_gap)
        self.retry = RetryPolicy.from_options(retry)
        self._options: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "key": key,
            "secret": secret,
            "token": token,
            "profile": profile,
            "region": region,
            "part_size": part_size,
            "multipart_threshold": multipart_threshold,
            "max_concurrency": max_concurrency,
            "read_part_size": read_part_size,
            "coalesce_gap": coalesce_gap,
            "retry": retry,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "conditional_put": conditional_put,
            "s3fs_options": s3fs_options,
        }
        self.conditional_put = conditional_put
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.endpoint_url = endpoint_url
        config_kwargs: dict[str, Any] = {
            "s3": {"payload_signing_enabled": False},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            # one retry policy (ours): no hidden botocore retries under it
            "retries": {"total_max_attempts": 1},
            # lets memoryview slices of the caller's buffers be request bodies
            "parameter_validation": False,
            "max_pool_connections": max(10, 2 * self.max_concurrency),
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
        }
        fs_kwargs: dict[str, Any] = {"config_kwargs": config_kwargs}
        if endpoint_url:
            fs_kwargs["endpoint_url"] = endpoint_url
        if key is not None or secret is not None:
            fs_kwargs.update(key=key, secret=secret)
        if token is not None:
            fs_kwargs["token"] = token
        if profile is not None:
            fs_kwargs["profile"] = profile
        if region is not None:
            fs_kwargs["client_kwargs"] = {"region_name": region}
        for k, v in (s3fs_options or {}).items():
            if k == "config_kwargs":
                config_kwargs.update(v)
            else:
                fs_kwargs[k] = v
        try:
            self._client = _get_client(fs_kwargs, self.max_concurrency)
        except ImportError as e:
            raise StorageError(
                f"{url}: S3 support needs s3fs; install it with `pip install 'bytecp[s3]'` ({e})"
            ) from e

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
        return f"{self.url.rstrip('/')}/{path.strip('/')} ({op}, endpoint {self.endpoint_url or 'AWS'})"

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

    # -- writing -------------------------------------------------------------
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        total = sum(len(v) for v in views)
        try:
            if total <= self.multipart_threshold:
                body: Any = views[0] if len(views) == 1 else b"".join(views)
                where = self._where(path, "put_object")
                self._run(lambda: self._call("put_object", where, Bucket=self.bucket, Key=self._key(path), Body=body))
            else:
                self._run(lambda: self._multipart(path, views, total))
        except StorageError as e:
            raise self._error(e, path, "write") from e

    #: parts of one ``write_stream`` in flight at once (each holds a part in memory)
    STREAM_WINDOW = 4

    def write_stream(self, path: str, pieces: Iterable[Buffer], *, size_hint: int | None = None) -> int:
        """A multipart upload fed as the pieces come: each full part goes up
        while the next one fills, at most :attr:`STREAM_WINDOW` parts in
        flight (memory: that many parts, whatever the file's size). A file
        that fits in one part is one PUT. The object appears only when the
        upload completes; on any error (the producer's included) the upload
        is aborted, so no object and no orphaned parts remain."""
        import concurrent.futures

        part = self._part_size_for(size_hint) if size_hint else self.part_size
        window = max(1, min(self.max_concurrency, self.STREAM_WINDOW))
        key = self._key(path)
        loop = self._client.fs.loop
        buf = bytearray(part)
        filled = total = 0
        upload_id: str | None = None
        futures: list[concurrent.futures.Future[dict[str, Any]]] = []

        def s3op(fn: Callable[[], T]) -> T:
            try:
                return fn()
            except StorageError as e:
                raise self._error(e, path, "write") from e

        def send(body: Any) -> None:
            nonlocal upload_id
            if upload_id is None:
                where = self._where(path, "create_multipart_upload")
                created = s3op(lambda: self._run(lambda: self._call(
                    "create_multipart_upload", where, Bucket=self.bucket, Key=key)))
                upload_id = created["UploadId"]
            n = len(futures) + 1
            if n > MAX_PARTS:
                raise StorageError(
                    f"{self._where(path, 'write')}: more than {MAX_PARTS} parts of {part} B; "
                    "give write_stream the file's size (size_hint) or a larger part_size"
                )
            futures.append(asyncio.run_coroutine_threadsafe(self._upload_part(path, key, upload_id, n, body), loop))
            while sum(not f.done() for f in futures) >= window:
                concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in futures:  # fail fast: an upload error stops the producer
                if f.done() and f.exception() is not None:
                    s3op(f.result)

        try:
            for piece in pieces:  # errors of the producer propagate unchanged
                view = memoryview(piece).cast("B")
                while len(view):
                    if filled == part:  # a full part and more to come: send it
                        send(buf)
                        buf, filled = bytearray(part), 0
                    take = min(part - filled, len(view))
                    buf[filled : filled + take] = view[:take]
                    filled += take
                    total += take
                    view = view[take:]
            if upload_id is None:  # it all fits in one part: one PUT
                body = memoryview(buf)[:filled]
                where = self._where(path, "put_object")
                s3op(lambda: self._run(lambda: self._call(
                    "put_object", where, Bucket=self.bucket, Key=key, Body=body)))
                return total
            if filled:
                send(memoryview(buf)[:filled])
            done = [s3op(f.result) for f in futures]
            uid = upload_id
            s3op(lambda: self._run(lambda: self._complete(path, key, uid, done, total)))
            return total
        except BaseException:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures, timeout=30)
            if upload_id is not None:
                uid = upload_id
                self._run(lambda: self._abort(path, key, uid))
            raise

    async def _upload_part(self, path: str, key: str, upload_id: str, n: int, body: Any) -> dict[str, Any]:
        """One part of a streamed upload, with retries; its ``{"PartNumber", "ETag"}``."""

        async def attempt() -> Any:
            async with self._client.sem:
                s3 = await self._client.s3()
                return await s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body)

        out = await _retry.acall(
            attempt, policy=self.retry, where=self._where(path, f"upload_part {n}"), backend=self.backend
        )
        return {"PartNumber": n, "ETag": out["ETag"]}

    def _part_size_for(self, total: int) -> int:
        size = self.part_size
        if -(-total // size) > MAX_PARTS:  # grow parts so the file fits in 10,000
            size = -(-total // MAX_PARTS)
        return size

    async def _multipart(self, path: str, views: list[memoryview], total: int) -> None:
        key = self._key(path)
        plan = plan_parts(views, self._part_size_for(total))
        nparts = len(plan)
        created = await self._call(
            "create_multipart_upload", self._where(path, "create_multipart_upload"), Bucket=self.bucket, Key=key
        )
        upload_id = created["UploadId"]
        where_ = self._where

        async def upload(n: int) -> dict[str, Any]:
            pieces = plan[n - 1]
            body: Any = None

            async def attempt() -> Any:
                nonlocal body
                async with self._client.sem:
                    if body is None:  # joined only while in flight: memory stays bounded
                        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                    s3 = await self._client.s3()
                    return await s3.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body
                    )

            out = await _retry.acall(
                attempt, policy=self.retry, where=where_(path, f"upload_part {n}/{nparts}"), backend=self.backend
            )
            body = None
            return {"PartNumber": n, "ETag": out["ETag"]}

        tasks = [asyncio.ensure_future(upload(n)) for n in range(1, nparts + 1)]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            parts = [t.result() for t in tasks]
            await self._complete(path, key, upload_id, parts, total)
        except BaseException:
            for t in tasks:
                t.cancel()
            await self._abort(path, key, upload_id)
            raise

    async def _complete(self, path: str, key: str, upload_id: str, parts: list[dict[str, Any]], total: int) -> None:
        where = self._where(path, "complete_multipart_upload")
        try:
            await self._call(
                "complete_multipart_upload",
                where,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except StorageNotFoundError:
            # a retried complete whose first attempt succeeded but whose answer
            # was lost finds the upload gone: accept it if the object is there
            head = await self._call("head_object", where, Bucket=self.bucket, Key=key)
            if int(head["ContentLength"]) != total:
                raise

    async def _abort(self, path: str, key: str, upload_id: str) -> None:
        try:
            await self._call(
                "abort_multipart_upload",
                self._where(path, "abort_multipart_upload"),
                limit=False,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
            )
        except StorageNotFoundError:
            pass
        except Exception as e:  # keep the original error; say what is left behind
            log.warning(
                "%s: could not abort multipart upload (%s); delete_prefix() or a bucket "
                "lifecycle rule removes its parts",
                self._where(path, "abort_multipart_upload"),
                e,
            )

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        payload = bytes(data)
        try:
            if not exclusive:
                where = self._where(path, "commit put_object")
                self._run(lambda: self._call("put_object", where, Bucket=self.bucket, Key=self._key(path), Body=payload))
            elif self._conditional_put_works():
                self._run(lambda: self._put_if_absent(path, payload))
            else:
                self._run(lambda: self._check_then_put(path, payload))
        except StorageError as e:
            raise self._error(e, path, "commit") from e

    @property
    def exclusive_commit(self) -> str:  # type: ignore[override]
        if self.conditional_put is False or self._client.conditional_put.get(self.bucket) is False:
            return "check-then-publish"
        return "atomic"

    def _exists(self, path: str) -> CheckpointExistsError:
        return CheckpointExistsError(
            f"{self.url.rstrip('/')}/{path.strip('/')} already exists: another save committed here "
            "first; pass overwrite=True to replace it, or save to another URL"
        )

    async def _holds(self, path: str, payload: bytes) -> bool:
        """Whether the object at ``path`` has exactly ``payload`` (missing: False)."""
        where = self._where(path, "get_object (exclusive commit)")

        async def attempt() -> bytes | None:
            async with self._client.sem:
                s3 = await self._client.s3()
                try:
                    resp = await s3.get_object(Bucket=self.bucket, Key=self._key(path))
                except Exception as e:
                    info = _client_error_info(e)
                    if info and (info[0] in _NOT_FOUND_CODES or info[1] == 404):
                        return None
                    raise
                body = resp["Body"]
                try:
                    return bytes(await body.read())
                finally:
                    body.close()

        return await _retry.acall(attempt, policy=self.retry, where=where, backend=self.backend) == payload

    async def _put_if_absent(self, path: str, payload: bytes) -> None:
        """``PUT`` with ``If-None-Match: *``; 412 means another commit won, unless
        the object is this very payload (a retry whose first answer was lost)."""
        key = self._key(path)
        where = self._where(path, "commit put_object If-None-Match")

        async def attempt() -> Any:
            async with self._client.sem:
                s3 = await self._client.s3()
                try:
                    return await s3.put_object(Bucket=self.bucket, Key=key, Body=payload, IfNoneMatch="*")
                except Exception as e:
                    info = _client_error_info(e)
                    if info and info[0] == "ConditionalRequestConflict":  # AWS: a racing conditional write; retry
                        raise TransientStorageError(f"{where}: {info[0]}") from e
                    if info and (info[0] == "NotImplemented" or info[1] == 501):
                        raise _ConditionalPutUnsupported(f"{where}: the server does not implement conditional PUTs ({e}); pass the storage option conditional_put=False to commit by HEAD + PUT instead") from e
                    raise

        try:
            await _retry.acall(attempt, policy=self.retry, where=where, backend=self.backend)
        except StorageError as e:
            info = _client_error_info(e.__cause__) if e.__cause__ is not None else None
            if info and (info[0] == "PreconditionFailed" or info[1] == 412):
                if await self._holds(path, payload):
                    return
                raise self._exists(path) from None
            if isinstance(e, _ConditionalPutUnsupported) and self.conditional_put is None:
                log.warning("%s; falling back to HEAD + PUT (not atomic)", e)
                self._client.conditional_put[self.bucket] = False
                await self._check_then_put(path, payload)
                return
            raise

    async def _check_then_put(self, path: str, payload: bytes) -> None:
        """Fallback for servers without conditional PUTs: HEAD, PUT, read back.

        A commit landing between the HEAD and the PUT is replaced (the window
        is one request); one landing after the PUT but before the read-back is
        detected and reported as :class:`CheckpointExistsError` to this caller.
        """
        key = self._key(path)
        where = self._where(path, "commit head_object")
        try:
            await self._call("head_object", where, Bucket=self.bucket, Key=key)
        except StorageNotFoundError:
            pass
        else:
            if await self._holds(path, payload):
                return
            raise self._exists(path)
        await self._call("put_object", self._where(path, "commit put_object"), Bucket=self.bucket, Key=key, Body=payload)
        if not await self._holds(path, payload):
            raise CheckpointExistsError(
                f"{self.url.rstrip('/')}/{path.strip('/')} was replaced by another save right after this "
                "one committed (this server has no conditional PUT, so the commit is not atomic); "
                "the other save owns the URL now"
            )

    def _conditional_put_works(self) -> bool:
        """Whether to use ``If-None-Match: *`` (checked once per bucket and process)."""
        if self.conditional_put is not None:
            return self.conditional_put
        known = self._client.conditional_put.get(self.bucket)
        if known is None:
            known = self._client.conditional_put[self.bucket] = self._run(self._probe_conditional_put)
            if not known:
                log.warning(
                    "bytecp: s3://%s at %s ignores If-None-Match on PUT; exclusive commits fall back "
                    "to HEAD + PUT (two jobs saving to one URL at the same moment may both commit)",
                    self.bucket, self.endpoint_url or "AWS",
                )
        return known

    async def _probe_conditional_put(self) -> bool:
        """Two conditional PUTs of one probe object: the second must be refused."""
        probe = f".bytecp-conditional-put-probe-{uuid.uuid4().hex}"
        key = self._key(probe)
        where = self._where(probe, "conditional put probe")
        honoured = False
        try:
            for n in range(2):
                try:
                    await self._call("put_object", where, Bucket=self.bucket, Key=key, Body=b"", IfNoneMatch="*")
                except StorageError as e:
                    info = _client_error_info(e.__cause__) if e.__cause__ is not None else None
                    if info and (info[0] == "PreconditionFailed" or info[1] == 412) and n == 1:
                        honoured = True
                    elif info and (info[0] == "NotImplemented" or info[1] in (400, 501)):
                        return False
                    else:
                        raise
        finally:
            try:
                await self._call("delete_object", where, limit=False, Bucket=self.bucket, Key=key)
            except Exception as e:  # noqa: BLE001 - a leftover probe object is harmless
                log.debug("%s: could not delete the probe object: %s", where, e)
        return honoured

    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._key(p) for p in paths]
        if keys:
            self._run(lambda: self._delete_keys(keys))

    async def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            out = await self._call(
                "delete_objects",
                self._where(batch[0], f"delete_objects ({len(batch)} keys)"),
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"{self.url}: could not delete {len(errors)} object(s), first "
                    f"s3://{self.bucket}/{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )

    def delete_prefix(self, prefix: str = "") -> None:
        """Delete every object below ``prefix`` and abort unfinished multipart uploads there."""
        self.abort_incomplete_uploads(prefix)
        self.delete(self.list_files(prefix))

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort multipart uploads below ``prefix`` (left by a killed writer); returns how many."""
        return self._run(lambda: self._abort_all(prefix))

    def list_incomplete_uploads(self, prefix: str = "") -> list[str]:
        """Paths (relative to the root) with unfinished multipart uploads."""
        return [rel for rel, _ in self._run(lambda: self._uploads(prefix))]

    async def _uploads(self, prefix: str) -> list[tuple[str, str]]:
        base = self._key(prefix)
        base = f"{base}/" if base else ""
        out: list[tuple[str, str]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
        while True:
            page = await self._call("list_multipart_uploads", self._where(prefix, "list_multipart_uploads"), **kw)
            for u in page.get("Uploads", []) or []:
                out.append((self._rel(u["Key"]), u["UploadId"]))
            if not page.get("IsTruncated"):
                return out
            kw["KeyMarker"] = page.get("NextKeyMarker")
            kw["UploadIdMarker"] = page.get("NextUploadIdMarker")

    async def _abort_all(self, prefix: str) -> int:
        uploads = await self._uploads(prefix)
        for rel, upload_id in uploads:
            await self._abort(rel, self._key(rel), upload_id)
        return len(uploads)

    # -- reading ---------------------------------------------------------------
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = len(view)
        if n == 0:
            return
        try:
            self._run(lambda: self._read_ranges(path, offset, view))
        except StorageNotFoundError as e:
            raise self._missing(path, e) from e

    async def _read_ranges(self, path: str, offset: int, view: memoryview) -> None:
        n = len(view)
        step = self.read_part_size
        chunks = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
        await asyncio.gather(*[self._read_range(path, offset, view, lo, hi) for lo, hi in chunks])

    async def _read_range(self, path: str, offset: int, view: memoryview, lo: int, hi: int) -> None:
        await self._read_span(path, offset + lo, offset + hi, [(offset + lo, view[lo:hi])], (offset, len(view)))

    async def _read_span(
        self,
        path: str,
        start: int,
        end: int,
        parts: list[tuple[int, memoryview]],
        whole: tuple[int, int] | None = None,
    ) -> None:
        """One ranged GET of ``[start, end)`` streamed into ``parts`` (sorted, disjoint); gaps skipped."""
        key = self._key(path)
        rng = f"bytes={start}-{end - 1}"
        where = self._where(path, f"get_object {rng}")
        report = whole or (start, end - start)

        async def attempt() -> None:
            async with self._client.sem:
                s3 = await self._client.s3()
                try:
                    resp = await s3.get_object(Bucket=self.bucket, Key=key, Range=rng)
                except Exception as e:
                    info = _client_error_info(e)
                    if info and (info[0] == "InvalidRange" or info[1] == 416):
                        raise self._truncated(path, report[0], report[1], None) from e
                    raise
                body = resp["Body"]
                try:
                    pos = start
                    scratch: memoryview | None = None
                    for off, v in parts:
                        while pos < off:  # a gap between coalesced ranges: read and drop
                            if scratch is None:
                                scratch = memoryview(bytearray(min(MiB, off - pos)))
                            got = await body.readinto(scratch[: min(len(scratch), off - pos)])
                            if got == 0:
                                raise self._truncated(path, report[0], report[1], pos)
                            pos += got
                        filled = 0
                        while filled < len(v):
                            got = await body.readinto(v[filled:])
                            if got == 0:
                                raise self._truncated(path, report[0], report[1], pos + filled)
                            filled += got
                        pos += filled
                finally:
                    body.close()

        await _retry.acall(attempt, policy=self.retry, where=where, backend=self.backend)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Coalesce nearby ranges (gaps up to ``coalesce_gap``) into GETs of up to ``read_part_size``."""
        items = []
        for offset, out in ranges:
            v = out.cast("B") if out.format != "B" or out.ndim != 1 else out
            if len(v):
                items.append((offset, v))
        if not items:
            return
        items.sort(key=lambda it: it[0])
        spans: list[list[Any]] = []  # [start, end, parts]
        large: list[tuple[int, memoryview]] = []
        for offset, v in items:
            end = offset + len(v)
            if len(v) >= self.read_part_size:
                large.append((offset, v))  # split into parallel parts by _read_ranges
                continue
            last = spans[-1] if spans else None
            if (
                last is not None
                and offset >= last[1]
                and offset - last[1] <= self.coalesce_gap
                and end - last[0] <= self.read_part_size
            ):
                last[1] = end
                last[2].append((offset, v))
            else:
                spans.append([offset, end, [(offset, v)]])

        async def run() -> None:
            await asyncio.gather(
                *[self._read_span(path, a, b, parts) for a, b, parts in spans],
                *[self._read_ranges(path, off, v) for off, v in large],
            )

        try:
            self._run(run)
        except StorageNotFoundError as e:
            raise self._missing(path, e) from e

    def _missing(self, path: str, e: StorageNotFoundError) -> StorageNotFoundError:
        cause = e.__cause__ or e
        return StorageNotFoundError(
            f"{self.url.rstrip('/')}/{path.strip('/')}: object is missing "
            f"(bucket {self.bucket!r}, key {self._key(path)!r}, endpoint "
            f"{self.endpoint_url or 'AWS'}: {type(cause).__name__}: {cause})"
        )

    def _truncated(self, path: str, offset: int, n: int, ends: int | None) -> CorruptCheckpointError:
        at = f"the object ends at {ends}" if ends is not None else "the object is shorter"
        return CorruptCheckpointError(
            f"{self.url.rstrip('/')}/{path.strip('/')}: object is truncated: wanted bytes "
            f"[{offset}, {offset + n}), {at}"
        )

    def size(self, path: str) -> int:
        where = self._where(path, "head_object")
        try:
            head = self._run(lambda: self._call("head_object", where, Bucket=self.bucket, Key=self._key(path)))
        except StorageNotFoundError as e:
            raise StorageNotFoundError(f"{self.url.rstrip('/')}/{path.strip('/')}: missing ({e})") from e
        return int(head["ContentLength"])

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except StorageNotFoundError:
            return False
        return True

    # -- listing ---------------------------------------------------------------
    def _rel(self, key: str) -> str:
        if not self.prefix:
            return key
        return key[len(self.prefix) :].lstrip("/")

    def list_files(self, prefix: str = "") -> list[str]:
        return sorted(rel for rel, _ in self._run(lambda: self._list(prefix, None)))

    def list_children(self, prefix: str = "") -> list[str]:
        found = self._run(lambda: self._list(prefix, "/"))
        base = self._key(prefix)
        cut = len(base) + 1 if base else 0
        return sorted({k[cut:].strip("/") for _, k in found if k[cut:].strip("/")})

    def file_sizes(self, prefix: str = "") -> dict[str, int]:
        """One listing (1,000 objects per request) instead of a HEAD per object."""
        sizes: dict[str, int] = {}
        self._run(lambda: self._list(prefix, None, sizes))
        return sizes

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
