"""``bytecp.follow``: an evaluation or serving process keeps its state at
the newest committed checkpoint of a training run, reading only what changed
and never holding a half-updated state.

Called by user code (one process, no ``torch.distributed``) and by
``bytecp follow`` (:mod:`bytecp.serving.cli`). Each turn of the generator:

1. lists the run (:func:`bytecp.catalog.list_checkpoints`) every ``poll_s``
   seconds until a checkpoint newer than the one held has committed; when
   several have, it goes straight to the newest (``skipped`` counts the others);
2. *pins* it and every checkpoint it references (``pins/.followers.<id>`` in
   each, under a lease of this process: :mod:`bytecp.saving.pins`), then
   checks no retention's doom marker names a file it reads, so retention
   cannot delete what is being read;
3. opens it and decides from index rows alone which of the state's tensors
   changed (:func:`bytecp.serving.changes.changed_tensors`);
4. *stages*: reads the changed tensors into staging tensors (the previous
   update's, reused) through the load path's planned ranged reads
   (:func:`bytecp.plan.load_plan.plan_load`,
   :func:`bytecp.loading.reader.execute_reads`), every chunk's crc32c checked;
5. *swaps*: only once every staged tensor arrived and verified, puts them
   into the state's tensors: a host tensor that alone holds its whole
   storage (a module's parameter or buffer, a dict's tensor; no view of it
   anywhere, checked by the storage's use count) takes the staged storage
   (``param.data = staged``, no copy; its old storage becomes the next
   update's staging buffer); any other (a view, memory shared, a CUDA
   tensor, whose pointers CUDA graphs may hold; every tensor with
   ``swap="copy"``) is copied into (``copy_`` under ``no_grad``); an
   interruption (``KeyboardInterrupt``, ``SystemExit``) during the swap
   finishes the swap before it propagates;
6. unpins, and yields a :class:`FollowUpdate`.

A failed update (a data file gone, a checksum wrong, storage down) changes
nothing in the state: with ``on_error="report"`` (default) it logs a warning
and yields a :class:`FollowUpdate` whose ``error`` says why, and waits for a
newer checkpoint than the one that failed; ``on_error="raise"`` raises
instead. Either way the state still holds the previous checkpoint whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version

from bytecp.catalog import CheckpointInfo, list_checkpoints, one_line
from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.references import PIN_DIR, name_of, sibling
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace, emit_event
from bytecp.saving import leases
from bytecp.saving.pins import doomed_files
from bytecp.serving.changes import changed_tensors, rows_by_tensor
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.dtypes import dtype_from_name, itemsize
from bytecp.tree.regions import full_region

__all__ = ["FOLLOWERS", "FollowUpdate", "follow", "state_tensors"]

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
    #: steps and seconds from the run's newest commit to the end of this update
    lag_steps: int = 0
    lag_s: float = 0.0
    #: why the update failed (the state is unchanged); None: it succeeded
    error: str | None = None
    #: the checkpoint the state holds after this update (None: nothing yet)
    held: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def state_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state's full tensors by FQN, named as a save names them (modules'
    state dicts, dicts, tensors), and its aliases (tied FQN -> stored FQN)."""
    from bytecp.adapter_api import detect_adapter
    from bytecp.dist import DistContext
    from bytecp.tree.state import flatten_tree

    if not isinstance(state, dict):
        raise ConfigError(f"state must be a dict such as {{'model': model}}, got {type(state).__name__}")
    adapter = detect_adapter(state)
    if adapter.name != "plain":
        raise ConfigError(f"bytecp.follow takes one process's full tensors (the plain adapter); this state "
                          f"selects the {adapter.name!r} adapter")
    flat = flatten_tree(adapter.save_tree(state, DistContext(local=True)))
    out: dict[str, torch.Tensor] = {}
    for fqn, leaf in flat.tensors.items():
        (shard,) = leaf.shards
        assert shard.region == full_region(leaf.global_shape)
        out[fqn] = shard.tensor
    live = _live_tensors(state)
    for fqn, t in out.items():  # the objects the state holds, not state dicts' detached views: swappable
        obj = live.get(fqn)
        if (obj is not None and obj.data_ptr() == t.data_ptr() and obj.shape == t.shape and obj.dtype == t.dtype
                and obj.stride() == t.stride()):
            out[fqn] = obj
    return out, dict(flat.aliases)


def _live_tensors(state: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensor objects the state holds by FQN: modules' parameters and
    buffers (tied ones under each name), dicts' tensors."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            for n, t in (*v.named_parameters(remove_duplicate=False), *v.named_buffers(remove_duplicate=False)):
                out.setdefault(f"{prefix}{k}.{n}", t)
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
        elif isinstance(v, Mapping):
            out.update(_live_tensors(v, f"{prefix}{k}."))
    return out


class _Follower:
    """What the process holds: the checkpoint's URL and rows; how it reads."""

    def __init__(self, run_url: str, state: dict[str, Any], *, storage_options: Mapping[str, Any],
                 checksums: bool, pin: bool, io_threads: int, swap: str = "auto") -> None:
        self.run_url, self.options = run_url.rstrip("/"), dict(storage_options)
        self.targets, _ = state_tensors(state)
        gc.collect()  # the state walk's reference cycles hold views of the targets: swaps check for views
        self.checksums, self.io_threads, self.swap = checksums, io_threads, swap
        self.url: str | None = None
        self.rows: dict[str, list[fmt.ChunkRecord]] = {}
        self.spare: dict[str, torch.Tensor] = {}  # the last update's staging tensors, reused
        self.id = fmt.new_save_id()
        self.lease: leases.Lease | None = None
        if pin:
            try:
                self.lease = leases.Lease(open_storage(f"{self.run_url}/{FOLLOWERS}", **self.options), self.id).start()
            except Exception as e:  # noqa: BLE001 - a read-only run: read without pins
                log.warning("bytecp.follow: cannot write a lease under %s (%s); reading without pins, so a "
                            "retention may delete a checkpoint mid-read (the update then fails, state intact)",
                            self.run_url, one_line(e))

    def close(self) -> None:
        if self.lease is not None:
            self.lease.stop()

    @contextlib.contextmanager
    def pinned(self, storage: Storage, md: fmt.Metadata) -> Iterator[None]:
        """(step 2) Pin the checkpoint and those it references; refuse files a retention doomed."""
        if self.lease is None:
            yield
            return
        me = name_of(storage.url)
        held = {me: set(md.own_data_files), **{n: set(md.files_of(n)) for n in md.references}}
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
                    raise CorruptCheckpointError(f"{storage.url}: {name} is being pruned by a retention; "
                                                 "skipped (a newer checkpoint follows)")
            yield
        finally:
            for ck in done:
                with contextlib.suppress(Exception):
                    ck.delete([pin])

    def stage(self, opened: OpenedCheckpoint, names: Sequence[str],
              rows: Mapping[str, list[fmt.ChunkRecord]]) -> dict[str, torch.Tensor]:
        """(step 4) The tensors ``names`` read whole into staging tensors (the
        previous update's, reused where shape and dtype match: a second copy of
        what changes, kept between updates) through the load path's planned
        ranged reads, every chunk's crc32c checked."""
        md = opened.metadata
        staged: dict[str, torch.Tensor] = {}
        for f in names:
            shape, dtype = tuple(md.tensors[f]["shape"]), dtype_from_name(md.tensors[f]["dtype"])
            old = self.spare.pop(f, None)
            ok = old is not None and tuple(old.shape) == shape and old.dtype == dtype
            staged[f] = old if ok and old is not None else torch.empty(shape, dtype=dtype)
        targets = [Target(f, full_region(tuple(t.shape)), t) for f, t in staged.items()]
        chunks = [r for f in names for r in rows[f]]
        reqs = plan_load([(t.fqn, t.box) for t in targets], chunks,
                         itemsizes={f: itemsize(t.dtype) for f, t in staged.items()})
        execute_reads(opened.storage, chunks, targets, reqs, io_threads=self.io_threads, verify=True,
                      trace=Trace("follow", opened.storage.url))
        return staged

    def update(self, info: CheckpointInfo, newest: CheckpointInfo, skipped: int) -> FollowUpdate:
        """(steps 2-5) Take checkpoint ``info``; raises, with the state untouched, when it cannot."""
        t0 = time.perf_counter()
        storage = open_storage(info.url, **self.options)
        opened = open_checkpoint(storage)  # committed: its metadata never changes, so it is read once
        with self.pinned(storage, opened.metadata):
            opened.check_sizes()
            md = opened.metadata
            wanted: dict[str, str] = {}  # state FQN -> stored FQN
            for fqn, t in self.targets.items():
                stored = md.aliases.get(fqn, fqn)
                info_t = md.tensors.get(stored)
                if info_t is None:
                    raise ConfigError(f"{info.url} holds no tensor {fqn!r} of the state")
                if tuple(info_t["shape"]) != tuple(t.shape) or info_t["dtype"] != str(t.dtype).split(".")[-1]:
                    raise ConfigError(f"{info.url}: {fqn!r} is {info_t['dtype']} {tuple(info_t['shape'])}, the "
                                      f"state's {t.dtype} {tuple(t.shape)}")
                wanted[fqn] = stored
            rows = rows_by_tensor(opened.all_rows())
            stored_names = list(dict.fromkeys(wanted.values()))
            if self.url is None:
                changes = changed_tensors(stored_names, rows, info.url, {}, info.url)
            else:
                changes = changed_tensors(stored_names, rows, info.url, self.rows, self.url,
                                          checksums=self.checksums)
            staged = self.stage(opened, changes.changed, rows)
        self.spare = _swap([(s, self.targets[f], staged[s]) for f, s in wanted.items() if s in staged], self.swap)
        del staged  # the swapped storages are the state's alone again
        self.url, self.rows = info.url, rows
        return FollowUpdate(
            step=info.step, url=info.url, bytes_read=sum(r.nbytes for f in changes.changed for r in rows[f]),
            tensors_read=len(changes.changed), tensors_unchanged=len(changes.unchanged),
            unchanged_by_reference=changes.by_reference, skipped=skipped, seconds=time.perf_counter() - t0,
            lag_steps=max(0, (newest.step or 0) - (info.step or 0)), lag_s=max(0.0, time.time() - md.created),
            held=info.url)


def _owns_storage(t: torch.Tensor) -> bool:
    """A host tensor laid over the whole of a storage nothing else holds
    (no view, no other tensor object): its storage may be replaced."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() or not t.is_leaf:
        return False
    storage = t.untyped_storage()
    if storage.nbytes() != t.nbytes:
        return False
    try:  # the tensor's own reference and ``storage`` above: 2
        return int(torch._C._storage_Use_Count(storage._cdata)) <= 2
    except AttributeError:  # pragma: no cover - a torch without it: copy
        return False


def _put(dst: torch.Tensor, src: torch.Tensor, swap: bool) -> None:
    """One staged tensor into its target (idempotent: a rerun after an interruption is harmless)."""
    if swap:
        if dst.data_ptr() != src.data_ptr():
            dst.data = src
    else:
        dst.copy_(src)
    increment_version(dst)  # incremental saves of the follower's state must see the change


def _swap(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], mode: str = "auto") -> dict[str, torch.Tensor]:
    """(step 5) Put every staged tensor into its target: storages swapped
    where the target owns its storage (``mode="auto"``), else copied; an
    interruption midway finishes the swap before it propagates, so the
    state is never mixed. Returns the staging tensors for the next update
    (the targets' old storages where swapped, the staged ones where copied)."""
    uses: dict[int, int] = {}
    for _, _, src in pairs:
        uses[id(src)] = uses.get(id(src), 0) + 1
    swaps = [mode == "auto" and uses[id(src)] == 1 and src.device == dst.device and _owns_storage(dst)
             for _, dst, src in pairs]
    spare = {f: dst.detach() if sw else src for (f, dst, src), sw in zip(pairs, swaps, strict=True)}
    done = 0
    try:
        with torch.no_grad():
            for (_, dst, src), sw in zip(pairs, swaps, strict=True):
                _put(dst, src, sw)
                done += 1
    except BaseException:
        with torch.no_grad():
            for (_, dst, src), sw in list(zip(pairs, swaps, strict=True))[done:]:
                _put(dst, src, sw)
        raise
    return spare


def _skipped(cks: list[CheckpointInfo], held: str | None, newest: CheckpointInfo) -> int:
    urls = [c.url for c in cks]
    start = urls.index(held) + 1 if held in urls else 0
    return max(0, urls.index(newest.url) - start)


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
) -> Iterator[FollowUpdate]:
    """Keep ``state`` (``{"model": model}``: modules, dicts of tensors,
    tensors; one process) at the newest committed checkpoint of the run
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
    The generator ends when ``stop`` is set, or after ``idle_timeout_s``
    seconds with no newer checkpoint; closing it (``break``) ends it too.
    """
    if on_error not in ("report", "raise"):
        raise ConfigError(f"on_error must be 'report' or 'raise', got {on_error!r}")
    if swap not in ("auto", "copy"):
        raise ConfigError(f"swap must be 'auto' or 'copy', got {swap!r}")
    stop = stop or threading.Event()
    f = _Follower(run_url, state, storage_options=storage_options or {}, checksums=checksums, pin=pin,
                  io_threads=io_threads, swap=swap)
    failed: set[str] = set()
    try:
        if held is not None:
            opened = open_checkpoint(open_storage(held, **(storage_options or {})))
            f.url, f.rows = held.rstrip("/"), rows_by_tensor(opened.all_rows())
        idle_since = time.monotonic()
        while not stop.is_set():
            cks = list_checkpoints(f.run_url, storage_options=storage_options)
            newest = cks[-1] if cks else None
            if newest is not None and newest.url != f.url and newest.url not in failed:
                skipped = _skipped(cks, f.url, newest)
                try:
                    up = f.update(newest, newest, skipped)
                except Exception as e:
                    if on_error == "raise":
                        raise
                    failed.add(newest.url)
                    log.warning("bytecp.follow: could not take %s, still holding %s: %s",
                                newest.url, f.url, one_line(e))
                    up = FollowUpdate(step=newest.step, url=newest.url, skipped=skipped,
                                      error=f"{type(e).__name__}: {one_line(e)}", held=f.url)
                idle_since = time.monotonic()
                if up.ok:  # exporters (bytecp.monitoring's Prometheus gauges) see lag and bytes per update
                    emit_event("follower_lag_steps", float(up.lag_steps))
                    emit_event("follower_lag_seconds", up.lag_s)
                    emit_event("follower_update_bytes", float(up.bytes_read))
                yield up
                continue
            if idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return
            stop.wait(poll_s)
    finally:
        f.close()
