"""The keeper's drain: a committed memory checkpoint copied to storage.

Run by :meth:`bytecp.storage.keeper_server.Keeper.op_drain` on a thread of
the keeper process (the coordinator asked, every ``every_n_steps``): the
files are read from this keeper or its peers and written to the storage URL,
``metadata.json`` last (the normal commit), never by the training processes.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Any

from bytecp.errors import StorageError
from bytecp.storage_api import open_storage

__all__ = ["drain"]

log = logging.getLogger("bytecp.storage.keeper")
METADATA = "metadata.json"


def _copy(keeper: Any, mem: Any, dst: Any, src: str, path: str, size: int) -> None:
    """One file to storage: straight from a read-only mapping of this keeper's
    own copy (no buffer; an eviction meanwhile leaves the mapping whole), else
    read from a peer."""
    try:
        fd = os.open(keeper._full(f"{src}/{path}"), os.O_RDONLY)
    except (FileNotFoundError, StorageError):
        dst.write_file(path, [mem.read_bytes(path, 0, size)])
        return
    try:
        if size == 0 or os.fstat(fd).st_size != size:
            dst.write_file(path, [mem.read_bytes(path, 0, size)])
            return
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m, memoryview(m) as view:
            dst.write_file(path, [view])
    finally:
        os.close(fd)


def drain(keeper: Any, src: str, url: str, options: dict[str, Any]) -> None:
    """Copy the committed memory checkpoint ``src`` to ``url``, metadata.json last;
    the outcome goes to ``keeper.drains[url]`` (stats) and the log."""
    record = keeper.drains[url]
    try:
        from bytecp.storage.keeper import KeeperStorage  # reads from here or the peers

        mem = KeeperStorage("keeper://" + src, keepers={keeper.name: f"127.0.0.1:{keeper.port}",
                             **{n: f"{h}:{p}" for n, (h, p) in keeper.peers.items()}},
                            host=keeper.name, token=keeper.token)
        dst = open_storage(url, **options)
        files = mem.file_sizes("")
        if METADATA not in files:
            raise StorageError(f"{src} is not a committed memory checkpoint (no {METADATA})")
        for path, size in sorted(files.items()):
            if path != METADATA:
                _copy(keeper, mem, dst, src, path, size)
        dst.commit(METADATA, mem.read_bytes(METADATA), exclusive=False)
        record.update(state="done", seconds=time.time() - record["since"])
    except Exception as e:  # noqa: BLE001 - reported through stats and the log
        log.error("keeper %s: draining %s to %s failed: %s", keeper.name, src, url, e)
        record.update(state="failed", error=str(e))
