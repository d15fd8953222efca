"""The retry policy: classification, backoff with jitter, the total deadline, metrics."""

from __future__ import annotations

import errno
import time

import pytest
from bytecp.storage import _retry
from bytecp.storage._retry import RetryPolicy

from bytecp.errors import (
    ConfigError,
    CorruptCheckpointError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
)


def test_policy_validation_names_the_field():
    with pytest.raises(ConfigError, match="deadline"):
        RetryPolicy(deadline=0)
    with pytest.raises(ConfigError, match="max_backoff"):
        RetryPolicy(initial_backoff=2, max_backoff=1)
    with pytest.raises(ConfigError, match="multiplier"):
        RetryPolicy(multiplier=0.5)
    with pytest.raises(ConfigError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    assert RetryPolicy.from_options(5).deadline == 5.0
    assert RetryPolicy.from_options({"max_backoff": 3}).max_backoff == 3
    with pytest.raises(ConfigError, match="retry="):
        RetryPolicy.from_options("soon")


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    p = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0)
    for attempt, base in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        waits = [p.backoff(attempt) for _ in range(200)]
        assert all(base * 0.5 <= w <= base for w in waits)
        assert max(waits) - min(waits) > base * 0.2  # jittered, not constant


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (TimeoutError("slow"), _retry.TRANSIENT),
        (ConnectionResetError(errno.ECONNRESET, "reset"), _retry.TRANSIENT),
        (OSError(errno.EPIPE, "broken pipe"), _retry.TRANSIENT),
        (PermissionError("no"), _retry.PERMISSION),
        (FileNotFoundError("gone"), _retry.NOT_FOUND),
        (ValueError("bad"), _retry.PERMANENT),
        (OSError(errno.ENOSPC, "full"), _retry.PERMANENT),
        (TransientStorageError("x"), _retry.TRANSIENT),
        (CorruptCheckpointError("x"), _retry.PERMANENT),
    ],
)
def test_generic_classification(exc, kind):
    assert _retry.classify(exc).kind == kind


def _botocore_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("SlowDown", 503, _retry.TRANSIENT),
        ("InternalError", 500, _retry.TRANSIENT),
        ("ServiceUnavailable", 503, _retry.TRANSIENT),
        ("", 502, _retry.TRANSIENT),
        ("TooManyRequests", 429, _retry.TRANSIENT),
        ("RequestTimeout", 400, _retry.TRANSIENT),
        ("AccessDenied", 403, _retry.PERMISSION),
        ("SignatureDoesNotMatch", 403, _retry.PERMISSION),
        ("InvalidAccessKeyId", 403, _retry.PERMISSION),
        ("NoSuchBucket", 404, _retry.NOT_FOUND),
        ("NoSuchKey", 404, _retry.NOT_FOUND),
        ("InvalidArgument", 400, _retry.PERMANENT),
    ],
)
def test_s3_classification(code, status, kind):
    import bytecp.storage.s3  # noqa: F401  registers the botocore classifier

    assert _retry.classify(_botocore_error(code, status)).kind == kind


def test_s3_connection_errors_are_transient():
    import aiohttp
    import bytecp.storage.s3  # noqa: F401
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    for exc in (
        EndpointConnectionError(endpoint_url="http://x"),
        ConnectionClosedError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientPayloadError("cut"),
    ):
        assert _retry.classify(exc).kind == _retry.TRANSIENT, exc


def test_transient_errors_are_retried_then_succeed(events):
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 4:
            raise ConnectionResetError(errno.ECONNRESET, "reset by peer")
        return "ok"

    p = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
    assert _retry.call(flaky, policy=p, where="mem://x/f (write)", backend="test") == "ok"
    assert len(calls) == 4
    retries = [e for e in events.events if e[0] == "storage_retry"]
    assert len(retries) == 3
    assert retries[0][2] == {"backend": "test", "reason": "ConnectionResetError"}


def test_the_total_deadline_bounds_retries():
    p = RetryPolicy(deadline=0.5, initial_backoff=0.05, max_backoff=0.1)
    calls = []

    def always():
        calls.append(1)
        raise TimeoutError("server is slow")

    t0 = time.monotonic()
    with pytest.raises(TransientStorageError, match=r"s3://b/k \(read\): still failing after \d+ attempt.*TimeoutError: server is slow"):
        _retry.call(always, policy=p, where="s3://b/k (read)", backend="test")
    assert time.monotonic() - t0 < 0.8
    assert len(calls) >= 3


def test_max_attempts():
    p = RetryPolicy(initial_backoff=0.001, max_backoff=0.001, max_attempts=3)
    calls = []

    def always():
        calls.append(1)
        raise TimeoutError()

    with pytest.raises(TransientStorageError):
        _retry.call(always, policy=p, where="x", backend="test")
    assert len(calls) == 3


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (PermissionError("denied"), StoragePermissionError),
        (FileNotFoundError("gone"), StorageNotFoundError),
        (ValueError("bad"), StorageError),
    ],
)
def test_permanent_errors_fail_at_once_naming_where(exc, expected, events):
    calls = []

    def fail():
        calls.append(1)
        raise exc

    with pytest.raises(expected, match=r"^file:///ck/x \(write\)"):
        _retry.call(fail, policy=RetryPolicy(), where="file:///ck/x (write)", backend="test")
    assert calls == [1] and not events.events


def test_async_retry_loop():
    import asyncio

    n = []

    async def flaky():
        n.append(1)
        if len(n) < 3:
            raise TimeoutError()
        return 42

    p = RetryPolicy(initial_backoff=0.001, max_backoff=0.002)
    assert asyncio.run(_retry.acall(flaky, policy=p, where="x", backend="test")) == 42
