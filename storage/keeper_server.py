"""The keeper: one process per host holding a job's memory checkpoints.

Started by ``python -m bytecp.storage.keeper_server`` (or ``bytecp keeper``)
before the training processes, and outliving them across restarts. It owns
a directory in ``/dev/shm`` (shared memory; mode 0700, files 0600) where the
host's ranks write their checkpoint files through the ``keeper://`` backend
(:mod:`bytecp.storage.keeper`), and answers on a TCP port, for requests
carrying the job's token:

``replicate``  (a rank's writer thread, after writing a file into the shared
               memory) push the file to the next ``replicas - 1`` keepers,
               crc32-checked, before the write counts as done;
``put``        (a peer keeper, or a rank on another host) store a file;
``commit``     (the coordinator) publish ``metadata.json`` here and at every
               live peer: only after every file of the checkpoint has its
               copies, so a committed memory checkpoint has R copies of each;
``alloc`` / ``adopt`` (a rank's stager, then its writer thread) lend the
               rank a shared-memory arena to copy its boxes into, then take
               it over as a data file, checksummed and replicated here
               (:mod:`bytecp.storage._keeper_arenas`: the rank copies each
               byte once and never checksums or writes it);
``get`` / ``sizes`` / ``delete`` (ranks and peers) read, list and delete
               (deleted data files go to the arenas' free pool);
``drain``      (the coordinator, every ``every_n_steps``) copy a committed
               memory checkpoint to a storage URL in the background, from
               this keeper or its peers, ``metadata.json`` last (the normal
               commit), never from the training processes;
``stats``      memory held, replication and drain lag (``bytecp.monitoring``).

Memory is bounded by ``budget_bytes``: free arenas are dropped first, then
older committed memory checkpoints of a run are evicted (never the newest
committed one) -- at every keeper, ``metadata.json`` first, so no keeper
keeps a part of an evicted checkpoint listed; a checkpoint that cannot fit
is refused with an error naming the budget.
"""

from __future__ import annotations

import argparse
import array
import logging
import os
import resource
import shutil
import signal
import socket
import socketserver
import tempfile
import threading
import time
from typing import Any

from bytecp.errors import CheckpointExistsError, StorageError

from ._errors import exists
from ._keeper_arenas import ARENA_DIR, Arenas
from ._keeper_budget import METADATA, Budget
from ._keeper_drain import drain
from ._keeper_wire import (
    Addr,
    FileRange,
    KeeperUnreachable,
    discard,
    parse_keepers,
    recv,
    recv_file,
    recv_payload,
    request,
    safe_path,
    send,
    token_ok,
    write_atomic,
)

__all__ = ["Keeper", "main"]

log = logging.getLogger("bytecp.storage.keeper")
_CHUNK = 64 << 20


class Keeper(Budget):
    """A host's keeper: its shared-memory root, its peers and its server."""

    def __init__(self, name: str, port: int, token: str, peers: dict[str, Addr], *, replicas: int = 2,
                 budget_bytes: int | None = None, root: str | None = None, host: str = "127.0.0.1",
                 domains: dict[str, str] | None = None, arena_timeout_s: float = 600.0) -> None:
        if replicas < 1:
            raise StorageError(f"keeper {name}: replicas must be >= 1, got {replicas}")
        self.name, self.token, self.replicas, self.budget = name, token, replicas, budget_bytes
        self.peers = {k: v for k, v in peers.items() if k != name}
        #: host -> failure domain (rack, switch); copies go to other domains first
        self.domains = dict(domains or {})
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.root = root or tempfile.mkdtemp(prefix=f"bytecp-keeper-{name}-", dir=base)
        os.chmod(self.root, 0o700)
        self.arenas = Arenas(self.root, timeout_s=arena_timeout_s)
        self._lock = threading.Lock()
        #: checkpoint prefix -> (first push started, last push ended), the newest few
        self.replication: dict[str, tuple[float, float]] = {}
        self.drains: dict[str, dict[str, Any]] = {}
        #: counters (stats): bytes of data files the ranks wrote here (not adopted arenas), of copies received
        self.written_bytes = self.received_bytes = 0
        keeper = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                # a reply is a header then its payload, two sends: with Nagle's algorithm on,
                # a small payload waits on the header's ACK (a 1 KB get: 1.00 -> 0.73 ms here)
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keeper._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((host, port), Handler)
        self.port = self.server.server_address[1]

    # -- serving -----------------------------------------------------------
    def serve_forever(self) -> None:
        self._serving = True
        self.server.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        if getattr(self, "_serving", False):  # shutdown() waits for a serve_forever loop
            self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _serve(self, sock: Any) -> None:
        try:
            header = recv(sock)
            if not token_ok(header.get("token"), self.token):
                send(sock, {"ok": False, "error": f"keeper {self.name}: wrong job token (another job's keeper?)"})
                return
            op = getattr(self, "op_" + str(header.get("op")), None)
            if op is None:
                send(sock, {"ok": False, "error": f"keeper {self.name}: unknown op {header.get('op')!r}"})
                return
            if header.get("n") and header.get("op") in ("put", "replicate"):
                self._receive(sock, header)  # into the file's mapping; the op finds it there
                payload = memoryview(b"")
            else:
                payload = recv_payload(sock, header) if header.get("n") else memoryview(b"")
            answer, data = op(header, payload)
            send(sock, dict(answer, ok=True), data)
        except (StorageError, OSError, ValueError) as e:
            kind = "exists" if isinstance(e, CheckpointExistsError) else "error"
            try:
                send(sock, {"ok": False, "kind": kind, "error": f"keeper {self.name}: {e}"})
            except OSError:
                pass

    # -- files -------------------------------------------------------------
    def _sizes(self, prefix: str) -> dict[str, int]:
        base = os.path.join(self.root, safe_path(prefix)) if prefix.strip("/") else self.root
        out: dict[str, int] = {}
        if os.path.isfile(base):
            return {prefix.strip("/"): os.path.getsize(base)}
        for d, dirs, files in os.walk(base):
            if d == self.root and ARENA_DIR in dirs:
                dirs.remove(ARENA_DIR)  # lent and free arenas are no checkpoint's files
            for f in files:
                if ".tmp-" not in f:
                    full = os.path.join(d, f)
                    out[os.path.relpath(full, self.root).replace(os.sep, "/")] = os.path.getsize(full)
        return out

    def _ring(self) -> list[tuple[str, Addr]]:
        """Where copies go, in order: the peers after this keeper in name
        order, those of another failure domain (``domains``) before those of
        this one."""
        names = sorted([*self.peers, self.name])
        i = names.index(self.name)
        mine = self.domains.get(self.name, self.name)
        ring = names[i + 1:] + names[:i]
        ring.sort(key=lambda n: self.domains.get(n, n) == mine)  # stable: ring order within each
        return [(n, self.peers[n]) for n in ring]

    def _receive(self, sock: Any, h: dict[str, Any]) -> None:
        """(``put``, a ``replicate`` carrying bytes) Make room, then receive the file into its mapping."""
        n = int(h["n"])
        try:
            with self._lock:
                self._room_for(h["path"], n)
                self._pending += n  # held from here, though the file is not complete yet
        except StorageError:
            discard(sock, n)
            raise
        try:
            recv_file(sock, h, self.root, h["path"])
        finally:
            with self._lock:
                self._pending -= n

    # -- ops ---------------------------------------------------------------
    def op_put(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        """(a peer keeper, or a rank on a host without one) Store a file: received by
        :meth:`_receive` already, unless it is empty."""
        with self._lock:
            if not h.get("n"):
                write_atomic(self.root, h["path"], [])
            self.received_bytes += int(h.get("n", 0))
        self._committed_here(safe_path(h["path"]))  # a peer's commit publishing metadata.json here
        return {}, []

    def op_replicate(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        path = safe_path(h["path"])
        full = self._full(path)  # (a rank on a host without a keeper sent the bytes: received already)
        with self._lock:
            try:
                self._room_for(path, 0)
            except StorageError:
                os.unlink(full)
                raise
            self.written_bytes += os.path.getsize(full)
        return self._replicated(path, str(h.get("ckpt") or os.path.dirname(path))), []

    def _replicated(self, path: str, ckpt: str) -> dict[str, Any]:
        """Push ``path`` (in this keeper's memory) to ``replicas - 1`` peers, or raise."""
        t0 = time.time()
        copies = 1 + self._push(path, self._full(path), self.replicas - 1)
        with self._lock:  # the span from its first file's push to its last one's end
            first = self.replication.pop(ckpt, (t0, t0))[0]
            self.replication[ckpt] = (min(first, t0), time.time())
            while len(self.replication) > 16:
                self.replication.pop(next(iter(self.replication)))
        if copies < self.replicas:
            raise StorageError(f"{path} has {copies} of {self.replicas} copies: fewer live peer keepers "
                               f"than replicas - 1 ({sorted(self.peers)}); start them or lower replicas")
        return {"copies": copies}

    def op_alloc(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        """(a rank's stager) Lend it an arena of ``nbytes``; ``free``: arenas it dropped unadopted."""
        nbytes = int(h["nbytes"])
        self.arenas.release(h.get("free") or [])
        if not self.arenas.fitting(nbytes):
            with self._lock:
                self._room_for(ARENA_DIR + "/x", nbytes)
        name, path, size = self.arenas.lend(nbytes, h.get("pid"))
        return {"arena": name, "file": path, "size": size}, []

    def op_prepare(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        """(a rank's prewarm) Have ``count`` free arenas of ``nbytes`` ready for it; answers their files."""
        nbytes, count = int(h["nbytes"]), int(h.get("count", 1))
        with self._lock:
            self._room_for(ARENA_DIR + "/x", nbytes * count)
        return {"files": self.arenas.prepare(nbytes, count, h.get("pid"))}, []

    def op_adopt(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        """(a rank's writer thread) Arena ``arena`` becomes data file ``path`` (its first ``size``
        bytes); answers the crc32c of each of ``ranges`` (and its block checksums, hex), where each
        starts in the file and its size, once the file has its copies."""
        path = safe_path(h["path"])
        spans = array.array("Q", bytes(payload)).tolist()  # (offset, nbytes) pairs
        ckpt = str(h.get("ckpt") or os.path.dirname(path))
        crcs, starts, size = self.arenas.adopt(str(h["arena"]), self._full(path), int(h["size"]),
                                               list(zip(spans[::2], spans[1::2], strict=True)), ckpt)
        answer = self._replicated(path, ckpt)
        return dict(answer, crcs=[x.crc for x in crcs], blocks=[x.blocks.hex() for x in crcs], starts=starts,
                    size=size), []

    def _push(self, path: str, full: str, want: int, *, to: list[tuple[str, Addr]] | None = None) -> int:
        """Send the file to ``want`` peers (the ring's next live ones); returns how many took it."""
        if want <= 0:
            return 0
        data = FileRange(full, 0, os.path.getsize(full))  # sent with sendfile, from the shared memory
        done = 0
        for name, addr in to if to is not None else self._ring():
            try:
                request(addr, {"op": "put", "token": self.token, "path": path}, [data])
                done += 1
            except KeeperUnreachable:
                log.warning("keeper %s: peer %s unreachable while replicating %s", self.name, name, path)
            if done >= want:
                break
        return done

    def op_commit(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        path = safe_path(h["path"])
        with self._lock:
            full = self._full(path)
            if h.get("exclusive") and os.path.exists(full):
                with open(full, "rb") as f:
                    if f.read() != payload:  # the same bytes: a retried commit that landed
                        raise exists(f"keeper://{path}")
            write_atomic(self.root, path, [payload])
        self._committed_here(path)
        copies = 1 + self._push(path, self._full(path), len(self.peers), to=list(self.peers.items()))
        if copies < self.replicas:
            raise StorageError(f"{path}: the commit reached {copies} of {self.replicas} keepers; start the "
                               f"missing peers or lower replicas")
        return {"copies": copies}, []

    def op_get(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        full = self._full(h["path"])
        if not os.path.isfile(full):
            return {"missing": True}, []
        size = os.path.getsize(full)
        offset = int(h.get("offset", 0))
        n = size - offset if h.get("nbytes") is None else int(h["nbytes"])
        return {"size": size}, [FileRange(full, offset, max(0, min(n, size - offset)))]

    def op_getv(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        """Several ranges of one file in one answer, concatenated (a load's reads of one file)."""
        full = self._full(h["path"])
        if not os.path.isfile(full):
            return {"missing": True}, []
        size = os.path.getsize(full)
        ranges = [(int(o), int(n)) for o, n in h["ranges"]]
        if any(o + n > size for o, n in ranges):
            return {"short": True, "size": size}, []
        return {"size": size}, [FileRange(full, o, n) for o, n in ranges]

    def op_sizes(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        return {"sizes": self._sizes(h.get("prefix", ""))}, []

    def op_delete(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        for p in h.get("paths", []):
            full = self._full(p)
            if os.path.isdir(full):
                for d, _, files in os.walk(full):  # data files go to the arenas' free pool
                    for f in files:
                        if f != METADATA:
                            self.arenas.recycle(os.path.join(d, f))
                shutil.rmtree(full, ignore_errors=True)
            elif os.path.exists(full) and not self.arenas.recycle(full):
                os.unlink(full)
        return {}, []

    def op_hello(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        return {"name": self.name, "root": self.root, "pid": os.getpid(), "replicas": self.replicas}, []

    def op_stats(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        now = time.time()
        lag = max((now - d["since"] for d in self.drains.values() if d["state"] == "running"), default=0.0)
        return {"name": self.name, "held_bytes": self.held_bytes(), "budget_bytes": self.budget,
                "replication_s": {k: b - a for k, (a, b) in self.replication.items()}, "drain_lag_s": lag, "drains": self.drains,
                "checkpoints": self._committed(), "arenas": self.arenas.stats(),
                "written_bytes": self.written_bytes, "received_bytes": self.received_bytes,
                "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2])}, []  # user + system, every thread

    def _committed(self) -> list[str]:
        return sorted(os.path.relpath(d, self.root).replace(os.sep, "/")
                      for d, _, files in os.walk(self.root) if METADATA in files and ARENA_DIR not in d)

    def op_drain(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], list[Any]]:
        src, url = safe_path(h["path"]), str(h["url"])
        self.drains[url] = {"state": "running", "since": time.time(), "src": src}
        threading.Thread(target=drain, args=(self, src, url, h.get("storage_options") or {}),
                         name="bytecp-keeper-drain", daemon=True).start()
        return {}, []


def main(argv: list[str] | None = None) -> None:
    """``python -m bytecp.storage.keeper_server --name h0 --port 7001 --keepers h0=...,h1=...``;
    the token comes from ``BYTECP_KEEPER_TOKEN`` (never the command line)."""
    ap = argparse.ArgumentParser(prog="bytecp keeper", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="this host's name in --keepers")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--keepers", default=os.environ.get("BYTECP_KEEPERS", ""), help="name=host:port,...")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--domains", default="", help="host=domain,... (copies go to other failure domains first)")
    ap.add_argument("--budget-bytes", type=int, default=None)
    ap.add_argument("--arena-timeout-s", type=float, default=600.0,
                    help="staging arenas lent and not adopted this long are reclaimed")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    ap.add_argument("--metrics-addr", default="127.0.0.1", help="address of /metrics (0.0.0.0: scraped from other hosts)")
    ap.add_argument("--job", default="", help="the job label of the metrics")
    ap.add_argument("--ready-file", default=None, help="written with the port once serving")
    args = ap.parse_args(argv)
    token = os.environ.get("BYTECP_KEEPER_TOKEN")
    if not token:
        raise SystemExit("bytecp keeper: set BYTECP_KEEPER_TOKEN to the job's token")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    keeper = Keeper(args.name, args.port, token, parse_keepers(args.keepers), replicas=args.replicas,
                    budget_bytes=args.budget_bytes, arena_timeout_s=args.arena_timeout_s,
                    domains=dict(p.split("=", 1) for p in args.domains.split(",") if "=" in p))
    if args.metrics_port is not None:
        from bytecp.monitoring.keeper_metrics import serve_keeper_metrics

        serve_keeper_metrics(lambda: keeper.op_stats({}, memoryview(b""))[0], args.job, args.metrics_port,
                             addr=args.metrics_addr)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(f"{keeper.port}\n")
        os.rename(args.ready_file + ".tmp", args.ready_file)
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)  # a stopped keeper frees its shared memory
    try:
        keeper.serve_forever()
    finally:
        shutil.rmtree(keeper.root, ignore_errors=True)


if __name__ == "__main__":
    main()
