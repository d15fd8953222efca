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

Modules: this one holds :class:`S3Storage`'s options, reads, listing and
deletes; its request plumbing, error codes and shared client are in
``_s3_base``, uploads and commits in ``_s3_write``; the pure planning of
parts and coalesced reads (no I/O, tested alone) is in ``_ranges``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bytecp.errors import ConfigError, CorruptCheckpointError, StorageError, StorageNotFoundError
from bytecp.storage_api import split_protocol

from . import _retry
from ._buffers import byte_view
from ._errors import file_url, missing, truncated
from ._ranges import chunks, coalesce
from ._retry import RetryPolicy
from ._s3_base import (
    MAX_PARTS,
    MIN_PART_SIZE,
    MiB,
    _client_error_info,
    _get_client,
    plan_parts,
)
from ._s3_write import _S3Writes
from ._timeout import DEFAULT_REQUEST_TIMEOUT_S
from ._timeout import check as check_timeout

__all__ = ["S3Storage", "MIN_PART_SIZE", "MAX_PARTS", "plan_parts"]

#: DeleteObjects requests one ``delete`` keeps in flight (each 1,000 keys)
DELETE_REQUESTS = 8


class S3Storage(_S3Writes):
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
    ``read_timeout`` (60 s): botocore's, per connection and socket read;
    ``request_timeout`` (120 s; ``None``: none): the most one attempt of a
    request may take whole (more for parts over 1 GiB), then it is cancelled
    and retried under ``retry``. ``conditional_put``: how an
    exclusive commit refuses an existing object -- ``None`` (default) a
    conditional PUT after checking once per bucket that the server honours
    it, ``True`` a conditional PUT without the check, ``False`` HEAD, PUT
    and read-back (for servers without conditional writes; not atomic).
    ``s3fs_options``: extra keywords for ``s3fs.S3FileSystem`` (advanced).
    """

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
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
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
        self.retry = RetryPolicy.from_options(retry, check_timeout(request_timeout, url))
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
            "request_timeout": request_timeout,
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

    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._key(p) for p in paths]
        if keys:
            self._run(lambda: self._delete_keys(keys))

    async def _delete_keys(self, keys: list[str]) -> None:
        """1,000 keys a request, :data:`DELETE_REQUESTS` requests at once (a
        131,072-rank checkpoint is 263 requests); every batch is tried, then a
        failure is raised: a request's error first, else the objects not deleted."""
        gate = asyncio.Semaphore(DELETE_REQUESTS)

        async def batch(part: list[str]) -> list[dict[str, Any]]:
            async with gate:
                out = await self._call(
                    "delete_objects",
                    self._where(part[0], f"delete_objects ({len(part)} keys)"),
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in part], "Quiet": True},
                )
            return [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]

        got = await asyncio.gather(*(batch(keys[i : i + 1000]) for i in range(0, len(keys), 1000)),
                                   return_exceptions=True)
        for r in got:
            if isinstance(r, BaseException):
                raise r
        errors = [e for r in got for e in r]  # type: ignore[union-attr]
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
        view = byte_view(out)
        n = len(view)
        if n == 0:
            return
        try:
            self._run(lambda: self._read_ranges(path, offset, view))
        except StorageNotFoundError as e:
            raise self._missing(path, e) from e

    async def _read_ranges(self, path: str, offset: int, view: memoryview) -> None:
        pieces = chunks(len(view), self.read_part_size)
        await asyncio.gather(*[self._read_range(path, offset, view, lo, hi) for lo, hi in pieces])

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

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                    each: Callable[[int], None] | None = None) -> None:
        """Coalesce nearby ranges (gaps up to ``coalesce_gap``) into GETs of up to ``read_part_size``."""
        self._read_ranges_all(path, ranges)
        self.each_after(len(ranges), each)  # (``reads_each`` False: once every range is in)

    def _read_ranges_all(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        items = [(offset, byte_view(out)) for offset, out in ranges]
        spans, large = coalesce(items, gap=self.coalesce_gap, max_span=self.read_part_size)
        if not spans and not large:
            return

        async def run() -> None:
            await asyncio.gather(
                *[self._read_span(path, a, b, parts) for a, b, parts in spans],
                *[self._read_ranges(path, off, v) for off, v in large],  # split into parallel parts
            )

        try:
            self._run(run)
        except StorageNotFoundError as e:
            raise self._missing(path, e) from e

    def _missing(self, path: str, e: StorageNotFoundError) -> StorageNotFoundError:
        cause = e.__cause__ or e
        return StorageNotFoundError(
            f"{file_url(self.url, path)}: object is missing "
            f"(bucket {self.bucket!r}, key {self._key(path)!r}, endpoint "
            f"{self.endpoint_url or 'AWS'}: {type(cause).__name__}: {cause})"
        )

    def _truncated(self, path: str, offset: int, n: int, ends: int | None) -> CorruptCheckpointError:
        return truncated(file_url(self.url, path), offset, n, ends, kind="object")

    def size(self, path: str) -> int:
        where = self._where(path, "head_object")
        try:
            head = self._run(lambda: self._call("head_object", where, Bucket=self.bucket, Key=self._key(path)))
        except StorageNotFoundError as e:
            raise missing(file_url(self.url, path), e) from e
        return int(head["ContentLength"])

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except StorageNotFoundError:
            return False
        return True


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
