"""Leases of saves in flight, and the files of saves that never committed.

A save's coordinator holds a **lease** while the save runs: the small file
``leases/<save_id>.json`` beside the checkpoint's data, rewritten every
quarter of its term with a new expiry time (``{"save_id", "renewed",
"expires"}``). It is taken when the save is named (plan), given up (the
file removed) when the save commits or fails. A save killed before that
leaves a lease that expires.

The files of a save (``data/<save_id>/``, ``index/<save_id>/``, its lease,
the doom marker ``doomed/<save_id>.json`` of an overwrite)
that is not the committed one are **orphans** when its lease has expired,
or when it has none and started more than one lease term ago (save ids
begin with their UTC start time). Orphans are removed by the next
successful save to the same URL (its coordinator, just after the commit:
:func:`sweep`) and by ``bytecp gc`` (:mod:`bytecp.tools.gc`). A save whose
lease is live, or that started less than a term ago, is never touched:
neither this job's nor another's.

The term is ``BYTECP_LEASE_SECONDS`` (default 60 s). Each lease carries its
own expiry, so readers need no setting; hosts' clocks are assumed to agree
within a quarter of the term. A lease also names its process (``host``:
host name, boot id and pid namespace; ``pid``): a reader on that same host
whose process is gone knows the save is dead at once.

A save that references other checkpoints (format version 3) commits only
while its lease has never lapsed (:meth:`Lease.check_held`): a retention
takes a pin whose save's lease expired for a dead save's
(:mod:`bytecp.saving.pins`), so that save must not commit afterwards.
"""

from __future__ import annotations

import calendar
import functools
import json
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from bytecp.format.references import DOOM_DIR
from bytecp.storage_api import Storage

__all__ = ["give_up_at", "LEASE_DIR", "Lease", "take", "give_up", "holding", "release", "lease_seconds",
           "may_be_running", "process_gone", "pid_running", "this_host", "SaveFiles", "saves_at", "orphans", "sweep"]

log = logging.getLogger("bytecp")

LEASE_DIR = "leases"
DEFAULT_LEASE_SECONDS = 60.0


def lease_seconds() -> float:
    """The lease term (``BYTECP_LEASE_SECONDS``, default 60 s)."""
    try:
        return max(0.05, float(os.environ.get("BYTECP_LEASE_SECONDS", DEFAULT_LEASE_SECONDS)))
    except ValueError:
        return DEFAULT_LEASE_SECONDS


def _lease_file(save_id: str) -> str:
    return f"{LEASE_DIR}/{save_id}.json"


@functools.cache
def this_host() -> str | None:
    """This host and pid namespace (host name, boot id, namespace inode):
    processes that show the same string see each other's pids. None where
    that cannot be told (no /proc): no pid is then ever taken for gone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{pidns}"


def process_gone(host: object, pid: object) -> bool:
    """Whether the process ``pid`` of ``host`` (as :func:`this_host` wrote
    it) provably no longer runs: only on this very host; a pid in use again
    counts as running."""
    if host is None or host != this_host() or not isinstance(pid, int) or pid <= 0:
        return False
    return not pid_running(pid)


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


_live: set[Lease] = set()
_live_lock = threading.Lock()


def _stop_all() -> None:
    """(interpreter exit, after the in-flight save's thread has ended) No
    renewing thread outlives the interpreter (see :mod:`bytecp.saving.handles`)."""
    with _live_lock:
        live = list(_live)
    for lease in live:
        lease.stop()


getattr(threading, "_register_atexit", lambda fn: None)(_stop_all)


class Lease:
    """(the save's coordinator) The lease of one save: :meth:`start` once the
    save is named, :meth:`stop` when it commits or fails. A thread of its own
    renews it; it never raises into the save (a lease it cannot write only
    weakens the protection, and is logged) -- except :meth:`check_held`,
    which a save that references other checkpoints calls before its commit."""

    def __init__(self, storage: Storage, save_id: str, seconds: float | None = None) -> None:
        self.storage, self.save_id = storage, save_id
        self.seconds = seconds or lease_seconds()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._on_stop: list[Callable[[], None]] = []
        self._until: float | None = None  # the expiry of the last write that reached storage
        self._lapsed = False  # a write reached storage later than a quarter term before the last expiry

    def _write(self) -> None:
        now = time.time()
        body = {"save_id": self.save_id, "renewed": now, "expires": now + self.seconds,
                "host": this_host(), "pid": os.getpid()}
        try:
            self.storage.write_file(_lease_file(self.save_id), [json.dumps(body).encode()])
        except Exception as e:  # noqa: BLE001 - the save goes on; only the protection is weaker
            log.warning("bytecp: could not write the lease of save %s at %s: %s", self.save_id, self.storage.url, e)
            return
        done = time.time()
        with self._lock:
            if self._until is not None and done >= self._until - self.seconds / 4:
                self._lapsed = True
            self._until = now + self.seconds

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the lease ends (commit, failure or exit), before its file goes."""
        self._on_stop.append(fn)

    def check_held(self) -> None:
        """(the save's coordinator, right before committing a checkpoint that
        references others) Raise :class:`CorruptCheckpointError` unless the
        lease reached storage and more than half its term is left: otherwise
        a retention may have taken this save for dead and removed a checkpoint
        it references. (Hosts' clocks agree within a quarter term and the
        commit takes less than a quarter term: together less than the half
        checked here.)"""
        now = time.time()
        with self._lock:
            until, lapsed = self._until, self._lapsed
        if self._stop.is_set() or until is None or lapsed or now >= until - self.seconds / 2:
            from bytecp.errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"{self.storage.url}: the lease of save {self.save_id} was not renewed in time (storage too slow "
                f"or the process stalled; term {self.seconds:g} s, BYTECP_LEASE_SECONDS), so a retention or gc "
                "may have taken it for a dead save and removed a checkpoint it references; it is not committed "
                "-- save again"
            )

    def start(self) -> Lease:
        self._write()
        self._thread = threading.Thread(target=self._renew, name="bytecp-lease", daemon=True)
        self._thread.start()
        with _live_lock:
            _live.add(self)
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            self._write()

    def stop(self) -> None:
        """End the lease: stop renewing and remove the file (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with _live_lock:
            _live.discard(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for fn in self._on_stop:  # what the save holds while its lease does (an overwrite's doom marker)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - left behind, it goes as an orphan of this save
                log.warning("bytecp: at the end of save %s at %s: %s", self.save_id, self.storage.url, e)
        try:
            self.storage.delete([_lease_file(self.save_id)])
        except Exception as e:  # noqa: BLE001 - an expired lease protects nothing
            log.debug("bytecp: could not remove the lease of save %s: %s", self.save_id, e)



def take(storage: Storage, save_id: str) -> Lease:
    """(the coordinator, once it has named the save) Start the save's lease."""
    return Lease(storage, save_id).start()


def _stop_where(held: Callable[[Lease], bool]) -> None:
    """End every lease this process holds for which ``held`` is true."""
    with _live_lock:
        mine = [lease for lease in _live if held(lease)]
    for lease in mine:
        lease.stop()


def holding(save_id: str) -> Lease | None:
    """(the save's coordinator) The lease this process holds for ``save_id``, if any."""
    with _live_lock:
        return next((lease for lease in _live if lease.save_id == save_id), None)


def give_up(save_id: str) -> None:
    """(the coordinator of a save that failed) End its lease, if it holds one."""
    _stop_where(lambda lease: lease.save_id == save_id)


def give_up_at(url: str) -> None:
    """(a save that failed, on its way out) End every lease this process
    still holds at ``url``: one save is in flight per process, so a lease
    left there after its save ended protects nothing (and would be renewed
    forever)."""
    _stop_where(lambda lease: lease.storage.url == url)


def release(storage: Storage, save_id: str) -> None:
    """(the coordinator, once the save has committed) End its lease and
    :func:`sweep` the files of earlier saves at this URL that never committed."""
    give_up(save_id)
    sweep(storage, save_id)


class SaveFiles:
    """The files one save left at a checkpoint URL, and whether it may still run."""

    def __init__(self, save_id: str) -> None:
        self.save_id = save_id
        self.files: list[str] = []
        self.expires: float | None = None  # from its lease, if it has one
        self.owner: tuple[object, object] = (None, None)  # its lease's (host, pid)

    def started(self) -> float | None:
        """Its UTC start time, read from the save id (None: not one of ours)."""
        try:
            return float(calendar.timegm(time.strptime(self.save_id.split("-", 1)[0], "%Y%m%dT%H%M%S")))
        except ValueError:
            return None

    def may_be_running(self, now: float) -> bool:
        if process_gone(*self.owner):
            return False
        if self.expires is not None:
            return now < self.expires
        started = self.started()
        return started is None or now < started + lease_seconds()


def may_be_running(storage: Storage, save_id: str, now: float | None = None) -> bool:
    """(retention, about a pin) Whether the save ``save_id`` to the checkpoint
    at ``storage`` may still run: its lease, else its start time."""
    entry = SaveFiles(save_id)
    if storage.exists(_lease_file(save_id)):
        entry.expires, entry.owner = _expiry(storage, _lease_file(save_id))
    return entry.may_be_running(time.time() if now is None else now)


def saves_at(storage: Storage, skip: str | None = None) -> dict[str, SaveFiles]:
    """(coordinator, ``bytecp gc``) Every save id with files at ``storage``:
    ``data/<id>/...``, ``index/<id>/...``, ``serving/<id>/...`` and its lease. The data and index
    files of the save ``skip`` (the committed one) are not listed: their
    folders are found by name (one listing request), so the sweep after
    each commit does not list the 2 x W files a W-rank save just wrote."""
    out: dict[str, SaveFiles] = defaultdict(lambda: SaveFiles(""))
    for top in ("data", "index", "serving", LEASE_DIR, DOOM_DIR):
        if top in ("data", "index", "serving"):
            paths = [p for sid in storage.list_children(top) if sid != skip
                     for p in storage.list_files(f"{top}/{sid}") if p.startswith(f"{top}/{sid}/")]
        else:
            paths = storage.list_files(top)
        for path in paths:
            parts = path.split("/")
            if top in (LEASE_DIR, DOOM_DIR):
                if len(parts) != 2 or not parts[1].endswith(".json"):
                    continue
                sid = parts[1][: -len(".json")]
                if top == DOOM_DIR and SaveFiles(sid).started() is None:
                    continue  # a retention's marker (its token is no save id): never a save's file
            elif len(parts) == 3:
                sid = parts[1]
            else:
                continue
            entry = out[sid]
            entry.save_id = sid
            entry.files.append(path)
            if top == LEASE_DIR:
                entry.expires, entry.owner = _expiry(storage, path)
    return dict(out)


def _expiry(storage: Storage, path: str) -> tuple[float, tuple[object, object]]:
    """A lease's expiry time and (host, pid); an unreadable lease counts as
    live for one term from now (it may be being rewritten)."""
    try:
        body = json.loads(storage.read_bytes(path))
        return float(body["expires"]), (body.get("host"), body.get("pid"))
    except Exception:  # noqa: BLE001
        return time.time() + lease_seconds(), (None, None)


def orphans(storage: Storage, committed_id: str | None, now: float | None = None) -> tuple[list[str], list[str]]:
    """(files of saves that never committed and cannot be running, files of
    saves that may still be running) at ``storage``; the committed save's
    files (``committed_id``) are never listed, except a lease it left."""
    now = time.time() if now is None else now
    dead: list[str] = []
    running: list[str] = []
    for sid, entry in saves_at(storage, skip=committed_id).items():
        if sid == committed_id:
            dead += [f for f in entry.files if f.startswith((LEASE_DIR + "/", DOOM_DIR + "/"))]
        else:
            (running if entry.may_be_running(now) else dead).extend(entry.files)
    return sorted(dead), sorted(running)


def sweep(storage: Storage, committed_id: str) -> list[str]:
    """(coordinator, just after a commit) Remove the orphans at this URL;
    returns them. Never raises: they are only garbage."""
    try:
        dead, _ = orphans(storage, committed_id)
        if dead:
            storage.delete(dead)
            log.info("bytecp: removed %d file(s) of saves to %s that never committed", len(dead), storage.url)
        return dead
    except Exception as e:  # noqa: BLE001
        log.warning("bytecp: could not remove files of earlier failed saves at %s: %s", storage.url, e)
        return []
