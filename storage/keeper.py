"""``keeper://`` backend: checkpoints in the host memory of the job's keepers.

``keeper://<run>/step-<N>`` names a checkpoint held by the keepers
(:mod:`bytecp.storage.keeper_server`, one per host). Which keepers, and
which one is this host's, come from ``storage_options`` (``keepers=``
``"h0=127.0.0.1:7001,h1=..."``, ``host="h0"``, ``token=...``) or the
environment (``BYTECP_KEEPERS``, ``BYTECP_KEEPER_HOST``,
``BYTECP_KEEPER_TOKEN``).

Who calls what, and when:

- (every rank's writer threads) ``write_file``: the bytes go straight into
  the local keeper's shared memory (a ``/dev/shm`` file, mode 0600), then the
  keeper pushes them to ``replicas - 1`` peers and answers: the write returns
  once the file has its copies. Serialization to storage and replication
  never run in the training process.
- (every rank's stager, then its writer thread; saves on a host with a
  keeper) ``staging_arena`` / ``adopt``: the keeper lends a shared-memory
  file, the rank maps it and copies its boxes into it (the only copy the
  training process makes), then the keeper takes the file over as the data
  file, computes the chunks' crc32c and replicates it
  (:mod:`bytecp.storage._keeper_arenas`). ``prepare_staging`` (prewarm)
  has one ready.
- (coordinator) ``commit``: the local keeper publishes ``metadata.json`` at
  every live keeper; a memory checkpoint exists once committed.
- (every rank's reader threads) reads: the local shared memory first, then
  each peer keeper over TCP (a host replaced since the save holds nothing;
  its peers do). Listings are the union over every live keeper.
- (the manager's coordinator) :meth:`drain_to`: the local keeper copies a
  committed memory checkpoint to storage in the background.

Every request carries the job's token; another job's keepers refuse it.
"""

from __future__ import annotations

import array
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bytecp.errors import StorageError
from bytecp.format.checksum import Sums, writer_block_bytes
from bytecp.storage_api import Buffer, SharedArena, Storage, join, split_protocol

from ._errors import file_url, missing, truncated
from ._keeper_maps import MAPPINGS, pin
from ._keeper_wire import (
    Addr,
    KeeperNotListening,
    KeeperUnreachable,
    parse_keepers,
    read_file_into,
    request,
    safe_path,
    write_atomic,
)

__all__ = ["KeeperStorage"]

#: this process's arenas lent and not yet adopted (name -> the arena, weakly):
#: those dropped unadopted (a failed save) are named at the next ``alloc``
_LENT: dict[str, weakref.ref[SharedArena]] = {}
_LENT_LOCK = threading.Lock()


def _dropped() -> list[str]:
    with _LENT_LOCK:
        gone = [n for n, ref in _LENT.items() if ref() is None]
        for n in gone:
            del _LENT[n]
    return gone


class KeeperStorage(Storage):
    """One checkpoint directory (or a run's prefix) in the keepers' memory."""

    remote = False  # reads are mostly this host's shared memory
    drains = True  # its keeper copies committed checkpoints to storage (drain_to)
    exclusive_commit = "check-then-publish"  # the local keeper checks, then publishes at every peer

    def __init__(self, url: str, *, keepers: str | dict[str, Any] | None = None, host: str | None = None,
                 token: str | None = None, autostart: bool | None = None, replicas: int = 2,
                 budget_bytes: int | None = None, single_copy: bool = True, **_: Any) -> None:
        proto, rest = split_protocol(url)
        self.url = url
        self.prefix = rest.strip("/")
        spec = keepers if keepers is not None else os.environ.get("BYTECP_KEEPERS", "")
        self.keepers = parse_keepers(spec) if isinstance(spec, (str, dict)) else dict(spec)
        self.host = host or os.environ.get("BYTECP_KEEPER_HOST", "")
        self.token = token or os.environ.get("BYTECP_KEEPER_TOKEN", "")
        if not self.keepers or self.host not in self.keepers or not self.token:
            raise StorageError(
                f"{url}: keeper:// needs the job's keepers, this host's name among them and the job's token "
                f"(storage_options keepers=/host=/token= or BYTECP_KEEPERS, BYTECP_KEEPER_HOST, "
                f"BYTECP_KEEPER_TOKEN); got keepers={sorted(self.keepers)} host={self.host!r}")
        #: start this host's keeper when none answers (``BYTECP_KEEPER_AUTOSTART=1``)
        self.autostart = autostart if autostart is not None else os.environ.get("BYTECP_KEEPER_AUTOSTART") == "1"
        self.replicas, self.budget_bytes = replicas, budget_bytes
        #: saves stage into arenas this host's keeper lends, which it adopts as data files
        #: (``single_copy=False``: they copy into private memory and write, as before)
        self.single_copy = bool(single_copy)
        self._opts = {"keepers": {k: f"{h}:{p}" for k, (h, p) in self.keepers.items()}, "host": self.host,
                      "token": self.token, "autostart": self.autostart, "replicas": replicas,
                      "budget_bytes": budget_bytes, "single_copy": self.single_copy}
        self._root: str | None = None  # the local keeper's shared-memory directory, once asked

    def options(self) -> dict[str, Any]:
        return dict(self._opts)

    # -- plumbing ------------------------------------------------------------
    def _key(self, path: str) -> str:
        return safe_path(join(self.prefix, path))

    def _ask(self, addr: Addr, header: dict[str, Any], payload: Sequence[Any] = (), **kw: Any) -> Any:
        return request(addr, dict(header, token=self.token), payload, **kw)

    def _ask_local(self, header: dict[str, Any], payload: Sequence[Any] = (), **kw: Any) -> Any:
        """A request to this host's keeper. Sent straight away (a ``hello``
        before each request cost a round trip: a quarter of a memory-tier
        save's requests); where nobody listens, :meth:`_keeper_or_error`
        says so clearly, or (autostart) starts one and the request goes again."""
        addr = self.keepers[self.host]
        try:
            return self._ask(addr, header, payload, **kw)
        except KeeperNotListening:
            self._keeper_or_error()
            return self._ask(addr, header, payload, **kw)

    def _local_root(self) -> str | None:
        """The local keeper's directory, when this process can write it (same host)."""
        if self._root is None:
            addr = self.keepers[self.host]
            try:
                if self.autostart:
                    self._keeper_or_error()
                answer, _ = self._ask(addr, {"op": "hello"})
            except KeeperUnreachable:
                return None  # no keeper here (yet): reads go to the peers
            root = str(answer["root"])
            self._root = root if os.access(root, os.W_OK) else ""
        return self._root or None

    def _order(self) -> list[Addr]:
        """This host's keeper first, then the others."""
        return [self.keepers[self.host]] + [a for n, a in sorted(self.keepers.items()) if n != self.host]

    # -- writing -------------------------------------------------------------
    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        key = self._key(path)
        root = self._local_root()
        if root is not None:
            write_atomic(root, key, buffers)
            self._ask_local({"op": "replicate", "path": key, "ckpt": self.prefix}, timeout=600)
        else:
            self._ask_local({"op": "replicate", "path": key, "ckpt": self.prefix}, list(buffers), timeout=600)

    @property
    def lends_arenas(self) -> bool:  # type: ignore[override]
        """Whether saves get arenas here: ``single_copy`` and a keeper on this host
        (a rank on a host without one writes over TCP, from the live tensors)."""
        return self.single_copy and self._local_root() is not None

    def staging_arena(self, nbytes: int) -> SharedArena | None:
        """An arena in this host's keeper's shared memory, mapped here (None: no keeper on this host)."""
        if not self.lends_arenas:
            return None
        answer, _ = self._ask_local({"op": "alloc", "nbytes": int(nbytes), "pid": os.getpid(),
                                          "free": _dropped()}, timeout=600)
        size = int(answer["size"])
        arena = SharedArena(MAPPINGS.map(str(answer["file"]), size), size, str(answer["arena"]))
        with _LENT_LOCK:
            _LENT[arena.name] = weakref.ref(arena)
        return arena

    def prepare_staging(self, nbytes: int, count: int = 1, pinned: bool = False) -> None:
        """(prewarm) The keeper readies ``count`` arenas for this process, which
        maps them now (``pinned``: and registers them for CUDA copies)."""
        if not self.lends_arenas:
            return
        answer, _ = self._ask_local({"op": "prepare", "nbytes": int(nbytes), "count": count,
                                          "pid": os.getpid()}, timeout=600)
        MAPPINGS.expect(int(nbytes), count)
        for path in answer["files"]:
            buf = MAPPINGS.map(str(path))
            if pinned and len(buf):
                pin(buf)

    def adopt(self, path: str, arena: SharedArena,
              ranges: Sequence[tuple[int, int]]) -> tuple[list[Sums], list[int], int]:
        """The keeper takes ``arena`` over as ``path`` (or copies ``ranges`` out of it, when they are
        less than half of it), checksums ``ranges`` and replicates the file."""
        spans = array.array("Q", [v for r in ranges for v in r])
        with _LENT_LOCK:
            _LENT.pop(arena.name, None)  # the keeper's now, adopted or refused
        answer, _ = self._ask_local({"op": "adopt", "arena": arena.name, "path": self._key(path),
                                          "size": arena.used, "ckpt": self.prefix}, [spans], timeout=600)
        blocks = answer.get("blocks")
        if blocks is None:  # a keeper started by an older bytecp: no block checksums
            if any(n > writer_block_bytes() for _, n in ranges):
                raise StorageError(f"{self.url}: this host's keeper sends no block checksums (an older bytecp "
                                   "started it); restart this host's `bytecp keeper` with this version")
            blocks = [""] * len(answer["crcs"])
        return ([Sums(int(c), bytes.fromhex(b)) for c, b in zip(answer["crcs"], blocks, strict=True)],
                [int(o) for o in answer["starts"]], int(answer["size"]))

    def _keeper_or_error(self) -> Addr:
        addr = self.keepers[self.host]
        try:
            self._ask(addr, {"op": "hello"})
        except KeeperUnreachable:
            if self.autostart:
                self._start_keeper(addr)
                return addr
            raise StorageError(
                f"{self.url}: this host's keeper ({self.host} at {addr[0]}:{addr[1]}) is not running: start "
                f"it with `bytecp keeper --name {self.host} --port {addr[1]}` before training") from None
        return addr

    def _start_keeper(self, addr: Addr) -> None:
        """(the first save on a host without a keeper) Start one, detached so it
        outlives this process; ranks of the host racing here start one each,
        and all but the one that binds the port exit at once."""
        cmd = [sys.executable, "-m", "bytecp.storage.keeper_server", "--name", self.host, "--port", str(addr[1]),
               "--keepers", ",".join(f"{k}={h}:{p}" for k, (h, p) in sorted(self.keepers.items())),
               "--replicas", str(self.replicas)]
        if self.budget_bytes is not None:
            cmd += ["--budget-bytes", str(self.budget_bytes)]
        subprocess.Popen(cmd, env=dict(os.environ, BYTECP_KEEPER_TOKEN=self.token), start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                self._ask(addr, {"op": "hello"})
                return
            except KeeperUnreachable:
                if time.monotonic() > deadline:
                    raise StorageError(f"{self.url}: started this host's keeper ({self.host}, port {addr[1]}) "
                                       f"but it did not answer within 60 s; run `bytecp keeper` by hand to see "
                                       f"why") from None
                time.sleep(0.1)

    def commit(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self._ask_local({"op": "commit", "path": self._key(path), "exclusive": exclusive}, [data], timeout=600)

    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._key(p) for p in paths]
        if keys:
            self._each({"op": "delete", "paths": keys})

    def delete_prefix(self, prefix: str = "") -> None:
        self._each({"op": "delete", "paths": [self._key(prefix) if prefix.strip("/") else safe_path(self.prefix)]})

    def _each(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``header`` to every live keeper; their answers."""
        out = []
        for addr in self._order():
            try:
                out.append(self._ask(addr, header)[0])
            except KeeperUnreachable:
                continue
        return out

    # -- reading -------------------------------------------------------------
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        key = self._key(path)
        root = self._local_root()
        if root is not None and os.path.isfile(os.path.join(root, key)):
            got = read_file_into(os.path.join(root, key), offset, out)
            if got < len(out):
                raise truncated(file_url(self.url, path), offset, len(out), offset + got)
            return
        for addr in self._order()[1:] if root is not None else self._order():
            try:
                answer, _ = self._ask(addr, {"op": "get", "path": key, "offset": offset, "nbytes": len(out)},
                                      out=out.cast("B"))
            except KeeperUnreachable:
                continue
            if answer.get("missing"):
                continue
            if answer["n"] < len(out):
                raise truncated(file_url(self.url, path), offset, len(out), answer["size"])
            return
        raise missing(file_url(self.url, path), "in no live keeper")

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]],
                    each: Callable[[int], None] | None = None) -> None:
        """Local shared memory: one read per range; a peer: every range in one request."""
        self._read_ranges_all(path, ranges)
        self.each_after(len(ranges), each)  # (``reads_each`` False: once every range is in)

    def _read_ranges_all(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        key = self._key(path)
        root = self._local_root()
        if (root is not None and os.path.isfile(os.path.join(root, key))) or len(ranges) < 2:
            for offset, out in ranges:
                self.read_into(path, offset, out)
            return
        spans = [[off, len(out)] for off, out in ranges]
        for addr in self._order()[1:] if root is not None else self._order():
            try:
                answer, data = self._ask(addr, {"op": "getv", "path": key, "ranges": spans})
            except KeeperUnreachable:
                continue
            if answer.get("missing"):
                continue
            if answer.get("short"):
                off, n = max(spans, key=lambda r: r[0] + r[1])
                raise truncated(file_url(self.url, path), off, n, answer["size"])
            pos = 0
            for _, out in ranges:
                view = out.cast("B")
                view[:] = data[pos:pos + len(view)]
                pos += len(view)
            return
        raise missing(file_url(self.url, path), "in no live keeper")

    def file_sizes(self, prefix: str = "") -> dict[str, int]:
        """The union of every live keeper's files below ``prefix`` (paths relative to this root)."""
        base = self._key(prefix) if prefix.strip("/") else safe_path(self.prefix) if self.prefix else ""
        cut = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, int] = {}
        for answer in self._each({"op": "sizes", "prefix": base}):
            for k, size in answer["sizes"].items():
                if self.prefix and not k.startswith(self.prefix + "/"):
                    continue  # the root itself, or a sibling sharing its name's start (run vs run2)
                out.setdefault(k[cut:], size)
        return out

    def list_files(self, prefix: str = "") -> list[str]:
        return sorted(self.file_sizes(prefix))

    def size(self, path: str) -> int:
        sizes = self.file_sizes(path)
        key = path.strip("/")
        if key not in sizes:
            raise missing(file_url(self.url, path), "in no live keeper")
        return sizes[key]

    def exists(self, path: str) -> bool:
        return path.strip("/") in self.file_sizes(path)

    # -- the memory tier -----------------------------------------------------
    def drain_to(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """(the manager's coordinator, after a memory commit) Have the local
        keeper copy this committed checkpoint to ``url`` in the background."""
        self._ask_local({"op": "drain", "path": safe_path(self.prefix), "url": url,
                         "storage_options": storage_options or {}})

    def keeper_stats(self) -> list[dict[str, Any]]:
        """Every live keeper's ``stats`` (memory held, replication and drain lag)."""
        return self._each({"op": "stats"})
