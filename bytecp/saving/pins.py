"""Pins and doom markers: a save that references other checkpoints of its
run and a tool deleting checkpoints of that run never both go ahead on the
same files (format version 3, FORMAT.md §6.7). Only files on the shared
storage are used: nothing an object store lacks (no lock, no rename).

**A save** that references checkpoints (its coordinator, around its commit:
:func:`held`):

1. *pins* each of them: ``pins/<its name>.<its save_id>`` in it;
2. *checks* each (:func:`check_bases`): no doom marker in it (``doomed/``)
   names a file the save references, then it holds the referenced save and
   lists those files, then each file exists with its size -- in that order;
3. writes its index, checks again, checks that its lease never lapsed
   (:meth:`bytecp.saving.leases.Lease.check_held`), and commits;
4. removes its pins (after the commit or the failure).

**A deleter** (retention, :func:`bytecp.tools.retention.retain`; an
overwrite, :func:`bytecp.saving.commit.check_target`), for each checkpoint
it may remove files of (:class:`Doom`):

1. *dooms* them, before anything else: ``doomed/<its token>.json`` in the
   checkpoint names every data file it may delete there (those no kept
   checkpoint references), and it deletes no other file the checkpoint
   lists;
2. once every doom marker is written, reads the checkpoint's pins
   (:func:`live_pins`: a pin whose save provably cannot commit any more
   keeps nothing), *then* the committed checkpoints of the run and what
   they reference;
3. deletes only doomed files no live pin and no committed checkpoint names
   (a live pin keeps every file);
4. removes its own doom marker last, after every file it deletes there
   (never another deleter's).

Why no save commits with a referenced file gone, nor loses one afterwards:
take a save S that pinned checkpoint X at time p and a deleter D that
doomed file g of X at d and read X's pins at r > d. If r > p, D saw S's
pin -- or, if S had already unpinned, S committed before r and D, listing
committed checkpoints after r, keeps what S references. If r < p, then
d < p, so S's check after p finds g in D's marker -- or finds D finished,
every file it deleted already gone, and fails on the missing file. A save
that passes its check therefore commits files no deleter removes while it
is committed. The order of reads (pins before the committed list; markers
before the base and its files) is what makes each case hold; S's second
check and its lease check close the case of a pin taken for dead: a save
whose lease lapsed never commits. Retention by the job that saves dooms
nothing its newest checkpoint (always kept) references, which is all its
next save may reference: the two never collide.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.references import DOOM_DIR, PIN_DIR, check_references, name_of, run_url, sibling
from bytecp.saving import leases
from bytecp.storage_api import Storage

__all__ = ["DOOM_DIR", "STALE_MARKER_SECONDS", "Doom", "check_bases", "doomed_files", "held", "live_pins", "pin", "unpin"]

log = logging.getLogger("bytecp")

def _listed(ck: Storage, folder: str) -> list[str]:
    """The pins or doom markers in ``ck``: a file a writer is still making
    (``<name>.tmp-<id>``, renamed into place by a local commit) or left half
    made when it was killed is neither (a partial marker would doom every
    file, a partial pin keep its base for ever)."""
    return [p for p in ck.list_files(folder) if ".tmp-" not in p.rsplit("/", 1)[-1]
            and (folder != DOOM_DIR or p.endswith(".json"))]


def pin(storage: Storage, md: fmt.Metadata) -> None:
    """(coordinator of a save, before :func:`check_bases`) Mark every
    checkpoint ``md`` references as in use by this save (``pins/<name>.<save_id>`` in it)."""
    for name in sorted(md.references):
        try:
            sibling(storage, name).write_file(f"{PIN_DIR}/{name_of(storage.url)}.{md.save_id}", [b"{}"])
        except FileNotFoundError as e:  # its directory went while the pin was written: removed meanwhile
            raise CorruptCheckpointError(
                f"{storage.url}: its base {run_url(storage.url)}/{name} was removed (by a retention) while the "
                f"save pinned it ({e}); the save is not committed -- save again without base="
            ) from e


def unpin(storage: Storage, md: fmt.Metadata) -> None:
    """(coordinator of a save, after its commit or failure) Remove this save's pins."""
    for name in sorted(md.references):
        try:
            sibling(storage, name).delete([f"{PIN_DIR}/{name_of(storage.url)}.{md.save_id}"])
        except Exception as e:  # noqa: BLE001 - a pin left behind keeps a base only until its lease is dead
            log.warning("bytecp: could not remove the pin of %s in %s: %s", storage.url, name, e)


def doomed_files(ck: Storage) -> frozenset[str] | None:
    """(a save, checking a base) The data files of ``ck`` that some deleter's
    doom marker names (None: every file, for a marker that cannot be read)."""
    out: set[str] = set()
    for path in _listed(ck, DOOM_DIR):
        try:
            out.update(json.loads(ck.read_bytes(path))["files"])
        except FileNotFoundError:
            continue  # lifted meanwhile
        except Exception:  # noqa: BLE001 - a marker of another writer: the safe reading
            return None
    return frozenset(out)


def check_bases(storage: Storage, md: fmt.Metadata) -> None:
    """(coordinator of a save, after :func:`pin`) Every checkpoint ``md``
    references has none of the referenced files named by a doom marker,
    holds the referenced save and lists the referenced files
    (:func:`check_references`), and each of them exists with its size; one
    :class:`CorruptCheckpointError` naming the base otherwise. Markers are
    read before the bases, the bases before their files (see the module's
    docstring)."""
    bases = {name: sibling(storage, name) for name in sorted(md.references)}
    for name, base in bases.items():
        marked, refs = doomed_files(base), set(md.files_of(name))
        doomed = refs if marked is None else refs & marked
        if doomed:
            raise CorruptCheckpointError(
                f"{storage.url}: its base {run_url(storage.url)}/{name} is being pruned by a retention (a marker in "
                f"{DOOM_DIR}/ names {min(doomed)}, which this save references); the save is not committed -- save "
                "again without base= (a CheckpointManager's next save is written whole)"
            )
    check_references(storage, md)
    for name, base in bases.items():
        wanted = md.files_of(name)
        found: dict[str, int] = {}
        for folder in sorted({p.rpartition("/")[0] for p in wanted}):
            found.update(base.file_sizes(folder))
        for path, size in sorted(wanted.items()):
            if found.get(path) != size:
                raise CorruptCheckpointError(
                    f"{storage.url}: data file {path} of its base {run_url(storage.url)}/{name} is gone "
                    f"(found {found.get(path)} bytes, {size} referenced): a retention or gc removed it; the save "
                    "is not committed -- save again without base="
                )


@contextlib.contextmanager
def held(storage: Storage, md: fmt.Metadata, lease: leases.Lease | None) -> Iterator[Callable[[], None]]:
    """(coordinator of a save, around its commit) Pin and check the
    checkpoints ``md`` references; yields the check to run again right
    before the commit (the bases, and that ``lease``, this save's, never
    lapsed); unpins once the commit is done or failed."""
    if not md.references:
        yield lambda: None
        return

    def again() -> None:
        check_bases(storage, md)
        if lease is None:
            raise CorruptCheckpointError(f"{storage.url}: save {md.save_id} holds no lease; it references other "
                                         "checkpoints and is not committed -- save again")
        lease.check_held()

    try:
        pin(storage, md)
        check_bases(storage, md)
        yield again
    finally:
        unpin(storage, md)


def live_pins(root: Storage, ck: Storage) -> tuple[list[str], list[str]]:
    """(a deleter, after dooming ``ck``) The pins in checkpoint ``ck`` of the
    run ``root`` whose saves may still commit, and those of saves that
    cannot (their lease expired or their process is gone, or they have no
    lease and started more than a term ago: :mod:`bytecp.saving.leases`)."""
    live: list[str] = []
    dead: list[str] = []
    now = time.time()
    for path in _listed(ck, PIN_DIR):
        name, _, save_id = path.split("/", 1)[-1].rpartition(".")
        running = not name or not save_id or leases.may_be_running(root.child(name), save_id, now)
        (live if running else dead).append(path)
    return live, dead


#: a doom marker older than this is a dead deleter's, whatever its host (a
#: retention's deletions in one checkpoint take seconds to minutes)
STALE_MARKER_SECONDS = 6 * 3600.0


class Doom:
    """(a deleter) Its doom markers: :meth:`mark` a checkpoint before
    reading its pins, :meth:`lift` it after its last deletion there."""

    def __init__(self, by: str, token: str | None = None) -> None:
        self.by = by
        #: unique per deleter; an overwrite's is its save id (its marker is
        #: then a file of that save, removed with its lease or as an orphan)
        self.token = token or f"{by}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self.marked: dict[str, Storage] = {}
        self._files: dict[str, frozenset[str]] = {}

    @property
    def path(self) -> str:
        return f"{DOOM_DIR}/{self.token}.json"

    def mark(self, ck: Storage, files: Iterable[str]) -> None:
        """Doom ``files`` (data files) of ``ck``: the only ones this deleter may delete there."""
        files = frozenset(files)
        body = {"by": self.by, "written": time.time(), "host": leases.this_host(), "pid": os.getpid(),
                "files": sorted(files)}
        self.marked[ck.url], self._files[ck.url] = ck, frozenset(files)
        ck.commit(self.path, json.dumps(body).encode())  # atomic: a save reads all of it or none

    def files(self, ck: Storage) -> frozenset[str]:
        """The files of ``ck`` this deleter doomed (the only ones it may delete there)."""
        return self._files.get(ck.url, frozenset())

    def lift(self, ck: Storage, parent: Storage | None = None) -> None:
        """Remove this deleter's marker (only its own) from ``ck``; through
        ``parent`` (the run) when ``ck`` is left empty, so that its directory goes too."""
        if parent is None:
            ck.delete([self.path])
        else:
            parent.delete([f"{name_of(ck.url)}/{self.path}"])
        self.marked.pop(ck.url, None)

    def lift_dead(self, ck: Storage, now: float | None = None) -> list[str]:
        """(a deleter, before its deletions in ``ck``) Remove the markers of
        deleters that can no longer delete anything: their process is gone
        (same host), or they were written over :data:`STALE_MARKER_SECONDS`
        ago. A killed retention's marker would otherwise fail, for good, every
        save referencing a file it names. Returns the markers removed."""
        now = time.time() if now is None else now
        gone = []
        for path in _listed(ck, DOOM_DIR):
            if path == self.path:
                continue
            try:
                body = json.loads(ck.read_bytes(path))
                dead = (leases.process_gone(body.get("host"), body.get("pid"))
                        or now - float(body["written"]) > STALE_MARKER_SECONDS)
            except FileNotFoundError:
                continue  # lifted meanwhile
            except Exception:  # noqa: BLE001 - unreadable (another writer's format): left as it is
                continue
            if dead:
                gone.append(path)
        if gone:
            ck.delete(gone)
            log.warning("bytecp: removed %d doom marker(s) of deleters no longer running in %s: %s",
                        len(gone), ck.url, ", ".join(gone))
        return gone

    def lift_all(self) -> None:
        """(on the deleter's way out, whatever happened) Remove every marker it left."""
        for ck in list(self.marked.values()):
            try:
                self.lift(ck)
            except Exception as e:  # noqa: BLE001 - a marker left behind only stops saves referencing it
                log.warning("bytecp: could not remove the doom marker %s of %s: %s", self.path, ck.url, e)
