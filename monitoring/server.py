"""The collector: a gRPC service ranks push reports to, with its own /metrics.

Who calls what, and when:

1. ``bytecp monitor serve`` (or a test) builds a :class:`CollectorServer`
   and calls :meth:`~CollectorServer.start`: it binds the gRPC port (and the
   Prometheus port when ``metrics_address`` is given) and starts a timer
   thread that finalizes checkpoints whose missing ranks are overdue.
2. Every rank's push client calls ``Report`` once per save/load; the
   :class:`CollectorServicer` hands it to the :class:`~.aggregate.Aggregator`,
   which finalizes a checkpoint when its last rank reports; finalizing
   updates :class:`~.job_metrics.JobMetrics` and logs the straggler.
3. ``bytecp monitor ls`` / ``show`` call ``ListCheckpoints`` /
   ``GetCheckpoint``.
4. :meth:`~CollectorServer.stop` on shutdown.

Binding: 127.0.0.1 by default. Another address requires a shared token
(``token=``; clients send it as ``authorization: Bearer <token>``) unless
``allow_unauthenticated`` is set, and should use TLS (``tls_cert``/``tls_key``).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from typing import Any

from bytecp.plugins import missing_extra

try:
    import grpc
    from prometheus_client import CollectorRegistry
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

from bytecp.errors import ConfigError

from ._channel import TokenInterceptor, is_loopback, parse_address
from ._wire import report_from_pb, summary_to_pb
from .aggregate import Aggregator, CheckpointAggregate
from .generated import monitor_pb2 as pb
from .generated import monitor_pb2_grpc
from .job_metrics import JobMetrics

__all__ = ["CollectorServicer", "CollectorServer", "DEFAULT_GRPC_ADDRESS", "DEFAULT_METRICS_ADDRESS"]

log = logging.getLogger(__name__)

DEFAULT_GRPC_ADDRESS = "127.0.0.1:7470"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9470"


def _describe(agg: CheckpointAggregate) -> str:
    st = agg.straggler()
    where = ""
    if st is not None and agg.world_size > 1:
        where = (
            f"; straggler rank {st.rank} in {st.phase} "
            f"({st.seconds:.3f}s vs median {st.median_seconds:.3f}s, finished {st.lag_seconds:.3f}s after the other ranks' median)"
        )
    state = "ok" if agg.ok else f"FAILED on ranks {sorted(agg.errors())}"
    missing = "" if agg.complete else f", {agg.world_size - len(agg.reports)} rank(s) never reported"
    return (
        f"{agg.key.job} {agg.key.operation} {agg.key.checkpoint_id}: {state}, "
        f"{agg.duration:.3f}s, max stall {agg.max_stall_seconds:.3f}s{missing}{where}"
    )


class CollectorServicer(monitor_pb2_grpc.CollectorServicer):
    """The three RPCs over an :class:`Aggregator` (testable without a server)."""

    def __init__(self, aggregator: Aggregator, metrics: JobMetrics | None = None) -> None:
        self.aggregator = aggregator
        self.metrics = metrics

    def Report(self, request: pb.RankReport, context: Any) -> pb.ReportAck:  # noqa: N802
        report = report_from_pb(request)
        if self.metrics is not None:
            self.metrics.report_received(report.job)
        accepted = self.aggregator.add(report)
        if not accepted and self.metrics is not None:
            self.metrics.rejected("duplicate")
        return pb.ReportAck(accepted=accepted)

    def ListCheckpoints(  # noqa: N802
        self, request: pb.ListCheckpointsRequest, context: Any
    ) -> pb.ListCheckpointsResponse:
        items = self.aggregator.list(request.job, request.operation, request.limit or 100)
        return pb.ListCheckpointsResponse(checkpoints=[summary_to_pb(a) for a in items])

    def GetCheckpoint(  # noqa: N802
        self, request: pb.GetCheckpointRequest, context: Any
    ) -> pb.CheckpointSummary:
        agg = self.aggregator.get(request.checkpoint, request.job, request.operation)
        if agg is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint {request.checkpoint!r} known")
            raise AssertionError("abort() raises")  # for type checkers
        return summary_to_pb(agg, with_reports=True)


class CollectorServer:
    """gRPC server + aggregation + job metrics (+ optional /metrics endpoint)."""

    def __init__(
        self,
        grpc_address: str = DEFAULT_GRPC_ADDRESS,
        metrics_address: str | None = None,
        *,
        token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        allow_unauthenticated: bool = False,
        registry: CollectorRegistry | None = None,
        complete_after: float = 120.0,
        keep: int = 1000,
        workers: int = 8,
    ) -> None:
        host, _ = parse_address(grpc_address)
        if not is_loopback(host) and not token and not allow_unauthenticated:
            raise ConfigError(
                f"refusing to serve the bytecp collector on {grpc_address} without a token: "
                "pass --token (and TLS), or --allow-unauthenticated on a trusted network"
            )
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("TLS needs both a certificate and its key")
        if not is_loopback(host) and tls_cert is None:
            log.warning("bytecp collector on %s without TLS: the token travels in clear", grpc_address)
        self.grpc_address = grpc_address
        self.metrics_address = metrics_address
        self.registry = CollectorRegistry() if registry is None else registry
        self.metrics = JobMetrics(self.registry)
        self.aggregator = Aggregator(
            complete_after=complete_after, keep=keep, on_finalize=self._on_finalize
        )
        self.servicer = CollectorServicer(self.aggregator, self.metrics)
        self._token = token
        self._tls = (tls_key, tls_cert) if tls_cert is not None and tls_key is not None else None
        self._workers = workers
        self._server: grpc.Server | None = None
        self._http: Any = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        #: bound ports (useful with port 0)
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None

    def _on_finalize(self, agg: CheckpointAggregate) -> None:
        self.metrics.observe(agg)
        log.info("%s", _describe(agg))

    def start(self) -> CollectorServer:
        interceptors = []
        if self._token:
            interceptors.append(
                TokenInterceptor(self._token, on_reject=lambda: self.metrics.rejected("unauthenticated"))
            )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="bytecp-collector"),
            interceptors=interceptors,
        )
        monitor_pb2_grpc.add_CollectorServicer_to_server(self.servicer, server)
        host, port = parse_address(self.grpc_address)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._tls is not None:
            creds = grpc.ssl_server_credentials([self._tls])
            self.grpc_port = server.add_secure_port(target, creds)
        else:
            self.grpc_port = server.add_insecure_port(target)
        if not self.grpc_port:
            raise ConfigError(f"could not bind the collector's gRPC port {self.grpc_address}")
        server.start()
        self._server = server
        metrics = "(none)"
        if self.metrics_address:
            from prometheus_client import start_http_server

            mhost, mport = parse_address(self.metrics_address)
            self._http, _ = start_http_server(mport, mhost, registry=self.registry)
            self.metrics_port = self._http.server_port
            metrics = f"{mhost}:{self.metrics_port}"
        self._timer = threading.Thread(target=self._expire_loop, name="bytecp-collector-timer", daemon=True)
        self._timer.start()
        log.info(
            "bytecp collector: gRPC on %s:%s, metrics on %s",
            host,
            self.grpc_port,
            metrics,
        )
        return self

    def _expire_loop(self) -> None:
        period = min(1.0, self.aggregator.complete_after / 4)
        while not self._stop.wait(period):
            try:
                self.aggregator.expire()
            except Exception:
                log.exception("bytecp collector: finalizing overdue checkpoints failed")

    def wait(self) -> None:
        """Block until the server stops (``bytecp monitor serve``)."""
        if self._server is not None:
            self._server.wait_for_termination()

    def stop(self, grace: float | None = 0.5) -> None:
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()  # it waits on _stop: ends at once
            self._timer = None
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> CollectorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
