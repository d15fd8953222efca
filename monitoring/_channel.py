"""Addresses, channels and the shared token, for clients and the server.

Clients (the push recorder on every rank, ``monitor show``/``ls``) open
channels with :func:`open_channel` and send :func:`call_metadata` with each
call; the collector checks the token with :class:`TokenInterceptor`.

Environment (read by clients when arguments are not given):
``BYTECP_MONITOR_TOKEN`` the shared token; ``BYTECP_MONITOR_CA`` a PEM file of
the CA that signed the collector's certificate (turns TLS on);
``BYTECP_MONITOR_TLS=1`` TLS with the system's roots.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable
from typing import Any

from bytecp.plugins import missing_extra

try:
    import grpc
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

__all__ = [
    "parse_address",
    "is_loopback",
    "open_channel",
    "call_metadata",
    "TokenInterceptor",
    "TOKEN_ENV",
    "CA_ENV",
    "TLS_ENV",
]

TOKEN_ENV = "BYTECP_MONITOR_TOKEN"
CA_ENV = "BYTECP_MONITOR_CA"
TLS_ENV = "BYTECP_MONITOR_TLS"
_AUTH_KEY = "authorization"

#: quick reconnects: a collector that comes back is used again within seconds
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    # each channel keeps its own connections: with gRPC's process-wide pool a
    # new client would inherit another channel's failed-connection backoff
    # (a query right after a collector restart failed with "connection refused")
    ("grpc.use_local_subchannel_pool", 1),
)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``"grpc://host:port"`` -> (host, port)."""
    addr = address.split("://", 1)[-1].strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"monitor address must be host:port, got {address!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_channel(
    address: str,
    *,
    root_certificates: bytes | None = None,
    tls: bool | None = None,
) -> grpc.Channel:
    """A channel to the collector; TLS when a CA is given or ``tls`` / the environment asks."""
    host, port = parse_address(address)
    if root_certificates is None and os.environ.get(CA_ENV):
        with open(os.environ[CA_ENV], "rb") as f:
            root_certificates = f.read()
    if tls is None:
        tls = root_certificates is not None or os.environ.get(TLS_ENV, "") in ("1", "true", "yes")
    target = _target(host, port)
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to send with every call (the token, when there is one)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return ((_AUTH_KEY, f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` is not ``Bearer <token>``."""

    def __init__(self, token: str, on_reject: Callable[[], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_reject = on_reject

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bytecp monitor token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == _AUTH_KEY:
                got = value if isinstance(value, str) else value.decode()
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        if self._on_reject is not None:
            self._on_reject()
        return self._deny
