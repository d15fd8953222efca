"""``bytecp.follow``: an evaluation or serving process keeps its state at
the newest committed checkpoint of a training run, reading only what changed
and never holding a half-updated state.

Called by user code (one process, or every rank of a process group: see
:func:`follow`) and by ``bytecp follow`` (:mod:`bytecp.serving.cli`). Each
turn of the generator:

1. (the coordinator) lists the run (the resume decision, :func:`bytecp.tools.resume.decide`) every ``poll_s``
   seconds, and its memory tier too when given ``memory_url``
   (:mod:`bytecp.serving.sources`: the newer step of either, memory first
   on a tie, the same save in the other tier never read twice), until a
   checkpoint newer than the one held has committed; when
   several have, it goes straight to the newest (``skipped`` counts the others);
2. (the coordinator) *pins* a storage checkpoint and every checkpoint it references (``pins/.followers.<id>`` in
   each, under a lease of this process: :mod:`bytecp.saving.pins`), then
   checks no retention's doom marker names a file it reads, so retention
   cannot delete what is being read; one a retention is pruning already
   (a newer checkpoint committed meanwhile) is let go and the run listed
   again, never reported as an error (a memory checkpoint is not pinned: the
   keepers have no pins, and one evicted mid-read fails the update, the
   state intact, and the next poll takes the newest that remains -- storage's
   copy when it was drained);
   it opens the checkpoint under its pin (``metadata.json`` and what the
   ranks need of the index, read once for the group, as a load's
   coordinator does) and, in a group, broadcasts its decision (stop, wait,
   take, fail) with the opened checkpoint: one collective;
3. (every rank) decides from the index rows of its own boxes
   alone which of the state's tensors changed
   (:func:`bytecp.serving.changes.changed_tensors`);
4. (every rank) *stages*: reads its boxes of the changed tensors into
   staging tensors (:func:`bytecp.serving.staging.stage`: the load path's
   planned ranged reads, every chunk's crc32c checked); in a group one
   all-gather then says every rank staged and verified (a failure on any
   rank raises on every rank, and none swaps);
5. (every rank) *swaps* (:func:`bytecp.serving.staging.swap_in`): storages
   swapped where a host tensor owns its storage (no copy), else copied
   into; an interruption (``KeyboardInterrupt``, ``SystemExit``) during the
   swap finishes the swap before it propagates;
6. (the coordinator) unpins; every rank yields a :class:`FollowUpdate`.

A failed update (a data file gone, a checksum wrong, storage down) changes
nothing in the state: with ``on_error="report"`` (default) it logs a warning
and yields a :class:`FollowUpdate` whose ``error`` says why (``"<exception
type>: <message>"``), and waits for a newer checkpoint than the one that
failed; ``on_error="raise"`` raises instead. Either way the state still
holds the previous checkpoint whole. A run that cannot be listed (storage
refusing or failing after its retries), or whose newest checkpoint cannot
be told (:class:`~bytecp.errors.ResumeDecisionError`), is a failed update
too (``url`` the run's, reported once until it changes), never "nothing
newer".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch

from bytecp.catalog import CheckpointInfo, one_line
from bytecp.dist import DistContext
from bytecp.errors import ConfigError, DistributedCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.header import Files, read_files
from bytecp.format.references import PIN_DIR, name_of, sibling
from bytecp.format.serving_wire import held_marker, serving_dtype_name
from bytecp.loading.opened import OpenedCheckpoint, Shared, open_checkpoint
from bytecp.recorder import emit_event
from bytecp.saving import leases
from bytecp.saving.pins import doomed_files
from bytecp.saving.serving import floating
from bytecp.serving.changes import changed_tensors, rows_by_tensor
from bytecp.serving.delta_update import owned_boxes, update_served
from bytecp.serving.held_marker import HeldMarker
from bytecp.serving.sources import Held, Sources
from bytecp.serving.staging import Box, stage, state_boxes, swap_in
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.regions import Region

__all__ = ["FOLLOWERS", "FollowUpdate", "follow"]

log = logging.getLogger("bytecp")

#: the name followers' pins and leases go under in the run (``<run>/.followers/leases/<id>.json``,
#: ``<run>/<checkpoint>/pins/.followers.<id>``): retention reads them as it reads a save's
FOLLOWERS = ".followers"


@dataclasses.dataclass(frozen=True)
class FollowUpdate:
    """One update of a follower: the checkpoint it now holds, or (``error``
    set) the one it failed to take while keeping the previous one."""

    step: int | None
    url: str
    tier: str = "storage"
    #: stored bytes read (the changed tensors' rows)
    bytes_read: int = 0
    tensors_read: int = 0
    tensors_unchanged: int = 0
    #: of the unchanged ones, those proven by references (the rest: by checksums)
    unchanged_by_reference: int = 0
    #: committed checkpoints passed over to reach the newest
    skipped: int = 0
    #: wall-clock seconds of the update (pin, open, decide, read, swap)
    seconds: float = 0.0
    #: steps from the newest committed step the poll listed to the step held after this update
    #: (0: the newest is held); seconds from the held checkpoint's commit to the end of this update
    lag_steps: int = 0
    lag_s: float = 0.0
    #: why the update failed (the state is unchanged); None: it succeeded
    error: str | None = None
    #: the checkpoint the state holds after this update (None: nothing yet)
    held: str | None = None
    #: (``dtype=``) the changed tensors taken from the run's serving files
    #: (their deltas, or a whole serving copy and the deltas after it) rather
    #: than read whole and cast, the most steps of deltas applied to one, and
    #: the elements the deltas changed on this rank
    tensors_by_delta: int = 0
    delta_steps: int = 0
    elements_changed: int = 0
    #: (``dtype=``) tensors read whole instead of by deltas, and missing or damaged deltas: why
    fallbacks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Decision(NamedTuple):
    """The coordinator's decision of one turn, broadcast to every rank:
    ``stop``, ``wait``, ``take`` a checkpoint (``opened``: the coordinator
    opened it, under its pin), or ``fail`` it (``error``)."""

    kind: str
    info: CheckpointInfo | None = None
    skipped: int = 0
    error: str | None = None
    tier: str = "storage"
    newest_step: int | None = None
    opened: Shared | None = None


class _Replaced(Exception):
    """(coordinator) The checkpoint chosen is being pruned: a newer one has committed."""


class _Follower:
    """What the process holds: the checkpoint's URL and rows of its boxes; how it reads."""

    def __init__(self, run_url: str, state: dict[str, Any], ctx: DistContext, *, storage_options: Mapping[str, Any],
                 checksums: bool, pin: bool, io_threads: int, swap: str = "auto", memory_url: str | None = None,
                 memory_options: Mapping[str, Any] | None = None, dtype: str | None = None) -> None:
        self.run_url, self.options, self.ctx = run_url.rstrip("/"), dict(storage_options), ctx
        self.sources = Sources(self.run_url, self.options, memory_url, memory_options)
        #: the held checkpoint's tier, step and save id
        self.tier: str = "storage"
        self.step: int | None = None
        self.save_id: str | None = None
        self.held, _ = state_boxes(state, ctx, swap)
        self.checksums, self.io_threads, self.swap = checksums, io_threads, swap
        #: the serving dtype the state holds its floating tensors in (None: the stored dtypes)
        self.dtype = dtype
        self._marker: HeldMarker | None = None  # the held step's marker for retention (dtype=)
        if dtype is not None:  # (a group: one all-gather of the ranks' boxes)
            self.owned, self.partial = owned_boxes(self.held, ctx)
        self.url: str | None = None
        self.rows: dict[str, list[fmt.ChunkRecord]] = {}
        self.spare: dict[Box, torch.Tensor] = {}  # the last update's staging tensors, reused
        self.told_dtype = False  # warned that the run's serving deltas are in another dtype
        self.id = fmt.new_save_id()
        self._mine: tuple[Shared, OpenedCheckpoint] | None = None  # the coordinator's last opened_for_ranks
        self.lease: leases.Lease | None = None
        if pin and ctx.is_coordinator:
            try:
                self.lease = leases.Lease(open_storage(f"{self.run_url}/{FOLLOWERS}", **self.options), self.id).start()
            except Exception as e:  # noqa: BLE001 - a read-only run: read without pins
                log.warning("bytecp.follow: cannot write a lease under %s (%s); reading without pins, so a "
                            "retention may delete a checkpoint mid-read (the update then fails, state intact)",
                            self.run_url, one_line(e))

    def close(self) -> None:
        if self._marker is not None:  # no longer holding anything retention should keep deltas after
            self._marker.close()
        if self.lease is not None:
            self.lease.stop()

    def mark_held(self) -> None:
        """(coordinator of a follower in a serving dtype, after each update) Tell
        retention which step it holds: the serving deltas of later checkpoints
        are kept while its lease lives (:func:`bytecp.tools.retention.followed_from`).
        Written by a thread of its own, so the update is yielded at once (a
        marker a moment behind keeps more deltas, never fewer)."""
        if self.lease is None or self.dtype is None or self.url is None:
            return
        if self._marker is None:
            self._marker = HeldMarker(self.lease.storage, held_marker(self.id), self.run_url)
        self._marker.put(json.dumps({"name": self.url.rstrip("/").rsplit("/", 1)[-1], "save_id": self.save_id,
                                     "step": self.step, "written": time.time()}).encode())

    def decide(self, pins: contextlib.ExitStack, stop: threading.Event, failed: set[str], idle_s: float | None,
               idle_since: float, report: bool) -> _Decision:
        """(coordinator) List the run; the newest checkpoint not held nor failed
        is pinned (under ``pins``, held until every rank staged), opened for
        every rank (:meth:`opened_for_ranks`) and taken. One
        a retention is pruning or has pruned (a newer one committed meanwhile)
        is let go and the newer one taken, never reported. With ``report``, a
        failure is a ``fail`` decision (without a checkpoint when the run could
        not be listed or decided); else its error is raised."""
        if stop.is_set():
            return _Decision("stop")
        for _ in range(8):
            try:
                found = self.sources.newest(Held(self.url, self.step, self.save_id), failed)
            except Exception as e:
                if not report:
                    raise
                return _Decision("fail", error=_why(e))
            if found is None:
                idle = idle_s is not None and time.monotonic() - idle_since >= idle_s
                return _Decision("stop" if idle else "wait")
            newest, skipped, tier = found.info, found.skipped, found.tier
            try:
                if tier == "storage":
                    storage = open_storage(newest.url, **self.options)
                    pins.enter_context(self.pinned(storage, _files(storage)))
            except Exception as e:  # every rank reports it (or raises it), none reads
                if isinstance(e, _Replaced) or self._replaced(newest, failed):
                    continue  # pruned by a retention (a newer checkpoint has committed): that one
                if not report:
                    raise
                return _Decision("fail", newest, skipped, _why(e), tier, found.newest_step)
            try:
                shared = self.opened_for_ranks(newest.url, tier)  # (under the pin)
            except Exception as e:
                if tier == "storage" and self._retired(newest, failed):
                    continue  # retired by a retention between the listing and the pin: the newer one
                if not report:
                    raise
                return _Decision("fail", newest, skipped, _why(e), tier, found.newest_step)
            return _Decision("take", newest, skipped, tier=tier, newest_step=found.newest_step, opened=shared)
        return _Decision("wait")  # still being replaced: the next poll sees the newer one

    def opened_for_ranks(self, url: str, tier: str) -> Shared:
        """(coordinator, each checkpoint taken or held) Checkpoint ``url`` opened
        for the group: its validated ``metadata.json`` and what the ranks need
        to find their rows (:meth:`OpenedCheckpoint.share`: a version-1 index
        whole, else the row budget by which each rank reads its own segments),
        broadcast so that no other rank reads ``metadata.json`` (a load's
        coordinator does the same). The coordinator keeps its own opened
        checkpoint for :meth:`received` (its file listing, its checked rows)."""
        opened = open_checkpoint(open_storage(url, **self.sources.options_for(tier)))
        shared = opened.share()
        self._mine = (shared, opened)
        return shared

    def received(self, url: str, tier: str, shared: Shared) -> OpenedCheckpoint:
        """(every rank, once per :meth:`opened_for_ranks`) The coordinator's opened
        checkpoint ``url``, on this rank's storage (the coordinator's own object on it)."""
        mine, self._mine = self._mine, None
        if mine is not None and mine[0] is shared:
            return mine[1]
        return OpenedCheckpoint.received(open_storage(url, **self.sources.options_for(tier)), shared)

    def _replaced(self, chosen: CheckpointInfo, failed: set[str]) -> bool:
        """(coordinator, after ``chosen`` failed to open) Whether it is gone because a
        newer checkpoint replaced it (a retention pruned it meanwhile): the run lists another."""
        try:
            again = self.sources.newest(Held(self.url, self.step, self.save_id), failed)
        except Exception:  # noqa: BLE001 - the open's own error is reported
            return False
        return again is not None and again.info.url != chosen.url and (again.info.step or 0) > (chosen.step or 0)

    def _retired(self, chosen: CheckpointInfo, failed: set[str]) -> bool:
        """(coordinator, after an update of ``chosen`` failed on every rank) Whether its
        ``metadata.json`` is gone (its pin keeps its data files, not that) and a newer
        checkpoint replaced it: a retention retired it after it was pinned."""
        try:
            gone = read_files(open_storage(chosen.url, **self.options), committed=True) is None
        except FileNotFoundError:
            gone = True
        except Exception:  # noqa: BLE001 - the update's own error is reported
            return False
        return gone and self._replaced(chosen, failed)

    @contextlib.contextmanager
    def pinned(self, storage: Storage, files: Files) -> Iterator[None]:
        """(coordinator) Pin the checkpoint and those it references; refuse files a retention doomed."""
        if self.lease is None:
            yield
            return
        me = name_of(storage.url)
        held = {me: set(files.own_data_files), **{n: set(files.files_of(n)) for n in files.header.references}}
        pin = f"{PIN_DIR}/{FOLLOWERS}.{self.id}"
        done: list[Storage] = []
        try:
            for name in sorted(held):
                ck = storage if name == me else sibling(storage, name)
                ck.write_file(pin, [b"{}"])
                done.append(ck)
            for name, ck in zip(sorted(held), done, strict=True):
                doomed = doomed_files(ck)
                if doomed is None or held[name] & doomed:
                    raise _Replaced(f"{storage.url}: {name} is being pruned by a retention")
            yield
        finally:
            for ck in done:
                with contextlib.suppress(Exception):
                    ck.delete([pin])

    def _rows(self, opened: OpenedCheckpoint, wanted: Mapping[str, str]) -> dict[str, list[fmt.ChunkRecord]]:
        """The rows meeting this process's boxes, by stored FQN."""
        boxes: dict[str, list[Region]] = {}
        for f, s in wanted.items():
            boxes.setdefault(s, []).extend(box for box, _ in self.held[f].boxes)
        got = rows_by_tensor(opened.rows_for(boxes).rows)
        return {s: [r for r in got.get(s, []) if any(Region(r.offsets, r.lengths).intersect(b) for b in bs)]
                for s, bs in boxes.items()}

    def hold(self, url: str, shared: Shared) -> None:
        """(every rank) The state holds checkpoint ``url`` already (``held=``;
        ``shared``: the coordinator's :meth:`opened_for_ranks`)."""
        tier = self.sources.tier_of(url)
        opened = self.received(url, tier, shared)
        self.url, self.rows = url.rstrip("/"), self._rows(opened, self._wanted(opened.metadata, url))
        self.tier, self.step, self.save_id = tier, opened.metadata.step, opened.metadata.save_id

    def _wanted(self, md: fmt.Metadata, url: str) -> dict[str, str]:
        """State FQN -> stored FQN, every tensor's shape and dtype checked."""
        wanted: dict[str, str] = {}
        for fqn, h in self.held.items():
            stored = md.aliases.get(fqn, fqn)
            info_t = md.tensors.get(stored)
            if info_t is None:
                raise ConfigError(f"{url} holds no tensor {fqn!r} of the state")
            held_as = str(h.dtype).split(".")[-1]
            cast = self.dtype is not None and held_as == self.dtype and floating(info_t["dtype"])
            if tuple(info_t["shape"]) != h.shape or (info_t["dtype"] != held_as and not cast):
                raise ConfigError(f"{url}: {fqn!r} is {info_t['dtype']} {tuple(info_t['shape'])}, the "
                                  f"state's {h.dtype} {h.shape}")
            wanted[fqn] = stored
        return wanted

    def update(self, d: _Decision) -> FollowUpdate:
        """(every rank) Take the checkpoint the coordinator chose: decide and
        stage this process's boxes (local), agree every rank staged and
        verified (one all-gather: a failure anywhere raises on every rank,
        none swaps), swap. Raises, with the state untouched, when it cannot."""
        info, shared = d.info, d.opened
        assert info is not None and shared is not None
        t0 = time.perf_counter()
        if self.dtype is not None:
            return self._update_served(d, t0)

        def stage_mine() -> tuple[Any, ...]:
            opened = self.received(info.url, d.tier, shared)
            if self.ctx.is_coordinator:
                opened.check_sizes()
            wanted = self._wanted(opened.metadata, info.url)
            rows = self._rows(opened, wanted)
            stored_names = list(dict.fromkeys(wanted.values()))
            if self.url is None:
                changes = changed_tensors(stored_names, rows, info.url, {}, info.url)
            else:
                changes = changed_tensors(stored_names, rows, info.url, self.rows, self.url, checksums=self.checksums)
            staged, nbytes = stage(opened, self.held, wanted, changes.changed, rows, self.spare, self.io_threads)
            return wanted, rows, changes, staged, nbytes, opened.metadata

        wanted, rows, changes, staged, nbytes, md = self.ctx.run("follow/stage", stage_mine)
        self.spare = swap_in(self.held, wanted, staged, self.swap)
        del staged  # the swapped storages are the state's alone again
        self.url, self.rows = info.url, rows
        self.tier, self.step, self.save_id = d.tier, info.step, md.save_id
        created = md.created
        return FollowUpdate(
            step=info.step, url=info.url, tier=d.tier, bytes_read=nbytes, tensors_read=len(changes.changed),
            tensors_unchanged=len(changes.unchanged), unchanged_by_reference=changes.by_reference,
            skipped=d.skipped, seconds=time.perf_counter() - t0, lag_steps=_lag(d.newest_step, info.step),
            lag_s=max(0.0, time.time() - created), held=info.url)

    def _update_served(self, d: _Decision, t0: float) -> FollowUpdate:
        """(every rank) :meth:`update` of a state held in a serving dtype (:mod:`bytecp.serving.delta_update`)."""
        info = d.info
        assert info is not None and d.opened is not None and self.dtype is not None
        urls = {"storage": self.run_url}
        if self.sources.memory is not None:
            urls["memory"] = self.sources.memory.url
        got = update_served(self, info.url, d.tier, d.opened, self.dtype, self.owned, self.partial, urls)
        self.url, self.rows = info.url, got.rows
        self.tier, self.step, self.save_id = d.tier, info.step, got.save_id
        return FollowUpdate(
            step=info.step, url=info.url, tier=d.tier, bytes_read=got.bytes_read, tensors_read=got.tensors_read,
            tensors_unchanged=got.tensors_unchanged, unchanged_by_reference=got.unchanged_by_reference,
            skipped=d.skipped, seconds=time.perf_counter() - t0, lag_steps=_lag(d.newest_step, info.step),
            lag_s=max(0.0, time.time() - got.created), held=info.url, tensors_by_delta=got.tensors_by_delta,
            delta_steps=got.delta_steps, elements_changed=got.elements_changed, fallbacks=tuple(got.fallbacks))


def _files(storage: Storage) -> Files:
    """(coordinator, each checkpoint it takes) What the pins need of the
    checkpoint at ``storage``: its header and data files, parsed as far as
    those (every rank opens the whole checkpoint when it takes it)."""
    files = read_files(storage, committed=True)
    if files is None:  # deleted, or retired by a retention (its base.json is not a checkpoint to take)
        raise FileNotFoundError(f"{storage.url}/{fmt.METADATA_FILE}: gone since the run was listed")
    return files


def _why(e: BaseException) -> str:
    """An update's ``error``: the exception's name once, then its message (one line)."""
    return f"{type(e).__name__}: {one_line(e, 2000)}"


def _lag(newest: int | None, held: int | None) -> int:
    """Committed steps the follower is behind: the newest listed minus the one held (0 when unknown)."""
    return max(0, newest - held) if newest is not None and held is not None else 0


def _take(f: _Follower, d: _Decision, failed: set[str], on_error: str) -> FollowUpdate | None:
    """(every rank) The update of a ``take`` or ``fail`` decision; a failure
    leaves the state whole and is reported (its checkpoint never retried) or raised.
    None: the checkpoint was gone when the update opened it because a newer one
    replaced it (a retention retired it after it was pinned: its pin keeps its data
    files, not its ``metadata.json``), which is no error: the next turn takes the newer one."""
    info = d.info
    assert info is not None
    try:
        if d.error is None:
            return f.update(d)
        error = d.error  # (the coordinator's, reported: already "<type>: <message>")
    except Exception as e:
        # a failure every rank met alike (one process; in a group, the agreed stage's, raised on every rank)
        # asks the coordinator whether the checkpoint was retired meanwhile for a newer one: by the run's
        # state, not by the error's type; a rank's own failure does not (the others are past it, on the next
        # turn's collectives)
        together = not f.ctx.enabled or isinstance(e, DistributedCheckpointError)
        if together and d.tier == "storage" and f.ctx.broadcast("follow/replaced", lambda: f._retired(info, failed)):
            log.info("bytecp.follow: %s was retired by a retention once a newer checkpoint committed; taking that one",
                     info.url)
            return None
        if on_error == "raise":
            raise
        error = _why(e)
    failed.add(info.url)
    log.warning("bytecp.follow: could not take %s, still holding %s: %s", info.url, f.url, error)
    return FollowUpdate(step=info.step, url=info.url, tier=d.tier, skipped=d.skipped, error=error,
                        held=f.url, lag_steps=_lag(d.newest_step, f.step))


def follow(
    run_url: str,
    state: dict[str, Any],
    *,
    poll_s: float = 5.0,
    held: str | None = None,
    on_error: str = "report",
    checksums: bool = True,
    pin: bool = True,
    io_threads: int = 8,
    swap: str = "auto",
    stop: threading.Event | None = None,
    idle_timeout_s: float | None = None,
    storage_options: dict[str, Any] | None = None,
    memory_url: str | None = None,
    memory_storage_options: dict[str, Any] | None = None,
    group: Any = None,
    distributed: bool | None = None,
    dtype: Any = None,
) -> Iterator[FollowUpdate]:
    """Keep ``state`` (``{"model": model}``: modules, dicts of tensors,
    tensors; one process or a process group) at the newest committed checkpoint of the run
    ``run_url``; yields a :class:`FollowUpdate` after each update (see the
    module's docstring for the order of one update).

    ``held``: the checkpoint ``state`` already holds (e.g. loaded at start),
    so the first update reads only what changed since; None: the first
    update reads every tensor of the state. ``on_error``: ``"report"`` (a
    warning and an update with ``error`` set) or ``"raise"``.
    ``checksums=False``: only references prove a tensor unchanged.
    ``pin=False``: no pins (a run this process may not write to).
    ``swap``: ``"auto"`` (storages swapped where a tensor owns its storage,
    else copied) or ``"copy"`` (every tensor copied into: for engines that
    hold raw pointers to the weights outside torch).
    ``memory_url`` (``keeper://<job>/<run>``, the trainer's
    ``CheckpointManager(memory_url=...)``; ``memory_storage_options`` its
    keepers, host and token): the run's memory tier is listed each poll too,
    and whichever tier has the newer step is read (see
    :mod:`bytecp.serving.sources`); ``up.tier`` says which.
    The generator ends when ``stop`` is set, or after ``idle_timeout_s``
    seconds with no newer checkpoint; closing it (``break``) ends it too.

    A process group follows together (``distributed``: None, when
    ``torch.distributed`` is initialized; ``group``: default the world):
    every rank of ``group`` calls ``follow`` with its own shards (FSDP2,
    tensor parallel DTensors; full tensors are every rank's whole copy).
    Each turn the coordinator (rank 0 of the group) lists the run, pins the
    newest checkpoint and broadcasts which to take (one collective; its
    ``stop`` and ``idle_timeout_s`` end every rank's generator); every rank
    reads only its boxes of the changed tensors; one all-gather says every
    rank staged and verified, and only then does any rank swap (a failure
    on one rank is every rank's failed update, none swaps).

    ``dtype`` (``torch.bfloat16``): the state holds its floating tensors in
    this dtype (a serving engine's weights); each changed one is read cast,
    or -- when the trainer writes serving deltas in it
    (``CheckpointManager(..., serving_dtype=torch.bfloat16)``) -- brought
    forward from the held checkpoint by only the elements that changed,
    every step's element checksum checked before anything is swapped in, or
    from the serving copy written whole at a recent step, whichever reads
    fewer bytes (:mod:`bytecp.serving.delta_update`). A missing or damaged
    delta is read whole instead and reported (``up.fallbacks``);
    ``up.tensors_by_delta`` says how many came by deltas.
    """
    if on_error not in ("report", "raise"):
        raise ConfigError(f"on_error must be 'report' or 'raise', got {on_error!r}")
    if swap not in ("auto", "copy"):
        raise ConfigError(f"swap must be 'auto' or 'copy', got {swap!r}")
    serving = None if dtype is None else serving_dtype_name(dtype)
    stop = stop or threading.Event()
    ctx = DistContext(group, local=not distributed) if distributed is not None else DistContext(group)
    f = _Follower(run_url, state, ctx, storage_options=storage_options or {}, checksums=checksums, pin=pin,
                  io_threads=io_threads, swap=swap, memory_url=memory_url, memory_options=memory_storage_options,
                  dtype=serving)
    failed: set[str] = set()
    reported: str | None = None  # the last run-level failure reported (once until it changes)
    try:
        if held is not None:
            shared = ctx.broadcast("follow/held", lambda: f.opened_for_ranks(held, f.sources.tier_of(held)))
            ctx.run("follow/held", lambda: f.hold(held, shared))
            del shared  # (the opened checkpoint is not held past its use)
            if ctx.is_coordinator:
                f.mark_held()
        idle_since = time.monotonic()
        while True:
            with contextlib.ExitStack() as pins:  # the coordinator's pins, until every rank staged
                d = ctx.broadcast("follow/decide", lambda: f.decide(  # noqa: B023
                    pins, stop, failed, idle_timeout_s, idle_since, on_error == "report"))  # noqa: B023
                if d.kind == "stop":
                    return
                if d.kind == "wait" or (d.info is None and d.error == reported):
                    stop.wait(poll_s)
                    continue
                if d.info is None:  # the run could not be listed or decided: nothing taken
                    reported = d.error
                    log.warning("bytecp.follow: nothing taken from %s (holding %s): %s", f.run_url, f.url or "nothing",
                                d.error)
                    up = FollowUpdate(step=None, url=f.run_url, error=d.error, held=f.url,
                                      lag_steps=_lag(d.newest_step, f.step))
                else:
                    reported = None
                    taken = _take(f, d, failed, on_error)
                    if taken is None:  # replaced by a newer checkpoint meanwhile: that one, now
                        continue
                    up = taken
            del d  # (the opened checkpoint it carries is not held while the caller has the update)
            idle_since = time.monotonic()
            if up.ok and ctx.is_coordinator:
                f.mark_held()
            if up.ok:  # exporters (bytecp.monitoring's Prometheus gauges) see lag and bytes per update
                emit_event("follower_lag_seconds", up.lag_s)
                emit_event("follower_update_bytes", float(up.bytes_read))
            if up.step is not None:  # behind the newest committed step, whether the update took it or not
                emit_event("follower_lag_steps", float(up.lag_steps))
            yield up
    finally:
        f.close()
