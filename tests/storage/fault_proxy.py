"""An HTTP proxy in front of an S3 server that injects faults, for the fault tests.

Clients point ``endpoint_url`` at the proxy; it forwards each request
unchanged (the Host header included, so SigV4 signatures still verify) to
the real server, except that a rule may instead:

- ``"503"``: answer ``503 SlowDown`` (S3's throttling reply),
- ``"500"``: answer ``500 InternalError``,
- ``"403"`` (never drawn by default): answer ``403 AccessDenied``, what S3
  answers a request its policy denies (a role without ``s3:ListBucket``),
- ``"reset"``: reset the connection before forwarding (TCP RST),
- ``"reset_after"``: forward, then reset instead of answering (the request
  took effect but the client never hears so: retries must be idempotent),
- ``"truncate"``: forward, send the status and headers and half the body,
  then reset (a connection dropped mid-download);
- ``"hang"`` (never drawn by default): read the request and never answer,
  holding the connection open until the proxy closes (a server that
  accepted a request and stalled: the client's per-request timeout's case).

Faults are drawn with a seeded RNG for a fraction of the requests that a
predicate selects; ``fail_always`` makes a predicate's requests fail every
time (a persistent fault). ``drop_headers`` names request headers the proxy
removes (a server that ignores them, e.g. ``If-None-Match``; only against
servers that do not check signatures, such as moto). Counters record what
happened.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import random
import socket
import struct
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable

Predicate = Callable[[str, str], bool]  # (method, path with query) -> bool

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}

_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
)
_FAULT_REPLIES = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "AccessDenied", "Access Denied"),
}
KINDS = ("503", "500", "reset", "reset_after", "truncate")
HANG = "hang"


def any_request(method: str, path: str) -> bool:
    return True


@dataclasses.dataclass
class Rule:
    """Fault ``kinds`` for a ``rate`` of the requests ``when`` selects."""

    rate: float
    kinds: tuple[str, ...] = KINDS
    when: Predicate = any_request


class FaultProxy:
    """A threaded proxy on 127.0.0.1; use as a context manager."""

    def __init__(self, upstream: str, *, seed: int = 0, drop_headers: tuple[str, ...] = ()) -> None:
        u = urllib.parse.urlsplit(upstream)
        drop = {h.lower() for h in drop_headers}
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rules: list[Rule] = []
        self.fail_always: list[tuple[Predicate, str]] = []
        self.counts: Counter[str] = Counter()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, outcome)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # a reply is written as headers then body: with Nagle's algorithm on, the body
            # waits for the client's delayed ACK of the headers, 40 ms a request
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def _reset(self) -> None:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                try:
                    self.connection.close()
                except OSError:
                    pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(n) if n else b""

            def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length" and k.lower() not in drop:
                            conn.putheader(k, v)
                    if body or self.command in ("PUT", "POST"):
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body if body else None)
                    resp = conn.getresponse()
                    data = resp.read()
                    headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
                    return resp.status, resp.reason, headers, data
                finally:
                    conn.close()

            def _handle(self) -> None:
                body = self._body()
                fault = proxy._draw(self.command, self.path)
                proxy._note(self.command, self.path, fault or "ok")
                if fault in _FAULT_REPLIES:
                    status, code, message = _FAULT_REPLIES[fault]
                    data = _ERROR_BODY.format(code=code, message=message).encode()
                    self.send_response_only(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                if fault == "reset":
                    self._reset()
                    return
                if fault == HANG:
                    proxy._closing.wait(600)
                    self._reset()
                    return
                status, reason, headers, data = self._forward(body)
                if fault == "reset_after" or (fault == "truncate" and len(data) < 2):
                    self._reset()
                    return
                self.send_response_only(status, reason)
                has_length = False
                for k, v in headers:
                    if k.lower() == "content-length":
                        has_length = True
                        if self.command != "HEAD":
                            v = str(len(data))
                    self.send_header(k, v)
                if not has_length:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault == "truncate":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self._reset()
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def finish(self) -> None:
                try:
                    super().finish()
                except OSError:
                    pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False  # a client's idle keep-alive connection must not hold up the close

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # resets are the point

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # a short poll: shutdown() waits up to one interval (0.5 s by default), once per proxy
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    def _draw(self, method: str, path: str) -> str | None:
        with self._lock:
            for pred, kind in self.fail_always:
                if pred(method, path):
                    return kind
            for rule in self.rules:
                if rule.when(method, path) and self._rng.random() < rule.rate:
                    return self._rng.choice(rule.kinds)
        return None

    def _note(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1
            self.requests.append((method, path, outcome))

    @property
    def faults(self) -> int:
        return sum(n for k, n in self.counts.items() if k != "ok")

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
