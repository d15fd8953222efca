"""Queries to a collector, for people and tools (``bytecp monitor ls``/``show``).

Not used on the training path: ranks only push (``push.PushRecorder``).
"""

from __future__ import annotations

from ._channel import call_metadata, open_channel
from ._wire import aggregate_from_pb
from .aggregate import CheckpointAggregate
from .generated import monitor_pb2 as pb
from .generated import monitor_pb2_grpc

__all__ = ["CollectorClient"]


class CollectorClient:
    """A blocking client; ``token``/``root_certificates`` default to the environment."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = call_metadata(token)
        self._channel = open_channel(address, root_certificates=root_certificates)
        self._stub = monitor_pb2_grpc.CollectorStub(self._channel)

    def list(self, job: str = "", operation: str = "", limit: int = 0) -> list[pb.CheckpointSummary]:
        """Checkpoints the collector knows, newest first."""
        req = pb.ListCheckpointsRequest(job=job, operation=operation, limit=limit)
        resp = self._stub.ListCheckpoints(req, timeout=self.timeout, metadata=self._metadata)
        return list(resp.checkpoints)

    def get(self, checkpoint: str, job: str = "", operation: str = "") -> CheckpointAggregate:
        """One checkpoint with every rank's report (``grpc.RpcError`` NOT_FOUND if unknown)."""
        req = pb.GetCheckpointRequest(checkpoint=checkpoint, job=job, operation=operation)
        msg = self._stub.GetCheckpoint(req, timeout=self.timeout, metadata=self._metadata)
        return aggregate_from_pb(msg)

    def report(self, message: pb.RankReport) -> bool:
        """Push one report synchronously (tools and tests; ranks use PushRecorder)."""
        ack = self._stub.Report(message, timeout=self.timeout, metadata=self._metadata)
        return bool(ack.accepted)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CollectorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
