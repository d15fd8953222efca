"""A training process's mappings of the keeper's arenas, kept between saves.

Used by :meth:`bytecp.storage.keeper.KeeperStorage.staging_arena` (every
lent arena) and ``prepare_staging`` (prewarm). Mapping a shared-memory
file costs page-table work for every page (about 60 ms per 256 MiB, as
much as the copy into it); the keeper pools the data files retention
deletes and lends a rank back one it filled, so a rank keeps its last
mappings, by (device, inode, size), and copies into a file lent again
without mapping it again. Each mapping holds its file open: one whose file
the keeper has since unlinked (evicted, or dropped from its pool) is let go
at the next lend, so it pins no memory the keeper's budget does not see
beyond one save. A mapping that CUDA copies were staged into was registered
with CUDA then (:mod:`bytecp.saving.staging`), and stays registered while it
is kept: it is unregistered when it is let go.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import sys
import threading

__all__ = ["Mappings", "MAPPINGS", "address_of", "pin"]

_Key = tuple[int, int, int]


class Mappings:
    """The process's mappings of arenas, least recently lent first."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[_Key, tuple[mmap.mmap, int]] = collections.OrderedDict()
        self._expected: dict[int, int] = {}
        self.hits = 0
        self.misses = 0

    def map(self, path: str, size: int | None = None) -> mmap.mmap:
        """A writable shared mapping of ``size`` bytes (None: all) of ``path``, reused when still mapped."""
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino, st.st_size if size is None else size)
            with self._lock:
                self._let_go_unlinked()
                hit = self._maps.pop(key, None)
            if hit is not None:
                os.close(fd)
                buf, fd = hit
                self.hits += 1
            else:
                buf = mmap.mmap(fd, key[2], flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                self.misses += 1
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._maps[key] = (buf, fd)
            while len(self._maps) > self.keep:
                _let_go(*self._maps.popitem(last=False)[1])
        return buf

    def expect(self, nbytes: int, count: int) -> None:
        """(prewarm) Saves will take turns in ``count`` arenas of ``nbytes``: keep that many mapped."""
        with self._lock:
            self._expected[nbytes] = count
            self.keep = max(self.keep, sum(self._expected.values()) + len(self._expected))

    def _let_go_unlinked(self) -> None:
        for key, (buf, fd) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                del self._maps[key]
                _let_go(buf, fd)


def _let_go(buf: mmap.mmap, fd: int) -> None:
    """Close a mapping's file and unpin the mapping if CUDA copies pinned it
    (it is unmapped once the last view of it is gone)."""
    os.close(fd)
    pinning = sys.modules.get("bytecp.device_memory")  # never imported: nothing was pinned (no torch here)
    if pinning is not None and len(buf):
        pinning.unregister(address_of(buf))


def address_of(buf: mmap.mmap) -> int:
    """Where a (non-empty, open) mapping starts in this process."""
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def pin(buf: mmap.mmap) -> bool:
    """(prewarm of a job whose state is on a CUDA device) Register a mapping
    for CUDA copies now rather than at the first save."""
    from bytecp import device_memory  # a CUDA job: torch is loaded

    return device_memory.register(address_of(buf), len(buf))


MAPPINGS = Mappings()
