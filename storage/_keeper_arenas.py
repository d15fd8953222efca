"""The keeper's staging arenas: shared-memory files lent to the host's ranks.

The single-copy path of ``keeper://`` saves. Who calls what, and when:

- (a rank's stager, :meth:`bytecp.storage.keeper.KeeperStorage.staging_arena`)
  op ``alloc``: :meth:`Arenas.lend` hands out a file of at least ``nbytes``
  below ``<root>/.arenas`` (mode 0600), a ready one from the free pool when
  one fits, else a new one allocated now (``posix_fallocate``: its pages
  exist before the rank maps it). The rank maps it and copies its boxes
  into it: the only copy of the bytes the training process makes;
- (the rank's writer thread) op ``adopt``: :meth:`Arenas.adopt` computes
  the crc32c of every chunk (the writer's function, the same values), cuts
  the file to the data file's size and renames it into the checkpoint: the
  arena *is* the data file (same inode), laid out as the writer lays one
  out. The keeper then replicates it like a written file;
- (prewarm, op ``prepare``) :meth:`Arenas.prepare` readies a free one;
- an arena whose boxes were copied out (:meth:`Arenas.adopt`) waits, out
  of the pool, for its checkpoint's commit (its save may still read the
  staged boxes until then): :meth:`Arenas.committed` then pools it, to be
  lent back to its rank; one whose checkpoint never commits is unlinked
  after ``timeout_s``, and room for the budget drops these first;
- files the keeper deletes (retention's ``delete``) return to the free pool
  (:meth:`Arenas.recycle`, at most ``pool_max`` files, the oldest dropped
  first) instead of being unlinked; room for the budget drops free ones
  first (:meth:`Arenas.drop_free`). A rank is lent back, where one fits, a
  file it filled before: it still has it mapped, so its copy takes no page
  faults (a fresh mapping of 256 MiB costs about 60 ms);
- with ``BYTECP_DEBUG_BUFFERS=1`` (:mod:`bytecp.tree.buffers`) a file that
  enters the free pool is filled with the poison byte, and checked when it
  is lent again: a byte written meanwhile (a rank writing through a mapping
  it kept after its arena became a data file, or after it dropped it)
  fails the ``alloc`` naming the file;
- arenas never adopted come back: a rank names those it dropped at its next
  ``alloc`` (``free``); those of a process that died return to the pool;
  those lent longer than ``timeout_s`` ago are unlinked (a late writer then
  writes to pages no one else sees; its ``adopt`` fails naming the timeout).
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import threading
import time
from collections.abc import Sequence

from bytecp.errors import StorageError
from bytecp.format.checksum import Sums, sums, sums_of_ranges
from bytecp.saving.leases import pid_running
from bytecp.tree import buffers
from bytecp.tree.pools import KeptPool

from ._keeper_wire import reserve

__all__ = ["Arenas", "ARENA_DIR"]

#: the arenas' directory below the keeper's root (never listed as a checkpoint's)
ARENA_DIR = ".arenas"
#: files smaller than this are unlinked, not pooled
MIN_POOLED = 1 << 20


@dataclasses.dataclass
class _Lent:
    path: str
    nbytes: int
    pid: int | None  # None: the keeper cannot see the rank's process (another pid namespace)
    since: float


class Arenas:
    """The lent and free staging arenas of one keeper."""

    def __init__(self, root: str, *, timeout_s: float = 600.0, pool_max: int = 8) -> None:
        self.dir = os.path.join(root, ARENA_DIR)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.timeout_s, self.pool_max = timeout_s, pool_max
        #: arenas each process asked to have ready (prewarm): the pool holds at least their sum
        self.prepared: dict[int | None, int] = {}
        self._lock = threading.RLock()  # _unlink runs both under it and outside
        self._seq = itertools.count()
        self.lent: dict[str, _Lent] = {}
        self.free: list[tuple[int, str]] = []  # (size, path), oldest first
        #: checkpoint -> its copied-out arenas (since, path), pooled at its commit
        self.returning: dict[str, list[tuple[float, str]]] = {}
        #: inode -> the pid whose arena it was (free files are lent back to it first)
        self.filled_by: dict[int, int] = {}
        #: counters (stats, the ``bytecp_keeper_arena*`` metrics): arenas lent, adopted as
        #: data files, whose boxes were copied out, reclaimed unadopted; bytes lent and adopted
        self.lent_total = 0
        self.adopted = 0
        self.copied_out = 0
        self.reclaimed = 0
        self.lent_bytes = 0
        self.adopted_bytes = 0
        #: free files filled with the poison byte (debug mode), checked when lent again
        self.poisoned: set[str] = set()

    # -- lending -------------------------------------------------------------
    def _new(self, nbytes: int) -> str:
        path = os.path.join(self.dir, f"a-{os.getpid()}-{next(self._seq)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            reserve(fd, nbytes, path)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return path

    def _take_free(self, nbytes: int, pid: int | None = None) -> tuple[int, str] | None:
        """The smallest free arena of ``nbytes`` to twice that, out of the pool
        (one ``pid`` filled before first)."""
        fits = [f for f in self.free if nbytes <= f[0] <= 2 * nbytes + (1 << 20)]
        if not fits:
            return None
        best = min(fits, key=lambda f: (self.filled_by.get(_inode(f[1])) != pid, f[0] != nbytes, f[0]))
        self.free.remove(best)
        if best[1] in self.poisoned:
            self.poisoned.discard(best[1])
            _check_poison(best[1])
        return best

    def fitting(self, nbytes: int) -> bool:
        with self._lock:
            return any(nbytes <= f[0] <= 2 * nbytes + (1 << 20) for f in self.free)

    def lend(self, nbytes: int, pid: int | None, released: Sequence[str] = ()) -> tuple[str, str, int]:
        """-> (name, path, size) of an arena of at least ``nbytes`` lent to ``pid``."""
        self.release(released)
        self.reclaim()
        with self._lock:
            found = self._take_free(nbytes, pid)
        size, path = found if found is not None else (nbytes, self._new(nbytes))
        if pid is not None and not pid_running(pid):
            pid = None
        name = os.path.basename(path) + f"-{next(self._seq)}"
        with self._lock:
            self.lent[name] = _Lent(path, size, pid, time.monotonic())
            self.lent_total += 1
            self.lent_bytes += size
        return name, path, size

    def prepare(self, nbytes: int, count: int, pid: int | None) -> list[str]:
        """(prewarm) ``count`` free arenas of ``nbytes``, lent to ``pid`` first; -> their paths."""
        with self._lock:
            self.prepared[pid] = count
            for gone in [p for p in self.prepared if p is not None and not pid_running(p)]:
                del self.prepared[gone]
            have = [p for s, p in self.free if s == nbytes and self.filled_by.get(_inode(p)) in (pid, None)][:count]
        while len(have) < count:
            path = self._new(nbytes)
            with self._lock:
                self.free.append((nbytes, path))
            have.append(path)
        if pid is not None and pid_running(pid):
            inodes = [_inode(p) for p in have]
            with self._lock:
                for ino in inodes:
                    self.filled_by[ino] = pid
        return have

    # -- adopting ------------------------------------------------------------
    def adopt(self, name: str, dest: str, size: int, ranges: Sequence[tuple[int, int]],
              ckpt: str = "") -> tuple[list[Sums], list[int], int]:
        """Make arena ``name`` the file ``dest`` of ``size`` bytes; -> the checksums
        of each range (crc32c and block checksums), where each now starts, and the file's size.

        When the ranges take less than half the arena (a rank whose plan
        writes a few of the boxes it copied: replicas another rank writes),
        they are copied out here into a file of their own, page-aligned as
        the writer lays them out, and the arena goes back to the pool: the
        checkpoint never holds, nor replicates, the boxes it does not list."""
        with self._lock:
            lent = self.lent.pop(name, None)
        if lent is None:
            raise StorageError(f"staging arena {name} is not lent to a save here: it was reclaimed (not adopted "
                               f"within {self.timeout_s:.0f} s, or its process was seen gone); save again")
        try:
            if size > lent.nbytes or any(o < 0 or o + n > size for o, n in ranges):
                raise StorageError(f"staging arena {name}: {size} bytes or a chunk beyond its {lent.nbytes}")
            if sum(_page(n) for _, n in ranges) * 2 < size:
                crcs, starts, size = _copy_out(lent.path, dest, ranges)
                self._give_back(lent, ckpt)
                with self._lock:
                    self.copied_out += 1
                    self.adopted_bytes += size
                return crcs, starts, size
            crcs = _crcs(lent.path, ranges)
            if size < lent.nbytes:
                os.truncate(lent.path, size)
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            if lent.pid is not None:
                ino = os.stat(lent.path).st_ino
                with self._lock:
                    self.filled_by[ino] = lent.pid
                    while len(self.filled_by) > 256:  # inodes of files long gone
                        self.filled_by.pop(next(iter(self.filled_by)))
            os.rename(lent.path, dest)
        except BaseException:
            self._unlink(lent.path)
            raise
        with self._lock:
            self.adopted += 1
            self.adopted_bytes += size
        return crcs, [o for o, _ in ranges], size

    def _give_back(self, lent: _Lent, ckpt: str) -> None:
        """An arena whose boxes were copied out waits for ``ckpt``'s commit
        (its save may still read its copy of the state there until then)."""
        path = os.path.join(self.dir, f"r-{os.getpid()}-{next(self._seq)}")
        os.rename(lent.path, path)
        with self._lock:
            if lent.pid is not None:
                self.filled_by[os.stat(path).st_ino] = lent.pid  # lent back to its rank first
            self.returning.setdefault(ckpt.strip("/"), []).append((time.monotonic(), path))

    def committed(self, ckpt: str) -> None:
        """(the keeper, at ``ckpt``'s commit here) Its copied-out arenas go to the free pool."""
        with self._lock:
            waiting = self.returning.pop(ckpt.strip("/"), [])
        for _, path in waiting:
            if not self.recycle(path):
                self._unlink(path)

    # -- returning -----------------------------------------------------------
    def recycle(self, full: str) -> bool:
        """Pool the deleted file ``full`` (True), or leave it to be unlinked (False)."""
        try:
            size = os.path.getsize(full)
        except OSError:
            return False
        with self._lock:
            most = max(self.pool_max, sum(self.prepared.values()))  # every rank's rotation, prewarmed
            if size < MIN_POOLED or most < 1:
                return False
            while len(self.free) >= most:  # the oldest free one makes room
                self._unlink(self.free.pop(0)[1])
            path = os.path.join(self.dir, f"f-{os.getpid()}-{next(self._seq)}")
            os.rename(full, path)
            if buffers.debug():
                _poison(path)
                self.poisoned.add(path)
            self.free.append((size, path))
        return True

    def release(self, names: Sequence[str]) -> None:
        """(a rank's next ``alloc``) Arenas it dropped without adopting go back to the pool."""
        for name in names:
            with self._lock:
                lent = self.lent.pop(str(name), None)
            if lent is not None:
                self.reclaimed += 1
                if not self.recycle(lent.path):
                    self._unlink(lent.path)

    def reclaim(self) -> None:
        """Arenas of processes that died, and those lent too long ago, are unlinked."""
        now = time.monotonic()
        with self._lock:
            # a dead process's arena is unlinked, not pooled: were the pid misjudged (another pid
            # namespace), the process would go on writing an orphaned file, never one lent again
            stale = [n for n, v in self.lent.items()
                     if (v.pid is not None and not pid_running(v.pid)) or now - v.since > self.timeout_s]
        with self._lock:  # copied-out arenas of checkpoints that never committed
            late = [(c, p) for c, w in self.returning.items() for t, p in w if now - t > self.timeout_s]
            for c, p in late:
                self.returning[c] = [w for w in self.returning[c] if w[1] != p]
                if not self.returning[c]:
                    del self.returning[c]
        for _, p in late:
            self._unlink(p)
        for name in stale:
            with self._lock:
                lent = self.lent.pop(name, None)
            if lent is not None:
                self.reclaimed += 1
                self._unlink(lent.path)

    def drop_free(self) -> int:
        """Unlink one copied-out arena waiting for its commit, else the largest
        free one; -> its size (0: none was there)."""
        with self._lock:
            if self.returning:
                ckpt = next(iter(self.returning))
                _, path = self.returning[ckpt].pop(0)
                if not self.returning[ckpt]:
                    del self.returning[ckpt]
            elif self.free:
                path = max(self.free)[1]
                self.free = [f for f in self.free if f[1] != path]
            else:
                return 0
        size = _size(path)
        self._unlink(path)
        return size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"lent": len(self.lent), "free": len(self.free), "free_bytes": sum(s for s, _ in self.free),
                    "returning": sum(len(w) for w in self.returning.values()),
                    "lent_total": self.lent_total, "adopted": self.adopted, "copied_out": self.copied_out,
                    "reclaimed": self.reclaimed, "lent_bytes": self.lent_bytes,
                    "adopted_bytes": self.adopted_bytes}

    def _unlink(self, path: str) -> None:
        self.poisoned.discard(path)
        try:
            ino = os.stat(path).st_ino
            with self._lock:
                self.filled_by.pop(ino, None)
            os.unlink(path)
        except FileNotFoundError:
            pass


def _poison(path: str) -> None:
    """(debug mode) Fill a free arena's file with the poison byte."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), size) as m:
                buffers.poison(m)


def _check_poison(path: str) -> None:
    """(debug mode) A free arena about to be lent again still holds only the poison byte."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            at = buffers.poisoned(m)
    if at >= 0:
        raise buffers.UseAfterRelease(
            f"{path}: byte {at} of this free staging arena was written after it went back to the keeper's pool "
            "(a rank writing through a mapping it kept after its save, or after it dropped the arena)")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1


def _page(n: int) -> int:
    return -(-n // 4096) * 4096


def _copy_out(src: str, dest: str, ranges: Sequence[tuple[int, int]]) -> tuple[list[Sums], list[int], int]:
    """Write ``ranges`` of ``src`` into a new file ``dest``, each page-aligned
    (the gaps read as zeros); -> their checksums, their starts, the file's size."""
    starts, pos = [], 0
    for _, n in ranges:
        starts.append(pos)
        pos += _page(n)
    fd = os.open(src, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ) if ranges else None
    finally:
        os.close(fd)
    os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
    tmp = f"{dest}.tmp-{os.getpid()}-{threading.get_ident()}"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(m) if m is not None else memoryview(b"")
    try:
        crcs = sums_of_ranges(view, ranges, _SUMMING.get())
        os.ftruncate(out, pos)
        for (o, n), at in zip(ranges, starts, strict=True):
            with view[o:o + n] as piece:
                done = 0
                while done < n:
                    with piece[done:] as rest:
                        done += os.pwrite(out, rest, at + done)
    except BaseException:
        os.close(out)
        os.unlink(tmp)
        raise
    finally:
        view.release()
        if m is not None:
            m.close()
    os.close(out)
    os.rename(tmp, dest)
    return crcs, starts, pos


#: the keeper's pool that sums adopted arenas (one thread a core, at most 16), shared by every rank's
#: request: the sums of one save's files spread over the host's cores
_SUMMING = KeptPool(max(1, min(16, os.cpu_count() or 1)), "keeper-sums")


def _crcs(path: str, ranges: Sequence[tuple[int, int]]) -> list[Sums]:
    """The checksums of each ``(offset, nbytes)`` of the file, read through a mapping (no copy)."""
    if not ranges:
        return []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return [sums(b"") for _ in ranges]
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        view = memoryview(m)
        try:
            return sums_of_ranges(view, ranges, _SUMMING.get())
        finally:
            view.release()
    finally:
        m.close()

