"""The keeper's wire format and its shared-memory files.

Used by the keeper process (:mod:`bytecp.storage.keeper_server`) and by the
``keeper://`` backend (:mod:`bytecp.storage.keeper`) in the training
processes. One request per TCP connection: a 4-byte big-endian length, a
JSON header (which carries the job's token and, for a payload, its size
``n`` and ``crc32c``), then ``n`` payload bytes; the answer has the same
shape (``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``).

A keeper moves files without a userspace copy: a payload part that is a
:class:`FileRange` (replication's ``put``, a ``get`` answer) goes out with
``sendfile`` from the shared-memory file, and a ``put`` is received
(:func:`recv_file`) with ``recv_into`` straight into a mapping of the
destination file; the receiver checks the crc32c over that mapping.

A keeper's files live below one directory in ``/dev/shm`` (shared memory),
mode 0700, files 0600: only the job's user reads them; the token keeps
other jobs of the same user out of the TCP side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import json
import mmap
import os
import socket
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from bytecp.errors import CheckpointExistsError, StorageError
from bytecp.format.checksum import crc32c

__all__ = [
    "Addr", "parse_keepers", "request", "send", "recv", "recv_payload", "recv_file", "discard", "safe_path",
    "write_atomic", "read_file_into", "crc_of", "token_ok", "KeeperUnreachable", "KeeperNotListening", "FileRange", "reserve",
]

Addr = tuple[str, int]
_LEN = struct.Struct("!I")
_MAX_HEADER = 1 << 20


class KeeperUnreachable(StorageError):
    """No keeper answers at an address (not running, or the host is gone)."""


class KeeperNotListening(KeeperUnreachable):
    """Nobody accepted the connection: the request never reached a keeper (safe to send again)."""


def parse_keepers(spec: str | dict[str, str]) -> dict[str, Addr]:
    """``"h0=127.0.0.1:7001,h1=127.0.0.1:7002"`` (or a dict) -> ``{"h0": ("127.0.0.1", 7001), ...}``."""
    items = spec.items() if isinstance(spec, dict) else (
        part.split("=", 1) for part in spec.split(",") if part.strip())
    out: dict[str, Addr] = {}
    for name, addr in items:
        host, _, port = str(addr).strip().rpartition(":")
        if not host or not port.isdigit():
            raise StorageError(f"keeper address {addr!r} of {name!r} is not host:port (BYTECP_KEEPERS / keepers=)")
        out[str(name).strip()] = (host, int(port))
    return out


@dataclasses.dataclass(frozen=True)
class FileRange:
    """A payload part: ``nbytes`` of the file ``path`` from ``offset``, sent
    with ``sendfile`` (the kernel moves the pages; no userspace copy)."""

    path: str
    offset: int
    nbytes: int


def crc_of(buffers: Sequence[Any]) -> int:
    """The crc32c of the buffers, one after the other."""
    crc = 0
    for b in buffers:
        crc = crc32c(b, crc)
    return crc


def _check(header: dict[str, Any], buf: memoryview) -> None:
    """Raise when ``buf`` fails the header's checksum (``crc32c``; ``crc``: zlib's, older senders)."""
    if "crc32c" in header:
        ok = crc32c(buf) == header["crc32c"]
    elif "crc" in header:
        ok = zlib.crc32(buf) == header["crc"]
    else:
        return
    if not ok:
        raise StorageError(f"keeper payload of {len(buf)} bytes failed its crc32c check (corrupted in transfer)")


def token_ok(given: object, token: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())


def send(sock: socket.socket, header: dict[str, Any], payload: Sequence[Any] = ()) -> None:
    """``header``, then the payload: buffers, and :class:`FileRange` parts
    (checksummed through a read-only mapping, sent with ``sendfile``)."""
    with contextlib.ExitStack() as stack:
        files: dict[str, tuple[Any, mmap.mmap | None]] = {}
        parts: list[memoryview | tuple[Any, int, int]] = []
        crc, n = 0, 0
        for p in payload:
            if not isinstance(p, FileRange):
                v = memoryview(p).cast("B")
                crc, n = crc32c(v, crc), n + len(v)
                parts.append(v)
                continue
            if p.path not in files:
                f = stack.enter_context(open(p.path, "rb", buffering=0))  # noqa: SIM115
                size = os.fstat(f.fileno()).st_size
                m = stack.enter_context(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)) if size else None
                files[p.path] = (f, m)
            f, m = files[p.path]
            if p.nbytes < 0 or p.nbytes and (p.offset < 0 or p.offset + p.nbytes > (len(m) if m else 0)):
                raise StorageError(f"{p.path}: bytes {p.offset}..{p.offset + p.nbytes} are beyond its end")
            if p.nbytes:
                with memoryview(m) as whole, whole[p.offset:p.offset + p.nbytes] as v:  # type: ignore[arg-type]
                    crc = crc32c(v, crc)
            n += p.nbytes
            parts.append((f, p.offset, p.nbytes))
        header = dict(header, n=n)
        if parts and "crc" not in header and "crc32c" not in header:
            header["crc32c"] = crc
        raw = json.dumps(header).encode()
        sock.sendall(_LEN.pack(len(raw)) + raw)
        for part in parts:
            if isinstance(part, memoryview):
                sock.sendall(part)
            elif part[2] and sock.sendfile(part[0], part[1], part[2]) != part[2]:
                raise ConnectionError(f"{part[0].name}: sendfile stopped short (the file shrank?)")


def _recv_exact(sock: socket.socket, out: memoryview) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got:])
        if not n:
            raise ConnectionError("keeper connection closed mid-message")
        got += n


def recv(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > _MAX_HEADER:
        raise ConnectionError(f"keeper message header of {length} bytes refused")
    raw = bytearray(length)
    _recv_exact(sock, memoryview(raw))
    header: dict[str, Any] = json.loads(raw)
    return header


def recv_payload(sock: socket.socket, header: dict[str, Any], out: memoryview | None = None) -> memoryview:
    """The payload ``header`` announces, into ``out`` (or a new buffer), crc-checked when it has one."""
    n = int(header.get("n", 0))
    buf = out if out is not None else memoryview(bytearray(n))
    if len(buf) != n:
        raise StorageError(f"keeper sent {n} bytes where {len(buf)} were asked for")
    _recv_exact(sock, buf)
    _check(header, buf)
    return buf


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` payload bytes (a refused ``put``: its sender then reads the refusal)."""
    buf = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        _recv_exact(sock, buf[:min(n, len(buf))])
        n -= len(buf)


@contextlib.contextmanager
def _new_file(root: str, path: str, flags: int) -> Iterator[int]:
    """The descriptor of a new file ``root/path`` (mode 0600, its directories
    0700) written under a temporary name: renamed into place when the block
    ends, removed if it raises."""
    full = os.path.join(root, safe_path(path))
    os.makedirs(os.path.dirname(full), mode=0o700, exist_ok=True)
    tmp = f"{full}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(tmp, flags | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, full)


def recv_file(sock: socket.socket, header: dict[str, Any], root: str, path: str) -> int:
    """(a keeper, for a ``put``) The payload ``header`` announces, received
    straight into a mapping of the new file ``root/path`` (mode 0600, through
    a temporary name and a rename), crc-checked there; returns its size."""
    n = int(header.get("n", 0))
    with _new_file(root, path, os.O_RDWR) as fd:
        if n:
            try:  # a full /dev/shm refuses the put (its sender reads why), never a SIGBUS here
                reserve(fd, n, os.path.join(root, path))
            except StorageError:
                discard(sock, n)
                raise
            with mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
                with memoryview(m) as view:
                    _recv_exact(sock, view)
                    _check(header, view)
    return n


def request(addr: Addr, header: dict[str, Any], payload: Sequence[Any] = (), *,
            out: memoryview | None = None, timeout: float = 60.0,
            connect_timeout: float = 2.0) -> tuple[dict[str, Any], memoryview]:
    """One request to the keeper at ``addr``: its answer header and payload.

    Raises :class:`KeeperUnreachable` when nobody answers, and
    :class:`StorageError` carrying the keeper's error when it refuses."""
    try:
        sock = socket.create_connection(addr, timeout=connect_timeout)
    except OSError as e:
        raise KeeperNotListening(f"no keeper at {addr[0]}:{addr[1]} ({e})") from None
    with sock:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            send(sock, header, payload)
            answer = recv(sock)
            if not answer.get("ok"):
                if answer.get("kind") == "exists":
                    raise CheckpointExistsError(str(answer.get("error")))
                raise StorageError(f"keeper {addr[0]}:{addr[1]}: {answer.get('error', 'refused')}")
            n = int(answer.get("n", 0))
            data = recv_payload(sock, answer, out[:n] if out is not None and n else None)
        except (TimeoutError, ConnectionError) as e:
            raise KeeperUnreachable(f"keeper {addr[0]}:{addr[1]} stopped answering ({e})") from None
    return answer, data


def safe_path(path: str) -> str:
    """A relative ``/`` path with no ``..`` or empty parts (refuses escapes from the keeper's root)."""
    parts = [p for p in path.strip("/").split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts) or not parts:
        raise StorageError(f"keeper path {path!r} refused: it must be relative and stay below the root")
    return "/".join(parts)


def write_atomic(root: str, path: str, buffers: Sequence[Any]) -> int:
    """Write ``root/path`` (mode 0600) through a temporary name and a rename; returns its size."""
    n = 0
    with _new_file(root, path, os.O_WRONLY) as fd:
        for b in buffers:
            v = memoryview(b).cast("B")
            while v:
                k = os.write(fd, v)
                n += k
                v = v[k:]
    return n


def read_file_into(full: str, offset: int, out: memoryview) -> int:
    """Read ``len(out)`` bytes of the file ``full`` from ``offset``; returns how many were there."""
    fd = os.open(full, os.O_RDONLY)
    try:
        got = 0
        while got < len(out):
            k = os.preadv(fd, [out[got:]], offset + got)
            if not k:
                break
            got += k
        return got
    finally:
        os.close(fd)


def reserve(fd: int, nbytes: int, path: str) -> None:
    """Give the file ``fd`` its ``nbytes`` of memory now (tmpfs pages exist
    before the first touch), so a full ``/dev/shm`` is an error here, never a
    SIGBUS in the process writing through a mapping later."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.ftruncate(fd, nbytes)  # a filesystem without fallocate: sparse, as before
            return
        raise StorageError(f"{path}: cannot reserve {nbytes} bytes of shared memory ({e.strerror}): /dev/shm is "
                           "full or smaller than the memory tier needs; give it more room (or the container a "
                           "larger --shm-size) or set the keeper's --budget-bytes below its size") from None
    except AttributeError:  # no posix_fallocate on this platform
        os.ftruncate(fd, nbytes)
