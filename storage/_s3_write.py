"""S3 writes: single and multipart uploads, streamed uploads, and the
commit (a plain PUT, a conditional PUT, or HEAD + PUT + read-back).

:class:`_S3Writes` is a base of :class:`bytecp.storage.s3.S3Storage`; the
engine's writer threads call ``write_file``/``write_stream`` for data files,
then the coordinator calls ``commit`` for ``metadata.json``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bytecp.errors import (
    CheckpointExistsError,
    StorageError,
    StorageNotFoundError,
    TransientStorageError,
)
from bytecp.storage_api import Buffer

from . import _retry
from ._buffers import byte_view, byte_views
from ._errors import exists, file_url
from ._s3_base import (
    _NOT_FOUND_CODES,
    MAX_PARTS,
    T,
    _client_error_info,
    _ConditionalPutUnsupported,
    _S3Base,
    log,
    plan_parts,
)

__all__: list[str] = []


class _S3Writes(_S3Base):
    """Uploads and commits of one S3 storage (see :mod:`bytecp.storage.s3`)."""

    # -- writing -------------------------------------------------------------
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        views = byte_views(buffers)
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
                view = byte_view(piece)
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
        return exists(file_url(self.url, path))

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
                f"{file_url(self.url, path)} was replaced by another save right after this "
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
        """Two conditional PUTs of one probe object: the second must be refused
        (a refusal of the first, retried after a lost answer, counts the same)."""
        probe = f".bytecp-conditional-put-probe-{uuid.uuid4().hex}"
        key = self._key(probe)
        where = self._where(probe, "conditional put probe")
        honoured = False
        try:
            for _ in range(2):
                try:
                    await self._call("put_object", where, Bucket=self.bucket, Key=key, Body=b"", IfNoneMatch="*")
                except StorageError as e:
                    info = _client_error_info(e.__cause__) if e.__cause__ is not None else None
                    if info and (info[0] == "PreconditionFailed" or info[1] == 412):
                        # the second PUT refused; or the first one's retry, after an attempt that
                        # landed but whose answer was lost (a reset): the key is this probe's own
                        honoured = True
                        break
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
