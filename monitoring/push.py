"""The push client: every rank sends its reports to a collector, never blocking.

Who calls what, and when:

1. The core resolves ``monitor="host:port"`` (or ``$BYTECP_MONITOR``) through
   :func:`bytecp.recorder.resolve_monitor`, which builds one
   :class:`PushRecorder` per address per process.
2. When a save or load ends, the core calls :meth:`PushRecorder.on_report`
   on the thread that ends it: the report goes into a bounded queue and the
   call returns (microseconds). Nothing here raises into training.
3. A daemon thread (started on the first report, restarted after a fork)
   sends the queue to the collector, one ``Report`` RPC each. A report that
   cannot be delivered within ``timeout`` (collector absent, slow, refusing
   the token), or that finds the queue full, is dropped: one warning per
   outage, a ``monitor_report_dropped`` event per report. When the collector
   is back the next report goes through and a line says so.
4. At interpreter exit the queue is flushed for at most ``flush_seconds``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
import time

from bytecp.plugins import missing_extra

try:
    import grpc
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

from bytecp.recorder import CheckpointReport, emit_event

from ._channel import call_metadata, open_channel, parse_address
from ._wire import report_to_pb
from .generated import monitor_pb2_grpc

__all__ = ["PushRecorder"]

log = logging.getLogger(__name__)


class PushRecorder:
    """A :class:`~bytecp.recorder.Recorder` that pushes reports to ``address``.

    ``address`` is ``"host:port"`` of a ``bytecp monitor serve`` collector.
    ``token`` and ``root_certificates`` default to ``$BYTECP_MONITOR_TOKEN``
    and the file named by ``$BYTECP_MONITOR_CA`` (see ``_channel``).
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        queue_size: int = 1024,
        timeout: float = 3.0,
        flush_seconds: float = 2.0,
    ) -> None:
        parse_address(address)  # fail early on a malformed address (at configuration time)
        self.address = address
        self.timeout = timeout
        self.flush_seconds = flush_seconds
        self._metadata = call_metadata(token)
        self._root_certificates = root_certificates
        self._queue: queue.Queue[CheckpointReport | None] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = -1
        self._closed = False
        self._warned = False
        self._host = socket.gethostname()
        #: reports delivered / dropped by this process (read by tests and ``repr``)
        self.sent = 0
        self.dropped = 0
        atexit.register(self._at_exit)

    def __repr__(self) -> str:
        return f"PushRecorder({self.address!r}, sent={self.sent}, dropped={self.dropped})"

    # -- Recorder (training threads) ------------------------------------
    def on_report(self, report: CheckpointReport) -> None:
        if self._closed:
            return
        try:
            self._ensure_thread()
            self._queue.put_nowait(report)
        except queue.Full:
            self._drop(report, "the send queue is full (collector slow or absent)")
        except Exception as e:  # never into training
            self._drop(report, f"{type(e).__name__}: {e}")

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        """Events are per-process metrics (PrometheusRecorder); nothing is pushed."""

    # -- control ---------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued report was sent or dropped; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Flush (bounded) and stop the sender; later reports are ignored."""
        self.flush(self.flush_seconds if timeout is None else timeout)
        self._closed = True
        with self._lock:
            thread = self._thread if self._pid == os.getpid() else None
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
            # ended here, not in the interpreter's finalization (a thread still
            # inside gRPC then aborts the process): what is still queued is
            # dropped, the report being sent ends within its deadline
            thread.join(self.timeout + 1.0)

    def _at_exit(self) -> None:
        if not self._closed and self._thread is not None and self._pid == os.getpid():
            self.close()

    # -- sender thread ---------------------------------------------------
    def _ensure_thread(self) -> None:
        pid = os.getpid()
        if self._pid == pid and self._thread is not None:
            return
        with self._lock:
            if self._pid == pid and self._thread is not None:
                return
            if self._pid not in (-1, pid):  # forked: the parent's queue and thread are not ours
                self._queue = queue.Queue(maxsize=self._queue.maxsize)
            self._pid = pid
            self._thread = threading.Thread(target=self._run, name="bytecp-monitor-push", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        q = self._queue
        channel: grpc.Channel | None = None
        stub: monitor_pb2_grpc.CollectorStub | None = None
        broken = ""
        try:
            channel = open_channel(self.address, root_certificates=self._root_certificates)
            stub = monitor_pb2_grpc.CollectorStub(channel)
        except Exception as e:  # a bad CA file, say: keep draining so nothing waits on us
            broken = f"cannot open a channel: {type(e).__name__}: {e}"
        try:
            while True:
                report = q.get()
                try:
                    if report is None:
                        return
                    if stub is None or self._closed:
                        self._drop(report, broken or "the pusher was closed before it was sent")
                    else:
                        self._send(stub, report)
                finally:
                    q.task_done()
        finally:
            if channel is not None:
                channel.close()

    def _send(self, stub: monitor_pb2_grpc.CollectorStub, report: CheckpointReport) -> None:
        try:
            stub.Report(
                report_to_pb(report, self._host, os.getpid()),
                timeout=self.timeout,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
            self._drop(report, why)
            return
        except Exception as e:
            self._drop(report, f"{type(e).__name__}: {e}")
            return
        with self._lock:
            self.sent += 1
        if self._warned:
            self._warned = False
            log.warning("bytecp monitor: collector at %s reachable again; reports resume", self.address)

    def _drop(self, report: CheckpointReport, why: str) -> None:
        with self._lock:
            self.dropped += 1
        if not self._warned:
            self._warned = True
            log.warning(
                "bytecp monitor: dropping reports for collector %s (%s); training continues, "
                "this is said once until the collector is back",
                self.address,
                why,
            )
        emit_event("monitor_report_dropped", 1.0, job=report.job, rank=str(report.rank))
