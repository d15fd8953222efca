"""Retries with exponential backoff and jitter, bounded by a total deadline.

Every backend routes its storage calls through :func:`call` (threads) or
:func:`acall` (coroutines on an fsspec event loop). An error is first
*classified*:

- transient (throttling, 5xx, reset connections, timeouts): retried after
  ``min(max_backoff, initial_backoff * multiplier**attempt)`` scaled by a
  random jitter factor in ``[0.5, 1.0]``, until the policy's total deadline
  would be passed; then :class:`TransientStorageError` names the URL, the
  operation, the attempts and the last cause;
- permission (access denied, bad signature, unknown key, no credentials):
  :class:`StoragePermissionError` at once;
- not found (no such bucket/key/file): :class:`StorageNotFoundError` at once;
- anything else: :class:`StorageError` at once.

Each attempt is bounded by the policy's ``request_timeout`` (:mod:`._timeout`):
an attempt that does not answer in time is a transient failure, retried.

Each retry is counted through ``bytecp.recorder.emit_event("storage_retry",
1, backend=..., reason=...)``. Backends register classifiers for their own
error types with :func:`register_classifier` (S3 registers botocore's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from bytecp import recorder
from bytecp.errors import (
    BytecpError,
    ConfigError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
)

from . import _timeout
from ._timeout import DEFAULT_REQUEST_TIMEOUT_S

__all__ = [
    "RetryPolicy",
    "Verdict",
    "TRANSIENT",
    "PERMISSION",
    "NOT_FOUND",
    "PERMANENT",
    "classify",
    "register_classifier",
    "to_storage_error",
    "call",
    "acall",
]

log = logging.getLogger("bytecp.storage")

T = TypeVar("T")

TRANSIENT = "transient"
PERMISSION = "permission"
NOT_FOUND = "not_found"
PERMANENT = "permanent"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How an error is handled: its kind and a short reason (for logs and metrics)."""

    kind: str
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long and how often transient storage errors are retried."""

    deadline: float = 120.0
    """Total seconds one operation may spend across all its attempts and waits."""

    initial_backoff: float = 0.1
    """Wait before the first retry, in seconds (before jitter)."""

    max_backoff: float = 10.0
    """Upper bound of a single wait, in seconds."""

    multiplier: float = 2.0
    """Growth factor of the wait from one retry to the next."""

    max_attempts: int | None = None
    """Optional cap on attempts (first try included); ``None``: only the deadline bounds them."""

    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    """Seconds one attempt may take before it counts as a transient failure
    (scaled by the bytes it moves, :func:`bytecp.storage._timeout.limit`);
    ``None``: unbounded. Backends set it from their ``request_timeout`` option."""

    def __post_init__(self) -> None:
        if self.deadline <= 0:
            raise ConfigError(f"RetryPolicy.deadline must be > 0 seconds, got {self.deadline}")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ConfigError(
                "RetryPolicy needs 0 <= initial_backoff <= max_backoff, got "
                f"{self.initial_backoff} and {self.max_backoff}"
            )
        if self.multiplier < 1:
            raise ConfigError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        _timeout.check(self.request_timeout, "RetryPolicy")

    @classmethod
    def from_options(
        cls, value: RetryPolicy | dict | float | int | None, request_timeout: object = "policy"
    ) -> RetryPolicy:
        """Accept a policy, a dict of its fields, or a bare deadline in seconds;
        ``request_timeout`` (a backend's storage option), unless left at
        ``"policy"``, replaces the policy's."""
        if value is None:
            policy = cls()
        elif isinstance(value, RetryPolicy):
            policy = value
        elif isinstance(value, dict):
            policy = cls(**value)
        elif isinstance(value, int | float):
            policy = cls(deadline=float(value))
        else:
            raise ConfigError(f"retry= must be a RetryPolicy, a dict or a deadline in seconds, got {value!r}")
        if request_timeout == "policy":
            return policy
        return dataclasses.replace(policy, request_timeout=request_timeout)  # type: ignore[arg-type]

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (0-based), with jitter."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        return base * random.uniform(0.5, 1.0)


# -- classification ------------------------------------------------------

Classifier = Callable[[BaseException], Verdict | None]
_classifiers: list[Classifier] = []

_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EAGAIN,
}


def register_classifier(fn: Classifier) -> Classifier:
    """Add a classifier consulted before the generic rules (first match wins)."""
    if fn not in _classifiers:
        _classifiers.insert(0, fn)
    return fn


def classify(exc: BaseException) -> Verdict:
    """Decide whether ``exc`` is worth a retry."""
    if isinstance(exc, TransientStorageError):
        return Verdict(TRANSIENT, type(exc).__name__)
    if isinstance(exc, BytecpError):
        if isinstance(exc, StoragePermissionError):
            return Verdict(PERMISSION, "permission")
        if isinstance(exc, StorageNotFoundError):
            return Verdict(NOT_FOUND, "not_found")
        return Verdict(PERMANENT, type(exc).__name__)
    for fn in _classifiers:
        v = fn(exc)
        if v is not None:
            return v
    if isinstance(exc, asyncio.TimeoutError | TimeoutError | socket.timeout):
        return Verdict(TRANSIENT, "timeout")
    if isinstance(exc, ConnectionError):
        return Verdict(TRANSIENT, type(exc).__name__)
    if isinstance(exc, PermissionError):
        return Verdict(PERMISSION, "permission")
    if isinstance(exc, FileNotFoundError):
        return Verdict(NOT_FOUND, "not_found")
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return Verdict(TRANSIENT, errno.errorcode.get(exc.errno or 0, "oserror"))
    return Verdict(PERMANENT, type(exc).__name__)


def to_storage_error(exc: BaseException, where: str, verdict: Verdict | None = None) -> StorageError:
    """Wrap ``exc`` in the matching :class:`StorageError` whose message names ``where``."""
    if isinstance(exc, StorageError):
        return exc
    verdict = verdict or classify(exc)
    cause = f"{type(exc).__name__}: {exc}"
    if verdict.kind == PERMISSION:
        return StoragePermissionError(
            f"{where}: permission denied ({cause}). Check the credentials (AWS_* environment, "
            "~/.aws, instance role, or key=/secret= options) and the access policy."
        )
    if verdict.kind == NOT_FOUND:
        return StorageNotFoundError(f"{where}: not found ({cause})")
    if verdict.kind == TRANSIENT:
        return TransientStorageError(f"{where}: {cause}")
    return StorageError(f"{where}: {cause}")


# -- retry loops -----------------------------------------------------------


class _Attempts:
    """Book-keeping shared by the sync and async loops."""

    def __init__(self, policy: RetryPolicy, where: str, backend: str) -> None:
        self.policy = policy
        self.where = where
        self.backend = backend
        self.start = time.monotonic()
        self.attempt = 0

    def next_wait(self, exc: BaseException) -> float:
        """Seconds to sleep before retrying ``exc``; raises when it must not be retried."""
        verdict = classify(exc)
        if verdict.kind != TRANSIENT:
            if isinstance(exc, BytecpError):
                raise exc  # already says what is wrong
            raise to_storage_error(exc, self.where, verdict) from exc
        self.attempt += 1
        wait = self.policy.backoff(self.attempt - 1)
        elapsed = time.monotonic() - self.start
        out_of_attempts = self.policy.max_attempts is not None and self.attempt >= self.policy.max_attempts
        if out_of_attempts or elapsed + wait > self.policy.deadline:
            raise TransientStorageError(
                f"{self.where}: still failing after {self.attempt} attempt(s) in {elapsed:.1f} s "
                f"(retry deadline {self.policy.deadline:g} s); last error: {type(exc).__name__}: {exc}"
            ) from exc
        log.debug("retrying %s in %.2f s after %s: %s", self.where, wait, verdict.reason, exc)
        recorder.emit_event("storage_retry", 1, backend=self.backend, reason=verdict.reason)
        return wait


def call(fn: Callable[[], T], *, policy: RetryPolicy, where: str, backend: str, nbytes: int = 0) -> T:
    """Run ``fn()`` with retries, each attempt bounded by the policy's
    ``request_timeout`` for ``nbytes``; ``where`` names the URL and operation in errors."""
    attempts = _Attempts(policy, where, backend)
    seconds = _timeout.limit(policy.request_timeout, nbytes)
    while True:
        try:
            return _timeout.run(fn, seconds, where)
        except Exception as exc:  # classified below; non-transient re-raised at once
            time.sleep(attempts.next_wait(exc))


async def acall(
    fn: Callable[[], Awaitable[T]], *, policy: RetryPolicy, where: str, backend: str, nbytes: int = 0
) -> T:
    """Coroutine version of :func:`call`; ``fn`` makes a fresh awaitable per attempt."""
    attempts = _Attempts(policy, where, backend)
    seconds = _timeout.limit(policy.request_timeout, nbytes)
    while True:
        try:
            return await _timeout.bounded_await(fn, seconds, where)
        except Exception as exc:
            await asyncio.sleep(attempts.next_wait(exc))
