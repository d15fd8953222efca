"""Per-request timeouts: a storage request that never returns becomes an error.

A hung NFS mount, or an S3 server that accepts a request and never answers,
would otherwise hold a save until its deadline (``save_timeout_s``). Every
backend bounds each request instead:

- coroutines (S3 on fsspec's event loop): :func:`bounded_await` cancels the
  request after its limit (called per attempt by ``_retry.acall``);
- blocking calls (local disk, fsspec and HDFS filesystems): :func:`run`
  makes the call on a daemon worker thread and stops waiting after its
  limit; the worker stays blocked in the kernel and is reused once the call
  returns (a thread in an uninterruptible NFS wait cannot be stopped by
  anyone). ``_retry.call`` runs each attempt through it; :func:`bounded`
  wraps a backend's methods where there is no retry policy (local disk).

The limit of a request moving ``n`` bytes is ``request_timeout * (1 + n /
1 GiB)``: the base covers a small request, large ones (a local data file
written in one call) get time in proportion. A timeout raises
:class:`~bytecp.errors.TransientStorageError` naming the URL, the operation
and the limit, so a backend's retry policy retries it like a reset
connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from bytecp.errors import ConfigError, TransientStorageError

from ._errors import file_url

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT_S",
    "BYTES_PER_TIMEOUT",
    "limit",
    "check",
    "timed_out",
    "run",
    "bounded_await",
    "bounded",
]

T = TypeVar("T")

#: the default per-request timeout of every backend (the ``request_timeout`` storage option)
DEFAULT_REQUEST_TIMEOUT_S = 120.0
#: a request moving this many bytes gets one more ``request_timeout``
BYTES_PER_TIMEOUT = 1 << 30


def check(value: float | None, url: str) -> float | None:
    """Validate a ``request_timeout`` option (seconds > 0, or None for none)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{url}: request_timeout must be seconds > 0 or None, got {value!r}")
    return float(value)


def limit(base: float | None, nbytes: int = 0) -> float | None:
    """Seconds a request moving ``nbytes`` may take (None: unbounded)."""
    if base is None:
        return None
    return base * (1.0 + max(0, nbytes) / BYTES_PER_TIMEOUT)


def timed_out(where: str, seconds: float) -> TransientStorageError:
    """The error of a request that did not answer within ``seconds``."""
    return TransientStorageError(
        f"{where}: no answer within {seconds:.4g} s (the storage option request_timeout; "
        "a hung mount or a server that accepted the request and never answered)"
    )


# -- blocking calls ------------------------------------------------------------


class _Job:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Worker:
    """A daemon thread running jobs; idle ones wait in ``_idle`` (so a stuck
    request never blocks the interpreter's exit)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="bytecp-storage-request", daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job.result = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                job.error = e
            job.done.set()
            job = None  # type: ignore[assignment]  # drop references while idle
            with _lock:
                if len(_idle) >= _MAX_IDLE:
                    return
                _idle.append(self)


_MAX_IDLE = 32
_idle: list[_Worker] = []
_lock = threading.Lock()


def _forget_workers() -> None:
    _idle.clear()  # the child of a fork has none of the parent's threads


os.register_at_fork(after_in_child=_forget_workers)


def run(fn: Callable[[], T], seconds: float | None, where: str) -> T:
    """``fn()`` on a worker thread (with the caller's context variables),
    waited for at most ``seconds``; called per attempt by the retry loop
    and by :func:`bounded` methods. ``None``: called here, unbounded."""
    if seconds is None:
        return fn()
    ctx = contextvars.copy_context()
    job = _Job(functools.partial(ctx.run, fn))
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
    worker.jobs.put(job)
    if not job.done.wait(seconds):
        raise timed_out(where, seconds)
    if job.error is not None:
        raise job.error
    return job.result


async def bounded_await(make: Callable[[], Awaitable[T]], seconds: float | None, where: str) -> T:
    """Await one attempt, cancelled after ``seconds`` (``_retry.acall``)."""
    if seconds is None:
        return await make()
    try:
        return await asyncio.wait_for(make(), seconds)
    except asyncio.TimeoutError:
        raise timed_out(where, seconds) from None


def _nbytes(value: Any) -> int:
    """Bytes in a buffer, a sequence of buffers or of ``(offset, buffer)``.
    (Asked of every sized request: a many-tensor load's batch holds tens of
    thousands of ranges, so the common types are told apart cheaply first.)"""
    if type(value) is memoryview:
        return value.nbytes
    if isinstance(value, bytes | bytearray):
        return len(value)
    if type(value) is list or type(value) is tuple or isinstance(value, Sequence):
        return sum(_nbytes(v[1] if isinstance(v, tuple) else v) for v in value)
    return int(getattr(value, "nbytes", 0) or 0)


def bounded(sized: Sequence[str | tuple[str, int]], unsized: Sequence[str]) -> Callable[[type[T]], type[T]]:
    """Class decorator: the methods named run through :func:`run` with the
    instance's ``request_timeout``. ``sized`` methods move the bytes of their
    last positional argument (``write_file``'s buffers, ``read_into``'s
    target, ``read_ranges``' ranges, ``commit``'s data), or of the one a
    ``(name, index)`` entry names (``read_ranges_summed``' ranges, before its
    spans); ``unsized`` ones get the base limit. The first argument names
    the file in the error."""

    def wrap(name: str, fn: Callable[..., Any], sized_: int | None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            base = self.request_timeout
            if base is None:
                return fn(self, *args, **kwargs)
            nbytes = _nbytes(args[sized_]) if sized_ is not None and len(args) > max(sized_, -1 - sized_) else 0
            first = args[0] if args else ""
            if not isinstance(first, str):  # read_files: a batch, named by its first file
                first = first[0][0] if isinstance(first, Sequence) and first and isinstance(first[0], tuple) else ""
            path = first
            where = f"{file_url(self.url, path)} ({name})"
            return run(lambda: fn(self, *args, **kwargs), limit(base, nbytes), where)

        return method

    def decorate(cls: type[T]) -> type[T]:
        for entry in sized:
            name, index = entry if isinstance(entry, tuple) else (entry, -1)
            setattr(cls, name, wrap(name, cls.__dict__[name], index))
        for name in unsized:
            setattr(cls, name, wrap(name, cls.__dict__[name], None))
        return cls

    return decorate
